"""Which task is which: ranks split into a tick wave and a tock wave over the same devices.

On each node the first half of the local ranks is the tick wave and the second half the
tock wave; local rank l and l + L/2 share device l (L = local world size). A task's
*partner* is the other wave's task on its device: they exchange averaged gradients, which
is how one model is kept across the waves.
"""
from __future__ import annotations

from dataclasses import dataclass

TICK, TOCK = 0, 1


@dataclass(frozen=True)
class WaveLayout:
    rank: int
    world: int
    local_world: int

    def __post_init__(self):
        if self.local_world % 2 or self.world % self.local_world:
            raise ValueError(f"wavelet runs two tasks per device: the ranks per node ({self.local_world}) must be "
                             f"even and divide the world size ({self.world}); launch twice as many processes "
                             f"as devices (ds-chimera launch --wavelet does)")

    @property
    def devices_per_node(self) -> int:
        return self.local_world // 2

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world

    @property
    def wave(self) -> int:
        return TICK if self.local_rank < self.devices_per_node else TOCK

    @property
    def device(self) -> int:
        """The local device index this task runs on."""
        return self.local_rank % self.devices_per_node

    @property
    def partner(self) -> int:
        shift = self.devices_per_node
        return self.rank + shift if self.wave == TICK else self.rank - shift

    def wave_ranks(self, wave: int) -> list:
        node_starts = range(0, self.world, self.local_world)
        first = 0 if wave == TICK else self.devices_per_node
        return [n + first + d for n in node_starts for d in range(self.devices_per_node)]
