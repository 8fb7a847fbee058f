"""How a step's gradients become what the optimizer steps: one strategy per engine, chosen at set-up.

The program says *when* (``SYNC_START`` right after a rank's last backward of a stage, ``SYNC_WAIT``
before the clip and the step); the strategy says *how*:

- :class:`AllReduceSync`: each stage's gradients are all-reduced over its replicas (Chimera) and its
  data-parallel copies in one collective, tied weights over the ranks that hold them, then averaged over
  data parallelism; the clipping norm is summed over the pipeline.
- :class:`Zero1Sync`: DeepSpeed's ZeRO-1 optimizer owns the data-parallel reduction (into each rank's
  optimizer-state partition) and the clipping, so the all-reduces cover replicas and tied weights within
  one pipeline, and each chunk's gradients go to ZeRO's reduction when the chunk is done.
  :class:`DeepSpeedZero1` is the one place that drives DeepSpeed's private ZeRO-1 internals.
- :class:`ShardedSync`: ZeRO-2/3 (:mod:`.sharding`): each chunk's gradients are reduce-scattered into
  the rank's shard; the norm is summed over every rank (each holds a different shard).

bf16 is a property of the first two (:class:`GradientSource`): DeepSpeed's BF16_Optimizer accumulates
each gradient into an fp32 buffer as it is produced (``immediate_grad_update``), and those buffers are
what is all-reduced, clipped and stepped.
"""
from __future__ import annotations

import torch

from .gradsync import FlatGradAllReduce


class GradientSource:
    """Where the gradient the optimizer reads lives: ``p.grad``; under bf16 the fp32 accumulator; under fp16
    ``p.grad`` (fp16, scaled) for the sync and the fp32 master's unscaled gradient for the norm and the clip."""

    def __init__(self, engine, fp16=None):
        """``fp16``: the engine's :class:`~.fp16_masters.Fp16MasterOptimizer` under fp16, else None."""
        self.fp16 = fp16
        self.hp_grads = {}        # id(bf16 parameter) -> its fp32 gradient accumulator (bf16 only)
        if engine.using_bf16_optimizer:
            optimizer = engine.optimizer
            for i, group in enumerate(optimizer.bf16_groups):
                for j, lp in enumerate(group):
                    self.hp_grads[id(lp)] = optimizer.fp32_groups_gradients[i][j]

    @property
    def bf16(self) -> bool:
        return bool(self.hp_grads)

    def of(self, params) -> list:
        """The gradient each parameter's optimizer reads (a zero tensor where there is none yet)."""
        if self.hp_grads:
            return [self.hp_grads[id(p)] for p in params]
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def to_sync(self, params) -> list:
        """:meth:`of`, with a missing ``p.grad`` created as zeros first: a sum is written back in place."""
        if not self.hp_grads:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return self.of(params)

    def counted(self, params) -> list:
        """The gradients of ``params`` that a norm counts (None where a parameter has none)."""
        if self.fp16 is not None:
            return self.fp16.master_grads(params)
        return self.of(params) if self.hp_grads else [p.grad for p in params]

    def held(self, module) -> list:
        """Every gradient this rank holds, which a clip scales."""
        if self.fp16 is not None:
            return [master.grad for _, master in self.fp16.pairs if master.grad is not None]
        return list(self.hp_grads.values()) if self.hp_grads else \
            [p.grad for p in module.parameters() if p.grad is not None]


class AllReduceSync:
    """Replicas, data parallelism and tied weights by flat all-reduces (see the module docstring)."""

    clips_itself = False       # ZeRO-1's optimizer clips and reports the norm itself

    def __init__(self, host, source: GradientSource):
        self.host, self.source = host, source
        self.divide_by = host.dp_size
        self.pending: list = []
        self._tied_posted = False

    def begin(self) -> None:
        self.pending, self._tied_posted = [], False

    def stage_done(self, stage: int) -> None:
        """``SYNC_START``: post the all-reduce of ``stage``'s gradients over its holders."""
        host = self.host
        self._post(host.chunk_modules[host.stage_chunk[stage]], host.groups.stage.get(stage), f"stage {stage}")

    def finish(self, stages: tuple) -> None:
        """``SYNC_WAIT``: post the tied weights' syncs (once per step), then wait for every posted sync."""
        host = self.host
        if not self._tied_posted:
            self._tied_posted = True
            for key in sorted(host.groups.tied):
                self._post(host.tied_modules[key], host.groups.tied[key], f"tied weights {key!r}")
        for sync in self.pending:
            sync.finish(host.timeout_s, self.divide_by)
        self.pending = []

    def _post(self, module, group, what: str) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        if group is None or not params:
            return
        self.pending.append(FlatGradAllReduce(self.source.to_sync(params), group, what))

    def norm_grads(self) -> tuple:
        """(gradients counted in the norm: each stage and tied module once; gradients the clip scales)."""
        return self.source.counted(self.host.owned_params()), self.source.held(self.host.engine.module)

    def norm_group(self):
        """The group a rank's squared norm is summed over: the ranks with distinct gradients, the pipeline's
        stages and tensor ranks of this data-parallel copy (DeepSpeed's model-parallel group)."""
        return self.host.engine.grid.get_model_parallel_group()

    def stepped(self) -> None:
        pass


