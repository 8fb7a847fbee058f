"""Memory over one training cycle, and what two tasks on one device need at their peak.

A task holds its static memory (weights, gradients, optimizer state) all the time. Its
activations grow linearly through the forward (0 to A over time F) and are freed
linearly through the backward (A to 0 over time B), so the curve repeats every C = F + B.

Wavelet runs two tasks per device, the second launched half a cycle later; each one's
forward then falls in the other's backward, where memory is freed. This module gives the
peak per device for that offset, for two tasks in lock-step (gang scheduling), and for one
task running the doubled batch, which is the plain data-parallel way to use the same memory.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskMemory:
    """One task's memory profile: ``static`` bytes always held, ``activations`` at the peak."""

    static: float
    activations: float
    fwd: float = 1.0
    bwd: float = 2.0

    def __post_init__(self):
        for name in ("static", "activations", "fwd", "bwd"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.fwd + self.bwd <= 0:
            raise ValueError("a cycle needs fwd + bwd > 0")

    @property
    def cycle(self) -> float:
        return self.fwd + self.bwd

    def activations_at(self, t: float) -> float:
        """Activation memory at time ``t`` of the repeating cycle (t = 0: a forward starts)."""
        t %= self.cycle
        if t <= self.fwd:
            return self.activations * (t / self.fwd if self.fwd else 1.0)
        return self.activations * (self.cycle - t) / self.bwd if self.bwd else 0.0

    def two_tasks_peak(self, offset: float) -> float:
        """Peak of two tasks' memory when the second starts ``offset`` (a fraction of a cycle) later.

        Both curves are piecewise linear, so the sum peaks at one of their breakpoints.
        """
        shift = (offset % 1.0) * self.cycle
        points = {0.0, self.fwd, shift % self.cycle, (shift + self.fwd) % self.cycle}
        peak = max(self.activations_at(t) + self.activations_at(t - shift) for t in points)
        return 2 * self.static + peak


def wavelet_memory(task: TaskMemory) -> dict:
    """Peak memory per device: tick-tock waves, gang-scheduled tasks, one task with the doubled batch."""
    return {
        "offset_waves": task.two_tasks_peak(0.5),
        "gang": task.two_tasks_peak(0.0),
        "doubled_batch": task.static + 2 * task.activations,
        "one_task": task.static + task.activations,
    }
