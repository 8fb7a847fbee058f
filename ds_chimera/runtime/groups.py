"""The process groups a placement needs, created once, in one order, on every rank.

``dist.new_group`` is collective over the whole world, so every rank creates every group
(for every pipeline of the world) in the same order and keeps the ones it belongs to.
The DeepSpeed engine and the Megatron contract both build theirs here:

- one group per model stage over the ranks that hold a replica of it (Chimera's two
  copies), either within each pipeline, or spanning the pipelines of one family (the
  data-parallel copies of one tensor rank: DeepSpeed's data-parallel gradient all-reduce
  and the replica sync are then one collective; each tensor rank holds its own slices, so
  the families of different tensor ranks never share a group);
- one group per tied-weight key over the ranks holding a module of it;
- NCCL only: one two-rank group per (edge, direction), because NCCL matches messages by
  issue order, not by tag;
- gloo only: ``job``, a group of the whole world that is the engine's own, for the tagged
  messages and the loss all-reduce, so that a failure can break it (and the failed engine's
  other groups) and leave the default group whole for the next engine (runtime/faults.py).
  On NCCL it is the default group (None): another world communicator costs device memory.

Group creation is bounded by the pipeline timeout (a missing rank fails, it does not hang).
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class PipelineGroups:
    """Groups of one placement. ``pipelines[i][p]``: global rank of pipeline rank ``p`` in pipeline ``i``, for
    every pipeline of the world (every data-parallel copy of every tensor rank).

    ``families``: lists of pipeline indices whose stage and tied groups are one collective (the data-parallel
    copies of one tensor rank); None: each pipeline on its own. ``stage`` and ``tied`` hold the groups this
    process is a member of (None: a group of one).
    """

    def __init__(self, placement, pipelines: list, mine: int, timeout_s: float, *, families: list | None = None,
                 tied_holders: dict | None = None, nccl_edges: bool = False, stages: list | None = None):
        self.placement, self.pipelines, self.mine = placement, [list(p) for p in pipelines], mine
        me = dist.get_rank()
        self.timeout = timedelta(seconds=timeout_s)
        self._cache: dict = {}
        self.stage: dict = {}        # stage -> group (None: a group of one)
        self.tied: dict = {}         # tied key -> group
        self.edges: dict = {}        # (src chunk, dst chunk, kind) -> group, NCCL only
        self.job = None if nccl_edges else self._new(list(range(dist.get_world_size())))
        slices = families if families is not None else [[i] for i in range(len(self.pipelines))]
        for stage in (range(placement.num_stages) if stages is None else stages):
            holders = placement.stage_group(stage)
            for d in slices:
                ranks = self._ranks(holders, d)
                group = self._group(ranks)
                if me in ranks:
                    self.stage[stage] = group
        for key in sorted(tied_holders or {}):
            for d in slices:
                ranks = self._ranks(tied_holders[key], d)
                group = self._group(ranks)
                if me in ranks:
                    self.tied[key] = group
        if nccl_edges:
            for d, ranks in enumerate(self.pipelines):
                for chunk in placement.chunks:
                    nxt = placement.next_chunk(chunk.index)
                    if nxt is None or placement.rank_of(nxt) == chunk.rank:
                        continue
                    pair = sorted({ranks[chunk.rank], ranks[placement.rank_of(nxt)]})
                    for key in ((chunk.index, nxt, "act"), (nxt, chunk.index, "grad")):
                        group = self._new(pair)
                        if d == mine:
                            self.edges[key] = group

    def all_groups(self) -> list:
        """Every group of this placement that this rank is a member of (for the fault monitor)."""
        return [g for g in [self.job, *self.stage.values(), *self.tied.values(), *self.edges.values()] if g is not None]

    def _ranks(self, pipe_ranks, family: list) -> tuple:
        return tuple(sorted({self.pipelines[i][p] for i in family for p in pipe_ranks}))

    def _new(self, ranks):
        return dist.new_group(list(ranks), timeout=self.timeout)

    def _group(self, ranks: tuple):
        """One group per distinct rank set (two stages with the same holders share it); None for one rank."""
        if ranks not in self._cache:
            self._cache[ranks] = self._new(ranks) if len(ranks) > 1 else None
        return self._cache[ranks]


def process_groups_in(*owners) -> list:
    """The process groups an object holds in its attributes (directly, or in a list, tuple or dict
    of them): DeepSpeed's grid and ZeRO optimizers keep theirs so. For the fault monitor."""
    found = []
    for owner in owners:
        for value in (vars(owner).values() if hasattr(owner, "__dict__") else ()):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            found += [item for item in items if isinstance(item, dist.ProcessGroup)]
    return found


BREAK_TAG = (1 << 30) + 1  # the receive no one sends, whose timed-out wait closes a group's connections


def close_gloo_connections(groups: list) -> None:
    """Close every connection of each gloo group, which ends every wait on it with an error (the
    fault monitor's way to end a wait after a failure: gloo cannot cancel one). A receive from a
    peer that times out closes them all; a peer that broke its side first makes that receive fail at
    once instead, which closes nothing else: then the next peer is tried."""
    import contextlib

    import torch
    me = dist.get_rank()
    for group in groups:
        with contextlib.suppress(Exception):
            if "gloo" not in str(dist.get_backend(group)):
                continue
            for peer in (r for r in dist.get_process_group_ranks(group) if r != me):
                try:
                    work = dist.irecv(torch.empty(1), src=peer, group=group, tag=BREAK_TAG)
                    work.wait(timedelta(milliseconds=1))
                except Exception as exc:
                    if "Timed out" in str(exc):
                        break
