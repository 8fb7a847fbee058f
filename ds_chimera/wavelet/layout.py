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


class WaveMPU:
    """DeepSpeed's model-parallel unit for a Wavelet task: its data-parallel group is its wave.

    With it, every collective DeepSpeed runs (the initial broadcast, a norm) stays within one
    wave, which has one task per device: no process group holds the two tasks of a device,
    so the groups can be NCCL's. The groups are created here, collectively, before DeepSpeed's
    engine exists. The model-parallel groups are this task alone.
    """

    def __init__(self, layout: WaveLayout, dist):
        self.layout = layout
        self.wave_groups = {w: dist.new_group(layout.wave_ranks(w)) for w in (TICK, TOCK)}  # every rank, same order
        self.own_group = None
        for rank in range(layout.world):                    # one single-rank group each, in one order
            group = dist.new_group([rank])
            if rank == layout.rank:
                self.own_group = group
        self.wave_ranks = layout.wave_ranks(layout.wave)

    def get_data_parallel_group(self):
        return self.wave_groups[self.layout.wave]

    def get_data_parallel_world_size(self) -> int:
        return len(self.wave_ranks)

    def get_data_parallel_rank(self) -> int:
        return self.wave_ranks.index(self.layout.rank)

    def get_model_parallel_group(self):
        return self.own_group

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_sequence_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.layout.rank
