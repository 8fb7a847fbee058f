"""The DeepSpeed engine's execution context: chunks, data, gradient syncs, clipping, the step.

:class:`PipelineHost` implements :class:`~.context.ExecutionContext` for
:class:`~.engine.ScheduledPipelineEngine`; the engine keeps DeepSpeed's API (train_batch,
eval_batch, checkpoints) and hands each step's program to the executor with this host. How the
gradients are synchronised (plain all-reduce, ZeRO-1, ZeRO-2/3 shards; bf16 in each) is one
strategy chosen at set-up (:mod:`.gradient_sync`); the host calls it where the program says.
"""
from __future__ import annotations

import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter

from ..schedules.actions import split_chunks
from .chunks import tied_holders
from .clipping import grad_norm, scale_to
from .gradient_sync import gradient_sync_for
from .groups import PipelineGroups
from .p2p import P2P, wait_or_fail
from .tensors import to_half


def every_pipeline(grid, num_ranks: int) -> tuple:
    """(Every pipeline of the world as its global ranks, tensor rank by tensor rank and data-parallel copy by
    copy; the families: for each tensor rank, the indices of its data-parallel copies)."""
    tensor_size, dp = grid.get_slice_parallel_world_size(), grid.get_data_parallel_world_size()
    sliced = "model" in grid.topology().get_axis_names()
    pipelines, families = [], []
    for t in range(tensor_size):
        families.append(list(range(len(pipelines), len(pipelines) + dp)))
        for d in range(dp):
            where = {"data": d, **({"model": t} if sliced else {})}
            pipelines.append([grid.stage_to_global(p, **where) for p in range(num_ranks)])
    return pipelines, families


