"""Fault containment: one rank's failure ends every rank within seconds, naming the origin.

Collectives cannot carry the news of a failure: the process groups are exactly what is
stuck. The rendezvous store can, since every rank holds a connection to it. Each process
runs one :class:`FaultMonitor` (a daemon thread on a clone of the default store) that

- publishes a heartbeat (a counter, so clocks never need to agree) every ``BEAT_S``;
- watches one key, ``failed/E``: the first failure of job E, written once (compare-and-set)
  with the origin rank and its exception. A rank that sees it raises :class:`JobFailed`
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
with the stock engine. The engines built before it are dead from then on: their process
groups may hold half-posted messages, so every later guarded call on them raises
:class:`JobFailed` instead of running into them. A new engine starts a new job
(:meth:`FaultMonitor.start_new_job`) on fresh process groups, when every rank is still there
and the failure broke only the failed engines' groups (``register``). A communication error
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
import weakref
from datetime import timedelta

from ..agreed import raised_on_every_rank
from ..logs import get_logger
from .bounded_store import BoundedStore, StoreUnresponsive
from .exit_codes import flush_and_exit, record_exit_codes, requested_exit_code
from .groups import close_gloo_connections
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
IDLE = "user code between ds_chimera calls"
BREAK_FALLBACK_S = 1.0    # a wait the failed engines' groups did not end: every gloo group is broken after this
RESTART = "restart the processes (the latest complete checkpoint resumes exactly)"
REBUILD_ENGINE = "build a new engine to go on"
STORE_GONE = ("the rendezvous store is unreachable: the process hosting it (rank 0 under env://, or the "
              "launcher) is gone")


class JobFailed(RuntimeError):
    """Another rank failed (or this job already did): this rank's call stops too. Catchable."""


