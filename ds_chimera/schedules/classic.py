"""The classic single-direction schedules: GPipe and 1F1B."""
from __future__ import annotations

from .actions import BACKWARD, FORWARD, Action
from .base import Schedule, linear_placement


def one_f_one_b_orders(placement, replica: int, mbs: list, orders: list | None = None) -> list:
    """Append a 1F1B order for ``mbs`` through ``replica``'s route to per-rank ``orders``.

    Stage s runs min(D-1-s, n) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards: DeepSpeed's TrainSchedule order.
    """
    if orders is None:
        orders = [[] for _ in range(placement.num_ranks)]
    route = placement.routes[replica]
    depth, n = len(route), len(mbs)
    for stage, chunk in enumerate(route):
        out = orders[placement.rank_of(chunk)]
        warmup = min(depth - 1 - stage, n)
        out.extend(Action(FORWARD, chunk, mb) for mb in mbs[:warmup])
        for k in range(n - warmup):
            out.append(Action(FORWARD, chunk, mbs[warmup + k]))
            out.append(Action(BACKWARD, chunk, mbs[k]))
        out.extend(Action(BACKWARD, chunk, mb) for mb in mbs[max(n - warmup, 0):])
    return orders


class GPipe(Schedule):
    """GPipe (Huang et al., NeurIPS 2019, arXiv:1811.06965): all forwards, then all backwards.

    Every rank holds the activations of all N micro-batches at its peak.
    """

    name = "gpipe"
    summary = "all forwards then all backwards; bubble (D-1)/(N+D-1), N activations per rank"

    def build_placement(self):
        return linear_placement(self.ranks, self.micro_batches)

    def build_orders(self):
        mbs = range(self.micro_batches)
        return [[Action(FORWARD, rank, mb) for mb in mbs] + [Action(BACKWARD, rank, mb) for mb in mbs]
                for rank in range(self.ranks)]


class OneFOneB(Schedule):
    """1F1B (PipeDream-Flush / DAPPLE: Narayanan et al., SC 2021; Fan et al., PPoPP 2021).

    The order of DeepSpeed's ``TrainSchedule``: stage s keeps at most D-s micro-batches
    in flight, so memory falls from D on the first rank to 1 on the last.
    """

    name = "1f1b"
    summary = "one-forward-one-backward; bubble (D-1)/(N+D-1), D..1 activations per rank"

    def build_placement(self):
        return linear_placement(self.ranks, self.micro_batches)

    def build_orders(self):
        return one_f_one_b_orders(self.placement, 0, list(range(self.micro_batches)))
