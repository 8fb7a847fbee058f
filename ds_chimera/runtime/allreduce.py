"""The runtime's all-reduce: one round of direct messages for small CPU tensors on gloo,
the backend's own collective otherwise.

gloo's all-reduce is a ring: 2(P - 1) message hops one after another, and each hop is a
cross-process wake-up. For the few KiB of a loss, a gradient norm or a small stage's
gradients the hops, not the bytes, are the cost. From the last member's post to every
member holding the result, over 4 CPU ranks on this project's 2-core machine: the ring
4.3-5.7 ms median, one round of direct messages 1.3-1.5 ms
(``python benchmarks/allreduce_exchange.py`` has the sweep over sizes and group sizes).
The direct exchange sends (P - 1) copies of the tensor from each member against the ring's
2(P - 1)/P, so above a size the ring wins: between 256 KiB and 1 MiB per member over 2 and
4 ranks here. The exchange is used up to ``EXCHANGE_MAX_BYTES`` per member and
``EXCHANGE_MAX_SENT`` sent per member (the 4-rank point measured), the ring above.

Every member sums the same operands in the same order (group rank order), so every member
gets bitwise the same result, as replicas that must stay identical need. NCCL and CUDA
tensors always take the backend's collective: NCCL's small-message protocol is built for this.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .p2p import post_or_fail

EXCHANGE_TAG = 1 << 29     # above the pipeline messages' tags and the loss tag (p2p.LOSS_TAG)
EXCHANGE_MAX_BYTES = 256 * 1024      # one member's tensor
EXCHANGE_MAX_SENT = 3 * 256 * 1024   # what one member sends: (P - 1) x its tensor
# the runtime's exchange keys: a stage's gradient sync uses its stage number, below all of these
TIED_SYNC_KEY = 1 << 16              # + the tied module's index
LOSS_KEY = 1 << 17
NORM_KEY = LOSS_KEY + 1
TOKENS_KEY = LOSS_KEY + 2


def uses_exchange(tensor: torch.Tensor, group=None) -> bool:
    """Whether ``tensor`` is all-reduced over ``group`` by the direct exchange."""
    size = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or size > EXCHANGE_MAX_BYTES:
        return False
    if "gloo" not in str(dist.get_backend(group)).lower():
        return False
    return (dist.get_world_size(group) - 1) * size <= EXCHANGE_MAX_SENT


class ExchangeAllReduce:
    """A posted sum all-reduce by direct messages; ``wait`` sums and writes into the tensor.

    It looks like a ``dist.Work`` to its callers (``wait(timeout)``, ``is_completed``).
    ``key`` tells concurrent exchanges on one group apart (a stage number, say); every
    member must post the exchanges of one group in the same order with the same keys.
    """

    def __init__(self, tensor: torch.Tensor, group=None, key: int = 0):
        if not tensor.is_contiguous():
            raise ValueError("the exchange all-reduce needs a contiguous tensor")
        self.tensor = tensor
        self.members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        me = dist.get_rank()
        tag = EXCHANGE_TAG + key
        self.incoming = {peer: torch.empty_like(tensor) for peer in self.members if peer != me}
        self.works = []
        for peer, buf in self.incoming.items():
            self.works.append(dist.irecv(buf, peer, group=group, tag=tag))
            self.works.append(dist.isend(tensor, peer, group=group, tag=tag))
        self.me, self.done = me, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.done:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self.works:      # one deadline for the whole exchange, not one per message
            if deadline is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        # every member adds the same operands in the same order: bitwise-equal results everywhere
        parts = [self.tensor if peer == self.me else self.incoming[peer] for peer in self.members]
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        self.tensor.copy_(total)
        self.works, self.incoming, self.done = [], {}, True
        return True


def allreduce_async(tensor: torch.Tensor, group=None, what: str = "an all-reduce", key: int = 0):
    """Post a sum all-reduce of ``tensor`` over ``group`` (None: every rank); returns its work.

    Small CPU tensors on gloo go by :class:`ExchangeAllReduce`, the rest by
    ``dist.all_reduce``. A peer that is gone at posting time is a clear error naming ``what``.
    """
    if uses_exchange(tensor, group):
        return post_or_fail(lambda: ExchangeAllReduce(tensor, group, key), what)
    return post_or_fail(lambda: dist.all_reduce(tensor, group=group, async_op=True), what)
