"""The engine for asynchronous 1F1B schedules: PipeOptim, PipeDream, 2BW, SpecTrain.

Each stage steps its optimizer inside the program (the ``S`` actions), right after the
backward that completes an update, so stages update at different times and there is no
flush between updates.

Pipeline fill: one ``train_batch`` runs its N mini-batches (``gradient_accumulation_steps``)
through a full pipeline and drains it before returning. The pipeline is therefore full
*within* a call, not across calls, so that on return every update of those mini-batches is
applied: checkpoints, ``eval_batch`` and learning-rate changes see one weight version per
stage, and DeepSpeed's data-iterator contract (a call consumes its own micro-batches) holds.
The price is a fill and drain of D-1 slots per call, (D-1)/(N+D-1) of its time: choose N
well above D (N = 64 at D = 4 loses 4.5%).

Each mini-batch is one update: its loss is not divided by N. Gradient clipping, where
configured, uses each stage's own gradient norm: a global norm would need every stage to
meet at each update, which is exactly the synchronisation these schedules remove.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..atomic import torch_save_atomic
from ..optim.bf16 import BF16MasterView
from ..optim.predictors import predictor_for
from ..optim.versions import WeightVersions
from . import checkpoint as ckpt
from .clipping import clip_by_norm
from .engine import ScheduledPipelineEngine, log
from .host import PipelineHost
from .p2p import LOSS_TAG, hold_until_sent, post_or_fail, wait_or_fail


class AsyncPipelineHost(PipelineHost):
    """The asynchronous engine's context: forwards on the weight version the policy says; each
    stage's step (sync over data parallelism, its own clipping, the predictor's bookkeeping)
    runs inside the program."""

    def __init__(self, engine):
        super().__init__(engine)
        schedule = engine.schedule
        self.record_versions = False
        self.predictor = None
        if schedule.weight_policy == "predict":
            # under bf16 the predictor reads the fp32 master weights and state behind the bf16 parameters
            optimizer = BF16MasterView(engine.optimizer, self.gradients.source.hp_grads) \
                if engine.using_bf16_optimizer else engine.optimizer
            self.predictor = predictor_for(schedule, optimizer)
        self.weight_versions = {c: WeightVersions(chunk, schedule.weight_policy, self.predictor)
                                for c, chunk in self.chunk_modules.items()}
        self.gaps = {key: schedule.steps_ahead(*key) for key in schedule.versions()
                     if key[0] in self.chunk_modules} if self.predictor is not None else {}

    def forward(self, chunk: int, mb: int, x, capture, train: bool):
        ahead = self.gaps.get((chunk, mb), 0) if train else 0
        return self.weight_versions[chunk].forward(mb, (x, capture), ahead, record=self.record_versions)

    def backward_done(self, chunk: int, mb: int) -> None:
        self.weight_versions[chunk].backward_done(mb, record=self.record_versions)

    def clip_gradients(self, scope, stage: int) -> None:
        """One stage's own norm: a global one would make every stage meet at each update."""
        if self.max_norm <= 0:
            return
        grads = self.gradients.source.held(self.engine.module)
        if grads:
            self.grad_norm = clip_by_norm(grads, grads, self.max_norm, None, self.device)
            self.engine._global_grad_norm = self.grad_norm

    def optimizer_step(self, chunks: tuple) -> None:
        if self.predictor is not None:
            self.predictor.before_step()
        self.engine._take_model_step(None)
        if self.predictor is not None:
            self.predictor.after_step()
        for chunk in chunks:
            self.weight_versions[chunk].step_done()


