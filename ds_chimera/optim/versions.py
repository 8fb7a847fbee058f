"""Which weights a mini-batch's forward and backward see, without in-place swaps.

The forward always runs the chunk through ``torch.func.functional_call`` on tensors that
are *functions of* the live parameters, so gradients still land in ``p.grad``:

- ``live``:    the parameters themselves (synchronous training).
- ``stash``:   ``p.clone()``. Autograd saves the clone, so the backward sees the forward's
  version however often ``p`` is stepped in between (PipeDream's weight stashing, 2BW).
- ``predict``: ``p + (W_hat - p).detach()``: the forward computes with the predicted W_hat,
  and a saved-tensor hook hands the *live* parameter to the backward wherever autograd
  saved W_hat (or a view of it) for an input gradient (PipeOptim, SpecTrain). Tensors
  derived from the weights in the forward (a softmax of them, say) keep their forward
  values, as they did in the reference implementation's ``.data`` swap.

The reference implementation swaps ``p.data`` in place around the forward, which current
autograd rejects whenever a saved weight changes version; none of this touches ``p``.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from ..schedules.actions import Kind

POLICIES = ("live", "stash", "predict")


class _LiveInBackward:
    """Saved-tensor hooks that swap predicted weights (and views of them) for the live ones."""

    def __init__(self, live_of: dict):
        self.live_of = live_of           # id(predicted tensor) -> (predicted tensor, live parameter)

    def pack(self, t):
        base = t if t._base is None else t._base
        hit = self.live_of.get(id(base))
        if hit is None or hit[0] is not base:
            return t
        live = hit[1]
        if t._base is None and t.shape == live.shape:
            return (live,)
        offset = live.storage_offset() + (t.storage_offset() - base.storage_offset())
        return (live, tuple(t.shape), tuple(t.stride()), offset)

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        live = packed[0].detach()
        if len(packed) == 1:
            return live
        return live.as_strided(packed[1], packed[2], packed[3])


class WeightVersions:
    """Per chunk: runs forwards on the policy's weights and counts the versions held.

    ``version`` is the number of optimizer steps applied to this chunk; ``peak_versions``
    the most distinct versions alive at once (live + stashed or predicted copies).
    """

    def __init__(self, module: torch.nn.Module, policy: str, predictor=None):
        if policy not in POLICIES:
            raise ValueError(f"weight policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if policy == "predict" and predictor is None:
            raise ValueError("the 'predict' weight policy needs a predictor")
        self.module, self.policy, self.predictor = module, policy, predictor
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.version = 0
        self.inflight: dict = {}         # mb -> version its forward used
        self.peak_versions = 1
        self.log: list = []              # (kind, mb, version, steps ahead) when recording
        self._stash = None               # (version, copies) the latest forwards share

    def forward(self, mb, args: tuple, steps_ahead: int = 0, record: bool = False):
        """Run the module's forward for micro-batch ``mb`` on this policy's weights."""
        if not torch.is_grad_enabled():      # evaluation: the live weights, nothing in flight
            return self.module(*args)
        self.inflight[mb] = self.version
        if record:
            self.log.append((Kind.FORWARD, mb, self.version, steps_ahead))
        if self.policy == "live":
            return self.module(*args)
        if self.policy == "stash":
            self.peak_versions = max(self.peak_versions, len(set(self.inflight.values()) | {self.version}))
            # one copy per version, shared by the forwards that use it (autograd keeps it alive
            # exactly as long as one of their backwards is pending)
            if self._stash is None or self._stash[0] != self.version:
                self._stash = (self.version, {n: p.clone() for n, p in self.params.items()})
            return functional_call(self.module, self._stash[1], args)
        predicted = {}
        for n, p in self.params.items():
            w_hat = self.predictor.predict(p, steps_ahead)
            # W_hat may be fp32 (a bf16 model's master weights): the forward runs in the model's dtype
            predicted[n] = p if w_hat is p else p + (w_hat.to(p.dtype) - p.detach()).detach()
        if any(t is not self.params[n] for n, t in predicted.items()):
            self.peak_versions = max(self.peak_versions, 2)
        # The live parameters are hooked too: with no update direction known yet (the first
        # steps), the forward uses them directly, and they still change before the backward.
        hooks = _LiveInBackward({id(t): (t, self.params[n]) for n, t in predicted.items()})
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return functional_call(self.module, predicted, args)

    def backward_done(self, mb, record: bool = False) -> None:
        """The backward of ``mb`` has run: its stashed version (if any) is released."""
        if record:
            self.log.append((Kind.BACKWARD, mb, self.version, 0))
        self.inflight.pop(mb, None)

    def step_done(self) -> None:
        self.version += 1
        self._stash = None               # in-flight graphs keep their copies; new forwards clone anew

    def reset(self) -> None:
        """A drained pipeline: nothing in flight (versions keep counting)."""
        self.inflight.clear()
