"""A normal exit destroys the process groups (ds_chimera.runtime.teardown).

Left alive, gloo groups can abort the process in C++ teardown after its work is done
("terminate called without an active exception"), which a launcher reports as a failed run.
The abort is a race, so it is not what these tests wait for; they check the cause is gone:
by the time the interpreter's last exit handlers run, no process group is left.
"""
import json

import pytest

from netutil import run_ranks

SCRIPT = r"""
import atexit, json, os, sys
import torch, torch.distributed as dist
out = sys.argv[1]

def record():        # registered first, so it runs after ds_chimera's own exit handlers
    with open(f"{out}.{os.environ['RANK']}", "w") as fh:
        json.dump({"initialized": dist.is_initialized()}, fh)
atexit.register(record)
dist.init_process_group("gloo")
from ds_chimera.runtime import faults
faults.monitor(10.0)
t = torch.ones(3)
dist.all_reduce(t)
assert t.tolist() == [2.0, 2.0, 2.0]
"""


@pytest.mark.parametrize("monitor", ["1", "0"])
def test_a_normal_exit_leaves_no_process_group(tmp_path, monitor):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "state"
    env = {"DS_CHIMERA_FAULT_MONITOR": monitor, "OMP_NUM_THREADS": "1"}
    results, _ = run_ranks([str(script), str(out)], 2, env, timeout_s=120)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, (rank, err[-2000:])
        with open(f"{out}.{rank}") as fh:
            assert json.load(fh) == {"initialized": False}, rank


SEND_SCRIPT = r"""
import gc, os, sys, time
import torch, torch.distributed as dist
from datetime import timedelta
from ds_chimera.runtime import p2p, teardown
dist.init_process_group("gloo")
teardown.destroy_groups_at_exit()
group = dist.new_group([0, 1])
if dist.get_rank() == 0:
    value = torch.full((1,), 7.0)
    work = dist.isend(value, 1, group=group, tag=3)
    if sys.argv[1] == "held":
        p2p.hold_until_sent(work, value)
    del work, value
    gc.collect()
    # and exits at once: the receiver posts its receive a second later
else:
    time.sleep(1.0)
    value = torch.zeros(1)
    try:       # the sender has exited: posting may fail already (a closed connection), or the wait
        dist.irecv(value, 0, group=group, tag=3).wait(timedelta(seconds=3))
        print("RECEIVED", value.item(), flush=True)
    except Exception as exc:
        print("LOST", type(exc).__name__, flush=True)
"""


@pytest.mark.parametrize("how", ["held", "dropped"])
def test_a_held_send_outlives_its_poster_and_the_exit(tmp_path, how):
    """gloo cancels a send whose Work is dropped (the 'dropped' case shows it still does, so the other
    case means something); a held one arrives even when its rank drops it and exits before the receive."""
    script = tmp_path / "send.py"
    script.write_text(SEND_SCRIPT)
    results, _ = run_ranks([str(script), how], 2, {"OMP_NUM_THREADS": "1", "DS_CHIMERA_FAULT_MONITOR": "0"},
                           timeout_s=120)
    receiver = results[1][1]
    assert ("RECEIVED 7.0" in receiver) == (how == "held"), (receiver, results[1][2][-2000:])
    assert ("LOST" in receiver) == (how == "dropped"), receiver


CHILDREN_SCRIPT = r"""
import multiprocessing as mp, sys
from ds_chimera.runtime import exit_codes
if __name__ == "__main__":
    queue = mp.get_context("spawn").Manager().Queue()      # as Megatron's async checkpoint writer makes one
    worker = mp.get_context("spawn").Process(target=__import__("time").sleep, args=(600,))
    worker.start()
    print(" ".join(str(p.pid) for p in mp.active_children()), flush=True)
    exit_codes.flush_and_exit("ending", 3)
"""


def test_an_ended_process_leaves_no_multiprocessing_child(tmp_path):
    """The fault monitor ends a process with os._exit (after a failure), which skips multiprocessing's exit
    handler: a Manager's server and a busy child must still end with it, not linger as orphans."""
    import os
    import subprocess
    import sys
    import time
    script = tmp_path / "children.py"
    script.write_text(CHILDREN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 3 and "ending" in proc.stderr, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.2)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and
            open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not left, f"children still running after their parent ended: {left}"
