"""Tensor x pipeline parallelism on the scheduled DeepSpeed engine: T = 2, P = 2 on 4 gloo ranks (8 ranks with
D = 2 in make test-full), against DeepSpeed's stock engine on the same topology and against one process.

tests/distributed/tensor_parallel_worker.py trains 3 steps of 8 tensor-parallel MLP blocks under every
synchronous schedule and the stock engine, puts each layer back together from its tensor slices, and writes
the weights, losses and gradient norms. A model whose every parameter is a slice ("sliced") is where DeepSpeed's
clipping norm is the true one, so stock is compared with clipping on and off; the row-parallel biases
("biased", held whole by every tensor rank) are compared with one process, where DeepSpeed's norm would count
those of stage 1 nowhere (it counts an unsliced parameter on model-parallel rank 0 only). Also ZeRO-1, data fed
to tensor rank 0 only (Megatron-DeepSpeed's way), fp16 with an overflow on one rank, and a resumed checkpoint.
CI runs every schedule clipped and a subset of the rest; make test-full runs every case on every schedule.
"""
import json
import os
import types

import pytest

from deepspeed_runs import torchrun
from netutil import remove_deepspeed_shm
from tiers import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "tensor_parallel_worker.py")
SCHEDULES = ["gpipe", "1f1b", "interleaved", "breadth-first", "chimera", "zb-h1", "zbv", "dualpipev"]
CLIP = "0.05"
TOL = 1e-6


UNCLIPPED = SCHEDULES if FULL else ["1f1b", "zbv", "chimera"]     # the worker's tiers
ZERO1 = ["1f1b", "zbv", "interleaved", "chimera"] if FULL else ["zbv", "chimera"]
FP16 = ["1f1b", "zbv", "chimera"] if FULL else ["chimera"]
BF16 = ["1f1b", "zbv", "chimera"] if FULL else ["chimera"]


def _launch(tmp_path_factory, ranks: int) -> dict:
    out = tmp_path_factory.mktemp(f"tp{ranks}") / "tp.json"
    args = ["--dp", str(ranks // 4)] + (["--full"] if FULL else [])
    proc = torchrun([WORKER, str(out), *args], timeout=900, nproc=ranks)
    remove_deepspeed_shm()
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"tensor-parallel worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[4, 8] if FULL else [4], ids=lambda n: f"{n}ranks")
def runs(request, tmp_path_factory):
    return _launch(tmp_path_factory, request.param)


def _diff(a, b) -> float:
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (a, b)
        return max((_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return abs(a - b)


def _weights_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) == [str(i) for i in range(8)], (sorted(a), sorted(b))
    for layer in a.values():
        assert layer != "tensor ranks disagree"
    return max(_diff(a[k], b[k]) for k in a)


@pytest.mark.parametrize("schedule, clip", [(s, CLIP) for s in SCHEDULES] + [(s, "0.0") for s in UNCLIPPED])
def test_equal_to_the_stock_engine_on_the_same_topology(runs, schedule, clip):
    ours, stock = runs[f"{schedule}/sliced-{clip}"], runs[f"stock/sliced-{clip}"]
    assert _weights_diff(ours["weights"], stock["weights"]) <= TOL
    assert _diff(ours["losses"], stock["losses"]) <= TOL


def test_the_clip_is_active_and_changes_the_weights(runs):
    """Every step's true norm is far above the clip, so the clipped runs above test the norm (DeepSpeed's engine
    reports none for fp32 pipelines: its weights equal the reference's, which only the true norm gives)."""
    clipped, plain = runs["reference"][f"sliced-{CLIP}"], runs["reference"]["sliced-0.0"]
    assert min(clipped["norms"]) > 10 * float(CLIP)
    assert _weights_diff(clipped["weights"], plain["weights"]) > 1e-3


@pytest.mark.parametrize("schedule, clip", [(s, CLIP) for s in SCHEDULES + ["stock"]] +
                         [(s, "0.0") for s in UNCLIPPED + ["stock"]])
def test_sliced_model_equals_one_process(runs, schedule, clip):
    ours, ref = runs[f"{schedule}/sliced-{clip}"], runs["reference"][f"sliced-{clip}"]
    assert _weights_diff(ours["weights"], ref["weights"]) <= TOL
    assert _diff(ours["losses"], ref["losses"]) <= TOL
    if clip == CLIP and schedule != "stock":
        assert _diff(ours["norms"], ref["norms"]) <= TOL * max(ref["norms"])


@pytest.mark.parametrize("schedule", SCHEDULES + [f"zero1-{s}" for s in ZERO1])
def test_whole_parameters_count_once_in_the_clipping_norm(runs, schedule):
    """The row-parallel biases are held whole by both tensor ranks: the norm counts them once (tensor rank 0),
    the slices in full; the weights, losses and norms equal one process with the clip active."""
    ours, ref = runs[f"{schedule}/biased-{CLIP}"], runs["reference"][f"biased-{CLIP}"]
    assert min(ref["norms"]) > float(CLIP)
    assert _weights_diff(ours["weights"], ref["weights"]) <= TOL
    assert _diff(ours["losses"], ref["losses"]) <= TOL
    if not schedule.startswith("zero1-"):       # ZeRO-1 reports its own norm (DeepSpeed's optimizer clips)
        assert _diff(ours["norms"], ref["norms"]) <= TOL * max(ref["norms"])
    assert ours["replicas_agree"]


@pytest.mark.parametrize("schedule", ["stock", "zbv"])
def test_data_on_tensor_rank0_only_with_a_broadcasting_batch_fn(runs, schedule):
    """Megatron-DeepSpeed's way: tensor rank 0 has the data iterator, the batch_fn broadcasts each batch."""
    ours, ref = runs[f"{schedule}-fed-by-tensor-rank0/sliced-0.0"], runs["reference"]["sliced-0.0"]
    assert _weights_diff(ours["weights"], ref["weights"]) <= TOL
    assert _diff(ours["losses"], ref["losses"]) <= TOL


def test_a_tensor_parallel_checkpoint_resumes_exactly(runs):
    r = runs["resume-zbv"]
    assert len(r["straight"]) == 2 and r["straight"] == r["resumed"] and r["same_weights"], r
    # one file per layer and tensor rank, named as DeepSpeed names them
    assert any("model_00" in f for f in r["layer_files"]) and any("model_01" in f for f in r["layer_files"])
    assert len(r["layer_files"]) == 2 * 8


def _close(a, b, rel=2e-2, abs_=2e-3) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, rel, abs_) for x, y in zip(a, b))
    return abs(a - b) <= abs_ + rel * abs(b)


@pytest.mark.parametrize("schedule", FP16)
def test_fp16_overflow_on_one_tensor_rank_skips_the_step_everywhere(runs, schedule):
    """fp16 with T = 2: an inf in one chunk's output on one rank (a different rank per schedule) at steps 1 and 2
    skips both steps on every rank, the scale follows DeepSpeed's DynamicLossScaler, and the clean steps equal one
    process running the same fp16 algorithm (to fp16's resolution)."""
    ours, ref = runs[f"fp16-{schedule}"], runs["reference"]["fp16"]
    assert ref["scales"] == [1024.0, 1024.0, 512.0, 512.0]        # hysteresis 2 spends one unit, then halves
    for scales, skipped in ours["scales_skipped"]:
        assert scales == ref["scales"] and skipped == [0, 1, 2, 2], (scales, skipped)
    assert ours["dtypes"] == ["torch.float16"]
    clean = [0, 3]
    assert _close([ours["losses"][s] for s in clean], [ref["losses"][s] for s in clean]), (ours["losses"],
                                                                                          ref["losses"])
    for layer in ours["weights"].values():
        assert layer != "tensor ranks disagree"
    assert _close([ours["weights"][k] for k in sorted(ref["weights"])],
                  [ref["weights"][k] for k in sorted(ref["weights"])])


@pytest.mark.parametrize("case", ["auto-fed-by-tensor-rank0"] + (["auto"] if FULL else []))
def test_schedule_auto_plans_with_the_tensor_group_and_trains_equal_to_one_process(runs, case):
    """"auto" with T = 2: rank 0's tensor group times its shards together (a row-parallel layer all-reduces), every
    rank runs the same plan, and the training equals one process with the clip active. Planned at initialize
    (training_data) and at the first call with data on tensor rank 0 only (the batch_fn broadcasting it)."""
    ours, ref = runs[f"{case}/biased-{CLIP}"], runs["reference"][f"biased-{CLIP}"]
    plans = ours["plans"]
    assert plans[0] is not None and all(p == plans[0] for p in plans), plans
    assert plans[0]["schedule"] in SCHEDULES and plans[0]["parts"][-1] == 8
    assert _weights_diff(ours["weights"], ref["weights"]) <= TOL
    assert _diff(ours["losses"], ref["losses"]) <= TOL
    assert _diff(ours["norms"], ref["norms"]) <= TOL * max(ref["norms"])
    if case == "auto-fed-by-tensor-rank0":
        # each layer priced at one tensor rank's parameters: up 8x8 + 8 and down 8x8 sliced, down's bias (8) whole;
        # the whole block has 16x8 + 16 + 8x16 + 8 = 280
        assert runs["auto-profile-params"] == [144] * 8


@pytest.mark.parametrize("schedule", BF16)
def test_bf16_equals_the_stock_engines_bf16_on_the_same_topology(runs, schedule):
    """bf16 (DeepSpeed's BF16_Optimizer: bf16 weights, fp32 masters) with T = 2 and the clip active: the weights
    equal stock's to one bf16 unit (sums taken in another order round differently), the losses and norms to 1e-2."""
    ours, ref = runs[f"bf16-{schedule}/sliced-{CLIP}"], runs[f"bf16-stock/sliced-{CLIP}"]
    assert min(ref["norms"]) > float(CLIP)
    assert _weights_diff(ours["weights"], ref["weights"]) <= 2 ** -8        # bf16's unit in [0.5, 1) (seen: 1.2e-4)
    assert _diff(ours["losses"], ref["losses"]) <= 1e-2 * max(ref["losses"])
    assert _diff(ours["norms"], ref["norms"]) <= 1e-2 * max(ref["norms"])
    assert ours["replicas_agree"]


def _schedule(name: str, **options):
    from ds_chimera.schedules import build
    return build(name, 2, 4, **options)


def test_what_tensor_parallelism_refuses_names_what_runs():
    from ds_chimera.config import check_tensor_parallel
    check_tensor_parallel(_schedule("zbv"), 2, 1)          # ZeRO-1 runs
    check_tensor_parallel(_schedule("pipedream"), 1, 0)     # tensor size 1: nothing to refuse
    with pytest.raises(ValueError, match=r"schedule 'pipedream' with tensor-parallel size 2.*synchronous schedule.*1f1b"):
        check_tensor_parallel(_schedule("pipedream"), 2, 0)
    with pytest.raises(ValueError, match="ZeRO stage 2 with tensor-parallel size 2.*use ZeRO stage 0 or 1"):
        check_tensor_parallel(_schedule("1f1b"), 2, 2)
