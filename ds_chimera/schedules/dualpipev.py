"""DualPipeV in the exact compute order of DeepSpeed 0.19.8's ``DualPipeVSchedule``."""
from __future__ import annotations

from .actions import BACKWARD, FORWARD, Action
from .base import Schedule, vshape_placement


class DualPipeV(Schedule):
    """DualPipeV (DeepSeek-AI, DeepSeek-V3 report, arXiv:2412.19437; "V" cut of DualPipe).

    Rank r holds stage r (phase 0) and stage 2D-1-r (phase 1); micro-batches go down the
    ranks and back up. The order reproduces DeepSpeed's eight-step schedule, with the
    weight gradient kept inside the backward, as DeepSpeed does. Needs N >= 2D.
    """

    name = "dualpipev"
    summary = "DeepSpeed's DualPipeV order: V-shape, 2 chunks per rank, needs N >= 2D"

    def validate(self):
        if self.micro_batches < 2 * self.ranks:
            raise ValueError(f"dualpipev needs micro_batches >= 2 * stages = {2 * self.ranks}, "
                             f"got {self.micro_batches}")

    def build_placement(self):
        return vshape_placement(self.ranks, self.micro_batches)

    def build_orders(self):
        return [self._rank_order(rank) for rank in range(self.ranks)]

    def _rank_order(self, rank: int) -> list:
        d, n = self.ranks, self.micro_batches
        chunk = (rank, 2 * d - 1 - rank)
        counts = {FORWARD: [0, 0], BACKWARD: [0, 0]}
        out = []

        def run(kind, phase):
            out.append(Action(kind, chunk[phase], counts[kind][phase]))
            counts[kind][phase] += 1

        F, B = FORWARD, BACKWARD
        steps = [
            ((d - rank - 1) * 2, [(F, 0)]),
            (rank + 1, [(F, 0), (F, 1)]),
            (d - rank - 1, [(B, 1), (F, 1)]),
            (n - 2 * d + rank + 1, [(F, 0), (B, 1), (F, 1), (B, 0)]),
            (d - rank - 1, [(B, 1), (F, 1), (B, 0)]),
            (rank + 1, [(B, 1), (B, 0)]),
            (d - rank - 1, [(B, 0)]),
        ]
        for repeat, pattern in steps:
            for _ in range(repeat):
                for kind, phase in pattern:
                    run(kind, phase)
        return out
