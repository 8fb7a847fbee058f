"""Looped schedules: V chunks per rank, stage s on rank s mod D."""
from __future__ import annotations

from ..validation import check_int
from .actions import BACKWARD, FORWARD, Action
from .base import Schedule, looped_placement


class _Looped(Schedule):
    options = {"chunks": 2}

    def validate(self):
        self.chunks = check_int(self.name, "chunks", self.config["chunks"], 1)

    def build_placement(self):
        return looped_placement(self.ranks, self.chunks, self.micro_batches)

    def chunk(self, rank: int, v: int) -> int:
        return v * self.ranks + rank   # chunk index == stage index: one replica


class Interleaved(_Looped):
    """Depth-first interleaved 1F1B (Narayanan et al., SC 2021, arXiv:2104.04473), Megatron's order.

    Micro-batches advance in groups of D through one chunk, then the next; 1F1B in the
    steady state. Bubble (D-1)/(V*N+D-1); about D + (D-1)/V stage activations per rank.
    """

    name = "interleaved"
    summary = "Megatron's depth-first interleaved 1F1B, V chunks per rank; bubble (D-1)/(VN+D-1)"

    def validate(self):
        super().validate()
        if self.micro_batches % self.ranks:
            raise ValueError(f"interleaved needs micro_batches to be a multiple of stages "
                             f"({self.ranks}), got {self.micro_batches}: set DeepSpeed's "
                             f"gradient_accumulation_steps (Megatron's num_microbatches) to a multiple of "
                             f"{self.ranks}, or use breadth-first, which takes any number")

    def build_orders(self):
        d, v, n = self.ranks, self.chunks, self.micro_batches
        total = n * v

        def action(kind, rank, k):
            group = (k // d) % v
            chunk_slot = group if kind == FORWARD else v - 1 - group
            mb = (k // (d * v)) * d + k % d
            return Action(kind, self.chunk(rank, chunk_slot), mb)

        orders = []
        for rank in range(d):
            warmup = min((d - rank - 1) * 2 + (v - 1) * d, total)
            out = [action(FORWARD, rank, k) for k in range(warmup)]
            for k in range(total - warmup):
                out.append(action(FORWARD, rank, warmup + k))
                out.append(action(BACKWARD, rank, k))
            out.extend(action(BACKWARD, rank, k) for k in range(total - warmup, total))
            orders.append(out)
        return orders


class BreadthFirst(_Looped):
    """Breadth-first looped pipeline (Lamy-Poirier, arXiv:2211.05953).

    All N micro-batches go through a rank's chunk v before chunk v+1, and backward runs
    the chunks in reverse. Same bubble as interleaved, N activations per rank; its gain
    is that each chunk's weights and gradients move once per step under sharded DP.
    """

    name = "breadth-first"
    summary = "looped breadth-first, V chunks per rank; bubble (D-1)/(VN+D-1), N activations"

    def build_orders(self):
        mbs = range(self.micro_batches)
        orders = []
        for rank in range(self.ranks):
            out = [Action(FORWARD, self.chunk(rank, v), mb) for v in range(self.chunks) for mb in mbs]
            out += [Action(BACKWARD, self.chunk(rank, v), mb)
                    for v in reversed(range(self.chunks)) for mb in mbs]
            orders.append(out)
        return orders
