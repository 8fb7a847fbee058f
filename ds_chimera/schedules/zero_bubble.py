"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241).

The backward is split into I (input grad, on the critical path) and W (weight grad,
movable). Deferred W's fill the slots where 1F1B would idle.
"""
from __future__ import annotations

from .actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from .base import Schedule, linear_placement, vshape_placement
from .timing import fastest_list_schedule


class ZBH1(Schedule):
    """ZB-H1: 1F1B's order of F and I; rank r runs its weight-grads r micro-batches late.

    The lag lets the input-grad chain of the cool-down run back to back, and the r
    deferred W's fill the slots 1F1B leaves idle there. Bubble (D-1)(F+I-W), a third of
    1F1B's at F = I = W; at most D micro-batches in flight (held until W), 1F1B's peak.
    """

    name = "zb-h1"
    summary = "zero-bubble H1: split backward, 1F1B memory; about 1/3 of 1F1B's bubble"

    def build_placement(self):
        return linear_placement(self.ranks, self.micro_batches)

    def build_orders(self):
        d, n = self.ranks, self.micro_batches
        orders = []
        for rank in range(d):
            warmup, lag = min(d - 1 - rank, n), rank
            out = [Action(FORWARD, rank, mb) for mb in range(warmup)]
            next_w = 0
            for mb in range(n):
                if warmup + mb < n:
                    out.append(Action(FORWARD, rank, warmup + mb))
                out.append(Action(INPUT_GRAD, rank, mb))
                if mb >= lag:
                    out.append(Action(WEIGHT_GRAD, rank, next_w))
                    next_w += 1
            out.extend(Action(WEIGHT_GRAD, rank, mb) for mb in range(next_w, n))
            orders.append(out)
        return orders


class ZBV(Schedule):
    """ZB-V: V-shape placement (2 chunks per rank), split backward, 1F1B's peak memory.

    The order comes from greedy list scheduling on unit slots (F = I = W): a ready I
    (or, in the second variant, a ready F) first, then the other, with forwards kept
    within D stages of in-flight activations, then a deferred W when it ends before known
    critical work. Both variants are simulated and the faster kept. Close to zero bubble
    for N >= 2D.
    """

    name = "zbv"
    summary = "zero-bubble V: V-shape, 2 chunks per rank, split backward; near 0 bubble for N >= 2D"

    def build_placement(self):
        return vshape_placement(self.ranks, self.micro_batches)

    def build_orders(self):
        return fastest_list_schedule(self.placement, [float(self.ranks)] * self.ranks, self.name)
