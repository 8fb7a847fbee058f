"""Order builders that use time: merging timed pieces, and greedy list scheduling.

Any per-rank order obtained by sorting actions on start times of a feasible timing is
itself deadlock-free: a dependency on the same rank always starts strictly earlier.
"""
from __future__ import annotations

import heapq
from collections import deque

from .actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from .placement import Placement


def merge_by_time(num_ranks: int, timed: list) -> list:
    """Merge ``(start_time, tie, rank, action)`` tuples into one order per rank."""
    orders = [[] for _ in range(num_ranks)]
    for _, _, rank, action in sorted(timed, key=lambda x: (x[0], x[1])):
        orders[rank].append(action)
    return orders


def time_orders(placement: Placement, orders: list, costs) -> dict:
    """Start time of every action of ``orders`` under ``costs`` (comm-free)."""
    from ..sim.simulator import simulate  # the simulator is the one source of timing
    from .lowering import lower
    result = simulate(lower("piece", placement, orders, synchronous=False), costs)
    if not result.valid:
        raise RuntimeError(f"internal error: a schedule piece is invalid: {result.errors[:3]} {result.deadlock}")
    return result.start_times()


def list_schedule(placement: Placement, limits: list, cost=(1.0, 1.0, 1.0), prefer_late_chunk=True,
                  forward_first=False, with_makespan=False):
    """Greedy zero-bubble list scheduling with split backward (Qi et al., arXiv:2401.10241).

    Whenever a rank is free it runs, in priority order: a ready input-grad I; a ready
    forward F if its in-flight activations stay within ``limits[rank]`` (stage units,
    counted from F to W); else a deferred weight-grad W, which fills what would be a
    bubble. ``cost`` is (F, I, W) per chunk in slots. With ``with_makespan`` it also returns
    the makespan of the order under those costs (no communication cost).
    """
    f_cost, i_cost, w_cost = cost
    num_ranks = placement.num_ranks
    size = placement.size
    chunks_of = [placement.chunks_on(r) for r in range(num_ranks)]
    if prefer_late_chunk:
        chunks_of = [sorted(cs, key=lambda c: -placement.chunks[c].stage) for cs in chunks_of]
    mbs_of = [placement.micro_batches_of(placement.chunks[c].replica) for c in range(len(placement.chunks))]
    next_f = [0] * len(placement.chunks)          # index into mbs_of[chunk]
    f_end: dict = {}
    ready_i = [[] for _ in range(num_ranks)]      # heap of (ready time, seq, chunk, mb)
    seq = 0
    pending_w = [deque() for _ in range(num_ranks)]
    live = [0.0] * num_ranks
    remaining = [sum(3 * len(mbs_of[c]) for c in chunks_of[r]) for r in range(num_ranks)]
    orders = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    busy_until = [0.0] * num_ranks

    def forward_ready(chunk, mb):
        prev = placement.prev_chunk(chunk)
        return 0.0 if prev is None else f_end.get((prev, mb))

    def input_becomes_ready(chunk, mb, when):
        nonlocal seq
        seq += 1
        heapq.heappush(ready_i[placement.rank_of(chunk)], (when, seq, chunk, mb))

    while heap:
        t, r = heapq.heappop(heap)
        if remaining[r] == 0 or t < busy_until[r]:
            continue   # finished, or a stale wake-up while busy
        choice, future = None, []

        def pick_input():
            if ready_i[r]:
                when, _, chunk, mb = ready_i[r][0]
                if when <= t:
                    heapq.heappop(ready_i[r])
                    return (INPUT_GRAD, chunk, mb)
                future.append(when)
            return None

        def pick_forward():
            if live[r] + size > limits[r] + 1e-9:
                return None
            for chunk in chunks_of[r]:
                if next_f[chunk] < len(mbs_of[chunk]):
                    mb = mbs_of[chunk][next_f[chunk]]
                    ready = forward_ready(chunk, mb)
                    if ready is not None and ready <= t:
                        return (FORWARD, chunk, mb)
                    if ready is not None:
                        future.append(ready)
            return None

        for pick in ((pick_forward, pick_input) if forward_first else (pick_input, pick_forward)):
            choice = pick()
            if choice is not None:
                break
        if choice is None and pending_w[r]:
            # A W is only worth starting if it ends before known critical work arrives.
            if not future or min(future) >= t + w_cost * size - 1e-9:
                choice = (WEIGHT_GRAD,) + pending_w[r][0]
        if choice is None:
            if future:   # otherwise the rank sleeps until a producer wakes it
                heapq.heappush(heap, (min(future), r))
            continue
        kind, chunk, mb = choice
        end = t + {FORWARD: f_cost, INPUT_GRAD: i_cost, WEIGHT_GRAD: w_cost}[kind] * size
        orders[r].append(Action(kind, chunk, mb))
        remaining[r] -= 1
        if kind == FORWARD:
            next_f[chunk] += 1
            f_end[(chunk, mb)] = end
            if placement.next_chunk(chunk) is None:
                input_becomes_ready(chunk, mb, end)
            live[r] += size
        elif kind == INPUT_GRAD:
            prev = placement.prev_chunk(chunk)
            if prev is not None:
                input_becomes_ready(prev, mb, max(end, f_end[(prev, mb)]))
            pending_w[r].append((chunk, mb))
        else:
            pending_w[r].popleft()
            live[r] -= size
        busy_until[r] = end
        heapq.heappush(heap, (end, r))
        consumer = placement.next_chunk(chunk) if kind == FORWARD else (
            placement.prev_chunk(chunk) if kind == INPUT_GRAD else None)
        if consumer is not None and placement.rank_of(consumer) != r:
            heapq.heappush(heap, (end, placement.rank_of(consumer)))
    if any(remaining):
        raise RuntimeError(f"list scheduling stalled with work left per rank: {remaining}")
    # every rank ran its order as soon as dependencies allowed, so this is the order's makespan
    return (orders, max(busy_until)) if with_makespan else orders


def with_full_backward(orders: list) -> list:
    """Fuse each I with its W into one B at the I's position (for schedules without a split)."""
    return [[Action(BACKWARD, a.chunk, a.mb) if a.kind == INPUT_GRAD else a
             for a in order if a.kind != WEIGHT_GRAD] for order in orders]
