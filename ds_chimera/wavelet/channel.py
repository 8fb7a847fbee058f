"""The two tasks of one device talk through shared memory, not through a process group.

NCCL refuses two ranks of one communicator on one device, and Wavelet puts two tasks on
each device: so no process group may hold both. Each wave has its own group (one task per
device); the partner messages (a wave's averaged gradient, the tick's start signal) go
through this channel instead: one shared-memory buffer per direction, mapped by both
tasks, and two counters in the rendezvous store (messages written, messages read) that
order the writes and the reads. One message is in flight per direction: a writer waits
until its previous message was read. Beside the messages, each task posts a few numbers on a
board of its own that the partner reads at any time, unordered (its latest step start, the bytes
it holds: see ``BOARD``). Bounded waits: a partner that stops is a clear error (a wait on the
board reads only shared memory, so its bound is the timeout); a store that stops answering is the
fault monitor's to catch, or, with the monitor off, the bounded store's the engine then gives the
channel (runtime/bounded_store.py).

Tensors on an accelerator are staged through host memory. (CUDA IPC between the two
processes would avoid that copy; it needs a GPU to build and verify, and is not done.)
"""
from __future__ import annotations

import os
import tempfile
import time
import uuid

import torch

from ..runtime import faults
from ..runtime.faults import PeerTimeout

POLL_S = 0.0005
# a task's board: its pid, the count of steps it opened, the latest one's start (seconds since the
# epoch), its cycle (seconds), and the bytes it holds for the backward and in Wavelet's own buffers
# (see .meter)
BOARD = ("pid", "opened", "start", "cycle", "saved", "buffers")


def poll_until(ready, timeout_s: float, timeout_message: str, poll_s: float = POLL_S) -> None:
    """Poll ``ready()`` until it holds. Another rank's failure ends the wait (JobFailed, from the fault
    monitor) at once; after ``timeout_s`` it is a PeerTimeout with ``timeout_message``."""
    start = time.monotonic()
    monitor = faults.current()
    while not ready():
        if monitor is not None:
            monitor.check()
        if time.monotonic() - start > timeout_s:
            raise PeerTimeout(timeout_message)
        time.sleep(poll_s)


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PairChannel:
    """Messages of up to ``capacity`` floats between this task and its ``partner`` (same device)."""

    def __init__(self, store, rank: int, partner: int, capacity: int, timeout_s: float):
        self.store, self.rank, self.partner = store, rank, partner
        self.capacity, self.timeout_s = capacity, timeout_s
        self.waited = 0.0                  # seconds spent waiting for the partner (or the store), in total
        if rank == 0:
            store.set("wavelet/job", uuid.uuid4().hex)
        self._wait_for(lambda: store.check(["wavelet/job"]), "task 0's channel id")   # a bounded get needs it set
        job = store.get("wavelet/job").decode()
        self.out_path = os.path.join(_folder(), f"ds_chimera_wavelet_{job}_{rank}_to_{partner}")
        in_path = os.path.join(_folder(), f"ds_chimera_wavelet_{job}_{partner}_to_{rank}")
        self.board_path = self.out_path + "_board"
        self.outbox = torch.from_file(self.out_path, shared=True, size=capacity + 1, dtype=torch.float32)
        self.board = torch.from_file(self.board_path, shared=True, size=len(BOARD), dtype=torch.float64)
        self._mine = self.board.numpy()     # numpy views: a post is a plain store, cheap enough per saved tensor
        self._mine[BOARD.index("pid")] = os.getpid()
        store.set(f"wavelet/ready/{rank}", "1")
        self._wait_for(lambda: store.check([f"wavelet/ready/{partner}"]), f"task {partner}'s channel")
        self.inbox = torch.from_file(in_path, shared=True, size=capacity + 1, dtype=torch.float32)
        self.partner_board = torch.from_file(in_path + "_board", shared=True, size=len(BOARD), dtype=torch.float64)
        self._theirs = self.partner_board.numpy()
        self.nbytes = 2 * (capacity + 1) * 4   # the two mapped message buffers
        for path in (in_path, in_path + "_board"):
            os.unlink(path)                # both mapped: the name is no longer needed (the partner unlinks ours)
        self.sent = self.received = 0

    def _key(self, kind: str, src: int, dst: int) -> str:
        return f"wavelet/{kind}/{src}-{dst}"

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def _wait_for(self, ready, what: str) -> None:
        """Poll ``ready()`` until it holds; a PeerTimeout naming ``what`` after the channel's timeout."""
        start = time.monotonic()
        try:
            poll_until(ready, self.timeout_s, f"ds_chimera wavelet: {what} did not arrive after {self.timeout_s:g}s: "
                                              f"a task died or is stuck")
        finally:
            self.waited += time.monotonic() - start

    def post(self, slot: str, value: float) -> None:
        """Set one of this task's board numbers (``BOARD``) for the partner to read."""
        self._mine[BOARD.index(slot)] = value

    def peek(self, slot: str, mine: bool = False) -> float:
        """The partner's latest board number ``slot`` (or this task's own, ``mine``)."""
        return float((self._mine if mine else self._theirs)[BOARD.index(slot)])

    def wait_post(self, slot: str, value: float, what: str) -> None:
        """Wait until the partner has posted ``value`` in ``slot``."""
        self._wait_for(lambda: self.peek(slot) == value, what)

    def send(self, payload: torch.Tensor, what: str) -> None:
        """Write ``payload`` for the partner once it has read the previous message."""
        if payload.numel() > self.capacity:
            raise ValueError(f"wavelet channel: a message of {payload.numel()} floats, capacity {self.capacity}")
        read_key = self._key("read", self.rank, self.partner)
        self._wait_for(lambda: self._count(read_key) >= self.sent, f"task {self.partner}'s read of {what}")
        self.outbox[0] = payload.numel()
        self.outbox[1:1 + payload.numel()].copy_(payload.detach().reshape(-1).to("cpu", torch.float32))
        self.sent += 1
        self.store.add(self._key("sent", self.rank, self.partner), 1)

    def recv(self, numel: int, device, what: str) -> torch.Tensor:
        """The partner's next message (``numel`` floats) on ``device``."""
        sent_key = self._key("sent", self.partner, self.rank)
        self._wait_for(lambda: self._count(sent_key) > self.received, what)
        if int(self.inbox[0]) != numel:
            raise RuntimeError(f"wavelet channel: expected {numel} floats from task {self.partner}, got "
                               f"{int(self.inbox[0])}")
        out = self.inbox[1:1 + numel].clone().to(device)
        self.received += 1
        self.store.add(self._key("read", self.partner, self.rank), 1)
        return out

    def flush(self, what: str) -> None:
        """Wait until the partner has read every message sent so far."""
        read_key = self._key("read", self.rank, self.partner)
        self._wait_for(lambda: self._count(read_key) >= self.sent, what)

    def close(self) -> None:
        for path in (self.out_path, self.board_path):
            if os.path.exists(path):
                os.unlink(path)
