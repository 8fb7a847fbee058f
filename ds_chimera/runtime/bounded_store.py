"""A rendezvous-store client whose every call ends within a deadline.

torch's TCPStore client waits for the server's reply without a limit: its timeout bounds
waiting for a key, not a request the server never answers. Under ``env://`` the server is a
thread of rank 0's process, so a stopped (SIGSTOP) or frozen rank 0 leaves every other rank
blocked in its next store call, the fault monitor's heartbeat included, and the store is the
channel that should carry the news. Here each call runs on one helper thread and the caller
waits at most ``deadline_s``: past it, :class:`StoreUnresponsive` names how long the store has
been silent. The helper stays blocked in the unanswered call, so later calls fail at once
instead of queueing behind it; if the reply does come (the host resumed), calls work again.
"""
from __future__ import annotations

import queue
import threading
import time

DEADLINE_S = 5.0          # a live store answers in milliseconds, even on a loaded host


class StoreUnresponsive(RuntimeError):
    """The rendezvous store did not answer within the deadline: its host is stopped or frozen."""


class _Call:
    """One request to the helper thread, and its outcome."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.finished = threading.Event()
        self.value = self.error = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:        # handed to the caller, whatever it was
            self.error = exc
        self.finished.set()


class BoundedStore:
    """Wraps a ``torch.distributed.Store``; the methods used here, each bounded by ``deadline_s``."""

    def __init__(self, store, deadline_s: float = DEADLINE_S, name: str = "store"):
        self._store, self.deadline_s = store, deadline_s
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: _Call | None = None  # the last call handed to the helper, and when
        self._pending_since = 0.0
        # a daemon: a call the store never answers must not hold the interpreter's exit
        self._helper = threading.Thread(target=self._serve, name=f"ds_chimera-{name}", daemon=True)
        self._helper.start()

    def _serve(self) -> None:
        while True:
            call = self._requests.get()
            if call is None:
                return
            call.run()

    def close(self) -> None:
        """End the helper thread, waiting for a call under way at most what is left of its deadline.

        At a normal exit this must happen before the interpreter finalizes: a daemon thread
        that comes back from a store call then is ended by Python inside torch's C++ frames,
        which aborts the process ("terminate called without an active exception"). A call
        already past its deadline is not waited for: its host stopped, it may never return."""
        self._requests.put(None)
        pending = self._pending
        if pending is not None:
            left = self._pending_since + self.deadline_s - time.monotonic()
            if not pending.finished.wait(max(0.0, left)):
                return
        if self._helper is not threading.current_thread():
            self._helper.join(self.deadline_s)

    def _call(self, method: str, *args):
        # one call at a time (the monitor's thread and the guarded work share a client); a
        # caller waits for the one before it at most the deadline too
        if not self._lock.acquire(timeout=self.deadline_s):
            raise StoreUnresponsive(f"the rendezvous store did not answer within {self.deadline_s:g}s")
        try:
            pending = self._pending
            if pending is not None and not pending.finished.is_set():
                silent = time.monotonic() - self._pending_since
                raise StoreUnresponsive(f"the rendezvous store has not answered for {silent:.1f}s")
            call = _Call(getattr(self._store, method), args)
            self._pending, self._pending_since = call, time.monotonic()
            self._requests.put(call)
            if not call.finished.wait(self.deadline_s):
                raise StoreUnresponsive(f"the rendezvous store did not answer {method}() within "
                                        f"{self.deadline_s:g}s: its host (rank 0 under env://, else the "
                                        f"launcher) died or is stuck")
        finally:
            self._lock.release()
        if call.error is not None:
            raise call.error
        return call.value

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        """The value of a key that exists (a missing key would wait in the server past any deadline)."""
        return self._call("get", key)

    def add(self, key, amount: int) -> int:
        return self._call("add", key, amount)

    def check(self, keys) -> bool:
        return self._call("check", keys)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)

    def multi_get(self, keys):
        return self._call("multi_get", keys)
