"""The executor's context behind Megatron's contract: chunks, data, Megatron's loss bookkeeping.

:class:`MegatronHost` is the :class:`~ds_chimera.runtime.context.ExecutionContext` of one
``forward_backward_func`` call (the contract is described in :mod:`.runner`). Each forward
gets its micro-batch through a :class:`OneMicroBatch` of its chunk's :class:`MicroBatchFeed`:
micro-batch ``mb`` is the ``mb``-th item of the data iterator, whatever order the schedule
runs it in.
"""
from __future__ import annotations

import contextlib

import torch

from ..runtime.gradsync import FlatGradAllReduce
from ..schedules.actions import split_chunks
from .model_chunk import unwrap
from .weight_blocks import BlockRecorder, settle_blocks


class MicroBatchFeed:
    """Hands micro-batch ``mb`` of one data iterator to whichever forward asks, in any order."""

    def __init__(self, source, count: int):
        self.source, self.count, self.items, self.used = source, count, [], False

    def item(self, mb: int):
        self.used = True
        while len(self.items) <= mb:
            try:
                self.items.append(next(self.source))
            except StopIteration:
                raise RuntimeError(f"ds_chimera: the data iterator ran out after {len(self.items)} micro-batches; "
                                   f"this call needs {self.count}") from None
        return self.items[mb]

    def finish(self) -> None:
        """Keep iterators aligned across calls: a used iterator advances by exactly ``count``."""
        if self.used and len(self.items) < self.count:
            self.item(self.count - 1)


class OneMicroBatch:
    """The iterator ``forward_step_func`` receives: one ``next()`` gives its micro-batch."""

    def __init__(self, feed: MicroBatchFeed, mb: int):
        self.feed, self.mb, self.taken = feed, mb, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken:
            raise RuntimeError(f"ds_chimera: forward_step_func called next(data_iterator) twice for micro-batch "
                               f"{self.mb}; each forward gets exactly one micro-batch")
        self.taken = True
        return self.feed.item(self.mb)


