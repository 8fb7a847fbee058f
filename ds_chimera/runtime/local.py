"""Run a schedule's programs in one process, on real modules and optimizers.

Every rank's program runs on the same :class:`~.executor.StepExecutor` as in the
distributed engines, on a :class:`LocalHost` per rank; messages pass through an
in-process mailbox. Each rank's state (its stages' weights, optimizers and weight
versions) changes only by its own ops, in its own order, so any interleaving that
respects the data dependencies gives the same numbers as the distributed runtime. It is
the engine of the convergence study (``benchmarks/pipeoptim_convergence.py``), where D
ranks on two cores would measure the CPU rather than the method.

Programs of one route (no replicas), any number of chunks per rank, split backwards
included; the module of stage ``s`` is ``stages[s]``.
"""
from __future__ import annotations

from ..optim.predictors import predictor_for
from ..optim.versions import WeightVersions
from ..schedules.actions import Clip, ClipScope, Comm, split_chunks
from ..schedules.base import Schedule
from .clipping import clip_by_norm
from .executor import StepExecutor
from .tensors import as_tuple


class LocalTransport:
    """Messages of one process's ranks: a shared mailbox. Receives never wait (the caller checks :meth:`ready`)."""

    def __init__(self, mailbox: dict):
        self.mailbox = mailbox

    @staticmethod
    def _key(msg):
        return (msg.kind, msg.src, msg.dst, msg.mb)

    def ready(self, msg) -> bool:
        return self._key(msg) in self.mailbox

    def send(self, msg, dst_rank: int, tensors) -> None:
        self.mailbox[self._key(msg)] = [t.detach() for t in as_tuple(tensors)]

    def recv(self, msg, src_rank: int, what: str) -> list:
        return self.mailbox.pop(self._key(msg))

    def prepost(self, msg, src_rank: int, what: str) -> bool:
        return False         # messages are in the mailbox or not: nothing to post

    def flush(self) -> None:
        pass


class LocalHost:
    """One rank's context in a :class:`LocalPipeline`."""

    def __init__(self, pipeline: "LocalPipeline", rank: int, transport: LocalTransport):
        self.pipeline, self.pipe_rank, self.transport = pipeline, rank, transport
        self.placement = pipeline.schedule.placement
        self.split_chunks = split_chunks(pipeline.schedule.orders[rank])

    def load_input(self, chunk: int, mb: int):
        return self.pipeline.batches[mb][0]

    def forward(self, chunk: int, mb: int, x, capture, train: bool):
        pipe = self.pipeline
        out = pipe.versions[chunk].forward(mb, (x,), pipe.gaps.get((chunk, mb), 0), record=pipe.record)
        if capture is not None:        # the whole stage is one block of the split backward
            capture.append((out, [p for p in pipe.stages[chunk].parameters() if p.requires_grad]))
        return out

    def loss(self, output, chunk: int, mb: int):
        loss = self.pipeline.loss_fn(output, self.pipeline.batches[mb][1])
        self.pipeline.losses.append(loss.item())
        return loss

    def backward_done(self, chunk: int, mb: int) -> None:
        self.pipeline.versions[chunk].backward_done(mb, record=self.pipeline.record)

    def start_grad_sync(self, stage: int) -> None:
        pass       # one route: no replica to sync with

    def wait_grad_syncs(self, stages: tuple) -> None:
        pass

    def clip_gradients(self, scope, stage: int) -> None:
        self.pipeline.clip(scope, stage)

    def optimizer_step(self, chunks: tuple) -> None:
        for chunk in chunks:
            self.pipeline.step_stage(chunk)

    def gather_weights(self, chunk: int) -> None:
        raise ValueError("sharded data parallelism (ZeRO-2/3) runs on the DeepSpeed engine only")

    wait_weights = release_weights = prepare_grads = gather_weights