class AsyncPipelineEngine(ScheduledPipelineEngine):
    """A ScheduledPipelineEngine whose stages step inside the program, once per update."""

    host_class = AsyncPipelineHost

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        schedule = self.schedule
        self.update_interval = schedule.update_interval()
        self.predictor = self.host.predictor
        self.weight_versions = self.host.weight_versions
        self.continuous = schedule.continuous
        if self.continuous:
            self._init_continuous()
        if self.global_rank == 0 and self.predictor is not None:
            log.info("%s: weight predictor %r for %s, steps_ahead=%r", schedule.name, self.predictor.name,
                     type(self.optimizer).__name__, schedule.config["steps_ahead"])

    def set_train_batch_size(self, train_batch_size):
        if train_batch_size == self.train_batch_size():
            return           # Megatron-DeepSpeed calls it every iteration; the same size changes nothing
        raise ValueError(f"set_train_batch_size({train_batch_size!r}) with the asynchronous schedule "
                         f"{self.schedule.name!r}: its update interval, weight versions and prediction gaps are "
                         f"set up for {self.micro_batches} micro-batches per call; build a new engine for another "
                         f"batch size (the synchronous schedules rebuild their programs in place)")

    @property
    def record_versions(self) -> bool:
        return self.host.record_versions

    @record_versions.setter
    def record_versions(self, value: bool) -> None:
        self.host.record_versions = value

    def weight_versions_held(self) -> int:
        """The most weight versions this rank has held at once (live + stashed or predicted)."""
        return max(v.peak_versions for v in self.weight_versions.values())

    # ---- a pipeline kept full across calls (fill = continuous) ---------------------------------
    def _init_continuous(self) -> None:
        """Programs of a first, a steady and a draining call; the simulator proves them end to end."""
        from ..sim.simulator import simulate
        schedule = self.schedule
        proof = simulate(schedule.unrolled_program(3))
        if not proof.valid:
            raise ValueError(f"schedule {schedule.name!r} with fill='continuous' is invalid: "
                             f"{(proof.errors or list(proof.deadlock.values()))[:3]}")
        self.part_programs = {part: schedule.part_program(part) for part in ("first", "steady", "drain")}
        gaps = schedule.part_steps_ahead() if self.predictor is not None else {}
        self.part_gaps = {part: {k: v for k, v in table.items() if k[0] in self.host.chunk_modules}
                          for part, table in gaps.items()}
        self.carry = None            # executor state of the micro-batches in flight between calls
        self.mb_base = 0             # global id of this call's micro-batch 0

    def _continuous_call(self, part: str, trace: bool):
        from .executor import new_carry, shift_carry
        n, depth = self.micro_batches, self.num_stages
        if self.carry is None:
            self.carry = new_carry()
        first, last = self.pipe_rank == 0, self.pipe_rank == depth - 1
        if part == "drain":
            count, offset = (depth - 1 if last else 0), 0
        elif first and not last:
            count, offset = (n + depth - 1, 0) if part == "first" else (n, depth - 1)
        else:
            count, offset = n, 0
        batches = {offset + i: b for i, b in self._load_batches(count).items()} if count else {}
        self.host.gaps = self.part_gaps.get(part, {})
        self.host.begin(batches, train=True)
        loss_sum, _ = self.executor.run(self.part_programs[part].ops[self.pipe_rank], train=True,
                                        scale=1.0 / self.update_interval, trace=trace, carry=self.carry,
                                        mb_base=self.mb_base, flush=part == "drain", device=self.device)
        if part == "drain":
            shift_carry(self.carry, depth - 1)
            if any(self.carry.values()):
                raise RuntimeError("internal error: micro-batches left in flight after the drain")
            self.carry, self.mb_base = None, self.mb_base + depth - 1
            for versions in self.weight_versions.values():
                versions.reset()
        else:
            shift_carry(self.carry, n)
            for versions in self.weight_versions.values():
                versions.inflight = {mb - n: v for mb, v in versions.inflight.items()}
            self.mb_base += n
        return loss_sum

    def drain(self) -> float | None:
        """Finish the D-1 mini-batches still in flight (fill = continuous); the last stage reads their
        labels from the data iterator. Returns their mean loss, or None if nothing was in flight.
        ``eval_batch`` and ``save_checkpoint`` drain first."""
        if not self.continuous or self.carry is None:
            return None
        with self._guard("drain"):
            loss_sum = self._continuous_call("drain", trace=False)
            return self._aggregate_loss(loss_sum, self.num_stages - 1).item() if self.num_stages > 1 else None

    def eval_batch(self, *args, **kwargs):
        self.drain()
        return super().eval_batch(*args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        self.drain()
        return super().save_checkpoint(*args, **kwargs)

    # ---- a call ----------------------------------------------------------------------------
    def _train_call(self, trace: bool):
        """The program steps each stage itself; nothing is left to do after it but the loss."""
        if self.continuous:
            loss_sum = self._continuous_call("first" if self.carry is None else "steady", trace)
        else:
            self.host.begin(self._load_batches(self.micro_batches), train=True)
            loss_sum, _ = self.executor.run(self.plan.program.ops[self.pipe_rank], train=True,
                                            scale=1.0 / self.update_interval, trace=trace, device=self.device)
            for versions in self.weight_versions.values():
                versions.reset()
        return self._aggregate_loss(loss_sum, self.micro_batches)

    def _aggregate_loss(self, loss_sum, micro_batches: int):
        """The call's mean loss on every rank, without a barrier at the end of the call.

        Only the last stage has losses, and it finishes a call (D-1) backwards before the first
        stage. An all-reduce over the pipeline would hold it there, and the next call would
        start with a partly empty pipeline. Instead the last stages average over data
        parallelism (they run in step) and send the result on; the other stages receive it
        when they finish, by which time it has arrived.
        """
        last = self.num_stages - 1
        if self.num_stages == 1:
            return super()._aggregate_loss(loss_sum, micro_batches)
        value = torch.zeros(1, dtype=torch.float32, device=self.device)
        timeout = self.plan.timeout_s
        if self.pipe_rank == last:
            if loss_sum is not None:
                value += loss_sum.reshape(-1)[:1].to(value.dtype)
            if self.dp_size > 1:
                wait_or_fail(lambda: dist.all_reduce(value, group=self.grid.get_data_parallel_group(), async_op=True),
                             timeout, "the loss all-reduce of the last stage")
            value /= micro_batches * self.dp_size
            for work, _ in getattr(self, "_loss_sends", []):
                wait_or_fail(work, timeout, "a loss sent to an earlier stage")
            dp_id = self.grid.get_data_parallel_id()
            self._loss_sends = [(post_or_fail(lambda p=p: dist.isend(value, self.grid.stage_to_global(p, data=dp_id),
                                                                     group=self.host.groups.job, tag=LOSS_TAG),
                                              "the loss send"), value)
                                for p in range(last)]
            for work, sent in self._loss_sends:     # the engine may be dropped before they arrive
                hold_until_sent(work, sent)
        else:
            source = self.grid.stage_to_global(last, data=self.grid.get_data_parallel_id())
            wait_or_fail(lambda: dist.irecv(value, source, group=self.host.groups.job, tag=LOSS_TAG), timeout,
                         "the loss from the last stage")
        return value.squeeze(0)

    # ---- predictor state in checkpoints --------------------------------------------------------
    def _extra_state_file(self, directory: str) -> str:
        return os.path.join(directory, f"ds_chimera_predictor-rank{self.global_rank:04d}.pt")

    def _save_extra_state(self, directory: str) -> None:
        if self.predictor is not None:
            torch_save_atomic(self.predictor.state_dict(), self._extra_state_file(directory))

    def _load_extra_state(self, directory: str) -> None:
        if self.predictor is None:
            return
        path = self._extra_state_file(directory)
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {directory} has no weight-predictor state for rank "
                                    f"{self.global_rank} ({path}); it was not written by {self.schedule.name!r}")
        self.predictor.load_state_dict(ckpt.load_written(path, self.device))
