"""A rank's failure while ``"schedule": "auto"`` profiles (in ``deepspeed.initialize`` or at the first call) ends every
rank within seconds, naming it.

Rank 0 and its tensor peer profile the layers together (T = 2, P = 2): one failing strands the other in a
tensor all-reduce, and ranks 2 and 3 in the wait for the profile, where no broadcast of the error can reach
them. The ranks run as plain processes (no launcher ends the others, as on other nodes):
tests/distributed/auto_profile_fault_worker.py, whose victim's script goes on after its error (so its process's
end is not what frees the others). CI: a raise on each profiling rank in initialize and one at the first call;
make test-full adds a death.
"""
import json
import os

import pytest

from netutil import remove_deepspeed_shm, run_ranks
from tiers import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "auto_profile_fault_worker.py")
BOUND_S = 10.0          # the fault monitor's promise: every rank ends within seconds of the failure
CASES = [(1, "raise", "initialize"), (0, "raise", "initialize"), (1, "raise", "first-call")] + \
    ([(1, "kill", "initialize"), (0, "kill", "first-call")] if FULL else [])


@pytest.mark.parametrize("victim, fault, when", CASES, ids=lambda v: str(v))
def test_a_failure_while_auto_profiles_ends_every_rank_naming_it(victim, fault, when, tmp_path):
    exit_times = []
    try:
        outputs, _ = run_ranks([WORKER, str(tmp_path), str(victim), fault, when], 4,
                               {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                               timeout_s=240, exit_times=exit_times)
    finally:
        remove_deepspeed_shm()
    fault_file = tmp_path / "fault.json"
    assert fault_file.exists(), f"the fault never fired\n{outputs[victim][2][-3000:]}"
    fault_at = json.loads(fault_file.read_text())["time"]
    for rank, (code, out, err) in enumerate(outputs):
        log = out + err
        assert "the profile ran" not in log, f"rank {rank} went on\n{log[-3000:]}"
        caught = tmp_path / f"caught-rank{rank}.json"
        if rank == victim:
            if fault == "raise":      # its own error, caught by its script, the process ending normally
                got = json.loads(caught.read_text())
                assert got["type"] == "ValueError", got
                assert f'"schedule": "auto" failed on rank {victim} while profiling the layers' in got["message"], got
                assert "injected failure" in got["message"], got
                assert code == 0, f"rank {rank} exited {code}\n{log[-3000:]}"
            continue
        # stranded in a collective: its initialize raises JobFailed naming the victim (the collective broke when
        # the victim's process ended), or the monitor ends the process within DELIVER_S with that line
        if caught.exists():
            got = json.loads(caught.read_text())
            assert got["type"] == "JobFailed" and f"ds_chimera: rank {victim} failed" in got["message"], (rank, got)
            assert code == 0, f"rank {rank} caught its error and exited {code}\n{log[-3000:]}"
            ended = got["time"]
        else:
            assert code != 0, f"rank {rank} ended normally, having caught nothing\n{log[-3000:]}"
            assert f"ds_chimera: rank {victim} failed" in log, f"rank {rank} blamed someone else\n{log[-3000:]}"
            assert f"rank {rank} stops too" in log, f"rank {rank}\n{log[-3000:]}"
            ended = exit_times[rank]
        assert ended - fault_at <= BOUND_S, f"rank {rank} ended {ended - fault_at:.1f}s after the fault (bound " \
                                            f"{BOUND_S:g}s)\n{log[-3000:]}"
        if fault == "raise":      # not freed by the victim's process ending (its script goes on for LINGER_S)
            assert ended < exit_times[victim], f"rank {rank} ended only after the victim's process\n{log[-3000:]}"
