"""Sharded data parallelism as program ops: where each chunk's weights are gathered and freed.

Under ZeRO-2 and ZeRO-3 each data-parallel rank keeps a 1/DP shard of every chunk's
weights, gradients and optimizer state. A chunk's full weights are all-gathered before
it computes (GATHER) and, under ZeRO-3, freed when it is done (RELEASE); its gradients
are reduce-scattered by the stage's gradient sync, posted after its last backward as in
any synchronous program. This pass adds the GATHER and RELEASE ops to a lowered program:

- a chunk's *use* is a run of consecutive compute actions on it in the rank's order;
  with ``reshard_after_forward`` (ZeRO-3's default) every use is gathered and released on
  its own; without it, a chunk stays gathered from its first compute to its last;
- each GATHER is posted one compute action ahead of the use it serves, so the all-gather
  overlaps the previous chunk's compute: at most two chunks are gathered at once;
- ZeRO-2 keeps the full weights between steps (they only change at the step): one GATHER
  per chunk per step, before its first compute, and no RELEASE;
- a chunk's full gradients live from its first weight-gradient action to the end of its
  reduce-scatter (the stage's GRAD_SYNC): a SYNC_WAIT on the reduce-scatters still under
  way goes before a chunk's first weight-gradient action, so one chunk's full gradients
  exist at a time where the order allows (breadth-first; a depth-first rank accumulates
  every chunk's at once, whatever the waits).

So the order decides the traffic: a breadth-first rank runs all micro-batches through a
chunk before the next, 2V-1 gathers a step for V chunks; a depth-first (interleaved)
rank switches chunks every few actions and gathers far more. :func:`gathers_per_rank`
counts them, and the simulator prices them.
"""
from __future__ import annotations

from .actions import GRADIENT_KINDS, STAGE_STEP, Action, Comm, Gather, SyncStart, Release, SyncWait
from .lowering import Program

SHARDED_ZERO_STAGES = (2, 3)


def uses(order: list) -> list:
    """(chunk, index of its first action, index of its last) of each run of consecutive actions on a chunk."""
    runs: list = []
    for i, action in enumerate(order):
        if runs and runs[-1][0] == action.chunk:
            runs[-1][2] = i
        else:
            runs.append([action.chunk, i, i])
    return [tuple(run) for run in runs]


def _segments(order: list, zero: int, reshard_after_forward: bool) -> list:
    """(chunk, first action index, last action index, release after it) of each gathered span."""
    if zero == 3 and reshard_after_forward:
        return [(chunk, first, last, True) for chunk, first, last in uses(order)]
    first, last = {}, {}
    for i, action in enumerate(order):
        first.setdefault(action.chunk, i)
        last[action.chunk] = i
    return [(chunk, first[chunk], last[chunk], zero == 3) for chunk in sorted(first, key=first.get)]


def shard(program: Program, zero: int, reshard_after_forward: bool = True) -> Program:
    """``program`` with the GATHER and RELEASE ops of ZeRO stage ``zero`` (2 or 3)."""
    if zero not in SHARDED_ZERO_STAGES:
        raise ValueError(f"sharding: ZeRO stage must be one of {SHARDED_ZERO_STAGES}, got {zero!r}")
    if any(type(op) is Action and op.kind == STAGE_STEP for ops in program.ops for op in ops):
        raise ValueError(f"sharding: {program.name!r} is asynchronous; its stages step alone, each needing its "
                         f"whole optimizer state")
    ops = []
    for rank_ops in program.ops:
        compute = [i for i, op in enumerate(rank_ops) if type(op) is Action]
        order = [rank_ops[i] for i in compute]
        before: dict = {}        # op index -> ops to insert before it
        after: dict = {}         # op index -> ops to insert after it
        for chunk, first, last, release in _segments(order, zero, reshard_after_forward):
            # posted before the previous compute action (at the start for the first): one ahead;
            # and before the receives that feed that action, so it does not wait behind them
            anchor = compute[first - 1] if first > 0 else (compute[0] if compute else len(rank_ops))
            while anchor > 0 and type(rank_ops[anchor - 1]) is Comm:
                anchor -= 1
            before.setdefault(anchor, []).append(Gather(chunk))
            if release:
                after.setdefault(compute[last], []).append(Release(chunk))
        for index, stages in _grad_waits(rank_ops):
            before.setdefault(index, []).append(SyncWait(stages))
        out = []
        for i, op in enumerate(rank_ops):
            out.extend(before.get(i, ()))
            out.append(op)
            out.extend(after.get(i, ()))
        out.extend(before.get(len(rank_ops), ()))
        ops.append(out)
    return Program(f"{program.name}+zero{zero}", program.placement, ops, program.synchronous, program.weights)


def _grad_waits(rank_ops: list) -> list:
    """(op index, stages) of the SYNC_WAITs that end the reduce-scatters still under way before each
    chunk's first weight-gradient action."""
    waits, pending, started = [], set(), set()
    for i, op in enumerate(rank_ops):
        if type(op) is SyncStart:
            pending.add(op.stage)
        elif type(op) is SyncWait:
            pending -= set(op.stages)
        elif type(op) is Action and op.kind in GRADIENT_KINDS and op.chunk not in started:
            started.add(op.chunk)
            if pending:
                waits.append((i, tuple(sorted(pending))))
                pending = set()
    return waits


def gathers_per_rank(program: Program) -> list:
    """How many chunk all-gathers each rank posts in one step."""
    return [sum(1 for op in ops if type(op) is Gather) for ops in program.ops]
