"""One 4-rank launch of tests/distributed/worker.py for a family of DeepSpeed runtime scenarios.

Importing DeepSpeed costs seconds per process, so a family's scenarios share one torchrun (the
worker destroys each scenario's process groups after it); a test file is a family, so a scenario
that crashes its launch fails that file's tests only. A test file names its scenarios in
``SCENARIOS``; the ``rank_results``/``results`` fixtures (tests/conftest.py) launch them once.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netutil import free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "worker.py")


def torchrun(args, timeout=900, extra_env=None, nproc=4):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run_family(out_dir: Path, names: list) -> list:
    """Every rank's {scenario: result} (each rank writes its own file, and each is checked)."""
    if len(set(names)) != len(names):
        raise ValueError(f"a scenario is listed twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    out = out_dir / "results.json"
    proc = torchrun([WORKER, str(out), ",".join(names)])
    files = [Path(f"{out}.rank{rank}") for rank in range(4)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(f.read_text()) for f in files]
