"""A pipelined Trainer's checkpoint, resumed by the plain single-process ``transformers.Trainer``.

tests/distributed/hf_plain_resume.py trains a tiny GPT-2 pipelined on 2 ranks (ZeRO-0 on 2 stages;
ZeRO-1 on 1 stage x 2 replicas) with a checkpoint at step 2, then resumes each checkpoint in one
plain process without ds_chimera or DeepSpeed. The plain Trainer loads the optimizer and the
scheduler only when ``optimizer.pt`` exists (else it trains on with fresh ones, silently), so the
pipelined checkpoint writes one: the resumed steps must equal the uninterrupted plain run's.
About 30 s on 2 cores.
"""
import json
import os
import subprocess
import sys

import pytest

from netutil import free_port

import tiers

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
# about 45 s of CI's 10-minute budget: make test-full runs it (CI keeps tests/test_hf.py's save-time warning)
pytestmark = pytest.mark.skipif(not tiers.FULL, reason="make test-full (DS_CHIMERA_FULL=1) runs it")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "hf_plain_resume.py")
CASES = ["1f1b-2x1", "zero1-1x2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_plain_resume")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    launch = [sys.executable, "-m", "ds_chimera.cli", "launch", "--torchrun", "--nproc_per_node", "2",
              "--master_port", str(free_port()), WORKER, "pipeline", str(out)]
    pipe = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    if pipe.returncode != 0:
        pytest.fail(f"pipelined run failed (rc={pipe.returncode}):\n{pipe.stdout[-3000:]}\n{pipe.stderr[-6000:]}")
    plain = subprocess.run([sys.executable, WORKER, "plain", str(out)], env=env, capture_output=True, text=True,
                           timeout=300)
    if plain.returncode != 0:
        pytest.fail(f"plain run failed (rc={plain.returncode}):\n{plain.stdout[-3000:]}\n{plain.stderr[-6000:]}")
    with open(out / "pipeline.json") as fh, open(out / "plain.json") as gh:
        return {"out": out, "pipeline": json.load(fh), "plain": json.load(gh)}


def after(history: list, step: int) -> list:
    return [h for h in history if h["step"] > step]


def same(ours: list, ref: list) -> None:
    assert [h["step"] for h in ours] == [h["step"] for h in ref] and ours
    for mine, theirs in zip(ours, ref):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-8), (key, mine, theirs)


@pytest.mark.parametrize("case", CASES)
def test_a_plain_trainer_resumes_a_pipelined_checkpoint_exactly(runs, case):
    """Steps 3-4 of the plain run resumed at step 2 equal the uninterrupted plain run's (optimizer, schedule, RNG)."""
    files = set(os.listdir(runs["out"] / "pipe" / case / "checkpoint-2"))
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors", "pipeline"} <= files
    plain = runs["plain"][case]
    same(after(plain["resumed"], 2), after(plain["reference"], 2))
    same(runs["pipeline"][case], plain["reference"])          # and the pipelined run itself was the plain one


@pytest.mark.parametrize("case", CASES)
def test_without_optimizer_pt_the_plain_trainer_restarts_its_schedule_silently(runs, case):
    """The failure this guards against: without optimizer.pt HF loads neither optimizer nor scheduler."""
    plain = runs["plain"][case]
    bare, ref = after(plain["bare"], 2), after(plain["reference"], 2)
    assert bare[0]["learning_rate"] != pytest.approx(ref[0]["learning_rate"])       # warm-up again from 0
    assert bare[-1]["loss"] != pytest.approx(ref[-1]["loss"], rel=1e-6)


def test_a_plain_trainer_with_ds_chimera_imported_warns_on_such_a_checkpoint(runs):
    (message,) = runs["plain"]["warnings"]
    assert "was written by a pipelined Trainer whose optimizer state only the pipeline can read" in message
    assert "starts a fresh optimizer and learning-rate schedule" in message
