"""Layer cuts: where the layers are split into a placement's stages, and what each stage then costs.

Three ways to cut: ``time`` balances the measured forward + backward time of the stages (the
cut the planner adds); ``parameters`` and ``uniform`` are DeepSpeed's own methods (parameter
counts balanced, or the same number of layers per stage), so the planner can price what a
plain DeepSpeed run would do.
"""
from __future__ import annotations

from ..partition import deepspeed_cut
from ..schedules.costs import StageCosts

CUT_METHODS = ("time", "parameters", "uniform")


def cut(layers: list, num_stages: int, method: str) -> list:
    """Layer boundaries (``num_stages + 1`` indices, DeepSpeed's ``parts``) of ``layers`` (LayerCosts)."""
    if len(layers) < num_stages:
        raise ValueError(f"{len(layers)} layers cannot fill {num_stages} stages")
    if len(layers) == num_stages:       # one layer per stage (Megatron's built chunks): every method agrees
        return list(range(num_stages + 1))
    if method == "time":
        return balanced_cut([layer.fwd + layer.bwd for layer in layers], num_stages)
    if method in ("parameters", "uniform"):
        return deepspeed_cut(method, [layer.params for layer in layers], num_stages)
    raise ValueError(f"cut method must be one of {', '.join(CUT_METHODS)}; got {method!r}")


def balanced_cut(weights: list, num_stages: int) -> list:
    """Contiguous, non-empty parts of ``weights`` whose largest sum is the smallest possible.

    Bisection on the largest sum: the fewest parts of at most T each (greedy) is at most
    ``num_stages`` exactly when a cut into ``num_stages`` parts of at most T exists (a part can
    always be split further without growing). Then the greedy cut is spread to ``num_stages``
    parts by splitting single layers off the end where parts are missing.
    """
    n = len(weights)
    lo, hi = max(weights), sum(weights)
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        if _fewest_parts(weights, mid) <= num_stages:
            hi = mid
        else:
            lo = mid
    bounds = [0]
    total = 0.0
    for i, w in enumerate(weights):
        # start a new part when this layer would overflow it, or when the layers left are just enough
        # to give every remaining part one
        parts_left = num_stages - len(bounds)
        if i > bounds[-1] and (total + w > hi * (1 + 1e-9) or n - i <= parts_left):
            bounds.append(i)
            total = 0.0
        total += w
    bounds.append(n)
    assert len(bounds) == num_stages + 1, (bounds, num_stages)
    return bounds


def _fewest_parts(weights: list, limit: float) -> int:
    parts, total = 1, 0.0
    for w in weights:
        if total + w > limit * (1 + 1e-9) and total > 0:
            parts += 1
            total = 0.0
        total += w
    return parts


def stage_costs(layers: list, parts: list, checkpoint_interval: int = 0) -> StageCosts:
    """Each stage's F, B, W and activation bytes per micro-batch, for the cut ``parts``.

    With activation checkpointing every ``checkpoint_interval`` layers (DeepSpeed's rule: a block
    with parameters is checkpointed), a checkpointed block keeps only its input and its backward
    recomputes its forward first.
    """
    fwd, bwd, wgrad, act = [], [], [], []
    for s in range(len(parts) - 1):
        start, stop = parts[s], parts[s + 1]
        f = b = w = a = 0.0
        step = checkpoint_interval or (stop - start) or 1
        for block in range(start, stop, step):
            members = layers[block:min(block + step, stop)]
            bf = sum(layer.fwd for layer in members)
            f += bf
            b += sum(layer.bwd for layer in members)
            w += sum(layer.wgrad for layer in members)
            if checkpoint_interval and any(layer.params for layer in members):
                b += bf
                a += layers[block - 1].output_bytes if block > 0 else members[0].activation_bytes
            else:
                a += sum(layer.activation_bytes for layer in members)
        fwd.append(f)
        bwd.append(b)
        wgrad.append(w)
        act.append(a)
    return StageCosts(tuple(fwd), tuple(bwd), tuple(wgrad), tuple(act))


def stage_sums(layers: list, parts: list, attr: str) -> list:
    """``attr`` of the layers summed per stage (e.g. ``param_bytes``, ``params``)."""
    return [sum(getattr(layer, attr) for layer in layers[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1)]


def boundary_bytes(layers: list, parts: list) -> list:
    """The bytes each stage sends on (its last layer's output) per micro-batch."""
    return [layers[parts[s + 1] - 1].output_bytes for s in range(len(parts) - 1)]
