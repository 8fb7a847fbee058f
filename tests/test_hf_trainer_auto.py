"""``"pipeline": {"schedule": "auto"}`` in an HF Trainer's DeepSpeed config: planned, then run as named.

tests/distributed/hf_auto.py trains a tiny GPT-2 (dropout on, shuffled data) on 2 ranks with
``"schedule": "auto"`` and then with the section the planner wrote to its plan_file. The planner
profiles the Trainer's first micro-batch without moving any random stream, and its choice (schedule,
options, layer cut) is what the engine builds, so the two runs must be bit-for-bit the same.
About 25 s on 2 cores.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from netutil import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "hf_auto.py")
RANKS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_auto")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    launch = [sys.executable, "-m", "ds_chimera.cli", "launch", "--torchrun", "--nproc_per_node", str(RANKS),
              "--master_port", str(free_port()), WORKER, str(out)]
    pipe = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    if pipe.returncode != 0:
        pytest.fail(f"pipelined run failed (rc={pipe.returncode}):\n{pipe.stdout[-3000:]}\n{pipe.stderr[-6000:]}")
    return {"out": out, "stdout": pipe.stdout + pipe.stderr}


def record(runs, case, rank):
    with open(runs["out"] / f"{case}-rank{rank}.json") as fh:
        return json.load(fh)


def test_auto_trains_exactly_as_the_schedule_it_chose_named(runs):
    with open(runs["out"] / "plan.json") as fh:
        chosen = json.load(fh)["pipeline"]
    assert "schedule auto:" in runs["stdout"] and "chosen: " in runs["stdout"]       # the planner's report, logged
    for rank in range(RANKS):
        auto, named = record(runs, "auto", rank), record(runs, "named", rank)
        assert auto["class"] == "PipelineTrainer"
        assert auto["auto"]["pipeline"] == chosen                 # every rank got rank 0's choice
        # what the engine built is the plan: schedule, options and the planner's cut (not partition_method's)
        assert (auto["schedule"], auto["parts"]) == (chosen["schedule"], chosen["parts"])
        assert {k: v for k, v in chosen.items() if k not in ("schedule", "parts")}.items() <= auto["options"].items()
        assert (named["schedule"], named["options"], named["parts"]) == \
            (auto["schedule"], auto["options"], auto["parts"])
        assert len(auto["losses"]) == 3 and auto["losses"] == named["losses"]
        assert auto["grad_norms"] == named["grad_norms"]
        ours = torch.load(runs["out"] / f"auto-rank{rank}.pt", weights_only=True)
        ref = torch.load(runs["out"] / f"named-rank{rank}.pt", weights_only=True)
        assert sorted(ours) == sorted(ref)
        assert all(torch.equal(ours[k], ref[k]) for k in ref)
