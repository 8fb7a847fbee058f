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

from ..optim.bf16 import BF16MasterView
from ..optim.predictors import predictor_for
from ..optim.versions import WeightVersions
from .engine import ScheduledPipelineEngine
from .p2p import LOSS_TAG


class AsyncPipelineEngine(ScheduledPipelineEngine):
    """A ScheduledPipelineEngine whose stages step inside the program, once per update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        schedule = self.schedule
        self.update_interval = schedule.update_interval()
        self.record_versions = False
        self.predictor = None
        if schedule.weight_policy == "predict":
            # under bf16 the predictor reads the fp32 master weights and state behind the bf16 parameters
            optimizer = BF16MasterView(self.optimizer, self._hp_grads) if self.using_bf16_optimizer else self.optimizer
            self.predictor = predictor_for(schedule, optimizer)
        self.weight_versions = {c: WeightVersions(chunk, schedule.weight_policy, self.predictor)
                                for c, chunk in self.chunk_modules.items()}
        self._gaps = {key: schedule.steps_ahead(*key) for key in schedule.versions()
                      if key[0] in self.chunk_modules} if self.predictor is not None else {}
        self.continuous = schedule.continuous
        if self.continuous:
            self._init_continuous()
        if self.global_rank == 0 and self.predictor is not None:
            print(f"[ds_chimera] {schedule.name}: weight predictor {self.predictor.name!r} for "
                  f"{type(self.optimizer).__name__}, steps_ahead={schedule.config['steps_ahead']!r}", flush=True)

    def steps_ahead(self, chunk: int, mb: int) -> int:
        return self._gaps.get((chunk, mb), 0)

    def weight_versions_held(self) -> int:
        """The most weight versions this rank has held at once (live + stashed or predicted)."""
        return max(v.peak_versions for v in self.weight_versions.values())

    # ---- one update ------------------------------------------------------------------------
    def step_chunk(self, chunk: int, mb: int) -> None:
        """The ``S`` action: sync this stage's gradients over data parallelism, clip, step."""
        self._finish_grad_syncs()
        self._clip_stage()
        if self.predictor is not None:
            self.predictor.before_step()
        self._take_model_step(None)
        if self.predictor is not None:
            self.predictor.after_step()
        self.weight_versions[chunk].step_done()

    def _clip_stage(self) -> None:
        if self.true_clip <= 0:
            return
        if self._hp_grads:        # bf16: the fp32 gradients the optimizer will read
            grads = list(self._hp_grads.values())
        else:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([g.detach().float().norm() for g in grads]))
            self._global_grad_norm = float(norm)
            coef = self.true_clip / (self._global_grad_norm + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)

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
        self.part_gaps = {part: {k: v for k, v in table.items() if k[0] in self.chunk_modules}
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
        self._gaps = self.part_gaps.get(part, {})
        loss_sum, _ = self.executor.run(self.part_programs[part].ops[self.pipe_rank], batches, train=True,
                                        scale=1.0 / self.update_interval, trace=trace, carry=self.carry,
                                        mb_base=self.mb_base, flush=part == "drain")
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
            batches = self._load_batches(self.micro_batches)
            loss_sum, _ = self.executor.run(self.plan.program.ops[self.pipe_rank], batches, train=True,
                                            scale=1.0 / self.update_interval, trace=trace)
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
        if self.pipe_rank == last:
            if loss_sum is not None:
                value += loss_sum.reshape(-1)[:1].to(value.dtype)
            if self.dp_size > 1:
                self.p2p._wait(lambda: dist.all_reduce(value, group=self.grid.get_data_parallel_group(), async_op=True),
                               "the loss all-reduce of the last stage")
            value /= micro_batches * self.dp_size
            for work, _ in getattr(self, "_loss_sends", []):
                self.p2p._wait(work, "a loss sent to an earlier stage")
            dp_id = self.grid.get_data_parallel_id()
            self._loss_sends = [(self.p2p.post(lambda p=p: dist.isend(value, self._global_rank_of(p, dp_id),
                                                                      tag=LOSS_TAG), "the loss send"), value)
                                for p in range(last)]
        else:
            self.p2p._wait(lambda: dist.irecv(value, self._global_rank_of(last, self.grid.get_data_parallel_id()),
                                      tag=LOSS_TAG), "the loss from the last stage")
        return value.squeeze(0)

    # ---- predictor state in checkpoints --------------------------------------------------------
    def _extra_state_file(self, directory: str) -> str:
        return os.path.join(directory, f"ds_chimera_predictor-rank{self.global_rank:04d}.pt")

    def _save_extra_state(self, directory: str) -> None:
        if self.predictor is None:
            return
        final = self._extra_state_file(directory)
        tmp = f"{final}.tmp"
        torch.save(self.predictor.state_dict(), tmp)
        os.replace(tmp, final)

    def _load_extra_state(self, directory: str) -> None:
        if self.predictor is None:
            return
        path = self._extra_state_file(directory)
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {directory} has no weight-predictor state for rank "
                                    f"{self.global_rank} ({path}); it was not written by {self.schedule.name!r}")
        self.predictor.load_state_dict(torch.load(path, map_location=self.device, weights_only=False))