class MegatronHost:
    """The executor's context for one call (see :class:`~ds_chimera.runtime.context.ExecutionContext`):
    chunks, data, Megatron's loss bookkeeping, Chimera's replica syncs. Clipping and the
    optimizer step are the caller's (Megatron's training loop), so the program's CLIP and
    STEP are no-ops here."""

    def __init__(self, runner, schedule, chunks, feeds, config, forward_step_func, num_microbatches,
                 collect_non_loss_data, train: bool):
        placement = schedule.placement
        self.placement, self.pipe_rank = placement, runner.rank
        local = placement.chunks_on(runner.rank)
        self.chunk_modules = dict(zip(local, chunks))
        self.feeds = dict(zip(local, feeds))
        self.split_chunks = split_chunks(schedule.orders[runner.rank]) if train else set()
        self.transport = runner.p2p
        self.groups = runner.groups
        self.config, self.forward_step_func = config, forward_step_func
        self.num_microbatches, self.collect_non_loss_data = num_microbatches, collect_non_loss_data
        self.train = train
        self.loss_func = None
        self.started: set = set()       # chunks that ran their first forward of this call
        self.grad_scale = 1.0
        self.reduced: dict = {}         # micro-batch -> what loss_func reported
        self.num_tokens = torch.zeros((), dtype=torch.int64)
        self.pending: list = []
        self.timeout_s = runner.timeout_s
        self.cp_size = _context_parallel_size()
        self.recorders: dict = {}       # chunk -> its BlockRecorder for this call (split-backward chunks)

    def load_input(self, chunk: int, mb: int):
        return ()             # first stages read their data in forward_step_func; set_input_tensor([None])

    def forward(self, c: int, mb: int, x, capture, train: bool):
        chunk = self.chunk_modules[c]
        inputs = (list(x) or [None]) if isinstance(x, tuple) else [x]     # first stages: [None], as Megatron
        set_input_tensor = getattr(unwrap(chunk), "set_input_tensor", None)
        if set_input_tensor is None:
            raise TypeError(f"model chunk {type(unwrap(chunk)).__name__} has no set_input_tensor(); Megatron's "
                            f"contract passes each stage's input that way")
        set_input_tensor(inputs)
        feed = self.feeds[c]
        data = OneMicroBatch(feed, mb) if feed is not None else None
        autocast = contextlib.nullcontext()
        if getattr(self.config, "enable_autocast", False):
            autocast = torch.autocast(next(chunk.parameters()).device.type, dtype=self.config.autocast_dtype)
        if c not in self.started and hasattr(unwrap(chunk), "set_is_first_microbatch"):
            unwrap(chunk).set_is_first_microbatch()        # FP8 layers recast their weights once per call
        self.started.add(c)
        recording = self._recorder(c, chunk).recording(capture) if capture is not None else contextlib.nullcontext()
        with autocast, recording as nodes:
            output, loss_func = self.forward_step_func(data, chunk)
        if capture is not None:
            settle_blocks(chunk, capture, nodes, output)
        self.loss_func = loss_func
        self._set_auxiliary_loss_scales(output)
        return output

    def _recorder(self, c: int, chunk) -> BlockRecorder:
        recorder = self.recorders.get(c)
        if recorder is None:
            recorder = self.recorders[c] = BlockRecorder(chunk)
        return recorder

    def close(self) -> None:
        """End of the call: the chunks' block hooks come off (the caller's modules are left as they were)."""
        for recorder in self.recorders.values():
            recorder.close()
        self.recorders = {}

    def _set_auxiliary_loss_scales(self, output) -> None:
        """MoE and multi-token-prediction losses are scaled as the main loss, as Megatron does after each forward."""
        config = self.config
        moe = getattr(config, "num_moe_experts", None) is not None
        mtp = getattr(config, "mtp_num_layers", None) is not None
        if not (moe or mtp) or not self.train:
            return
        device = output.device if isinstance(output, torch.Tensor) else None
        scale = self.grad_scale * torch.ones(1, device=device)
        per_token = getattr(config, "calculate_per_token_loss", False)
        if moe:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
            MoEAuxLossAutoScaler.set_loss_scale(scale if per_token else scale * self.cp_size / self.num_microbatches)
        if mtp:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
            MTPLossAutoScaler.set_loss_scale(scale if per_token else scale / self.num_microbatches)

    def loss(self, output, chunk: int, mb: int):
        """Megatron's loss bookkeeping for the forward that just ran on a loss stage."""
        loss_func, self.loss_func = self.loss_func, None
        if loss_func is None:
            if self.train:
                raise ValueError("forward_step_func returned no loss_func on a loss stage; training needs one")
            self.reduced[mb] = output
            return output
        if self.collect_non_loss_data:        # forward-only: __call__ refuses it in training
            self.reduced[mb] = loss_func(output, non_loss_data=True)
            return output
        outputs = loss_func(output)
        # in place, as Megatron's forward_step_calc_loss: a reduced dict holding a view of the loss
        # (loss.detach()) then reports what Megatron's own schedule reports
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            if getattr(self.config, "calculate_per_token_loss", False):
                self.num_tokens += torch.as_tensor(num_tokens).detach().cpu().to(torch.int64)
            else:
                loss /= torch.clamp(torch.as_tensor(num_tokens, device=loss.device), min=1)
                loss /= self.num_microbatches
        elif len(outputs) == 2:
            loss, reduced = outputs
            loss *= self.cp_size
            loss /= self.num_microbatches
        else:
            raise ValueError(f"loss_func must return (loss, reduced) or (loss, num_tokens, reduced); "
                             f"got {len(outputs)} values")
        self.reduced[mb] = reduced
        return loss

    # ---- Chimera's replica gradient all-reduce, posted by the program's SyncStart -------------
    @staticmethod
    def _grad(p):
        if getattr(p, "main_grad", None) is not None:      # Megatron DDP's buffers
            return p.main_grad
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def backward_done(self, chunk: int, mb: int) -> None:
        pass

    def start_grad_sync(self, stage: int) -> None:
        group = self.groups.stage.get(stage)
        if group is None:
            return
        chunk = next(m for c, m in self.chunk_modules.items() if self.placement.chunks[c].stage == stage)
        params = [p for p in chunk.parameters() if p.requires_grad]
        if not params:
            return
        self.pending.append(FlatGradAllReduce([self._grad(p) for p in params], group, f"stage {stage}'s replicas"))

    def wait_grad_syncs(self, stages: tuple) -> None:
        for sync in self.pending:
            sync.finish(self.timeout_s)
        self.pending = []

    def clip_gradients(self, scope, stage: int) -> None:
        pass                  # Megatron's optimizer clips (over its own model-parallel groups)

    def optimizer_step(self, chunks: tuple) -> None:
        pass                  # the caller steps after forward_backward_func returns

    def gather_weights(self, chunk: int) -> None:
        raise ValueError("sharded data parallelism (ZeRO-2/3) runs on the DeepSpeed engine only")

    wait_weights = release_weights = prepare_grads = gather_weights


def _context_parallel_size() -> int:
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_context_parallel_world_size()
    except Exception:      # Megatron absent or not initialised: no context parallelism
        pass
    return 1
