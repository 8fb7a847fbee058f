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