class PipelineHost:
    """The context the executor runs one rank's program on (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        plan = engine.plan
        self.plan, self.placement = plan, plan.placement
        self.pipe_rank = engine.grid.get_stage_id()
        self.device = engine.device
        self.timeout_s = plan.timeout_s
        self.dp_size = engine.grid.get_data_parallel_world_size()
        self.loss_fn = engine.module.loss_fn
        prepared = engine.prepared
        self.chunk_modules = {chunk.index: chunk for chunk in prepared.chunks}
        self.tied_modules = prepared.tied
        self.stage_chunk = {chunk.stage: c for c, chunk in self.chunk_modules.items()}
        self.split_chunks = split_chunks(plan.schedule.orders[self.pipe_rank])
        holders = tied_holders(engine.module._layer_specs, self.placement, plan.parts)
        self.tied_owner = {key: min(ranks) for key, ranks in holders.items()}
        grid = engine.grid
        self.tensor_rank = grid.get_slice_parallel_rank()
        pipelines, families = every_pipeline(grid, self.placement.num_ranks)
        nccl = dist.get_backend() != "gloo"
        global_ranks = [grid.stage_to_global(p) for p in range(self.placement.num_ranks)]   # this pipeline's
        self.groups = PipelineGroups(self.placement, pipelines, pipelines.index(global_ranks),
                                     plan.timeout_s,
                                     # ZeRO-1 reduces over data parallelism itself: then each pipeline on its own
                                     families=families if engine.zero_optimization_stage() != 1 else None,
                                     tied_holders=holders, nccl_edges=nccl)
        self.transport = P2P(global_ranks.__getitem__, self.device, len(self.placement.chunks),
                             plan.timeout_s, self.groups.edges,
                             dynamic_shapes=bool(getattr(engine.module, "dynamic_shape", False)),
                             default_group=self.groups.job)
        self.max_norm = plan.clip
        self.grad_norm = None                 # the norm before clipping of the last step (None: not clipped)
        self.batches: dict = {}
        # ZeRO-2/3: this rank's chunks sharded over data parallelism (see .sharding)
        self.shards = prepared.shards
        # fp16 at ZeRO stage 0: the optimizer is the fp32 masters' wrapper (runtime/fp16_masters.py); at ZeRO-1
        # DeepSpeed's ZeRO-1 optimizer unscales, checks for overflow everywhere and clips (clips_itself)
        self.fp16 = engine.optimizer if plan.config.fp16_masters else None
        self.half_inputs = plan.config.fp16
        self.gradients = gradient_sync_for(self, engine, self.shards, self.fp16)
        if self.gradients.clips_itself:
            self._mark_pipeline_copies()     # DeepSpeed's ZeRO-1 optimizer takes the norm

    # ---- the step's data ----------------------------------------------------------------------
    def begin(self, batches: dict, train: bool) -> None:
        """A new call: its micro-batches ({mb: (inputs, labels)}) and, when training, fresh sync state."""
        self.batches = batches
        if train:
            self.grad_norm = None
            self.gradients.begin()

    def load_input(self, chunk: int, mb: int):
        inputs = self.batches[mb][0]
        return to_half(inputs) if self.half_inputs else inputs

    def forward(self, chunk: int, mb: int, x, capture, train: bool):
        return self.chunk_modules[chunk](x, capture)

    def loss(self, output, chunk: int, mb: int):
        return self.loss_fn(output, self.batches[mb][1]) if self.loss_fn is not None else output

    def backward_done(self, chunk: int, mb: int) -> None:
        pass

    # ---- gradients (how: self.gradients, see .gradient_sync) -------------------------------------
    def start_grad_sync(self, stage: int) -> None:
        """Post the sync of one stage's gradients; the program calls it right after its last backward."""
        self.gradients.stage_done(stage)

    def wait_grad_syncs(self, stages: tuple) -> None:
        """Wait for every sync posted so far (and the tied weights', posted at the first wait of a step)."""
        self.gradients.finish(stages)

    def _held(self):
        """(parameter, whether this rank counts it) for each trainable parameter of this rank's chunks and
        tied modules: of a stage's replicas and a tied module's holders, one rank of the pipeline counts it."""
        for chunk in self.chunk_modules.values():
            counted = self.placement.stage_owner(chunk.stage) == self.pipe_rank
            yield from ((p, counted) for p in chunk.parameters() if p.requires_grad)
        for key, module in self.tied_modules.items():
            counted = self.tied_owner[key] == self.pipe_rank
            yield from ((p, counted) for p in module.parameters() if p.requires_grad)

    def owned_params(self) -> list:
        """Parameters this rank counts in the global norm: each stage and tied module once, and of a tensor
        rank's parameters its slices, with what every tensor rank holds whole counted on tensor rank 0 only."""
        owned = [p for p, counted in self._held() if counted]
        if self.tensor_rank != 0:
            owned = [p for p in owned if is_model_parallel_parameter(p)]
        return owned

    def _mark_pipeline_copies(self) -> None:
        """Where DeepSpeed's optimizer takes the norm (ZeRO-1): it skips a parameter marked ``ds_pipe_replicated``,
        as stock marks a tied module's copies; marked here by the same rule as :meth:`owned_params`."""
        for p, counted in self._held():
            p.ds_pipe_replicated = not counted

    def _sum_over_pipeline(self, squares) -> None:
        """Sum a rank's squared norm over the ranks that hold distinct gradients (the strategy's group)."""
        group = self.gradients.norm_group()
        wait_or_fail(lambda: dist.all_reduce(squares, group=group, async_op=True), self.timeout_s,
                     "the gradient-norm all-reduce")

    def global_grad_norm(self) -> float:
        return grad_norm(self.gradients.norm_grads()[0], self._sum_over_pipeline, self.device)

    def clip_gradients(self, scope, stage: int) -> None:
        """The global norm over unique parameters (a collective of the pipeline), every step: it is
        reported (``get_global_grad_norm()``) whether or not it clips. ZeRO-1 clips and reports itself."""
        if self.gradients.clips_itself:
            return
        if self.fp16 is not None and self.fp16.unscale(self._max_over_ranks, self.device):
            self.grad_norm = self.engine._global_grad_norm = None    # an overflow somewhere: the step is skipped
            return
        norm_of, held = self.gradients.norm_grads()
        self.grad_norm = grad_norm(norm_of, self._sum_over_pipeline, self.device)
        if self.max_norm > 0:
            scale_to(held, self.max_norm, self.grad_norm)
        self.engine._global_grad_norm = self.grad_norm

    def _max_over_ranks(self, flag) -> None:
        """fp16: each rank's overflow flag, the maximum over every rank (a skipped step is skipped everywhere)."""
        group = self.groups.job
        wait_or_fail(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True),
                     self.timeout_s, "the fp16 overflow check")

    def optimizer_step(self, chunks: tuple) -> None:
        self.engine._take_model_step(None)
        self.gradients.stepped()
        if self.grad_norm is not None and not self.gradients.clips_itself:
            # DeepSpeed's step reads its optimizer's own norm (BF16_Optimizer's covers this rank's
            # part only); the step's norm is the one the program's CLIP computed
            self.engine._global_grad_norm = self.grad_norm

    # ---- ZeRO-2/3: the chunks' weights, gathered and released where the program says ----------
    def gather_weights(self, chunk: int) -> None:
        self.shards.gather(chunk)

    def wait_weights(self, chunk: int) -> None:
        self.shards.wait(chunk)

    def prepare_grads(self, chunk: int) -> None:
        self.shards.prepare_grads(chunk)

    def release_weights(self, chunk: int) -> None:
        self.shards.release(chunk)
