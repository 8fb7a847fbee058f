"""Fault containment: one rank's failure ends every rank within seconds, naming the origin.

Collectives cannot carry the news of a failure: the process groups are exactly what is
stuck. The rendezvous store can, since every rank holds a connection to it. Each process
runs one :class:`FaultMonitor` (a daemon thread on a clone of the default store) that

- publishes a heartbeat (a counter, so clocks never need to agree) every ``BEAT_S``;
- watches one key, ``failed``: the first failure, written once (compare-and-set) with the
  origin rank and its exception. A rank that sees it raises :class:`JobFailed`
  (``ds_chimera: rank R failed: <exception>``) in its ds_chimera call: a wait for a message
  that is under way then ends within ``BEAT_S`` (:meth:`FaultMonitor.wait_interruptibly`: the
  watch thread closes the process groups' connections); a call that starts later raises at once. The exception is the
  caller's to catch (to save, report, clean up); uncaught, it ends the process with that one
  line. A rank that cannot be reached that way (stuck in a blocking collective outside
  ds_chimera's waits, or in user code that never calls in again) exits within
  ``DELIVER_S`` (``os._exit``), as it would have to anyway;
- watches the others' heartbeats: a rank on this host whose process is gone is reported
  dead within seconds; any rank silent for longer than the pipeline timeout is reported
  hung (stopped, or stuck where nothing else would notice).

Work on every engine (``train_batch``, ``eval_batch``, checkpoints, ``drain``, Wavelet's
steps, Megatron's forward-backward call) runs under :meth:`FaultMonitor.guard`: an
exception publishes the failure before it propagates to the caller, who may catch it as
with the stock engine. The job is failed from then on: its process groups may hold
half-posted messages, so every later guarded call on every rank raises :class:`JobFailed`
instead of running into them. A communication error
(a peer's connection closed, a bounded wait expired) is not the rank's own fault: the
guard first looks for the real origin (a published failure, a dead process, a silent
heartbeat), so the neighbour whose message did not come is not blamed.

The store itself can fail: under ``env://`` it is a thread of rank 0's process. Every call of
the monitor's is bounded (:class:`BoundedStore`); a store that stops answering means its host
is stopped or frozen, and every other rank ends naming it, whatever its own threads wait on.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from ..logs import get_logger
from .bounded_store import BoundedStore, StoreUnresponsive
from .teardown import destroy_groups_at_exit

log = get_logger()
BEAT_S = 0.25             # heartbeat and polling period
DEAD_AFTER_S = 1.5        # silence after which a rank whose local process is gone is declared dead
BLAME_WAIT_S = 4.0        # how long a communication error looks for its real origin
DELIVER_S = 3.0           # a rank whose call cannot be made to raise the failure exits after this long
HOST_GRACE_S = 3.0        # the store's host waits this long, at most, for the others to read a failure
EXIT_CODE = 1
ENV_DISABLE = "DS_CHIMERA_FAULT_MONITOR"      # "0": no monitor (every wait is still bounded)
PREFIX = "ds_chimera/faults/"
BREAK_TAG = (1 << 30) + 1  # the receive no one sends, whose timed-out wait closes a group's connections
IDLE = "user code between ds_chimera calls"
STORE_GONE = ("the rendezvous store is unreachable: the process hosting it (rank 0 under env://, or the "
              "launcher) is gone")


class JobFailed(RuntimeError):
    """Another rank failed (or this job already did): this rank's call stops too. Catchable."""


