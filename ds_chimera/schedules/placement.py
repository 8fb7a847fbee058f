"""Where model chunks live and which chunks each micro-batch flows through.

A model is cut into ``num_stages`` stages. A *replica* is one full copy of the model; a
*chunk* is one (replica, stage) pair pinned to one rank. Chimera holds two replicas, each
stage on two ranks; interleaved schedules hold one replica with several chunks per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence


class Chunk(NamedTuple):
    index: int
    replica: int
    stage: int
    rank: int


@dataclass
class Placement:
    """Chunks, their ranks, and the route (replica) of every micro-batch.

    ``size`` is a chunk's share of one rank's worth of layers: ``ranks / num_stages``.
    Costs, activations and weights are all counted in these units, so that a schedule
    with V chunks per rank pays 1/V per chunk.
    """

    num_ranks: int
    num_stages: int
    stage_ranks: Sequence[Sequence[int]]     # stage_ranks[replica][stage] -> rank
    mb_replica: Sequence[int]                # micro-batch -> replica it flows through
    chunks: list = field(init=False)
    routes: list = field(init=False)          # routes[replica] -> chunk indices, stage order

    def __post_init__(self) -> None:
        self.chunks, self.routes = [], []
        for replica, ranks in enumerate(self.stage_ranks):
            if len(ranks) != self.num_stages:
                raise ValueError(f"replica {replica} places {len(ranks)} stages, expected {self.num_stages}")
            route = []
            for stage, rank in enumerate(ranks):
                if not 0 <= rank < self.num_ranks:
                    raise ValueError(f"stage {stage} of replica {replica} is on rank {rank}, "
                                     f"allowed 0..{self.num_ranks - 1}")
                route.append(len(self.chunks))
                self.chunks.append(Chunk(len(self.chunks), replica, stage, rank))
            self.routes.append(route)
        self.size = self.num_ranks / self.num_stages
        self._next = {}
        self._prev = {}
        for route in self.routes:
            for a, b in zip(route, route[1:]):
                self._next[a], self._prev[b] = b, a

    @property
    def num_replicas(self) -> int:
        return len(self.routes)

    @property
    def num_micro_batches(self) -> int:
        return len(self.mb_replica)

    def rank_of(self, chunk: int) -> int:
        return self.chunks[chunk].rank

    def next_chunk(self, chunk: int):
        """The chunk that consumes this chunk's activations, or None for a loss chunk."""
        return self._next.get(chunk)

    def prev_chunk(self, chunk: int):
        """The chunk that feeds this one, or None for a chunk that loads data."""
        return self._prev.get(chunk)

    def chunks_on(self, rank: int) -> list:
        return [c.index for c in self.chunks if c.rank == rank]

    def micro_batches_of(self, replica: int) -> list:
        return [mb for mb, r in enumerate(self.mb_replica) if r == replica]

    def stage_group(self, stage: int) -> tuple:
        """Ranks holding a replica of ``stage``: they all-reduce its gradients."""
        return tuple(sorted({ranks[stage] for ranks in self.stage_ranks}))

    def stage_owner(self, stage: int) -> int:
        """The one rank that speaks for ``stage`` among its replicas: it counts the stage in the
        gradient norm, writes its layers to checkpoints and sends its weights to the others."""
        return self.stage_group(stage)[0]

    def replicated_stages(self) -> list:
        """The stages held by more than one rank (Chimera's replicas), whose gradients are all-reduced."""
        return [s for s in range(self.num_stages) if len(self.stage_group(s)) > 1]

    def weights_per_rank(self) -> list:
        """Weights held per rank, in units of one stage's worth (one rank's share) of layers."""
        held = [0.0] * self.num_ranks
        for c in self.chunks:
            held[c.rank] += self.size
        return held