class LocalPipeline:
    """``stages[s]`` is stage s's module and ``optimizers[s]`` its optimizer (one route of stages)."""

    def __init__(self, schedule: Schedule, stages: list, optimizers: list, loss_fn, clip: float = 0.0):
        placement = schedule.placement
        if placement.num_replicas != 1:
            raise ValueError(f"LocalPipeline runs single-route schedules; {schedule.name!r} has "
                             f"{placement.num_replicas} replicas of each stage")
        if len(stages) != placement.num_stages or len(optimizers) != placement.num_stages:
            raise ValueError(f"need {placement.num_stages} stage modules and optimizers, got {len(stages)} and "
                             f"{len(optimizers)}")
        self.schedule, self.stages, self.optimizers, self.loss_fn = schedule, stages, optimizers, loss_fn
        self.max_norm = clip
        policy = getattr(schedule, "weight_policy", "live") if not schedule.synchronous else "live"
        self.predictors = [None] * len(stages)
        if policy == "predict":
            self.predictors = [predictor_for(schedule, o) for o in optimizers]
        self.versions = [WeightVersions(m, policy, p) for m, p in zip(stages, self.predictors)]
        self.gaps = {key: schedule.steps_ahead(*key) for key in schedule.versions()} if policy == "predict" else {}
        self.scale = 1.0 / (schedule.update_interval() if not schedule.synchronous else schedule.micro_batches)
        self.record = False
        self.program = schedule.lower()
        self.batches: list = []
        self.losses: list = []

    # ---- what the hosts share -------------------------------------------------------------------
    def clip(self, scope, stage: int) -> None:
        """A stage's own norm, or (once per step, every rank at the barrier) the whole model's."""
        if self.max_norm <= 0:
            return
        if scope == ClipScope.STAGE:
            params = [self.stages[stage]]
        elif self._clipped:
            return
        else:
            self._clipped, params = True, self.stages
        grads = [p.grad for module in params for p in module.parameters() if p.grad is not None]
        if grads:
            clip_by_norm(grads, grads, self.max_norm)

    def step_stage(self, k: int) -> None:
        if self.predictors[k] is not None:
            self.predictors[k].before_step()
        self.optimizers[k].step()
        if self.predictors[k] is not None:
            self.predictors[k].after_step()
        self.optimizers[k].zero_grad(set_to_none=True)
        self.versions[k].step_done()

    # ---- one call ---------------------------------------------------------------------------------
    def train_batch(self, batches: list) -> float:
        """Run one call's programs on ``batches`` (one (x, y) per micro-batch); the mean loss."""
        self.batches, self.losses, self._clipped = batches, [], False
        program = self.program
        mailbox: dict = {}
        hosts = [LocalHost(self, r, LocalTransport(mailbox)) for r in range(program.num_ranks)]
        runs = [StepExecutor(host).start(ops, train=True, scale=self.scale)
                for host, ops in zip(hosts, program.ops)]
        pcs = [0] * program.num_ranks
        sent = [-1] * program.num_ranks          # op index whose sends are posted
        at_clip: set = set()                     # ranks waiting at a global clip (a collective of every rank)
        while any(pc < len(ops) for pc, ops in zip(pcs, program.ops)):
            progressed = False
            for r, ops in enumerate(program.ops):
                while pcs[r] < len(ops):
                    op = ops[pcs[r]]
                    if type(op) is Comm:
                        if sent[r] != pcs[r]:
                            runs[r].post_sends(op)
                            sent[r] = pcs[r]
                            progressed = True
                        if not all(hosts[r].transport.ready(m) for m in op.recvs):
                            break
                        runs[r].take_receives(op)
                    elif type(op) is Clip and op.scope == ClipScope.GLOBAL:
                        if r not in at_clip:
                            at_clip.add(r)
                            progressed = True
                        if len(at_clip) == program.num_ranks:     # every rank's gradients are complete
                            for q in sorted(at_clip):
                                runs[q].execute(program.ops[q][pcs[q]])
                                pcs[q] += 1
                            at_clip.clear()
                        break
                    else:
                        runs[r].execute(op)
                    pcs[r] += 1
                    progressed = True
            if not progressed:
                stuck = [str(ops[pc]) for pc, ops in zip(pcs, program.ops) if pc < len(ops)]
                raise RuntimeError(f"{self.schedule.name}: the programs deadlock at {stuck}")
        for run in runs:
            run.finish()
        for v in self.versions:
            v.reset()
        return sum(self.losses) / len(self.losses)

    def forward(self, x):
        """The model on its live weights (evaluation)."""
        import torch
        with torch.no_grad():
            for stage in self.stages:
                x = stage(x)
        return x
