"""Lowering: turn per-rank compute orders into complete per-rank programs: the whole step.

The pass adds what the placement implies and nothing else: point-to-point messages
between chunks on different ranks, batched so that every send of a batch is posted
before any of its receives is awaited; one gradient all-reduce per model stage, posted
as soon as the rank's last backward of that stage is done; the wait for those syncs,
the clipping and the optimizer step. A synchronous program ends with them (one flush);
an asynchronous one has them before every ``S`` action (each stage steps alone).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, replace

from .actions import (ACT, BACKWARD_KINDS, FORWARD, GRAD, GRADIENT_KINDS, STAGE_STEP, Action, Clip, ClipScope,
                      Comm, SyncStart, Message, Step, SyncWait)
from .placement import Placement
from .program_io import dump_program, parse_program


@dataclass
class Program:
    """What every consumer (simulator, runtimes, plots) executes: one op list per rank."""

    name: str
    placement: Placement
    ops: list            # ops[rank] -> [Action | Comm | SyncStart | SyncWait | Clip | Step]
    synchronous: bool = True
    weights: list | None = None   # weight copies per rank, where the schedule knows more than the placement

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def compute(self, rank: int) -> list:
        return [op for op in self.ops[rank] if isinstance(op, Action)]

    def orders(self) -> list:
        """The compute actions of every rank, in program order."""
        return [self.compute(rank) for rank in range(self.num_ranks)]

    def dump(self, path=None) -> str:
        """The program as text (see :mod:`.program_io`); written atomically to ``path`` if given."""
        return dump_program(self, path)

    @staticmethod
    def load(source) -> "Program":
        """A program from a file path or from the text :meth:`dump` wrote."""
        return Program(**parse_program(source))

    def __str__(self) -> str:
        return self.dump()


def _cross_rank_links(placement: Placement) -> list:
    """Per chunk: (its producer if on another rank, else None; its consumer if on another rank, else None)."""
    links = []
    for c in placement.chunks:
        prev, nxt = placement.prev_chunk(c.index), placement.next_chunk(c.index)
        links.append((prev if prev is not None and placement.rank_of(prev) != c.rank else None,
                      nxt if nxt is not None and placement.rank_of(nxt) != c.rank else None))
    return links


def _last_grad_index(placement: Placement, order: list) -> dict:
    """stage -> index in ``order`` after which all of the rank's grads for that stage exist."""
    last = {}
    for i, (kind, chunk, _) in enumerate(order):
        if kind in GRADIENT_KINDS:
            last[placement.chunks[chunk].stage] = i
    return last


@contextmanager
def gc_paused():
    """Pause the cyclic GC while building millions of small acyclic tuples (about 30% faster)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def without_global_clip(program: Program) -> Program:
    """``program`` without its global CLIP ops: for a step that neither clips nor reports the norm.

    The global CLIP is a collective of every rank (their squared norms summed), so it makes the
    ranks meet at the end of each step; where nobody reads the norm that meeting costs time for
    nothing. Removing a collective leaves every rank's work and messages as they were, so a
    program the simulator accepted stays complete and deadlock-free.
    """
    ops = [[op for op in rank_ops if not (type(op) is Clip and op.scope == ClipScope.GLOBAL)]
           for rank_ops in program.ops]
    return replace(program, ops=ops)


def lower(name: str, placement: Placement, orders: list, synchronous: bool = True) -> Program:
    """Add communication, gradient syncs and optimizer steps to per-rank compute orders."""
    with gc_paused():
        links = _cross_rank_links(placement)
        ops = [_lower_rank(placement, links, rank, order, synchronous) for rank, order in enumerate(orders)]
    return Program(name, placement, ops, synchronous)


def sync_points(placement: Placement, rank: int, order: list) -> dict:
    """Where a synchronous program posts its gradient syncs: action index -> stages posted right after it.

    A stage's sync is ready after the rank's last backward of that stage (index -1: before
    any compute, for a replica that sees no micro-batch when N < pipelines; it still joins
    the all-reduce, with zero gradients). Each group's syncs are posted in one canonical
    order (last stage first) on every member, so collectives sharing a group can never be
    issued in conflicting orders: a ready stage waits for the ones before it in its queue.
    The simulator-free timing (:mod:`.timing`) uses the same points.
    """
    last = _last_grad_index(placement, order)
    ready_at: dict = {}
    for chunk in placement.chunks_on(rank):
        stage = placement.chunks[chunk].stage
        ready_at.setdefault(last.get(stage, -1), set()).add(stage)
    queues: dict = {}
    for stages in ready_at.values():
        for stage in stages:
            queues.setdefault(placement.stage_group(stage), []).append(stage)
    for queue in queues.values():
        queue.sort(reverse=True)
    ready: set = set()
    points: dict = {}
    for index in sorted(ready_at):
        ready.update(ready_at[index])
        posted = []
        for queue in queues.values():
            while queue and queue[0] in ready:
                posted.append(queue.pop(0))
        if posted:
            points[index] = posted
    return points


def _lower_rank(placement: Placement, links: list, rank: int, order: list, synchronous: bool) -> list:
    ops: list = []
    pending_sends: tuple = ()
    points = sync_points(placement, rank, order) if synchronous else {}
    for stage in points.get(-1, ()):
        ops.append(SyncStart(stage, placement.stage_group(stage)))

    append = ops.append
    for i, action in enumerate(order):
        kind, chunk, mb = action
        prev, nxt = links[chunk]
        # what this action receives from and sends to other ranks (inline: this runs once per action)
        if kind == FORWARD:
            recvs = () if prev is None else (Message(ACT, prev, chunk, mb),)
            sends = () if nxt is None else (Message(ACT, chunk, nxt, mb),)
        elif kind in BACKWARD_KINDS:
            recvs = () if nxt is None else (Message(GRAD, nxt, chunk, mb),)
            sends = () if prev is None else (Message(GRAD, chunk, prev, mb),)
        else:
            recvs = sends = ()
        if kind == STAGE_STEP:
            stage = placement.chunks[action.chunk].stage
            if pending_sends:
                ops.append(Comm(pending_sends, ()))
                pending_sends = ()
            ops.append(SyncStart(stage, placement.stage_group(stage)))
            ops.append(SyncWait((stage,)))
            ops.append(Clip(ClipScope.STAGE, stage))
        elif pending_sends or recvs:
            append(Comm(pending_sends, recvs))
            pending_sends = ()
        append(action)
        pending_sends = sends
        if i in points:
            if pending_sends:
                ops.append(Comm(pending_sends, ()))
                pending_sends = ()
            for stage in points[i]:
                ops.append(SyncStart(stage, placement.stage_group(stage)))
    if pending_sends:
        ops.append(Comm(pending_sends, ()))
    if synchronous:
        chunks = tuple(placement.chunks_on(rank))
        ops.append(SyncWait(tuple(sorted({placement.chunks[c].stage for c in chunks}))))
        ops.append(Clip(ClipScope.GLOBAL))
        ops.append(Step(chunks))
    return ops


def lower_forward_only(name: str, placement: Placement, orders: list) -> Program:
    """The forwards of ``orders`` with their messages: an eval program (no gradients: no syncs, no step).

    It is not simulated (the simulator proves training programs, which end every micro-batch with its
    backward), and needs no proof of its own: its dependencies are a subset of the proven training
    program's (each forward waits only on earlier forwards; sends never block), so it cannot deadlock."""
    forwards = [[a for a in order if a.kind == FORWARD] for order in orders]
    return lower(name, placement, forwards, synchronous=False)
