"""Order builders that use time: merging timed pieces, and greedy list scheduling.

What an order costs is the simulator's to say (``sim/simulator.py``, the package's one timing model). The list
scheduler keeps only the clock its greedy choices are made on, whose end is the order's makespan with free
messages (tests hold it to the simulator's). Any per-rank order obtained by sorting actions on start times of a
feasible timing is itself deadlock-free: a dependency on the same rank always starts strictly earlier.
"""
from __future__ import annotations

import heapq
from collections import deque

from .actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from .placement import Placement


def merge_by_time(num_ranks: int, timed: list) -> list:
    """Merge ``(start_time, tie, rank, action)`` tuples into one order per rank."""
    orders = [[] for _ in range(num_ranks)]
    for _, _, rank, action in sorted(timed, key=lambda x: (x[0], x[1])):
        orders[rank].append(action)
    return orders


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
    nch = len(placement.chunks)
    prev_of = [placement.prev_chunk(c) for c in range(nch)]
    next_of = [placement.next_chunk(c) for c in range(nch)]
    rank_of = [placement.rank_of(c) for c in range(nch)]
    duration = {FORWARD: f_cost * size, INPUT_GRAD: i_cost * size, WEIGHT_GRAD: w_cost * size}
    chunks_of = [placement.chunks_on(r) for r in range(num_ranks)]
    if prefer_late_chunk:
        chunks_of = [sorted(cs, key=lambda c: -placement.chunks[c].stage) for cs in chunks_of]
    mbs_of = [placement.micro_batches_of(placement.chunks[c].replica) for c in range(nch)]
    next_f = [0] * nch                            # index into mbs_of[chunk]
    f_end: dict = {}
    ready_i = [[] for _ in range(num_ranks)]      # heap of (ready time, seq, chunk, mb)
    pending_w = [deque() for _ in range(num_ranks)]
    live = [0.0] * num_ranks
    remaining = [sum(3 * len(mbs_of[c]) for c in chunks_of[r]) for r in range(num_ranks)]
    orders = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    busy_until = [0.0] * num_ranks
    seq = 0
    push, pop = heapq.heappush, heapq.heappop

    def pick_input(r, t, future):
        queue = ready_i[r]
        if queue:
            when, _, chunk, mb = queue[0]
            if when <= t:
                pop(queue)
                return (INPUT_GRAD, chunk, mb)
            future.append(when)
        return None

    def pick_forward(r, t, future):
        if live[r] + size > limits[r] + 1e-9:
            return None
        for chunk in chunks_of[r]:
            index = next_f[chunk]
            if index < len(mbs_of[chunk]):
                mb = mbs_of[chunk][index]
                prev = prev_of[chunk]
                ready = 0.0 if prev is None else f_end.get((prev, mb))
                if ready is not None and ready <= t:
                    return (FORWARD, chunk, mb)
                if ready is not None:
                    future.append(ready)
        return None

    picks = (pick_forward, pick_input) if forward_first else (pick_input, pick_forward)
    while heap:
        t, r = pop(heap)
        if remaining[r] == 0 or t < busy_until[r]:
            continue   # finished, or a stale wake-up while busy
        future = []
        choice = picks[0](r, t, future) or picks[1](r, t, future)
        if choice is None and pending_w[r]:
            # A W is only worth starting if it ends before known critical work arrives.
            if not future or min(future) >= t + duration[WEIGHT_GRAD] - 1e-9:
                choice = (WEIGHT_GRAD,) + pending_w[r][0]
        if choice is None:
            if future:   # otherwise the rank sleeps until a producer wakes it
                push(heap, (min(future), r))
            continue
        kind, chunk, mb = choice
        end = t + duration[kind]
        orders[r].append(Action(kind, chunk, mb))
        remaining[r] -= 1
        if kind == FORWARD:
            next_f[chunk] += 1
            f_end[(chunk, mb)] = end
            if next_of[chunk] is None:
                seq += 1
                push(ready_i[r], (end, seq, chunk, mb))
            live[r] += size
            consumer = next_of[chunk]
        elif kind == INPUT_GRAD:
            prev = prev_of[chunk]
            if prev is not None:
                seq += 1
                push(ready_i[rank_of[prev]], (max(end, f_end[(prev, mb)]), seq, prev, mb))
            pending_w[r].append((chunk, mb))
            consumer = prev
        else:
            pending_w[r].popleft()
            live[r] -= size
            consumer = None
        busy_until[r] = end
        push(heap, (end, r))
        if consumer is not None and rank_of[consumer] != r:
            push(heap, (end, rank_of[consumer]))
    if any(remaining):
        raise RuntimeError(f"list scheduling stalled with work left per rank: {remaining}")
    # every rank ran its order as soon as dependencies allowed, so this is the order's makespan
    return (orders, max(busy_until)) if with_makespan else orders


def fastest_list_schedule(placement: Placement, limits: list, name: str, late_chunk_first=(True,)) -> list:
    """The fastest greedy variant: a ready I first or a ready F first, for each choice in
    ``late_chunk_first`` (a rank's later chunk first, or its earlier one).

    A variant that stalls on the memory bound is skipped; a tie keeps the earlier variant, so
    the result is deterministic. ``name`` labels the error if every variant stalls. (Earlier
    chunk first never won for ZB-V up to D = 8, N = 32, but does for some Chimera shapes with
    several pipelines; each variant is one more list schedule to plan.)
    """
    best = None
    for forward_first in (False, True):
        for prefer_late_chunk in late_chunk_first:
            try:
                orders, span = list_schedule(placement, limits, forward_first=forward_first,
                                             prefer_late_chunk=prefer_late_chunk, with_makespan=True)
            except RuntimeError:      # this greedy variant can stall on the memory bound
                continue
            if best is None or span < best[0] - 1e-9:
                best = (span, orders)
    if best is None:
        raise RuntimeError(f"{name}: no list-scheduling variant completed for {placement.num_ranks} ranks, "
                           f"{placement.num_micro_batches} micro-batches")
    return best[1]
