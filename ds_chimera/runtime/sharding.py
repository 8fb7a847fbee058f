"""Sharded data parallelism of pipeline chunks (ZeRO-2 and ZeRO-3), one flat buffer per chunk.

DeepSpeed's pipeline engine refuses ZeRO-2/3, and its ZeRO-3 hooks gather weights per
module call, not per chunk and per step as a pipeline schedule wants. So the sharding is
done here, per chunk, where the program says (:mod:`ds_chimera.schedules.sharding`):

- each chunk's trainable parameters become views into one flat fp32 buffer, padded to a
  multiple of the data-parallel size; this rank owns one 1/DP slice of it, kept as a
  separate *shard* parameter, which is what the optimizer steps (so its state is 1/DP);
- GATHER all-gathers the shards into the flat buffer (posted ahead; the chunk's next
  compute waits for it); RELEASE (ZeRO-3) frees the buffer's storage, and the parameter
  views come back with it at the next GATHER;
- before the chunk's first backward of a step its gradients get one flat buffer (the
  parameters' ``.grad`` are views into it, so autograd accumulates there and nothing is
  copied); the stage's gradient sync reduce-scatters that buffer into the shard's
  gradient (the data-parallel mean), and the buffer is freed once the collective is done.
  The program waits for one chunk's reduce-scatter before the next chunk's first backward
  (:mod:`ds_chimera.schedules.sharding`), so one chunk's full gradients exist at a time.

Writes into the flat buffer go through ``.data``, which does not bump the version counter
that autograd checks: a released and re-gathered chunk is the same tensor to autograd.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .p2p import post_or_fail, wait_or_fail


class ShardedChunk:
    """One chunk's weights: the flat buffer (its parameters are views into it) and this rank's shard."""

    def __init__(self, index: int, module: nn.Module, group, dp_rank: int, dp_size: int):
        self.index, self.group, self.dp_rank, self.dp_size = index, group, dp_rank, dp_size
        self.params = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
        for p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"ZeRO-2/3 with pipeline schedules needs fp32 parameters; chunk {index} has a "
                                 f"{p.dtype} one")
        numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-numel // dp_size) if numel else 0
        device = self.params[0].device if self.params else torch.device("cpu")
        self.flat = torch.zeros(self.shard_numel * dp_size, dtype=torch.float32, device=device)
        offset = 0
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        start = dp_rank * self.shard_numel
        self.shard = nn.Parameter(self.flat[start:start + self.shard_numel].clone())
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.flat_grad = torch.empty(self.flat.numel(), dtype=torch.float32, device=device)
        _free(self.flat_grad)
        self.grad_state = "none"     # this step's gradients: none, accumulating, posted (reduce-scatter), done
        self.gathered = True
        self.stale = False           # the shard was stepped since the last gather (ZeRO-2 keeps old full weights)
        self.gather_work = None
        self.grad_work = None
        self.gathers = 0

    # ---- weights ------------------------------------------------------------------------------
    def gather(self, timeout_s: float) -> None:
        """Post the all-gather of the shards into the (re-allocated) flat buffer."""
        if self.gather_work is not None:
            return
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.nbytes)
        self.gathered, self.stale = True, False
        self.gathers += 1
        if self.dp_size == 1:
            self.flat.data.copy_(self.shard.detach())
            return
        self.gather_work = post_or_fail(
            lambda: dist.all_gather_into_tensor(self.flat.data, self.shard.detach(), group=self.group,
                                                async_op=True), f"the all-gather of chunk {self.index}'s weights")

    def wait(self, timeout_s: float) -> None:
        if not self.gathered:
            raise RuntimeError(f"internal error: chunk {self.index} computes with its weights released")
        if self.gather_work is not None:
            wait_or_fail(self.gather_work, timeout_s, f"the all-gather of chunk {self.index}'s weights")
            self.gather_work = None

    def release(self, timeout_s: float) -> None:
        self.wait(timeout_s)
        _free(self.flat)
        self.gathered = False

    def shard_from_full(self) -> None:
        """After full weights were loaded into the views: take this rank's slice as the shard."""
        start = self.dp_rank * self.shard_numel
        self.shard.data.copy_(self.flat[start:start + self.shard_numel])

    # ---- gradients ----------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Before a backward: give the parameters gradient views into the chunk's flat buffer (once a step)."""
        if self.grad_state == "accumulating":
            return
        if self.grad_state == "posted":
            raise RuntimeError(f"internal error: chunk {self.index} computes gradients while they are reduce-scattered")
        self.flat_grad.untyped_storage().resize_(self.nbytes)
        self.flat_grad.zero_()
        for p, view in zip(self.params, self._grad_views()):
            if p.grad is not None:              # accumulated outside the program: kept
                view.copy_(p.grad)
            p.grad = view
        self.grad_state = "accumulating"

    def _grad_views(self):
        offset = 0
        for p in self.params:
            yield self.flat_grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def reduce_scatter(self) -> None:
        """Post the reduce-scatter of the chunk's gradient buffer into the shard's gradient."""
        if self.grad_state == "none":            # no backward went through prepare_grads
            self.prepare_grads()
        for p, view in zip(self.params, self._grad_views()):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.add_(p.grad)               # .grad replaced mid-step: both parts count
            p.grad = None
        self._grad_out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.flat_grad.device)
        self.grad_state = "posted"
        if self.dp_size == 1:
            self._grad_out.copy_(self.flat_grad)
            self.grad_work = None
            return
        self.grad_work = post_or_fail(
            lambda: dist.reduce_scatter_tensor(self._grad_out, self.flat_grad, group=self.group, async_op=True),
            f"the gradient reduce-scatter of chunk {self.index}")

    def finish_grads(self, timeout_s: float) -> None:
        """Wait for the reduce-scatter, free the full gradients; the shard's gradient is the data-parallel mean."""
        if self.grad_state == "done":
            return
        if self.grad_state != "posted":
            raise RuntimeError(f"internal error: chunk {self.index}'s gradients were never reduce-scattered "
                               f"(state {self.grad_state!r})")
        if self.grad_work is not None:
            wait_or_fail(self.grad_work, timeout_s, f"the gradient reduce-scatter of chunk {self.index}")
            self.grad_work = None
        _free(self.flat_grad)
        self.shard.grad = self._grad_out.div_(self.dp_size)
        self.grad_state = "done"


