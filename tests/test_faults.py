"""The fault monitor's jobs: after a caught failure a new engine starts a new job, an engine of the failed
job never runs again, and a new job is refused (saying why) where it cannot work. One process, a store
in a dict; tests/test_chaos.py runs the same on 4 ranks."""
import atexit
import json
import sys

import pytest

from ds_chimera.runtime import faults


class DictStore:
    """The store calls the monitor makes, on a dict (torch's semantics: add returns the new value,
    compare_set the value that stands)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self.data[key]

    def add(self, key, amount):
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])

    def check(self, keys):
        return all(key in self.data for key in keys)

    def compare_set(self, key, expected, desired):
        if key not in self.data and expected == "":
            self.set(key, desired)
        return self.data[key]

    def multi_get(self, keys):
        return [self.data[key] for key in keys]


@pytest.fixture
def monitor(monkeypatch):
    monkeypatch.setattr(faults, "dist_backend", lambda: "gloo")
    found = faults.FaultMonitor(DictStore(), rank=0, world=1, timeout_s=30.0)
    yield found
    found._stop.set()
    sys.excepthook = found._previous_hook
    atexit.unregister(found.close)


def fail_in_guard(monitor, epoch):
    with pytest.raises(RuntimeError, match="boom"):
        with monitor.guard("train_batch", epoch):
            raise RuntimeError("boom")


def test_without_a_failure_a_new_engine_stays_in_the_same_job(monitor):
    assert monitor.start_new_job() == 0 and monitor.start_new_job() == 0


def test_a_new_engine_after_a_caught_failure_starts_a_new_job_and_the_old_engine_never_runs(monitor):
    fail_in_guard(monitor, 0)
    with pytest.raises(faults.JobFailed, match="not started; the job failed"):
        with monitor.guard("train_batch", 0):
            pass
    assert monitor.start_new_job() == 1
    with monitor.guard("train_batch", 1):          # the new engine's work runs
        pass
    with pytest.raises(faults.JobFailed, match="rank 0 failed: RuntimeError: boom.*build a new engine"):
        with monitor.guard("train_batch", 0):
            pass
    assert monitor.failure() is None and monitor.failure(0)["message"].startswith("RuntimeError: boom")
    fail_in_guard(monitor, 1)                      # the new job can fail too, and is recorded apart
    assert monitor.failure(1) is not None and monitor.start_new_job() == 2


def test_an_error_every_rank_raises_together_is_not_published(monitor):
    """Rank 0's profiling failure, broadcast and raised by every rank: the first rank to report it would
    otherwise be named as its origin, and the job marked failed for an error each script may catch."""
    from ds_chimera.agreed import on_every_rank
    with pytest.raises(ValueError, match="failed on rank 0"):
        with monitor.guard("profiling"):
            raise on_every_rank(ValueError('"schedule": "auto" failed on rank 0 while profiling the layers'))
    assert monitor.failed is None and monitor.failure() is None
    with monitor.guard("train_batch", 0):          # the job goes on
        pass
    fail_in_guard(monitor, 0)                      # an unmarked error is still published
    assert monitor.failure()["message"].startswith("RuntimeError: boom")


def test_a_failure_read_from_the_store_is_recovered_from_too(monitor):
    """A rank that had not yet heard of the failure when its script built the new engine."""
    monitor.store.set("failed/0", json.dumps({"origin": 3, "message": "X", "reporter": 3, "kind": "raised"}))
    assert monitor.failed is None or monitor.failed["origin"] == 3
    assert monitor.start_new_job() == 1 and monitor.history[0]["origin"] == 3


@pytest.mark.parametrize("how", ["died", "exited", "nccl", "broke the default group"])
def test_a_new_job_is_refused_where_it_cannot_work(monitor, monkeypatch, how):
    record = {"origin": 2, "message": "its process died", "reporter": 0, "kind": "died" if how == "died" else "raised"}
    monitor.store.set("failed/0", json.dumps(record))
    if how == "exited":
        monitor.store.add("exited", 1)
    if how == "nccl":
        monkeypatch.setattr(faults, "dist_backend", lambda: "nccl")
    if how == "broke the default group":
        monitor.unrecoverable = "this rank was waiting in a process group that is not the failed engine's own"
    reason = {"died": "a rank has ended since", "exited": "a rank has ended since", "nccl": "needs gloo",
              "broke the default group": "not the failed engine's own"}[how]
    with pytest.raises(faults.JobFailed, match=f"rank 2 failed: its process died.*no new engine: .*{reason}.*restart"):
        monitor.start_new_job()
