"""A frozen rendezvous store (its host process stopped) answers nothing; every call must still end.

torch's TCPStore client waits for a reply without a limit, which left a stopped rank 0 (the
store's host under env://) freezing its partners. The host here is a child process, stopped
and resumed with signals.
"""
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from netutil import free_port
from ds_chimera.runtime.bounded_store import BoundedStore, StoreUnresponsive

HOST = ("import sys, time, datetime, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), 2, True, datetime.timedelta(seconds=60))\n"
        "s.set('ready', '1')\n"
        "time.sleep(120)\n")


@pytest.fixture
def hosted():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", HOST, str(port)])
    try:
        client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
        client.wait(["ready"])
        yield proc, client
    finally:
        proc.kill()
        proc.wait()


def test_calls_pass_through(hosted):
    _, client = hosted
    store = BoundedStore(client, deadline_s=2.0)
    store.set("a", "x")
    assert store.get("a") == b"x" and store.check(["a"]) and not store.check(["b"])
    assert store.add("n", 2) == 2 and store.add("n", 0) == 2
    assert store.compare_set("c", "", "y") == b"y" and store.multi_get(["a", "c"]) == [b"x", b"y"]


def test_a_stopped_host_is_an_error_within_the_deadline_and_recovers(hosted):
    proc, client = hosted
    store = BoundedStore(client, deadline_s=1.0)
    assert store.add("n", 1) == 1
    os.kill(proc.pid, signal.SIGSTOP)
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)                             # the signal is delivered asynchronously
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnresponsive, match=r"did not answer add\(\) within 1s: its host"):
            store.add("n", 1)
        assert time.monotonic() - start < 1.5
        start = time.monotonic()                     # the helper is still blocked: no second wait
        with pytest.raises(StoreUnresponsive, match="has not answered for"):
            store.check(["n"])
        assert time.monotonic() - start < 0.2
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while True:                                      # the blocked add completes once the host runs
        try:
            assert store.add("n", 0) == 2            # the add that timed out did reach the store
            break
        except StoreUnresponsive:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_close_does_not_wait_for_a_call_the_host_never_answered(hosted):
    """A process that ends because its store's host stopped must not wait at exit for the stuck call."""
    proc, client = hosted
    store = BoundedStore(client, deadline_s=1.0)
    os.kill(proc.pid, signal.SIGSTOP)
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)
    try:
        with pytest.raises(StoreUnresponsive):
            store.add("n", 1)
        start = time.monotonic()
        store.close()
        assert time.monotonic() - start < 0.2            # not the deadline's 1 s
    finally:
        os.kill(proc.pid, signal.SIGCONT)
