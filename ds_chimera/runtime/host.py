"""The DeepSpeed engine's execution context: chunks, data, gradient syncs, clipping, the step.

:class:`PipelineHost` implements :class:`~.context.ExecutionContext` for
:class:`~.engine.ScheduledPipelineEngine`; the engine keeps DeepSpeed's API (train_batch,
eval_batch, checkpoints) and hands each step's program to the executor with this host.

Gradients: each stage's all-reduce covers its replicas (Chimera) and its data-parallel
copies in one collective, posted by the program right after the stage's last backward.
ZeRO-1 owns the data-parallel reduction (into optimizer-state partitions) and the
clipping, so under ZeRO-1 the syncs cover replicas and tied weights within a pipeline,
and each chunk's gradients go to ZeRO's reduction when the chunk is done. Under bf16 the
gradients live in the optimizer's fp32 accumulators (immediate_grad_update): those are
what is all-reduced, clipped and stepped.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedules.actions import split_chunks
from .chunks import tied_holders
from .clipping import grad_norm, scale_to
from .gradsync import FlatGradAllReduce
from .groups import PipelineGroups
from .p2p import P2P, wait_or_fail


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
        self.zero1 = engine.zero_optimization_stage() == 1
        self.loss_fn = engine.module.loss_fn
        self.chunk_modules = {chunk.index: chunk for chunk in engine.module.ds_chimera_chunks}
        self.tied_modules = engine.module.ds_chimera_tied
        self.stage_chunk = {chunk.stage: c for c, chunk in self.chunk_modules.items()}
        self.split_chunks = split_chunks(plan.schedule.orders[self.pipe_rank])
        holders = tied_holders(engine.module._layer_specs, self.placement, plan.parts)
        self.tied_owner = {key: min(ranks) for key, ranks in holders.items()}
        grid = engine.grid
        pipelines = [[grid.stage_to_global(p, data=d) for p in range(self.placement.num_ranks)]
                     for d in range(self.dp_size)]
        nccl = dist.get_backend() != "gloo"
        self.groups = PipelineGroups(self.placement, pipelines, grid.get_data_parallel_id(), plan.timeout_s,
                                     span_pipelines=not self.zero1, tied_holders=holders, nccl_edges=nccl)
        self.transport = P2P(lambda p: grid.stage_to_global(p), self.device, len(self.placement.chunks),
                             plan.timeout_s, self.groups.edges,
                             dynamic_shapes=bool(getattr(engine.module, "dynamic_shape", False)),
                             default_group=self.groups.job)
        self.max_norm = plan.clip
        self.grad_norm = None                 # the norm before clipping of the last step (None: not clipped)
        self.hp_grads = {}
        optimizer = engine.optimizer
        if engine.using_bf16_optimizer:
            for i, group in enumerate(optimizer.bf16_groups):
                for j, lp in enumerate(group):
                    self.hp_grads[id(lp)] = optimizer.fp32_groups_gradients[i][j]
        self.pending: list = []
        self.batches: dict = {}
        self._tied_posted = False
        # ZeRO-2/3: this rank's chunks sharded over data parallelism (see .sharding)
        self.shards = engine.module._ds_chimera_shards

    # ---- the step's data ----------------------------------------------------------------------
    def begin(self, batches: dict, train: bool) -> None:
        """A new call: its micro-batches ({mb: (inputs, labels)}) and, when training, fresh sync state."""
        self.batches = batches
        if train:
            self.pending, self._tied_posted, self.grad_norm = [], False, None
            if self.zero1:
                self._zero1_start()

    def load_input(self, chunk: int, mb: int):
        return self.batches[mb][0]

    def forward(self, chunk: int, mb: int, x, capture, train: bool):
        return self.chunk_modules[chunk](x, capture)

    def loss(self, output, chunk: int, mb: int):
        return self.loss_fn(output, self.batches[mb][1]) if self.loss_fn is not None else output

    def backward_done(self, chunk: int, mb: int) -> None:
        pass

    # ---- gradients ------------------------------------------------------------------------------
    def start_grad_sync(self, stage: int) -> None:
        """Post the all-reduce of one stage's gradients; the program calls it right after its last backward."""
        if self.shards is not None:          # a reduce-scatter into the shards instead of an all-reduce
            self.shards.reduce_scatter(self.stage_chunk[stage])
            return
        chunk = self.chunk_modules[self.stage_chunk[stage]]
        group = self.groups.stage.get(stage)
        self._post_allreduce(chunk, group, f"stage {stage}")
        if self.zero1 and group is None and self.plan.zero1_reduce == "chunk":
            self._zero1_reduce(chunk.parameters())
            self.zero1_early_chunks += 1

    def wait_grad_syncs(self, stages: tuple) -> None:
        """Post the tied weights' syncs (once per step), then wait for every sync posted so far."""
        if self.shards is not None:          # the reduce-scatters of these stages' chunks
            self.shards.finish_grads([self.stage_chunk[stage] for stage in stages])
            return
        if not self._tied_posted:
            self._tied_posted = True
            for key in sorted(self.groups.tied):
                self._post_allreduce(self.tied_modules[key], self.groups.tied[key], f"tied weights {key!r}")
        divide_by = self.dp_size if not self.zero1 else 1     # ZeRO-1 averages over data parallel itself
        for sync in self.pending:
            sync.finish(self.timeout_s, divide_by)
        self.pending = []
        if self.zero1:
            self._zero1_finish()             # ZeRO-1 averages into each rank's partition and clips there

    def _post_allreduce(self, module, group, what: str) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        if group is None or not params:
            return
        if not self.hp_grads:
            for p in params:          # the sum is written back in place: a missing gradient is a zero one
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        self.pending.append(FlatGradAllReduce(self.grads(params), group, what))

    def grads(self, params) -> list:
        """The gradient each parameter's optimizer reads: fp32 master grads under bf16."""
        if self.hp_grads:
            return [self.hp_grads[id(p)] for p in params]
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def owned_params(self) -> list:
        """Parameters this rank counts in the global norm: each stage and tied module once."""
        owned = []
        for chunk in self.chunk_modules.values():
            if self.placement.stage_owner(chunk.stage) == self.pipe_rank:
                owned += [p for p in chunk.parameters() if p.requires_grad]
        for key, module in self.tied_modules.items():
            if self.tied_owner[key] == self.pipe_rank:
                owned += [p for p in module.parameters() if p.requires_grad]
        return owned

    def _sum_over_pipeline(self, squares) -> None:
        """Sum a rank's squared norm over the ranks that hold distinct gradients: the pipeline, or
        under ZeRO-2/3 (every data-parallel rank a different shard) the whole world."""
        group = None if self.shards is not None else self.engine.grid.get_pipe_parallel_group()
        wait_or_fail(lambda: dist.all_reduce(squares, group=group, async_op=True), self.timeout_s,
                     "the gradient-norm all-reduce")

    def _norm_grads(self) -> tuple:
        """(gradients counted in the norm, gradients the clip scales) of this rank."""
        if self.shards is not None:
            grads = [p.grad for p in self.shards.shard_params]
            return grads, grads
        owned = self.owned_params()
        norm_of = self.grads(owned) if self.hp_grads else [p.grad for p in owned]
        held = list(self.hp_grads.values()) if self.hp_grads else \
            [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return norm_of, held

    def global_grad_norm(self) -> float:
        return grad_norm(self._norm_grads()[0], self._sum_over_pipeline, self.device)

    def clip_gradients(self, scope, stage: int) -> None:
        """The global norm over unique parameters (a collective of the pipeline), every step: it is
        reported (``get_global_grad_norm()``) whether or not it clips. ZeRO-1 clips and reports itself."""
        if self.zero1:
            return
        norm_of, held = self._norm_grads()
        self.grad_norm = grad_norm(norm_of, self._sum_over_pipeline, self.device)
        if self.max_norm > 0:
            scale_to(held, self.max_norm, self.grad_norm)
        self.engine._global_grad_norm = self.grad_norm

    def optimizer_step(self, chunks: tuple) -> None:
        self.engine._take_model_step(None)
        if self.shards is not None:
            self.shards.stepped()
        if self.grad_norm is not None and not self.zero1:
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

    # ---- ZeRO-1: each chunk's gradients go to their optimizer partitions when the chunk is done ----
    def _zero1_start(self) -> None:
        """Prepare DeepSpeed's reduce buckets, as its own pipeline path does in reduce_gradients."""
        from deepspeed.accelerator import get_accelerator
        opt = self.engine.optimizer
        opt.set_gradient_accumulation_boundary(False)     # reduce hooks (overlap_comm) stay idle in backward
        if opt.contiguous_gradients:
            for dtype, bucket in opt.ipg_buckets.items():
                bucket.buffer.append(torch.empty(int(opt.reduce_bucket_size), dtype=dtype,
                                                 device=get_accelerator().current_device_name()))
                bucket.index = 0
        self._zero1_reduced = set()
        self.zero1_early_chunks = 0          # chunks reduced before the flush in this call (for inspection)
        if not hasattr(self, "_zero1_group_of"):
            self._zero1_group_of = {id(p): i for i, group in enumerate(opt.bit16_groups) for p in group}

    def _zero1_reduce(self, params, flush: bool = True) -> None:
        """Hand finished gradients to ZeRO's reduction (into the owning data-parallel rank's partition).

        With ``overlap_comm`` DeepSpeed runs the reduction on a side stream, so it overlaps the
        chunks still computing; without it the reduction runs now, in this rank's bubble.
        """
        opt = self.engine.optimizer
        opt.set_gradient_accumulation_boundary(True)
        try:
            for p in params:
                if id(p) in self._zero1_reduced or id(p) not in self._zero1_group_of or \
                        opt.get_gradient_for_reduction(p) is None:
                    continue
                opt.reduce_ready_partitions_and_remove_grads(p, self._zero1_group_of[id(p)])
                self._zero1_reduced.add(id(p))
            if flush:
                opt.reduce_ipg_grads()
                if opt.contiguous_gradients and opt.overlap_comm:
                    for bucket in opt.ipg_buckets.values():
                        bucket.index = 1 - bucket.index
        finally:
            opt.set_gradient_accumulation_boundary(False)

    def _zero1_finish(self) -> None:
        """Reduce what no chunk reduced (tied modules, or zero1_reduce="end"), then ZeRO's epilogue."""
        opt = self.engine.optimizer
        self._zero1_reduce([p for group in opt.bit16_groups for p in group], flush=False)
        opt.set_gradient_accumulation_boundary(True)
        opt.overlapping_partition_gradients_reduce_epilogue()
