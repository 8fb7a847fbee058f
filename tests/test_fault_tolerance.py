"""A dead rank makes every other rank exit with a clear error within a bounded time."""
import os

import pytest

from netutil import run_ranks

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "dead_rank.py")


@pytest.mark.parametrize("schedule", ["chimera", "zbv"])
def test_dead_rank_stops_the_others(schedule):
    timeout_s = 5
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DIE_RANK": "2"}
    try:
        outputs, elapsed = run_ranks([SCRIPT, schedule, str(timeout_s)], 4, env, timeout_s=120)
    except TimeoutError:
        pytest.fail("a surviving rank hung after its peer died")
    assert outputs[2][0] == 17                       # the rank that crashed
    for rank in (0, 1, 3):
        code, out, err = outputs[rank]
        assert code != 0, f"rank {rank} should have failed"
        assert "finished all steps" not in out
        assert "ds_chimera:" in err and ("died or is stuck" in err), err[-3000:]
    assert elapsed < 60 + 4 * timeout_s             # start-up plus a few timeouts, never a hang
