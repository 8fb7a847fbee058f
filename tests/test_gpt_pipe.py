"""Megatron-DeepSpeed's shape of training (GPTModelPipe, pretrain_gpt.py's loop), written here: every synchronous
schedule equals DeepSpeed's stock engine on the same script, 4 gloo ranks (see distributed/gpt_pipe_worker.py).

One launch for the family: a crash fails these tests only."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netutil import free_port, remove_deepspeed_shm
from tiers import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "gpt_pipe_worker.py")
# CI: one schedule per engine family and every feature; make test-full adds the rest (each passed 2026-12-03)
SCHEDULES = ["1f1b", "chimera", "zbv", "interleaved"] + (["gpipe", "breadth-first", "zb-h1", "dualpipev"] if FULL
                                                          else [])
RAMPUP = ["rampup-chimera"] + (["rampup-zbv"] if FULL else [])
STOCK_CKPT = ["chimera"] + (["1f1b", "zbv"] if FULL else [])
SCENARIOS = ([f"gpt-{s}" for s in SCHEDULES + RAMPUP] + ["gpt-1stage-chimera"]
             + [f"gpt-stock-ckpt-{s}" for s in STOCK_CKPT] + ["gpt-auto", "gpt-auto-stock-ckpt", "gpt-auto-profile-error",
                                                                "gpt-auto-own-ckpt"])
# the losses are float32 sums over a different order of micro-batches and replicas: equal to ~1 ulp of a loss ~10
REL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "results.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           WORKER, str(out), ",".join(SCENARIOS)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    finally:
        remove_deepspeed_shm()
    files = [Path(f"{out}.rank{rank}") for rank in range(4)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads(f.read_text()) for f in files]


def _same(got, expected):
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected):
        assert a == pytest.approx(b, rel=REL, abs=0), (got, expected)


@pytest.mark.parametrize("schedule", SCHEDULES + RAMPUP + ["1stage-chimera"])
def test_gpt_shaped_training_equals_stock(results, schedule):
    """Tied embedding, type:transformer cut, dict batches through batch_fn, an optimizer instance over two
    groups and megatron-core's OptimizerParamScheduler instance, set_train_batch_size every step: the same
    losses and learning rates as the stock engine, on every rank."""
    for rank_results in results:
        r = rank_results[f"gpt-{schedule}"]
        _same(r["losses"], r["stock_losses"])
        assert r["lrs"] == r["stock_lrs"] and len(set(r["lrs"])) > 1     # the scheduler moved the LR, as stock's
        assert r["scheduler_moved"]
        expected = schedule.split("-", 1)[1] if schedule.startswith(("rampup", "1stage")) else schedule
        assert r["schedule"] == expected


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_set_train_batch_size_with_an_unchanged_count_builds_nothing(results, schedule):
    """pretrain_gpt.py calls it before every iteration: no program is built for a count already running."""
    for rank_results in results:
        assert rank_results[f"gpt-{schedule}"]["plans_built"] == 0


def test_batch_size_ramp_up_builds_each_count_once(results):
    for rank_results in results:
        # 4 -> 8 -> 4 -> 8 builds only 8 (4 is the engine's own)
        for name in RAMPUP:
            assert rank_results[f"gpt-{name}"]["plans_built"] == 1


@pytest.mark.parametrize("schedule", STOCK_CKPT)
def test_a_stock_checkpoint_resumes_under_a_schedule(results, schedule):
    """Weights (the tied embedding written once, by stock, at its first layer), AdamW's moments mapped parameter
    by parameter onto the schedule's chunks, and the scheduler's state: the resumed run continues exactly as
    the stock engine resuming from the same checkpoint."""
    for rank_results in results:
        r = rank_results[f"gpt-stock-ckpt-{schedule}"]
        _same(r["losses"], r["stock_losses"])
        assert r["lrs"] == r["stock_lrs"]


@pytest.mark.parametrize("scenario", ["gpt-auto", "gpt-auto-stock-ckpt"])
def test_auto_without_training_data_plans_at_the_first_train_batch(results, scenario):
    """No training_data at initialize (the data reaches train_batch only): the first call profiles its own first
    micro-batch, plans, builds the chosen engine in the object the script holds and runs the call under it. The
    run is bit-identical to one naming the chosen section from the start, on every rank (the same choice
    everywhere), and equal to stock; with a stock checkpoint loaded before that first call (weights, AdamW state
    and Megatron's scheduler step count, which a second load must not count twice)."""
    chosen = {json.dumps(rank_results[scenario]["chosen"], sort_keys=True) for rank_results in results}
    assert len(chosen) == 1
    for rank_results in results:
        r = rank_results[scenario]
        assert r["losses"] == r["named_losses"] and r["lrs"] == r["named_lrs"]
        _same(r["losses"], r["stock_losses"])
        assert r["lrs"] == r["stock_lrs"]
        assert r["schedule"] == r["chosen"]["schedule"] and not r["deferred"]


def test_auto_loading_its_own_checkpoint_before_the_first_call_goes_on_under_that_checkpoints_plan(results):
    """Interleaved with chunks=2 wrote the checkpoint; "auto" (no training_data) loads it before any call and
    continues exactly as the named run did, under the same schedule and options."""
    for rank_results in results:
        r = rank_results["gpt-auto-own-ckpt"]
        assert r["losses"] == r["reference"], r
        assert r["schedule"] == "interleaved" and r["options"] == {"chunks": 2} and not r["deferred"], r


def test_a_layer_rank_0_cannot_profile_fails_every_rank_with_its_name(results):
    for rank_results in results:
        error = rank_results["gpt-auto-profile-error"]["error"]
        assert error and "failed on rank 0 while profiling the layers" in error
        assert "layer 3:NoGradRefusingBlock fails when the profiler runs it alone" in error