def _free(tensor) -> None:
    """Give a tensor's memory back; it keeps its shape and gets storage again with ``resize_``."""
    tensor.untyped_storage().resize_(0)


class ChunkShards:
    """Every chunk of this rank, sharded over its data-parallel group."""

    def __init__(self, chunks: dict, group, dp_rank: int, dp_size: int, zero: int, timeout_s: float = 300.0):
        self.zero, self.timeout_s = zero, timeout_s
        self.by_chunk = {c: ShardedChunk(c, module, group, dp_rank, dp_size) for c, module in chunks.items()}
        self.peak: dict = {}        # the most of each kind of memory() held at once since reset_peak()

    def engine_ready(self) -> None:
        """The engine has broadcast the full weights over data parallelism: cut the shards from them,
        and under ZeRO-3 free the full copies (the program gathers each chunk where it computes)."""
        for s in self.by_chunk.values():
            s.shard_from_full()
            if self.zero == 3:
                s.release(self.timeout_s)

    @property
    def shard_params(self) -> list:
        """What the optimizer steps: one shard parameter per chunk."""
        return [s.shard for s in self.by_chunk.values()]

    def gather(self, chunk: int) -> None:
        self.by_chunk[chunk].gather(self.timeout_s)
        self._note()

    def wait(self, chunk: int) -> None:
        self.by_chunk[chunk].wait(self.timeout_s)

    def release(self, chunk: int) -> None:
        self.by_chunk[chunk].release(self.timeout_s)

    def prepare_grads(self, chunk: int) -> None:
        self.by_chunk[chunk].prepare_grads()
        self._note()

    def reduce_scatter(self, chunk: int) -> None:
        self.by_chunk[chunk].reduce_scatter()
        self._note()

    def finish_grads(self, chunks=None) -> None:
        """Finish the reduce-scatters of ``chunks`` (default: every chunk; each must have been posted)."""
        for c in self.by_chunk if chunks is None else chunks:
            self.by_chunk[c].finish_grads(self.timeout_s)

    def gathers(self) -> int:
        """All-gathers posted so far (a count, for the reports)."""
        return sum(s.gathers for s in self.by_chunk.values())

    def stepped(self) -> None:
        """The optimizer updated the shards: every full copy is out of date until its next gather."""
        for s in self.by_chunk.values():
            s.stale = True
            s.shard.grad = None
            s.grad_state = "none"

    def gather_all(self) -> list:
        """Gather every released or out-of-date chunk (collective over data parallelism); returns the
        ones that were released, to release again after."""
        released = [c for c, s in self.by_chunk.items() if not s.gathered]
        for c, s in self.by_chunk.items():
            if not s.gathered or s.stale:
                self.gather(c)
        for c in self.by_chunk:
            self.wait(c)
        return released

    def _note(self) -> None:
        for key, value in self.memory().items():
            self.peak[key] = max(self.peak.get(key, 0), value)

    def reset_peak(self) -> None:
        self.peak = self.memory()

    def memory(self) -> dict:
        """Bytes this rank holds now: gathered weights, shards, full gradients (the flat buffers and any
        gradient outside them), shard gradients (reduce-scatter outputs included), and their total."""
        chunks = self.by_chunk.values()
        weights = sum(s.flat.untyped_storage().nbytes() for s in chunks)
        shards = sum(s.shard.numel() * 4 for s in chunks)
        grads = sum(s.flat_grad.untyped_storage().nbytes() for s in chunks)
        grads += sum(p.grad.numel() * p.grad.element_size() for s in chunks for p in s.params
                     if p.grad is not None and s.flat_grad.untyped_storage().nbytes() == 0)
        shard_grads = sum(s.shard_numel * 4 for s in chunks if s.grad_state in ("posted", "done"))
        return {"gathered_weights": weights, "shards": shards, "grads": grads, "shard_grads": shard_grads,
                "total": weights + shards + grads + shard_grads}
