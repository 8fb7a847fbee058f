"""One asynchronous all-reduce of a list of gradients, as a single flat message.

Posted when a stage's last backward is done (in the bubbles), finished before the step:
the DeepSpeed engine uses it for replicas, data parallelism and tied weights, the Megatron
contract for Chimera's replicas. Small CPU messages on gloo go by a direct exchange
(``allreduce``), which takes one message hop where gloo's ring takes 2(P - 1).
"""
from __future__ import annotations

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .allreduce import allreduce_async
from .p2p import wait_or_fail


class FlatGradAllReduce:
    """All-reduce (sum) ``grads`` over ``group``; :meth:`finish` writes the result back into them.

    ``key`` tells apart the syncs in flight on one group (the stage number); every member
    posts a group's syncs in the same order with the same keys.
    """

    def __init__(self, grads: list, group, what: str, key: int = 0):
        self.grads, self.what = grads, what
        self.flat = _flatten_dense_tensors(grads)
        self.work = allreduce_async(self.flat, group, f"the all-reduce of {what}", key)

    def finish(self, timeout_s: float, divide_by: int = 1) -> None:
        """Wait (bounded: a dead peer is a clear error), optionally average, and copy back in place."""
        wait_or_fail(self.work, timeout_s, f"the gradient all-reduce of {self.what}")
        if divide_by > 1:
            self.flat.div_(divide_by)
        for grad, synced in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads)):
            grad.copy_(synced)
