"""One asynchronous all-reduce of a list of gradients, as a single flat message.

Posted when a stage's last backward is done (in the bubbles), finished before the step:
the DeepSpeed engine uses it for replicas, data parallelism and tied weights, the Megatron
contract for Chimera's replicas.
"""
from __future__ import annotations

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .p2p import post_or_fail, wait_or_fail


class FlatGradAllReduce:
    """All-reduce (sum) ``grads`` over ``group``; :meth:`finish` writes the result back into them."""

    def __init__(self, grads: list, group, what: str):
        self.grads, self.what = grads, what
        self.flat = _flatten_dense_tensors(grads)
        self.work = post_or_fail(lambda: dist.all_reduce(self.flat, group=group, async_op=True),
                                 f"the all-reduce of {what}")

    def finish(self, timeout_s: float, divide_by: int = 1) -> None:
        """Wait (bounded: a dead peer is a clear error), optionally average, and copy back in place."""
        wait_or_fail(self.work, timeout_s, f"the gradient all-reduce of {self.what}")
        if divide_by > 1:
            self.flat.div_(divide_by)
        for grad, synced in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads)):
            grad.copy_(synced)
