"""The execution context: everything the executor needs from the host that runs a program.

The executor (:mod:`.executor`) knows the program's ops and autograd, nothing else. What
differs between hosts is behind this protocol, implemented by:

- :class:`~ds_chimera.runtime.host.PipelineHost`: the DeepSpeed engine's (synchronous);
- :class:`~ds_chimera.runtime.async_engine.AsyncPipelineHost`: the asynchronous engine's
  (weight versions, one stage's step inside the pipeline);
- ``ds_chimera.megatron.host.MegatronHost``: Megatron-Core's forward-backward contract;
- :class:`~ds_chimera.runtime.local.LocalHost`: every rank in one process (tests, studies).

The backward itself (full, input-grad, weight-grad) is autograd over what the forward
recorded and is the same for every host, so it lives in the executor; a host only hears
of it through :meth:`backward_done`.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..schedules.actions import ClipScope
from ..schedules.placement import Placement


@runtime_checkable
class Transport(Protocol):
    """Point-to-point messages between the ranks of one pipeline (:class:`~.p2p.P2P`, or in-process)."""

    def send(self, msg, dst_rank: int, tensors) -> None: ...

    def recv(self, msg, src_rank: int, what: str) -> list: ...

    def prepost(self, msg, src_rank: int, what: str) -> bool: ...

    def flush(self) -> None: ...


@runtime_checkable
class ExecutionContext(Protocol):
    """What a host provides to run its rank's program."""

    placement: Placement
    pipe_rank: int
    transport: Transport
    split_chunks: set          # chunks whose backward is split into I and W: their forward records blocks

    def load_input(self, chunk: int, mb: int) -> Any:
        """The input of micro-batch ``mb`` for a chunk that starts a route (it loads data)."""

    def forward(self, chunk: int, mb: int, x, capture: list | None, train: bool) -> Any:
        """Run chunk ``chunk`` on ``x``; ``capture`` collects (output, params) blocks for a split backward."""

    def loss(self, output, chunk: int, mb: int) -> Any:
        """On a chunk that ends a route: the loss of micro-batch ``mb`` (a scalar tensor when training)."""

    def backward_done(self, chunk: int, mb: int) -> None:
        """The input gradient of (chunk, mb) exists (weight versions release the forward's copy)."""

    def start_grad_sync(self, stage: int) -> None:
        """Post the all-reduce of ``stage``'s gradients over its replicas and data parallelism."""

    def wait_grad_syncs(self, stages: tuple) -> None:
        """Wait (bounded) for the syncs posted for ``stages``, and any the host adds (tied weights)."""

    def clip_gradients(self, scope: ClipScope, stage: int) -> None:
        """Clip to the configured norm: the global norm over unique parameters, or ``stage``'s own."""

    def optimizer_step(self, chunks: tuple) -> None:
        """Apply the optimizer to ``chunks``' parameters and clear their gradients."""

    def gather_weights(self, chunk: int) -> None:
        """Sharded programs (ZeRO-2/3): post the all-gather of ``chunk``'s weight shards."""

    def wait_weights(self, chunk: int) -> None:
        """Sharded programs: ``chunk`` is about to compute; wait for its gathered weights."""

    def release_weights(self, chunk: int) -> None:
        """Sharded programs (ZeRO-3): free ``chunk``'s gathered weights."""

    def prepare_grads(self, chunk: int) -> None:
        """Sharded programs: ``chunk`` is about to compute weight gradients; give them their buffer."""
