"""Timing of a step's compute actions, and profiler ranges around them.

On a CPU the host clock is the compute clock. On an accelerator the host only launches
kernels, so its clock would record launches: there each action is bracketed by device
events on the current stream, resolved once at the end of the step (one synchronisation,
after the work). Records are (rank, kind, chunk, mb, start s, end s) from the step start.
"""
from __future__ import annotations

import time

import torch


def profiler_running() -> bool:
    """Whether torch's profiler records now."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def profiler_range(op):
    """``torch.profiler.record_function`` for ``op``: the executor opens one per op while a profiler runs."""
    return torch.profiler.record_function(f"ds_chimera.{op}")


class HostClock:
    """Marks are host times (perf_counter)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def mark(self):
        return time.perf_counter()

    def seconds(self, mark) -> float:
        return mark - self.t0


class DeviceClock:
    """Marks are device events recorded on the current stream; seconds are read after the step.

    ``module`` is the device's torch module (``torch.cuda``, ``torch.xpu``...)."""

    def __init__(self, module):
        self.module = module
        self.t0 = self.mark()

    def mark(self):
        event = self.module.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        mark.synchronize()
        return self.t0.elapsed_time(mark) / 1000.0


def clock_for(device):
    """Device events where the device has them (cuda, xpu...), else the host clock."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    module = getattr(torch, kind, None)
    if kind != "cpu" and module is not None and hasattr(module, "Event") and \
            getattr(module, "is_available", lambda: False)():
        return DeviceClock(module)
    return HostClock()


class StepTrace:
    """Collects one step's action marks; :meth:`records` resolves them to seconds."""

    def __init__(self, rank: int, device="cpu", clock=None):
        self.rank = rank
        self.clock = clock if clock is not None else clock_for(device)
        self.marks: list = []

    def add(self, kind, chunk: int, mb: int, start, end) -> None:
        self.marks.append((kind, chunk, mb, start, end))

    def records(self) -> list:
        seconds = self.clock.seconds
        return [(self.rank, kind, chunk, mb, seconds(start), seconds(end)) for kind, chunk, mb, start, end in self.marks]