def _process_state(pid: int) -> str | None:
    """'gone', 'stopped', 'zombie' or 'running' for a pid on this host (None where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(state, "running")


class FaultMonitor:
    """The per-process monitor (see the module docstring). :func:`monitor` returns the one instance."""

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s = timeout_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.activity = IDLE                # what this rank is doing, for the others' messages
        # torch's env:// rendezvous makes rank 0 host the store; torchrun's agent hosts it instead
        self.hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
        self.failed_here = False
        self.failed = None                  # the job's failure record, once this rank knows it
        self.delivered = False              # a guarded call raised it (or the origin's own error) to its caller
        self._failed_at = None              # monotonic time this rank learned of the failure
        self._waiting = False               # the call's thread is in a wait the failure must end
        self._groups_broken = False
        self._stop = threading.Event()
        self._beat_keys = [f"beat/{r}" for r in range(world)]
        self._seen: dict = {}               # rank -> (last counter, local time it changed)
        self._done: set = set()
        self._peers: dict = {}              # rank -> (host, pid)
        # checking every heartbeat costs the store world^2 reads per period: slow down on large jobs
        self._check_every = max(1, world // 64)
        store.set(f"peer/{rank}", json.dumps([self.host, self.pid]))
        for key in self._beat_keys:         # every counter exists, so reading them never blocks
            store.add(key, 0)
        self._peer(0)                       # rank 0's process, examined if the store it hosts freezes
        atexit.register(self.close)
        self._previous_hook = sys.excepthook
        sys.excepthook = self._uncaught
        self._thread = threading.Thread(target=self._watch, name="ds_chimera-fault-monitor", daemon=True)
        self._thread.start()

    # ---- the failure record -------------------------------------------------------------------
    def failure(self) -> dict | None:
        """The published failure, or None. Raises if the store is unreachable."""
        if self.store.check(["failed"]):
            return json.loads(self.store.get("failed"))
        return None

    def publish(self, origin: int, message: str) -> dict:
        """Record a failure unless one is already recorded; returns the record that stands."""
        record = json.dumps({"origin": origin, "message": message, "reporter": self.rank})
        try:
            return json.loads(self.store.compare_set("failed", "", record))
        except Exception as exc:            # no store: this rank can only speak for itself
            log.error("ds_chimera: could not publish the failure to the rendezvous store (%s)", exc)
            return json.loads(record)

    @staticmethod
    def line(record: dict) -> str:
        if record["origin"] is None:        # the launcher's store, no rank
            return f"ds_chimera: the launcher failed: {record['message']}"
        return f"ds_chimera: rank {record['origin']} failed: {record['message']}"

    def store_silent(self, exc: StoreUnresponsive) -> dict:
        """The record for a store that stopped answering: its host is the failure."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return {"origin": None, "reporter": self.rank,
                    "message": f"its rendezvous store stopped answering ({exc}): the launcher is stopped or frozen"}
        host, pid = self._peers.get(0, (None, None))
        state = _process_state(pid) if host == self.host and pid else None
        how = "is stopped (SIGSTOP)" if state == "stopped" else "stopped responding"
        return {"origin": 0, "reporter": self.rank,
                "message": f"it {how}: the rendezvous store it hosts (env://) stopped answering ({exc})"}

    # ---- guarding a rank's work ---------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str):
        """Run a unit of work; an exception is published (with its real origin) before it propagates.
        Once the job has failed, the work does not start: :class:`JobFailed` names the origin."""
        if self.failed is not None:
            self.delivered = True
            raise JobFailed(self.line(self.failed) + f" [rank {self.rank}: {what} not started; the job failed]")
        previous, self.activity = self.activity, what
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            if isinstance(exc, JobFailed):
                self.delivered = True
                raise
            record = self._report(exc, what)
            self.failed_here = True
            self._learn(record)
            self.delivered = True
            if record["origin"] != self.rank:
                raise JobFailed(self.line(record)) from exc
            raise
        finally:
            self.activity = previous

    def _learn(self, record: dict) -> None:
        if self.failed is None:
            self._failed_at = time.monotonic()
            self.failed = record
            _record_exit_codes()

    def check(self) -> None:
        """Raise :class:`JobFailed` if the job has failed (a waiting call's poll)."""
        if self.failed is not None:
            raise self._stop_error()

    def _stop_error(self) -> JobFailed:
        """The JobFailed this rank's call raises once the job has failed (it reaches the caller)."""
        self.delivered = True
        return JobFailed(self.line(self.failed) + self._stops_too())

    def _stops_too(self) -> str:
        return f" [rank {self.rank} stops too: it was in {self.activity}]"

    def wait_interruptibly(self, work, timeout_s: float) -> None:
        """``work.wait(timeout)`` on this thread, ended by the job's failure with :class:`JobFailed`.

        gloo cannot cancel a wait (aborting the group does not wake it), but a receive whose wait
        times out closes every connection of its group, which ends every wait on them with an error.
        So the watch thread, learning of a failure while this thread waits, times out a receive
        on each of the process's gloo groups (:meth:`_break_groups`). The wait itself costs nothing
        extra; waiting on a helper thread instead cost two thread hand-overs per message
        (docs/investigations/cpu-step-time.md)."""
        self._waiting = True
        try:
            self.check()
            work.wait(timedelta(seconds=timeout_s))
        except JobFailed:
            raise
        except Exception as exc:
            if self.failed is not None:
                raise self._stop_error() from exc
            raise
        finally:
            self._waiting = False

    def _break_groups(self) -> None:
        """Close the connections of every gloo process group of this process, which ends the call's
        thread's wait (see :meth:`wait_interruptibly`): each gets a receive no one sends, waited on
        for a millisecond. The job has failed, so nothing is lost; the peers' waits on these
        connections end too, and they find the published failure."""
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        me = dist.get_rank() if dist.is_initialized() else self.rank
        for group in list(c10d._world.pg_map):
            with contextlib.suppress(Exception):
                if "gloo" not in str(dist.get_backend(group)):
                    continue
                peer = next((r for r in dist.get_process_group_ranks(group) if r != me), None)
                if peer is None:
                    continue
                work = dist.irecv(torch.empty(1), src=peer, group=group, tag=BREAK_TAG)
                work.wait(timedelta(milliseconds=1))
        log.debug("ds_chimera: rank %d closed its process groups' connections to end a wait", self.rank)

    def _report(self, exc: BaseException, what: str) -> dict:
        from .p2p import PeerTimeout
        # the failure this rank already learned first: the store's host may have ended since, having published it
        known = self.failed if self.failed is not None else self._safe_failure()
        if known is not None:
            return known
        text = f"{type(exc).__name__}: {exc} (in {what})"
        if isinstance(exc, (PeerTimeout, StoreUnresponsive)) or _is_comm_error(exc):
            culprit = self.find_culprit(BLAME_WAIT_S)
            if culprit is not None:
                return culprit
        return self.publish(self.rank, text)

    def find_culprit(self, wait_s: float) -> dict | None:
        """The real origin of a communication error: a published failure, a dead or silent rank."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                record = self.failure()
                suspect = None if record is not None else \
                    self._suspect(dead_after=DEAD_AFTER_S, silent_after=min(self.timeout_s, wait_s))
            except StoreUnresponsive as exc:
                return self.failed or self.store_silent(exc)
            except Exception:
                return self.failed or {"origin": 0, "reporter": self.rank, "message": STORE_GONE}
            if record is not None:
                return record
            if suspect is not None:
                return self.publish(*suspect)
            if time.monotonic() >= deadline:
                return None
            time.sleep(BEAT_S)

    def _uncaught(self, kind, value, traceback) -> None:
        """An exception no one caught, in or out of ds_chimera's calls: publish it, then end at once
        (the interpreter's own shutdown could wait on a stuck process group). Another rank's
        failure is one line, not a traceback of the connection it broke."""
        if issubclass(kind, JobFailed):
            self.exit(str(value))
        if not issubclass(kind, (KeyboardInterrupt, SystemExit)) and not self.failed_here:
            self.failed_here = True
            with contextlib.suppress(Exception):
                self.publish(self.rank, f"{kind.__name__}: {value}")
        self._previous_hook(kind, value, traceback)
        self.exit("")

    def exit(self, message: str, code: int = EXIT_CODE) -> None:
        """End this process now (``os._exit``: its threads may be blocked in a process group).

        The rank that hosts the rendezvous store (rank 0 under env://) first waits, briefly,
        for the others to have read the failure: with it gone they could not.
        """
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"exiting/{self.rank}", "1")
        if self.hosts_store:
            deadline = time.monotonic() + HOST_GRACE_S
            others = [r for r in range(self.world) if r != self.rank]
            while others and time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    others = [r for r in others if not self.store.check([f"exiting/{r}"])
                              and not self.store.check([f"done/{r}"]) and self._alive(r)]
                time.sleep(0.05)
        _flush_and_exit(message, code)

    def _alive(self, r: int) -> bool:
        host, pid = self._peer(r)
        return not (host == self.host and pid and _process_state(pid) in ("gone", "zombie", "stopped"))

    # ---- watching the others ------------------------------------------------------------------
    def _safe_failure(self):
        try:
            return self.failure()
        except Exception:
            return None

    def _suspect(self, dead_after: float, silent_after: float):
        """(origin, message) of a rank that died or went silent, or None. Raises if the store is gone."""
        now = time.monotonic()
        for r, beat in enumerate(self.store.multi_get(self._beat_keys)):
            last = self._seen.get(r)
            if last is None or last[0] != beat:
                self._seen[r] = (beat, now)
        for r in range(self.world):
            silent = now - self._seen[r][1]
            if r == self.rank or r in self._done or silent < min(dead_after, silent_after):
                continue
            if self.store.check([f"done/{r}"]):
                self._done.add(r)
                continue
            host, pid = self._peer(r)
            state = _process_state(pid) if host == self.host and pid else None
            if silent >= dead_after and state in ("gone", "zombie"):
                return r, f"its process (pid {pid} on {host}) died: no exception, no exit message"
            if silent >= silent_after:
                if host is None:
                    return r, (f"it never reached ds_chimera's work: no heartbeat in {silent:.1f}s (timeout "
                               f"{self.timeout_s:g}s); it died or is stuck before its first call")
                how = "is stopped (SIGSTOP)" if state == "stopped" else "stopped responding"
                return r, f"it {how}: no heartbeat for {silent:.1f}s (timeout {self.timeout_s:g}s)"
        return None

    def _peer(self, r: int):
        if r not in self._peers:
            if not self.store.check([f"peer/{r}"]):
                return None, None
            self._peers[r] = tuple(json.loads(self.store.get(f"peer/{r}")))
        return self._peers[r]

    def _watch(self) -> None:
        polls = 0
        while not self._stop.wait(BEAT_S):
            polls += 1
            try:
                self.store.add(f"beat/{self.rank}", 1)
                record = self.failure()
                suspect = None
                if 0 not in self._peers:    # rank 0's process, examined if the store it hosts freezes
                    self._peer(0)
                if record is None and polls % self._check_every == 0:
                    suspect = self._suspect(dead_after=DEAD_AFTER_S, silent_after=self.timeout_s)
            except StoreUnresponsive as exc:
                if self.hosts_store:        # its own server thread: this process is alive, keep watching
                    continue
                if self.failed is None:
                    self.exit(self.line(self.store_silent(exc)) + self._stops_too())
                    return
                if self.delivered:
                    return
                record, suspect = self.failed, None     # known before the store went: delivered as below
            except Exception:
                # the store's host ended (rank 0 under env://, or the launcher). If it failed, the
                # process groups fail too, and the guarded work reports it; stop watching, unless the
                # failure is known already (its host published it, then ended): delivered as below
                if self.failed is None or self.delivered:
                    return
                record, suspect = self.failed, None
            if record is None and suspect is not None:
                record = self.publish(*suspect)
            if record is not None:
                self._learn(record)
                if self._waiting and not self._groups_broken:
                    # on its own thread: a group whose peer died may block its receive, not this watch
                    self._groups_broken = True
                    threading.Thread(target=self._break_groups, name="ds_chimera-break-groups", daemon=True).start()
                if not self.delivered and time.monotonic() - self._failed_at > DELIVER_S:
                    where = "" if record["origin"] == self.rank else self._stops_too()
                    self.exit(self.line(record) + where)

    def close(self) -> None:
        """A normal end: the others must not mistake this rank's silence for a death. The watch
        thread and the store's helper end here, before the interpreter finalizes (a daemon
        thread still in a store call then would abort the process; see BoundedStore.close).

        After a failure the caller caught, the process groups hold messages that will never be
        matched, and destroying them aborts in C++ ("terminate called without an active
        exception"): the process ends here instead, with the code ``sys.exit`` was given."""
        if self._stop.is_set():
            return
        if self.failed is not None:
            self.exit("", _requested_exit_code())
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(BEAT_S + getattr(self.store, "deadline_s", 0.0))
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")
        closer = getattr(self.store, "close", None)
        if closer is not None:
            closer()


_EXIT_CODE = {"code": 0}


def _record_exit_codes() -> None:
    """Remember the code a later ``sys.exit(code)`` asks for: :meth:`FaultMonitor.close` must end a
    failed job's process itself (see there) and should end it with the script's own code."""
    if getattr(sys.exit, "_ds_chimera", False):
        return
    original = sys.exit

    def exit_recording(code=None):
        _EXIT_CODE["code"] = code
        original(code)
    exit_recording._ds_chimera = True
    sys.exit = exit_recording


def _requested_exit_code() -> int:
    code = _EXIT_CODE["code"]
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")          # sys.exit("message"): printed, status 1, as Python does
    return 1


def _is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    return any(marker in text for marker in ("Connection closed", "Connection reset", "Broken pipe",
                                             "Timed out waiting", "gloo"))


def _flush_and_exit(message: str, code: int = EXIT_CODE) -> None:
    try:
        sys.stdout.flush()
        if message:
            sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


_MONITOR: FaultMonitor | None = None
_MONITOR_LOCK = threading.Lock()


def monitor(timeout_s: float | None = None) -> FaultMonitor | None:
    """The process's monitor, started on first use once torch.distributed is up (None otherwise).

    ``timeout_s``: the longest a rank may stay silent before it is declared hung (the
    pipeline's timeout); the largest one registered wins.
    """
    global _MONITOR
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    # registered before the monitor's own close, so it runs after it (atexit runs last-in first)
    destroy_groups_at_exit()
    if os.environ.get(ENV_DISABLE) == "0":
        return None
    with _MONITOR_LOCK:
        if _MONITOR is None:
            try:
                store = dist.distributed_c10d._get_default_store().clone()
            except Exception as exc:       # a private torch API: without it, bounded waits remain
                log.warning("no fault monitor (the default store cannot be cloned: %s)", exc)
                return None
            store.set_timeout(timedelta(seconds=30))
            _MONITOR = FaultMonitor(BoundedStore(dist.PrefixStore(PREFIX, store), name="fault-store"),
                                    dist.get_rank(), dist.get_world_size(), timeout_s or 300.0)
        elif timeout_s is not None:
            _MONITOR.timeout_s = max(_MONITOR.timeout_s, timeout_s)
    return _MONITOR


def current() -> FaultMonitor | None:
    """The process's monitor if one is running (never starts one)."""
    return _MONITOR


def guard(what: str, timeout_s: float | None = None):
    """:meth:`FaultMonitor.guard` of the process's monitor (a no-op context without one)."""
    found = monitor(timeout_s)
    return found.guard(what) if found is not None else contextlib.nullcontext()
