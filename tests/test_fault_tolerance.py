"""A dead rank makes every other rank exit with a clear error within a bounded time."""
import os
import subprocess
import sys
import time

import pytest

from netutil import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "dead_rank.py")


@pytest.mark.parametrize("schedule", ["chimera", "zbv"])
def test_dead_rank_stops_the_others(schedule):
    timeout_s = 5
    port = free_port()
    procs = []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", DIE_RANK="2")
        procs.append(subprocess.Popen([sys.executable, SCRIPT, schedule, str(timeout_s)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a surviving rank hung after its peer died")
        outputs.append((proc.returncode, out, err))
    elapsed = time.monotonic() - start
    assert outputs[2][0] == 17                       # the rank that crashed
    for rank in (0, 1, 3):
        code, out, err = outputs[rank]
        assert code != 0, f"rank {rank} should have failed"
        assert "finished all steps" not in out
        assert "ds_chimera:" in err and ("died or is stuck" in err), err[-3000:]
    assert elapsed < 60 + 4 * timeout_s             # start-up plus a few timeouts, never a hang
