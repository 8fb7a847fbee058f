"""The cost model of one rank's work, in the units schedules and the simulator share.

It lives beside the schedules (not in the simulator) because schedules that choose their
own order from costs (Chimera's ``auto``) need it, and imports flow only downwards:
schedules <- simulator <- runtime.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD

COST_NAMES = ("fwd", "bwd", "wgrad", "comm", "allreduce", "send", "recv", "sync_post", "gather", "gather_post",
              "gather_skew", "step", "clip", "dispatch")


@dataclass(frozen=True)
class Costs:
    """Per micro-batch costs of one rank's worth of layers; a chunk pays them times its size.

    ``bwd`` is the full backward. A split backward pays ``bwd - wgrad`` for I and
    ``wgrad`` for W. ``comm`` is the latency of one point-to-point message, ``allreduce``
    the time of one stage's gradient all-reduce. ``send`` and ``recv`` are the rank's own
    time to post one message and to take one that has arrived (the runtime's per-message
    cost on the host: negligible next to GPU kernels, a visible share on CPU ranks), and
    ``sync_post`` its own time to post one gradient sync (gather the stage's gradients,
    post the all-reduce): the rank computes nothing meanwhile. ``gather`` is the time to
    all-gather one stage's worth of sharded weights (ZeRO-2/3; a chunk pays it times its
    size) and ``gather_post`` the rank's own time to post one. A gather ends only once every
    data-parallel member has posted it, and members drift apart between syncs (host stalls the
    lockstep copies of the program do not have): ``gather_skew`` is the mean time from a
    rank's post to the latest of its peers' posts (0 where the rank is the latest). Under sharding ``allreduce`` prices the
    gradients' reduce-scatter. ``dispatch`` is the runtime's host time around each
    compute action beyond the op itself (its bookkeeping, the gathered weights' readiness
    check): like ``send``, nothing next to a GPU kernel, a visible share on CPU
    ranks, and it adds up over the many actions of a looped schedule. ``step`` is the
    optimizer step of one stage's worth of weights (a chunk pays it times its size). ``clip``
    is the global gradient norm's collective (every rank's squared norm summed), counted from
    the moment the last rank arrives.
    """

    fwd: float = 1.0
    bwd: float = 2.0
    wgrad: float = 1.0
    comm: float = 0.0
    allreduce: float = 0.0
    send: float = 0.0
    recv: float = 0.0
    sync_post: float = 0.0
    gather: float = 0.0
    gather_post: float = 0.0
    gather_skew: float = 0.0
    step: float = 0.0
    clip: float = 0.0
    dispatch: float = 0.0

    def __post_init__(self):
        for name in COST_NAMES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"cost {name} must be a finite number >= 0, got {value!r}")
        if self.fwd <= 0 or self.bwd <= 0:
            raise ValueError(f"costs fwd and bwd must be > 0, got fwd={self.fwd}, bwd={self.bwd}")
        if self.wgrad > self.bwd:
            raise ValueError(f"cost wgrad must be at most bwd ({self.bwd}), got {self.wgrad}")

    def of(self, kind: str) -> float:
        if kind == FORWARD:
            return self.fwd
        if kind == BACKWARD:
            return self.bwd
        if kind == INPUT_GRAD:
            return self.bwd - self.wgrad
        if kind == WEIGHT_GRAD:
            return self.wgrad
        return 0.0


UNIT_COSTS = Costs(fwd=1.0, bwd=1.0, wgrad=0.5)


@dataclass(frozen=True)
class StageCosts:
    """Per-stage compute costs and activation sizes, for models whose layers differ (measured by the
    planner's profile of the user's layers; a stage is a placement stage, a contiguous run of layers).

    Where given, the simulator takes each chunk's F, B, I = ``bwd - wgrad`` and W from its stage
    here instead of ``Costs`` x the chunk's size, and counts ``activations`` (what one micro-batch
    leaves saved for the backward on that stage, in any unit, e.g. bytes) instead of micro-batches.
    """

    fwd: tuple
    bwd: tuple
    wgrad: tuple
    activations: tuple

    def __post_init__(self):
        n = len(self.fwd)
        for name in ("fwd", "bwd", "wgrad", "activations"):
            values = tuple(float(v) for v in getattr(self, name))
            if len(values) != n:
                raise ValueError(f"stage costs: {name} has {len(values)} stages, fwd has {n}")
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"stage costs: {name} must be finite numbers >= 0, got {values}")
            object.__setattr__(self, name, values)
        for s, (b, w) in enumerate(zip(self.bwd, self.wgrad)):
            if w > b + 1e-12:
                raise ValueError(f"stage costs: stage {s}'s wgrad {w} exceeds its bwd {b}")

    @property
    def num_stages(self) -> int:
        return len(self.fwd)

    def of(self, kind: str, stage: int) -> float:
        if kind == FORWARD:
            return self.fwd[stage]
        if kind == BACKWARD:
            return self.bwd[stage]
        if kind == INPUT_GRAD:
            return self.bwd[stage] - self.wgrad[stage]
        if kind == WEIGHT_GRAD:
            return self.wgrad[stage]
        return 0.0