class Zero1Sync(AllReduceSync):
    """ZeRO-1: replicas and tied weights within the pipeline, data parallelism by DeepSpeed's ZeRO-1."""

    clips_itself = True

    def __init__(self, host, source: GradientSource, reduce_each_chunk: bool):
        super().__init__(host, source)
        self.divide_by = 1                     # ZeRO-1 averages over data parallelism itself
        self.reduce_each_chunk = reduce_each_chunk
        self.zero = DeepSpeedZero1(host.engine.optimizer)
        self.early_chunks = 0                  # chunks reduced before the flush in this call (for inspection)

    def begin(self) -> None:
        super().begin()
        self.zero.start()
        self.early_chunks = 0

    def stage_done(self, stage: int) -> None:
        super().stage_done(stage)
        if self.reduce_each_chunk and self.host.groups.stage.get(stage) is None:
            # no replica to sum with first: the chunk's gradients are final, and go to ZeRO's reduction now
            self.zero.reduce(self.host.chunk_modules[self.host.stage_chunk[stage]].parameters())
            self.early_chunks += 1

    def finish(self, stages: tuple) -> None:
        super().finish(stages)
        self.zero.finish()              # ZeRO-1 averages into each rank's partition and clips there


class ShardedSync:
    """ZeRO-2/3: reduce-scatters into this rank's chunk shards (:class:`~.sharding.ChunkShards`)."""

    clips_itself = False

    def __init__(self, host, shards):
        self.host, self.shards = host, shards

    def begin(self) -> None:
        pass

    def stage_done(self, stage: int) -> None:
        self.shards.reduce_scatter(self.host.stage_chunk[stage])

    def finish(self, stages: tuple) -> None:
        self.shards.finish_grads([self.host.stage_chunk[stage] for stage in stages])

    def norm_grads(self) -> tuple:
        grads = [p.grad for p in self.shards.shard_params]
        return grads, grads

    def norm_group(self):
        return None          # every rank holds a different shard: the whole world

    def stepped(self) -> None:
        self.shards.stepped()


def gradient_sync_for(host, engine, shards, fp16=None):
    """The strategy of this engine's configuration (ZeRO stage, bf16, fp16): chosen once, at set-up."""
    if shards is not None:
        return ShardedSync(host, shards)
    source = GradientSource(engine, fp16)
    if engine.zero_optimization_stage() == 1:
        return Zero1Sync(host, source, reduce_each_chunk=host.plan.zero1_reduce == "chunk")
    return AllReduceSync(host, source)


class DeepSpeedZero1:
    """DeepSpeed's ZeRO-1 optimizer driven chunk by chunk, as its own pipeline path drives it at the end.

    Every use of its private internals (reduce buckets, partition hooks, the epilogue) is here."""

    def __init__(self, optimizer):
        self.opt = optimizer
        self.group_of = {id(p): i for i, group in enumerate(optimizer.bit16_groups) for p in group}
        self.reduced: set = set()

    def start(self) -> None:
        """Prepare the reduce buckets, as DeepSpeed's pipeline path does in reduce_gradients."""
        from deepspeed.accelerator import get_accelerator
        opt = self.opt
        opt.set_gradient_accumulation_boundary(False)     # reduce hooks (overlap_comm) stay idle in backward
        if opt.contiguous_gradients:
            for dtype, bucket in opt.ipg_buckets.items():
                bucket.buffer.append(torch.empty(int(opt.reduce_bucket_size), dtype=dtype,
                                                 device=get_accelerator().current_device_name()))
                bucket.index = 0
        self.reduced = set()

    def reduce(self, params, flush: bool = True) -> None:
        """Hand finished gradients to ZeRO's reduction (into the owning data-parallel rank's partition).

        With ``overlap_comm`` DeepSpeed runs the reduction on a side stream, so it overlaps the
        chunks still computing; without it the reduction runs now, in this rank's bubble.
        """
        opt = self.opt
        opt.set_gradient_accumulation_boundary(True)
        try:
            for p in params:
                if id(p) in self.reduced or id(p) not in self.group_of or opt.get_gradient_for_reduction(p) is None:
                    continue
                opt.reduce_ready_partitions_and_remove_grads(p, self.group_of[id(p)])
                self.reduced.add(id(p))
            if flush:
                opt.reduce_ipg_grads()
                if opt.contiguous_gradients and opt.overlap_comm:
                    for bucket in opt.ipg_buckets.values():
                        bucket.index = 1 - bucket.index
        finally:
            opt.set_gradient_accumulation_boundary(False)

    def finish(self) -> None:
        """Reduce what no chunk reduced (tied modules, or zero1_reduce="end"), then ZeRO's epilogue."""
        opt = self.opt
        self.reduce([p for group in opt.bit16_groups for p in group], flush=False)
        opt.set_gradient_accumulation_boundary(True)
        opt.overlapping_partition_gradients_reduce_epilogue()
