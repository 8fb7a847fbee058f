"""The ZeRO benchmark and its CPU diagnostic still run end to end on 4 CPU ranks and report what they say.

Structure only (rows, counts, the simulator's program): the figures themselves are measured by the
scripts, not asserted here.
"""
import json
import os
import subprocess
import sys

import pytest

import tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, out):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


@pytest.mark.skipif(not tiers.FULL, reason="make test-full (DS_CHIMERA_FULL=1) runs it: a benchmark's own run")
def test_zero_benchmark_prices_breadth_first_zero3_from_its_own_run(tmp_path):
    rows, text = run("benchmarks/zero.py", "--micro-batches", "4", "--repeats", "1", "--no-memory", "--no-fsdp",
                     "--rows", "breadth-first:3", out=tmp_path / "zero.json")
    (row,) = rows
    assert (row["schedule"], row["zero"], row["N"], row["gathers"]) == ("breadth-first", 3, 4, 7)   # 2V - 1
    costs = row["costs"]
    assert costs["gather"] > 0 and costs["gather_post"] > 0 and costs["gather_skew"] >= 0
    assert row["sim_s"] > 0 and row["measured_vs_sim"] == row["step_s"] / row["sim_s"]
    assert "zero N=4 breadth-first ZeRO-3" in text


def test_zero_cpu_reports_every_rank(tmp_path):
    rows, _ = run("tools/zero_cpu.py", "--rows", "interleaved:3", "--micro-batches", "2", out=tmp_path / "cpu.json")
    collectives = [r for r in rows if "collective" in r]
    steps = [r for r in rows if "schedule" in r]
    assert sorted((r["collective"], r["rank"]) for r in collectives) == \
        sorted((kind, rank) for kind in ("all_gather", "reduce_scatter") for rank in range(4))
    assert sorted(r["rank"] for r in steps) == [0, 1, 2, 3]
    assert all(r["cpu_ms"] > 0 and r["step_ms"] > 0 for r in steps)
