"""One gloo transport device per process, shared by every gloo process group.

torch gives each gloo process group its own TCP transport device, and each device runs an
event-loop thread that wakes 100 times a second even when nothing is sent (a 10 ms
``epoll_wait``). A benchmark that keeps two dozen engines alive, each with its own groups,
then has over a hundred such threads per rank: measured here with 50 idle groups, 5,700
context switches a second per process against 100 with one shared device. On 2 cores
shared by 4 ranks that steals time from whichever engine is stepping, the peers' included
(``tools/idle_engines.py``). One real training job has a handful of groups, so the benchmarks give
all groups one device: the rows then measure schedules and runtimes, not idle threads.

Call ``share_one_device()`` before the default process group is created.
"""
import torch.distributed.distributed_c10d as c10d

_devices: list = []


def share_one_device() -> None:
    """Make every gloo process group created from now on in this process use one transport
    device. Safe to call twice."""
    base = c10d.ProcessGroupGloo
    if getattr(base, "_shares_one_device", False):
        return

    class SharedDeviceGloo(base):
        """torch's gloo process group, built on this process's one shared device."""
        _shares_one_device = True

        def __init__(self, store, rank, size, timeout=None):
            options = base._Options()
            if timeout is not None:
                options._timeout = timeout
            if not _devices:
                _devices.append(base.create_default_device())
            options._devices = [_devices[0]]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo
