"""fp16 with dynamic loss scaling on the scheduled DeepSpeed engine (4 gloo ranks): DeepSpeed's semantics.

tests/distributed/fp16_worker.py trains 6 steps under every synchronous schedule with an inf injected
into one chunk on one rank at steps 1 and 2. On every rank: both steps are skipped (DeepSpeed's skipped-step
count, the weights those steps leave alone), the scale follows DeepSpeed's DynamicLossScaler fed the same
overflows (hysteresis 2 spends one unit, then halves; a window of 2 clean steps doubles), and the weights
and losses equal one process running the same fp16 algorithm (fp16 weights, fp32 masters, clipping on the
unscaled gradients) to fp16's resolution. DeepSpeed's CPU accelerator refuses fp16 in its own engine, so
at ZeRO stage 0 the stock engine cannot be the reference; on GPUs this is unmeasured (docs/limits.md).

With ZeRO-1 (2 stages x 2 data-parallel ranks) the optimizer is DeepSpeed's ZeRO-1 fp16 optimizer, and the
reference is DeepSpeed's stock engine on the same run: the worker lifts the CPU accelerator's fp16 refusal
for both (torch's CPU kernels run fp16).
"""
import json
import math
import os
from pathlib import Path

import pytest

from deepspeed_runs import torchrun
from tiers import FULL
from netutil import remove_deepspeed_shm

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "fp16_worker.py")
SCHEDULES = ["1f1b", "chimera", "zbv", "interleaved", "gpipe", "zb-h1", "breadth-first", "dualpipev"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "fp16.json"
    proc = torchrun([WORKER, str(out)], timeout=600)
    remove_deepspeed_shm()
    files = [Path(f"{out}.rank{r}") for r in range(4)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"fp16 worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads(f.read_text()) for f in files]


def _close(a, b, rel=2e-2, abs_=2e-3):
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, rel, abs_) for x, y in zip(a, b))
    return abs(a - b) <= abs_ + rel * abs(b)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(runs, schedule):
    expected_scales = runs[0]["deepspeed_scales"]
    assert expected_scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]      # the oracle moved both ways
    for rank, per_rank in enumerate(runs):
        r = per_rank[schedule]
        assert r["skipped"] == [0, 1, 2, 2, 2, 2], (rank, r["skipped"])
        assert r["global_steps"] == 6
        assert r["scales"] == expected_scales == per_rank["reference"]["scales"], (rank, r["scales"])
        # the poisoned rank's inf reaches every rank's loss: the overflow really happened, on one rank only
        assert not any(math.isfinite(x) for x in (r["losses"][1], r["losses"][2])), (rank, r["losses"])
        assert r["poisoned_rank"] == runs[0][schedule]["poisoned_rank"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fp16_training_equals_one_process_running_the_same_algorithm(runs, schedule):
    compared = 0
    for rank, per_rank in enumerate(runs):
        r, ref = per_rank[schedule], per_rank["reference"]
        assert r["dtypes"] == ["torch.float16"]
        clean = [s for s in range(6) if s not in (1, 2)]
        assert _close([r["losses"][s] for s in clean], [ref["losses"][s] for s in clean]), (rank, r["losses"],
                                                                                          ref["losses"])
        for index, tensors in r["weights"].items():
            assert _close(tensors, ref["weights"][index]), (rank, index)
            compared += 1
    assert compared >= 5          # every layer with weights, on the rank that owns it


def test_a_checkpoint_resumes_the_masters_and_the_loss_scale_exactly(runs):
    """zbv saved after the two overflows (scale 512, hysteresis spent) resumes bit for bit: the fp32 masters
    and the scale's state travel in the optimizer state, the fp16 weights in DeepSpeed's layer files."""
    for rank, per_rank in enumerate(runs):
        r = per_rank["resume-zbv"]
        assert r["straight"] == r["resumed"], (rank, r)
        assert r["same_weights"], rank
        assert r["skipped_resumed"] == 2                  # DeepSpeed's own count comes back with the engine state
        assert [scale for _, scale in r["straight"]] == [512.0, 512.0, 1024.0]
        # a weights-only load: the masters take the loaded weights, and one step moves them only a step's worth
        assert r["weights_only_masters_follow"], rank
        assert 0 < r["weights_only_step_moved"] < 0.05, (rank, r["weights_only_step_moved"])
        assert r["master_grads_after_step"] == 0, rank      # freed after each step, as DeepSpeed frees its own



ZERO1_SCHEDULES = ["1f1b", "chimera", "zbv"] + (["interleaved", "gpipe", "zb-h1", "breadth-first", "dualpipev"]
                                                if FULL else [])          # the worker's tiers


@pytest.mark.parametrize("schedule", ZERO1_SCHEDULES)
def test_fp16_with_zero1_follows_the_stock_engine_step_for_step(runs, schedule):
    """DeepSpeed's ZeRO-1 fp16 optimizer under each schedule: the scale, the skipped steps, the losses and every
    layer's fp16 weights equal DeepSpeed's stock engine on the same fp16 ZeRO-1 run with the same overflows."""
    expected_scales = runs[0]["deepspeed_scales"]
    for rank, per_rank in enumerate(runs):
        r, stock = per_rank[f"zero1-{schedule}"], per_rank["zero1-stock"]
        assert r["optimizer"] == stock["optimizer"] == "DeepSpeedZeroOptimizer"
        assert r["dtypes"] == stock["dtypes"] == ["torch.float16"]
        assert r["skipped"] == stock["skipped"] == [0, 1, 2, 2, 2, 2], (rank, r["skipped"])
        assert r["global_steps"] == 6
        assert r["scales"] == stock["scales"] == expected_scales, (rank, r["scales"])
        assert not any(math.isfinite(x) for x in (r["losses"][1], r["losses"][2])), (rank, r["losses"])
        clean = [s for s in range(6) if s not in (1, 2)]
        # stock sums its micro-batch losses in fp16, ds_chimera in fp32: the 4th digit may differ
        assert _close([r["losses"][s] for s in clean], [stock["losses"][s] for s in clean], rel=2e-3, abs_=0), \
            (rank, r["losses"], stock["losses"])
        assert sorted(r["weights"]) == sorted(stock["weights"]) and len(r["weights"]) == 9
        for index, tensors in r["weights"].items():       # fp16: one unit in the last place where sums reorder
            assert _close(tensors, stock["weights"][index], rel=2e-3, abs_=2.5e-4), (rank, schedule, index)


def test_fp16_with_zero1_resumes_the_partitions_and_the_scale_exactly(runs):
    """Chimera under fp16 ZeRO-1, saved after the two overflows: the fp32 partitions and DeepSpeed's scaler
    state (scale 512, its hysteresis spent) come back bit for bit."""
    for rank, per_rank in enumerate(runs):
        r = per_rank["resume-zero1-chimera"]
        assert r["straight"] == r["resumed"], (rank, r)
        assert r["same_weights"], rank
        assert r["skipped_resumed"] == 2
        assert [scale for _, scale in r["straight"]] == [512.0, 512.0, 1024.0]