class PeerTimeout(RuntimeError):
    """A peer did not deliver within the configured time: it died or is stuck (a bounded wait expired)."""


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
        self.epoch = 0                      # the job: a new engine after a caught failure starts the next one
        self.history: dict = {}             # epoch -> the failure that ended that job
        self.failed = None                  # this job's failure record, once this rank knows it
        self.delivered = False              # a guarded call raised it (or the origin's own error) to its caller
        self._failed_at = None              # monotonic time this rank learned of the failure
        self._waiting = False               # the call's thread is in a wait the failure must end
        self._groups_broken = False
        self._state_lock = threading.Lock()  # the watch thread learns a failure; start_new_job forgets it
        self.job_owners: list = []          # weak references to this job's engines: a failure breaks their groups
        self.unrecoverable = None           # why no new job can start in this process (groups it cannot rebuild)
        self.ever_failed = False            # some job failed: groups with unmatched messages may remain
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
    def failure(self, epoch: int | None = None) -> dict | None:
        """The failure published for job ``epoch`` (this one by default), or None. Raises if the store is unreachable."""
        key = f"failed/{self.epoch if epoch is None else epoch}"
        if self.store.check([key]):
            return json.loads(self.store.get(key))
        return None

    def publish(self, origin: int, message: str, kind: str = "raised") -> dict:
        """Record a failure unless one is already recorded; returns the record that stands.
        ``kind``: raised (caught by a guard), uncaught, died or silent (the last three end a process)."""
        record = json.dumps({"origin": origin, "message": message, "reporter": self.rank, "kind": kind})
        try:
            return json.loads(self.store.compare_set(f"failed/{self.epoch}", "", record))
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
    def guard(self, what: str, epoch: int | None = None, rebuild: str = REBUILD_ENGINE):
        """Run a unit of work; an exception is published (with its real origin) before it propagates,
        unless every rank raises it together (:func:`ds_chimera.agreed.on_every_rank`).
        Once the job has failed, the work does not start: :class:`JobFailed` names the origin.
        ``epoch``: the job of the engine doing the work; an engine of an earlier job never runs again
        (``rebuild``: how the caller gets a new one)."""
        if epoch is not None and epoch < self.epoch:
            self.delivered = True
            raise JobFailed(self.line(self.history[epoch]) + f" [rank {self.rank}: {what} not started: it was "
                            f"set up before that failure and its process groups are broken; {rebuild}]")
        if self.failed is not None:
            self.delivered = True
            raise JobFailed(self.line(self.failed) + f" [rank {self.rank}: {what} not started; the job failed: "
                            f"{rebuild}]")
        previous, self.activity = self.activity, what
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            if isinstance(exc, JobFailed):
                self.delivered = True
                raise
            if raised_on_every_rank(exc):    # every rank raises it already: nothing to spread, no origin to name
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

    def _learn(self, record: dict, epoch: int | None = None) -> None:
        """Take ``record`` as this job's failure (unless one is known, or it is an earlier job's)."""
        with self._state_lock:
            if self.failed is None and (epoch is None or epoch == self.epoch):
                self._failed_at = time.monotonic()
                self.failed = record
                self.ever_failed = True
                record_exit_codes()

    # ---- a new job after a caught failure -----------------------------------------------------
    def register(self, owner) -> None:
        """An engine of this job: a failure breaks the process groups its ``fault_groups()`` lists
        (and, as a last resort, every group: see :meth:`_break_groups`). Held weakly, and the
        groups are asked for only then: a reference here would keep a destroyed group's threads
        and sockets alive."""
        self.job_owners.append(weakref.ref(owner))

    def job_groups(self) -> list:
        """The live process groups of this job's live engines."""
        from torch.distributed import distributed_c10d as c10d
        live, seen = set(c10d._world.pg_map), set()
        out = []
        for ref in list(self.job_owners):
            owner = ref()
            for group in (owner.fault_groups() if owner is not None else ()):
                if group is not None and group in live and id(group) not in seen:
                    seen.add(id(group))
                    out.append(group)
        return out

    def start_new_job(self) -> int:
        """Called where an engine is built; returns the job (epoch) the engine belongs to.

        After a failure that every rank caught, the engine is the script's way of going on: it
        gets fresh process groups, so a new job starts with no failure. That is refused, with
        the reason, where it cannot work: a rank has ended since (a new engine needs every
        rank), or a wait had to break groups that ds_chimera does not rebuild."""
        record = self.failed if self.failed is not None else self.failure()
        if record is None:
            return self.epoch
        self._learn(record)
        record = self.failed
        if self.unrecoverable is None and dist_backend() != "gloo":
            self.unrecoverable = (f"going on after a failure needs gloo process groups, and these are "
                                  f"{dist_backend()} (its communicators cannot be told apart from the job's)")
        if self.unrecoverable is None and (self._ended() or record.get("kind") in ("uncaught", "died", "silent")):
            self.unrecoverable = "a rank has ended since, and a new engine needs every rank"
        if self.unrecoverable is not None:
            self.delivered = True
            raise JobFailed(self.line(record) + f" [rank {self.rank}: no new engine: {self.unrecoverable}; "
                            f"{RESTART}]")
        with self._state_lock:
            self.history[self.epoch] = record
            self.epoch += 1
            self.failed, self._failed_at, self.failed_here = None, None, False
            self.delivered, self._groups_broken = False, False
            self.job_owners = []
        log.warning("ds_chimera: rank %d builds a new engine after the failure (%s): job %d starts on new "
                    "process groups", self.rank, self.line(record), self.epoch)
        return self.epoch

    def _ended(self) -> bool:
        """Whether some rank's process has ended (or begun to) because of a failure."""
        try:
            return self.store.add("exited", 0) > 0
        except Exception:
            return True

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

    def _break_groups(self, groups: list, epoch: int) -> None:
        """Close the connections of this job's gloo process groups, which ends the call's thread's
        wait (see :meth:`wait_interruptibly`): each gets a receive no one sends, waited on for a
        millisecond. The job has failed, so nothing is lost; the peers' waits on these connections
        end too, and they find the published failure. A wait on another group (one the engines
        did not register, the default group among them) is still going after
        ``BREAK_FALLBACK_S``: then every gloo group is broken, and no new job can start here."""
        from torch.distributed import distributed_c10d as c10d
        log.debug("ds_chimera: rank %d breaks %d group(s) of the failed job", self.rank, len(groups))
        close_gloo_connections(groups)
        deadline = time.monotonic() + BREAK_FALLBACK_S
        while self._waiting and self.epoch == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._waiting and self.epoch == epoch:      # a wait of a new job is that job's
            log.debug("ds_chimera: rank %d still waits: it breaks every gloo group", self.rank)
            self.unrecoverable = ("this rank was waiting in a process group that is not the failed engine's "
                                  "own (the default group, or one DeepSpeed or Megatron keeps), which had to "
                                  "be broken to end the wait")
            close_gloo_connections(list(c10d._world.pg_map))
        log.debug("ds_chimera: rank %d closed its process groups' connections to end a wait", self.rank)

    def _report(self, exc: BaseException, what: str) -> dict:
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
                self.publish(self.rank, f"{kind.__name__}: {value}", kind="uncaught")
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
            self.store.add("exited", 1)
        if self.hosts_store:
            deadline = time.monotonic() + HOST_GRACE_S
            others = [r for r in range(self.world) if r != self.rank]
            while others and time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    others = [r for r in others if not self.store.check([f"exiting/{r}"])
                              and not self.store.check([f"done/{r}"]) and self._alive(r)]
                time.sleep(0.05)
        flush_and_exit(message, code)

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
        """(origin, message, kind) of a rank that died or went silent, or None. Raises if the store is gone."""
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
                return r, f"its process (pid {pid} on {host}) died: no exception, no exit message", "died"
            if silent >= silent_after:
                if host is None:
                    return r, (f"it never reached ds_chimera's work: no heartbeat in {silent:.1f}s (timeout "
                               f"{self.timeout_s:g}s); it died or is stuck before its first call"), "silent"
                how = "is stopped (SIGSTOP)" if state == "stopped" else "stopped responding"
                return r, f"it {how}: no heartbeat for {silent:.1f}s (timeout {self.timeout_s:g}s)", "silent"
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
                epoch = self.epoch
                record = self.failure(epoch)
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
                record, suspect, epoch = self.failed, None, self.epoch  # known before the store went: delivered below
            except Exception:
                # the store's host ended (rank 0 under env://, or the launcher). If it failed, the
                # process groups fail too, and the guarded work reports it; stop watching, unless the
                # failure is known already (its host published it, then ended): delivered as below
                if self.failed is None or self.delivered:
                    return
                record, suspect, epoch = self.failed, None, self.epoch
            if record is None and suspect is not None:
                record = self.publish(*suspect)
            if record is not None:
                self._learn(record, epoch)
                if self.failed is None:     # an earlier job's failure, read as a new job started
                    continue
                if self._waiting and not self._groups_broken:
                    # on its own thread: a group whose peer died may block its receive, not this watch
                    self._groups_broken = True
                    # the failed job's groups, named now: a thread that starts late must not reach a new job's
                    threading.Thread(target=self._break_groups, args=(self.job_groups(), self.epoch),
                                     name="ds_chimera-break-groups", daemon=True).start()
                if not self.delivered and time.monotonic() - self._failed_at > self._deliver_within(record):
                    where = "" if record["origin"] == self.rank else self._stops_too()
                    self.exit(self.line(self.failed) + where)
                if self.delivered and self._job_over(self.failed):
                    self.exit(self.line(self.failed) + f" [rank {self.rank} still runs {self.timeout_s:g}s after "
                              "it was told, and a rank has ended: nothing can go on (a new engine needs every "
                              "rank), so this process ends too]")

    def _job_over(self, record: dict) -> bool:
        """A told rank's script may catch and go on, but not once a rank has ended: then the script
        has the pipeline timeout to finish on its own (it may be blocked in a collective with the
        rank that ended, such as building a new PipelineModule's groups)."""
        if time.monotonic() - self._failed_at <= self.timeout_s + DELIVER_S:
            return False
        return record.get("kind") in ("uncaught", "died", "silent") or self._ended()

    def _deliver_within(self, record: dict) -> float:
        """How long a rank that has not been told of the failure may take to call in.

        A rank inside a ds_chimera call that did not end is blocked where no one can reach it:
        ``DELIVER_S``. A rank in its own code may yet call in, be told, catch it and go on (a new
        engine), as long as every rank lives: it has the pipeline timeout, and ``DELIVER_S`` once
        any rank has ended (the job cannot go on then)."""
        if self.activity != IDLE or record.get("kind") in ("uncaught", "died", "silent") or self._ended():
            return DELIVER_S
        return max(DELIVER_S, self.timeout_s)

    def close(self) -> None:
        """A normal end: the others must not mistake this rank's silence for a death. The watch
        thread and the store's helper end here, before the interpreter finalizes (a daemon
        thread still in a store call then would abort the process; see BoundedStore.close).

        After a failure the caller caught, the process groups hold messages that will never be
        matched, and destroying them aborts in C++ ("terminate called without an active
        exception"): the process ends here instead, with the code ``sys.exit`` was given."""
        if self._stop.is_set():
            return
        if self.ever_failed:
            self.exit("", requested_exit_code())
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(BEAT_S + getattr(self.store, "deadline_s", 0.0))
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")
        closer = getattr(self.store, "close", None)
        if closer is not None:
            closer()


def dist_backend() -> str:
    """The default group's backend ("gloo", "nccl", ...), or "none"."""
    import torch.distributed as dist
    try:
        return str(dist.get_backend())
    except Exception:
        return "none"


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist
    if isinstance(exc, getattr(dist, "DistError", ())):     # a store wait, a closed connection
        return True
    text = str(exc)
    return any(marker in text for marker in ("Connection closed", "Connection reset", "Broken pipe",
                                             "Timed out waiting", "gloo"))


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


def guard(what: str, timeout_s: float | None = None, epoch: int | None = None, rebuild: str = REBUILD_ENGINE):
    """:meth:`FaultMonitor.guard` of the process's monitor (a no-op context without one)."""
    found = monitor(timeout_s)
    return found.guard(what, epoch, rebuild) if found is not None else contextlib.nullcontext()


def start_new_job(timeout_s: float | None = None) -> int | None:
    """:meth:`FaultMonitor.start_new_job` of the process's monitor (None without one)."""
    found = monitor(timeout_s)
    return found.start_new_job() if found is not None else None


def register(owner) -> None:
    """:meth:`FaultMonitor.register` of the process's monitor, if one runs."""
    if _MONITOR is not None:
        _MONITOR.register(owner)
