"""What the two Wavelet tasks of a device hold, counted rather than read from the allocator.

A process's RSS (or an accelerator allocator's reserved bytes) is what its allocator keeps,
which may include freed blocks, and two processes sampled on their own clocks must be aligned
afterwards. Here each task counts what it holds:

- ``saved``: the bytes autograd saves for the backward (saved-tensor hooks around the forward;
  each distinct storage counted until autograd releases it after its node's backward;
  parameters left out, they are held anyway);
- ``buffers``: Wavelet's own buffers, which the engine posts (the channel's mapped buffers, the
  flat gradients during an update).

Both go on the task's board (see .channel). The tick task's :class:`PairSampler` reads both
tasks' boards and both processes' RSS at one instant, so a device's figures are on one clock.
"""
from __future__ import annotations

import os
import threading
import time

import torch

from .layout import TICK

FIELDS = ("time", "saved_tick", "saved_tock", "buffers_tick", "buffers_tock", "rss_tick", "rss_tock")


class _Saved:
    """A saved tensor as autograd holds it: uncounted when autograd drops it."""

    __slots__ = ("tensor", "counter", "key")

    def __init__(self, tensor, counter, key):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self):
        self.counter._release(self.key)


class SavedBytes:
    """The bytes held for the backward by the forwards run under :meth:`hooks`.

    ``post(n)`` gets the new total at every change. The count is per storage, so a tensor
    saved by several nodes counts once.
    """

    def __init__(self, post=None, exclude=()):
        self.held = 0
        self._post = post or (lambda n: None)
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._refs: dict = {}                 # storage address -> [references, bytes]
        self._lock = threading.Lock()         # an accelerator's backward releases on autograd's threads

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude:
            return tensor
        with self._lock:
            entry = self._refs.setdefault(key, [0, storage.nbytes()])
            entry[0] += 1
            if entry[0] == 1:
                self._change(entry[1])
        return _Saved(tensor, self, key)

    def _release(self, key) -> None:
        with self._lock:
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._refs[key]
                self._change(-entry[1])

    def _change(self, nbytes: int) -> None:
        self.held += nbytes
        self._post(self.held)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


def rss_bytes(pid: int) -> int | None:
    """Resident bytes of process ``pid`` (None where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PairSampler(threading.Thread):
    """Every ``period_s``, one timestamp and both tasks' board numbers and RSS (rows of ``FIELDS``)."""

    def __init__(self, channel, period_s: float = 0.001):
        super().__init__(daemon=True, name="ds_chimera-wavelet-meter")
        self.channel, self.period_s = channel, period_s
        self.rows: list = []
        self._done = threading.Event()

    def run(self):
        tock_pid = int(self.channel.peek("pid"))
        while not self._done.is_set():
            peek = self.channel.peek
            self.rows.append((time.time(), peek("saved", mine=True), peek("saved"), peek("buffers", mine=True),
                              peek("buffers"), rss_bytes(os.getpid()), rss_bytes(tock_pid)))
            self._done.wait(self.period_s)

    def stop(self) -> list:
        self._done.set()
        self.join()
        return self.rows


class Meter:
    """Counts what a Wavelet task holds; on the tick task, also samples its device's two tasks.

    Run the forwards under ``meter.hooks()``. ``start()`` and ``stop()`` bracket the sampling;
    ``stop()`` returns the rows (``FIELDS``) on the tick task and ``[]`` on the tock task.
    """

    def __init__(self, engine, period_s: float = 0.001):
        channel = engine.channel
        self.saved = SavedBytes(lambda n: channel.post("saved", n), exclude=engine.module.parameters())
        self._sampler = (lambda: PairSampler(channel, period_s)) if engine.layout.wave == TICK else None
        self._running = None

    def hooks(self):
        return self.saved.hooks()

    def start(self) -> None:
        if self._sampler is not None:
            self._running = self._sampler()
            self._running.start()

    def stop(self) -> list:
        running, self._running = self._running, None
        return running.stop() if running is not None else []


def pair_peaks(rows: list, base_rss: tuple = (0, 0)) -> dict:
    """Peaks (bytes) over one device's rows: each task's and the sum's, counted and RSS above ``base_rss``."""
    def peak(values):
        return max(values, default=0.0)
    saved = [(r[1], r[2]) for r in rows]
    rss = [tuple(max(0, (v or 0) - b) for v, b in zip(r[5:7], base_rss)) for r in rows]
    held = [(r[1] + r[3], r[2] + r[4]) for r in rows]
    return {"saved_tick": peak(s[0] for s in saved), "saved_tock": peak(s[1] for s in saved),
            "saved_sum": peak(sum(s) for s in saved), "held_sum": peak(sum(h) for h in held),
            "buffers": peak(max(r[3], r[4]) for r in rows),
            "rss_tick": peak(r[0] for r in rss), "rss_tock": peak(r[1] for r in rss),
            "rss_sum": peak(sum(r) for r in rss)}
