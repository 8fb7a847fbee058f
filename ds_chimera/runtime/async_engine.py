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
import time

import torch

from ..optim.bf16 import BF16MasterView
from ..optim.predictors import SmoothedGradient, make_predictor
from ..optim.versions import WeightVersions
from .engine import ScheduledPipelineEngine


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
            if schedule.name == "spectrain":
                self.predictor = SmoothedGradient(optimizer, schedule.config["smoothing"])
            else:
                self.predictor = make_predictor(optimizer, schedule.config["predictor"])
        self.weight_versions = {c: WeightVersions(chunk, schedule.weight_policy, self.predictor)
                                for c, chunk in self.chunk_modules.items()}
        self._gaps = {key: schedule.steps_ahead(*key) for key in schedule.versions()
                      if key[0] in self.chunk_modules} if self.predictor is not None else {}
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

    # ---- a call ----------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        if not torch._C.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        start = time.perf_counter()
        self.tput_timer.start()
        batches = self._load_batches(self.micro_batches)
        trace = self.plan.trace_dir is not None
        loss_sum, _ = self.executor.run(self.plan.program.ops[self.pipe_rank], batches, train=True,
                                        scale=1.0 / self.update_interval, trace=trace)
        for versions in self.weight_versions.values():
            versions.reset()
        # mean loss per update interval, averaged: the mean over the call's micro-batches
        self.agg_train_loss = self._aggregate_loss(loss_sum, self.micro_batches)
        self.tput_timer.stop(global_step=True)
        if trace:
            self._write_trace()
        self._print_progress(time.perf_counter() - start)
        return self.agg_train_loss

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
