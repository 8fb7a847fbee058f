"""Every synchronous schedule on DeepSpeed, 4 gloo ranks: equal to single-process training.

One torchrun group runs every scenario (importing DeepSpeed costs seconds per process);
each test then asserts on its scenario's numbers.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netutil import free_port
from tiers import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "worker.py")
sys.path.insert(0, os.path.join(HERE, "distributed"))

SCHEDULES = ["gpipe", "1f1b", "interleaved", "breadth-first", "chimera", "chimera-fd", "chimera-merged",
             "chimera-concat", "chimera-zb", "zb-h1", "zbv", "dualpipev"]
# at D = 4, N = 8 Chimera's default order is zero-bubble: "chimera" there is "chimera-zb"
EQUIV = [f"equiv-{topo}-{s}" for topo in ("4x1", "2x2") for s in SCHEDULES
         if (topo, s) != ("4x1", "chimera-zb")] + ["equiv-4x1-chimera-zb-f2"]
OTHER = ["tied-4x1-chimera", "tied-4x1-1f1b", "tied-2x2-zbv", "actckpt-4x1-chimera", "actckpt-4x1-zb-h1",
         "actckpt-4x1-chimera-zb",
         "actckpt-4x1-interleaved", "ckpt-resume-chimera", "ckpt-resume-2x2-zbv", "ckpt-cross-chimera-to-1f1b",
         "ckpt-cross-chimera-to-stock", "ckpt-cross-zbv-to-interleaved", "stock-clipping",
         "interop-stock-to-1f1b", "interop-1f1b-to-stock", "interop-stock-to-gpipe", "bf16-4x1-chimera",
         "bf16-2x2-zbv", "bf16-4x1-stock", "bf16-4x1-1f1b-noclip", "zero1-2x2-breadth-first", "zero1-2x2-zbv",
         "zero1-2x2-zbv-tied", "zero1-2x2-breadth-first-end", "lm-chimera", "lm-zbv", "trace-chimera", "trace-zbv", "bad-zero1-chimera", "bad-zero1-tied", "bad-zero2", "bad-zero1-reduce",
         "bad-fp16", "bad-load-other-schedule", "bad-batch-split", "bad-unknown", "bad-zero3-async", "bad-zero3-bf16",
         "bad-zero3-tied", "bad-reshard-zero1",
         "bad-pipelines", "bad-interleaved-n", "bad-option", "bad-async-tied", "bad-async-actckpt", "bad-async-bf16",
         "bad-async-steps-ahead"]
INPLACE = ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1", "zbv"]
MONITORED = ["1f1b", "chimera", "zbv"]
OTHER += ["inplace-actckpt", "monitors", "param-groups", "param-groups-forms", "param-groups-zero1-2x2",
          "param-groups-zero3-2x2", "bad-zero3-groups", "bad-groups-left-out", "eval-arguments", "batch-size-change",
          "bad-batch-size-interleaved", "bad-batch-size-async", "bad-eval-reduce", "bf16-export-2x2-zbv",
          "auto-plan", "bad-auto-no-data", "bad-stages"]
ASYNC_OPTIONS = {"pipeoptim-code": {"steps_ahead": "code"}, "pipeoptim-last": {"predictor": "last-update"}}
ASYNC_KEYS = ["pipedream", "pipedream-2bw", "pipeoptim", "spectrain", "pipeoptim-code", "pipeoptim-last"]
ASYNC_BF16 = ["async-bf16-4x1-pipeoptim", "async-bf16-2x2-pipedream"] + (["async-bf16-4x1-spectrain"] if FULL else [])
ASYNC_BF16_PROBES = ["pipeoptim"] + (["pipedream-2bw"] if FULL else [])
CONTINUOUS = ["async-continuous-pipeoptim"] + (["async-continuous-pipedream", "async-continuous-spectrain-code"]
                                               if FULL else [])
ASYNC = ([f"async-{topo}-{k}" for topo in ("4x1", "2x2") for k in ASYNC_KEYS] + [f"async-probe-{k}" for k in ASYNC_KEYS]
         + ["async-ckpt-resume-pipeoptim", "async-ckpt-resume-2x2-pipedream"]
         + ASYNC_BF16 + [f"async-bf16-probe-{k}" for k in ASYNC_BF16_PROBES] + CONTINUOUS
         + ["async-clipped-4x1-pipeoptim", "async-clipped-2x2-pipedream"])
OTHER += ASYNC
CONFIG_DIR = os.path.join(os.path.dirname(HERE), "configs")
CONFIGS = sorted(name[:-5] for name in os.listdir(CONFIG_DIR) if name.endswith(".json"))
if not FULL:     # CI: one per engine family (every schedule's equivalence is tested above either way)
    CONFIGS = [name for name in CONFIGS if name in ("chimera", "zbv", "pipeoptim")]
OTHER += [f"config-{name}" for name in CONFIGS]


def torchrun(args, timeout=900, extra_env=None):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
           str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """Every rank's {scenario: result}: each rank writes its own file, and each is checked.

    One torchrun for every scenario: the worker destroys each scenario's process groups after it
    (an engine keeps its gloo threads and sockets for the process's life), so the process stays small."""
    out = tmp_path_factory.mktemp("dist") / "results.json"
    proc = torchrun([WORKER, str(out), ",".join(EQUIV + OTHER)])
    files = [Path(f"{out}.rank{rank}") for rank in range(4)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def results(rank_results):
    return rank_results[0]


UNCLIPPED = EQUIV + ["program-4x1-chimera-zb", "unclipped-tied-4x1-chimera", "unclipped-zero1-2x2-breadth-first",
                     "unclipped-actckpt-4x1-chimera"]
CLIPPED = ["clipped-4x1-chimera", "clipped-2x2-chimera", "clipped-4x1-interleaved", "tied-4x1-chimera",
           "tied-4x1-1f1b", "tied-2x2-zbv", "zero1-2x2-breadth-first", "zero1-2x2-zbv", "zero1-2x2-zbv-tied",
           "zero1-2x2-breadth-first-end"]
OTHER += [s for s in UNCLIPPED + CLIPPED if s not in EQUIV and s not in OTHER]


@pytest.mark.parametrize("scenario", UNCLIPPED + CLIPPED)
def test_schedule_equals_single_process_training(rank_results, scenario):
    """On every rank: weights, the global mean loss, the eval loss and the gradient norm of each step.

    The unclipped cases are what catch a wrong gradient scale (a clipped step rescales it
    away); the clipped ones check the clip on the true global norm.
    """
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        if scenario in UNCLIPPED:
            assert max(r["ref_norms"]) < r["clip"], "the clip must stay inactive: the gradient scale is under test"
        else:
            assert max(r["ref_norms"]) > r["clip"], "clipping must be active for this test to mean anything"
        assert r["max_param_diff"] <= 1e-5, (rank, r["max_param_diff"])
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["max_loss_diff"] <= 1e-5, rank     # train_batch returns the global mean loss on every rank
        assert r["eval_diff"] <= 1e-5, rank
        assert len(r["norms"]) == len(r["ref_norms"]) == 3
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["ref_norms"])), (rank, r["norms"],
                                                                                       r["ref_norms"])
        assert r["replica_spread"] == 0.0      # Chimera's replicas (and DP copies) stay identical
        # the actckpt case checkpoints blocks of (Linear, Tanh): each Tanh runs again in the backward
        assert r["tanh_forwards_per_micro_batch"] == (2.0 if "actckpt" in scenario else 1.0)


@pytest.mark.parametrize("scenario", EQUIV)
def test_receives_are_posted_ahead_of_need(results, scenario):
    # gloo holds a send until its receive is posted; steps after the first (shapes known)
    # post receives early, so the data can arrive while the rank computes
    assert results[scenario]["early_receives"] > 0


def test_chimera_holds_two_replicas_per_stage(results):
    assert results["equiv-4x1-chimera"]["copies"] == 2
    assert results["equiv-2x2-chimera"]["copies"] == 4      # 2 replicas x 2 data-parallel
    assert results["equiv-4x1-1f1b"]["copies"] == 1
    assert results["equiv-4x1-chimera-zb-f2"]["copies"] == 4   # two pipelines each way


@pytest.mark.parametrize("scenario,forwards", [
    # blocks of two layers (Linear, Tanh): checkpointed (they have parameters), so each Tanh runs twice
    ("actckpt-4x1-chimera", 2.0), ("actckpt-4x1-interleaved", 2.0),
    # blocks of one layer under a split backward: as DeepSpeed, only the Linear blocks are checkpointed,
    # a parameter-free Tanh runs once (and results still equal single-process training)
    ("actckpt-4x1-zb-h1", 1.0), ("actckpt-4x1-chimera-zb", 1.0)])
def test_activation_checkpointing(results, scenario, forwards):
    r = results[scenario]
    assert r["max_param_diff"] <= 1e-5 and r["max_loss_diff"] <= 1e-5
    assert r["tanh_forwards_per_micro_batch"] == forwards


@pytest.mark.parametrize("scenario", ["ckpt-resume-chimera", "ckpt-resume-2x2-zbv"])
def test_checkpoint_resume_is_exact(results, scenario):
    r = results[scenario]
    assert r["max_param_diff"] == 0.0
    assert r["latest"] == "step2"
    layers = [f for f in r["files"] if f.startswith("layer_")]
    assert layers == [f"layer_{i:02d}-model_states.pt" for i in range(16)]   # once per layer, DeepSpeed's names
    assert not [f for f in r["files"] if "tmp" in f or "incomplete" in f]


@pytest.mark.parametrize("scenario", ["ckpt-cross-chimera-to-1f1b", "ckpt-cross-chimera-to-stock",
                                      "ckpt-cross-zbv-to-interleaved"])
def test_checkpoint_loads_under_another_schedule(results, scenario):
    assert results[scenario]["max_param_diff"] == 0.0


@pytest.mark.parametrize("scenario", ["interop-stock-to-1f1b", "interop-1f1b-to-stock", "interop-stock-to-gpipe"])
def test_checkpoints_resume_across_the_stock_engine_with_optimizer_state(results, scenario):
    """Same cut, same per-rank parameter order: DeepSpeed's default load (optimizer state included) works
    both ways, and the two engines then continue exactly alike."""
    r = results[scenario]
    assert r["engines"][0] != r["engines"][1] and "PipelineEngine" in r["engines"]
    assert all(a == b for a, b in r["losses"]) and r["max_param_diff"] == 0.0, r


ZERO_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "breadth-first": 2, "zb-h1": 1, "zbv": 2, "dualpipev": 2}
ZERO = [f"zero{z}-2x2-{s}" for s in ZERO_SCHEDULES for z in (2, 3)] + \
    ["zero3-4x1-breadth-first", "zero3-4x1-zbv", "zero3-2x2-breadth-first-keep"]
OTHER += ZERO + ["zero3-ckpt-breadth-first"]


@pytest.mark.parametrize("scenario", ZERO)
def test_sharded_data_parallelism_equals_single_process_training(rank_results, scenario):
    """ZeRO-2/3 over the pipeline's chunks, Adam, the clip active: every rank's weights, losses, norms
    and eval loss as one process; one gather per chunk and step (ZeRO-2, or ZeRO-3 keeping its weights)."""
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert max(r["ref_norms"]) > r["clip"], "the clip must be active"
        assert r["max_param_diff"] <= 1e-5 and r["compared_tensors"] >= 16, (rank, r["max_param_diff"])
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)), rank
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["ref_norms"], strict=True)), rank
        assert r["eval_diff"] <= 1e-5, rank
        assert r["gathers"] == [r["program_gathers"]] * 3           # the program's gathers, no more, each step
        chunks = ZERO_SCHEDULES[scenario.split("-", 2)[2].replace("-keep", "")]
        if scenario.startswith("zero2") or scenario.endswith("keep"):
            assert r["program_gathers"] == chunks
        # 1/DP of the weights stays on the rank between gathers
        dp = 2 if "2x2" in scenario else 1
        assert r["shard_bytes"] * dp == r["full_bytes"]
        if "breadth-first" in scenario:
            # one chunk's full gradients at a time (each reduce-scatter ends before the next chunk's
            # backward); ZeRO-3 gathers at most two chunks at once, from initialize on
            assert 0 < r["peak"]["grads"] <= r["chunk_bytes"], (rank, r["peak"])
            if scenario.startswith("zero3") and not scenario.endswith("keep"):
                assert r["peak"]["gathered_weights"] <= 2 * r["chunk_bytes"], (rank, r["peak"])


def test_breadth_first_gathers_less_than_depth_first_under_zero3(results):
    """The breadth-first paper's point, counted: 2V-1 gathers a step for V chunks, far more depth-first."""
    bf, interleaved = results["zero3-2x2-breadth-first"], results["zero3-2x2-interleaved"]
    assert bf["program_gathers"] == 2 * 2 - 1
    assert interleaved["program_gathers"] > 3 * bf["program_gathers"]
    assert results["zero3-4x1-breadth-first"]["program_gathers"] == 3


def test_sharded_checkpoints_resume_and_move_to_unsharded_runs(results):
    r = results["zero3-ckpt-breadth-first"]
    assert r["resume_diff"] == 0.0 and r["to_plain_diff"] == 0.0 and r["back_diff"] == 0.0
    assert "'zero': 3}" in r["refusal"] and "Load the weights only" in r["refusal"]


def test_global_norm_clipping_where_deepspeed_stock_is_wrong(results):
    r = results["stock-clipping"]
    assert r["ours"] <= 1e-5
    assert r["stock"] > 1e-3      # DeepSpeed 0.19.8's fp32 pipeline clipping uses a partial norm


@pytest.mark.parametrize("scenario,message", [
    ("bad-unknown", "unknown schedule 'chimaera'. Did you mean 'chimera'? Available: 1f1b, breadth-first, chimera"),
    ("bad-pipelines", "chimera: pipelines must divide stages/2 = 2 (allowed: [1, 2]), got 3"),
    ("bad-interleaved-n", "interleaved needs micro_batches to be a multiple of stages (4), got 6"),
    ("bad-option", "\"pipeline\" (schedule '1f1b'): unknown key 'chunks'."),
    ("bad-zero1-chimera", "ZeRO stage 1 with schedule 'chimera' is not supported: its stages are replicated"),
    ("bad-zero1-tied", "ZeRO stage 1 with weights tied across pipeline ranks (proj) is not supported"),
    ("bad-zero2", "ZeRO stage 2 with schedule 'chimera': its stages are replicated across pipeline ranks"),
    ("bad-zero3-async", "ZeRO stage 3 with schedule 'pipeoptim': an asynchronous schedule steps each stage alone"),
    ("bad-zero3-bf16", "ZeRO stage 3 with pipeline schedules shards fp32 weights; bf16 is not supported"),
    ("bad-zero3-tied", "ZeRO stage 3 with weights tied across layers (proj) is not supported"),
    ("bad-reshard-zero1", "reshard_after_forward applies to ZeRO stage 3 only; this config runs ZeRO stage 0"),
    ("bad-zero1-reduce", "\"pipeline\": zero1_reduce must be one of chunk, end; got 'later'"),
    ("bad-fp16", "fp16 training (loss scaling) is not supported by ds_chimera schedules yet"),
    ("bad-batch-split", "train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 x data-parallel "
                        "size 1"),
    ("bad-load-other-schedule", "its optimizer state does not map onto these chunks. Load the weights only"),
    ("bad-zero3-groups", "model_parameters has parameter groups with different options, and ZeRO stage 3 with "
                         "pipeline schedules steps one flat shard per chunk"),
    ("bad-groups-left-out", "model_parameters leaves out the trainable parameter bias of layer 0"),
    ("bad-batch-size-interleaved", "set_train_batch_size(12): interleaved needs micro_batches to be a multiple of "
                                   "stages (4), got 6"),
    ("bad-batch-size-async", "set_train_batch_size(8) with the asynchronous schedule 'pipedream'"),
    ("bad-eval-reduce", "eval_batch: reduce_output must be 'avg' or None, got 'sum'"),
    ("bad-auto-no-data", "the first train_batch/eval_batch has no data: pass data_iter"),
    ("bad-stages", "\"stages\": 2 differs from the PipelineModule's num_stages=4; with deepspeed.initialize the "
                   "module's num_stages decides"),
])
def test_bad_config_fails_at_initialize(results, scenario, message):
    assert message in (results[scenario]["error"] or "")


def test_auto_trains_exactly_like_the_schedule_it_chose(results):
    """"schedule": "auto" (issue 32): every rank runs the same plan, the plan_file holds it, and naming that
    section by hand gives the same weights, bit for bit; both equal one-process training."""
    r = results["auto-plan"]
    assert all(chosen == r["chosen"] for chosen in r["every_rank"])
    assert r["written"] == r["chosen"] and r["chosen"]["schedule"] != "auto"
    assert r["rerun"] == r["chosen"]          # a later start with the plan_file runs it, without data to profile
    assert len(r["chosen"]["parts"]) >= 5 and r["chosen"]["parts"][-1] == 9     # 9 layers, >= 4 stages
    assert r["compared_tensors"] > 0 and r["engine_diff"] == 0.0
    assert r["auto_losses"] == r["named_losses"]
    assert r["ref_diff"] < 1e-5
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["auto_losses"], r["ref_losses"]))


@pytest.mark.parametrize("scenario", ["bf16-4x1-chimera", "bf16-2x2-zbv", "bf16-4x1-1f1b-noclip"])
def test_bf16_with_deepspeeds_bf16_optimizer(results, scenario):
    """bf16 weights, fp32 master weights and grads: as close to fp32 training as DeepSpeed's own bf16."""
    r, stock = results[scenario], results["bf16-4x1-stock"]
    assert r["max_param_diff"] <= 2 * stock["max_param_diff"] + 1e-4
    assert r["max_param_diff"] < 5e-3
    assert all(abs(a - b) <= 3e-3 * abs(b) for a, b in zip(r["losses"], r["ref_losses"]))
    assert r["replica_spread"] == 0.0


@pytest.mark.parametrize("name", INPLACE)
def test_activation_checkpointing_with_in_place_layers_trains_as_the_stock_engine(results, name):
    """DeepSpeed checkpoints only blocks with parameters: a lone ReLU(inplace=True) runs as it is."""
    r = results["inplace-actckpt"]
    assert len(r[name]) == len(r["stock"]) == 2
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r[name], r["stock"])), (name, r)


PARAM_GROUPS = [("param-groups", f"{s}/groups") for s in ("1f1b", "chimera", "interleaved", "zbv")] + [
    ("param-groups-forms", "chimera/instance"), ("param-groups-forms", "chimera/one-named-group"),
    ("param-groups-zero1-2x2", "breadth-first/groups"), ("param-groups-zero3-2x2", "breadth-first/one-named-group")]


@pytest.mark.parametrize("scenario,case", PARAM_GROUPS)
def test_parameter_groups_train_as_on_the_stock_engine(results, scenario, case):
    """Weight-decay groups with their own lr (model_parameters, or an optimizer instance holding them), and
    DeepSpeed's one named group: every layer's weights after 3 AdamW steps equal the stock engine's, and the
    engine's optimizer carries the user's groups and options."""
    r = results[scenario][case]
    assert r["layers"] and r["tensors"] == 16
    assert r["max_param_diff"] <= 1e-6, r
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["stock_losses"])), r
    if case.endswith("one-named-group"):
        assert r["groups"] == [[["lr", 0.05], ["name", "all"], ["weight_decay", 0.01]]]
    else:
        assert r["groups"] == [[["lr", 0.05], ["weight_decay", 0.1]], [["lr", 0.02], ["weight_decay", 0.0]]]


def _close(a, b, tol=1e-5) -> bool:
    """Nested lists of floats (or None) equal within a relative tolerance; a scalar equals a 1-element list."""
    if isinstance(a, list) and len(a) == 1 and not isinstance(b, list):
        a = a[0]
    if isinstance(b, list) and len(b) == 1 and not isinstance(a, list):
        b = b[0]
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and \
            all(_close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.mark.parametrize("name", ["1f1b", "chimera", "zbv"])
def test_eval_batch_arguments_return_what_the_stock_engine_returns(results, name):
    """return_logits, compute_loss=False, reduce_output=None, bcast_loss=False, num_micro_batches: every
    rank's value as the stock engine's (Chimera's up pipeline ends on rank 0: its results reach rank 3)."""
    r = results["eval-arguments"]
    stock, ours = r["stock"], r[name]
    for rank in ("0", "1", "2", "3"):
        for case in ("outputs", "logits", "list", "half", "default"):
            assert _close(ours[rank][case], stock[rank][case]), (rank, case, ours[rank][case], stock[rank][case])
    assert stock["3"]["outputs"] is not None and len(stock["3"]["list"]) == 8     # the comparison has content
    # reduce_output=None with bcast_loss (the stock engine fails there): the list on every rank
    for rank in ("0", "1", "2", "3"):
        assert _close(ours[rank]["list-bcast"], stock["3"]["list"])


@pytest.mark.parametrize("name", ["1f1b", "chimera", "interleaved", "zbv"])
def test_set_train_batch_size_rebuilds_the_schedule(results, name):
    """8, then 4, then 16 micro-batches: the losses and weights of the stock engine doing the same."""
    r = results["batch-size-change"][name]
    assert r["micro_batches"] == [8, 4, 16]
    assert r["tensors"] == 16 and r["max_param_diff"] <= 1e-6, r
    assert _close(r["losses"], r["stock_losses"]), r


def test_bf16_export_writes_the_fp32_masters(results):
    """An HF export under bf16 gets the optimizer's fp32 masters (gathered over data parallelism), as a plain
    --bf16 Trainer saves fp32: float32 tensors, finer than bf16, that round to the modules' bf16 copies."""
    r = results["bf16-export-2x2-zbv"]
    assert r["layers"] and r["tensors"] == 16
    assert r["dtypes"] == ["torch.float32"]
    assert r["tensors_finer_than_bf16"] == 16
    assert r["max_rounding_diff"] == 0.0


@pytest.mark.parametrize("name", MONITORED)
def test_monitors_get_the_stock_engines_events(results, name):
    """csv_monitor files under the schedule: the stock engine's names, and per event the same steps and values."""
    r = results["monitors"]
    stock, ours = r["stock"], r[name]
    assert set(stock) == {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv", "Train_Samples_eval_loss.csv"}
    assert set(ours) == set(stock)
    for event, rows in stock.items():
        assert len(rows) == len(ours[event]) == (2 if "eval" in event else 4), (event, rows, ours[event])   # header
        assert rows[0] == ours[event][0]
        for theirs, mine in zip(rows[1:], ours[event][1:]):
            (step_a, value_a), (step_b, value_b) = theirs.split(","), mine.split(",")
            assert step_a == step_b and abs(float(value_a) - float(value_b)) <= 1e-5 * abs(float(value_a)), \
                (event, theirs, mine)


@pytest.mark.parametrize("scenario", ["lm-chimera", "lm-zbv"])
def test_dynamicconv_lm_trains_under_pipeline_schedules(results, scenario):
    losses = results[scenario]["losses"]
    assert losses[0] > 3.0                                  # about log(32) at the start
    assert sum(losses[-3:]) / 3 < 0.6 * losses[0], losses


@pytest.mark.parametrize("scenario,kinds", [("trace-chimera", {"F": 8, "B": 8}),
                                            ("trace-zbv", {"F": 16, "I": 16, "W": 16})])
def test_per_step_trace_of_what_each_rank_ran(results, scenario, kinds):
    files = results[scenario]["files"]
    assert sorted(files) == [f"step000001-rank{r:03d}.json" for r in range(4)]
    for names in files.values():     # N=8 micro-batches through this rank's chunks, each kind once
        assert {k: names.count(k) for k in set(names)} == kinds


# ---- asynchronous schedules (PipeOptim, PipeDream, 2BW, SpecTrain) --------------------------------------
@pytest.mark.parametrize("scenario", ASYNC_BF16)
def test_async_bf16_through_deepspeeds_bf16_optimizer(rank_results, scenario):
    """bf16 weights, fp32 master weights and state (predictions read them): fp32 training to bf16 rounding,
    against LocalPipeline and against the independent model of the method (async_reference)."""
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["max_param_diff"] < 5e-3 and r["model_param_diff"] < 5e-3, rank
        for ref in (r["ref_losses"], r["model_losses"]):
            assert len(ref) == len(r["losses"]) == 2
            assert all(abs(a - b) <= 5e-3 * abs(b) for a, b in zip(r["losses"], ref)), (rank, r["losses"], ref)
        assert r["versions_held"] == ([2, 2, 2, 1] if "4x1" in scenario else [2, 2, 1, 1])


@pytest.mark.parametrize("name", ASYNC_BF16_PROBES)
def test_async_bf16_weight_versions(results, name):
    from test_pipeoptim import expected_versions, observed_versions

    from ds_chimera.schedules import registry
    r = results[f"async-bf16-probe-{name}"]
    schedule = registry.build(name, 4, r["n"])
    assert observed_versions([tuple(e) for e in r["log"]], schedule) == expected_versions(schedule, r["calls"])


ASYNC_VERSUS = [s for s in ASYNC if s.startswith(("async-4x1", "async-2x2", "async-clipped"))]


@pytest.mark.parametrize("scenario", ASYNC_VERSUS)
def test_async_engine_equals_the_methods_independent_model(rank_results, scenario):
    """On every rank, the same global mini-batches: the distributed engine equals the independent model of its
    method (tests/distributed/async_reference.py, which shares nothing with the runtime) in weights, the
    mean loss of each call and each call's last stage gradient norm; and LocalPipeline. Unclipped, so that a
    wrong gradient scale moves the weights; the clipped cases clip some updates and not others."""
    stages, n = (4, 8) if "4x1" in scenario else (2, 4)
    interval = stages if "2bw" in scenario else 1         # 2BW accumulates D micro-batches per update
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["model_param_diff"] <= 1e-6, (rank, r["model_param_diff"])
        assert r["max_param_diff"] <= 1e-6, (rank, r["max_param_diff"])
        assert len(r["losses"]) == len(r["model_losses"]) == len(r["ref_losses"]) == 2
        assert r["model_loss_diff"] <= 1e-5 and r["max_loss_diff"] <= 1e-5, rank
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["model_norms"])), (rank, r["norms"],
                                                                                          r["model_norms"])
        assert r["global_steps"] == 2 * n // interval          # two calls, one optimizer step per update
        assert r["updates"] == stages * 2 * n // interval
        if "clipped" in scenario:
            assert 0 < r["updates_clipped"] < r["updates"], "clipping must be active on some updates only"
        else:
            assert r["clip"] > 1e3 and r["updates_clipped"] == 0


@pytest.mark.parametrize("key", ASYNC_KEYS)
def test_weight_copies_each_rank_holds(rank_results, key):
    from ds_chimera.schedules import registry
    name = "pipeoptim" if key.startswith("pipeoptim") else key
    held = rank_results[0][f"async-4x1-{key}"]["versions_held"]
    assert held == registry.build(name, 4, 8, **ASYNC_OPTIONS.get(key, {})).weights_per_rank()
    # the last stage's backward follows its forward at once, except where s = D-k looks one update further
    assert held == {"pipedream": [4, 3, 2, 1], "pipeoptim-code": [2, 2, 2, 2]}.get(key, [2, 2, 2, 1])
    for topo in ("4x1", "2x2"):          # the independent model's count, rank by rank
        for rank, per_rank in enumerate(rank_results):
            r = per_rank[f"async-{topo}-{key}"]
            assert r["versions_held"][rank] == r["model_versions_held"][r["stage_of_rank"][0]], (topo, rank)


@pytest.mark.parametrize("key", ASYNC_KEYS)
def test_instrumented_run_shows_each_methods_weight_versions(results, key):
    """Every forward and backward on every rank reads the version its method's definition gives
    (expected_versions: from the independent model's timetable, async_reference.pass_plan)."""
    from test_pipeoptim import PROBE_SPECTRAIN, expected_versions, observed_versions

    from ds_chimera.schedules import registry
    r = results[f"async-probe-{key}"]
    options = PROBE_SPECTRAIN if key == "spectrain" else ASYNC_OPTIONS.get(key, {})
    schedule = registry.build("pipeoptim" if key.startswith("pipeoptim") else key, 4, r["n"], **options)
    observed = observed_versions([tuple(e) for e in r["log"]], schedule)
    expected = expected_versions(schedule, r["calls"])
    assert len(observed) == len(expected) == 2 * 4 * r["n"] * r["calls"]
    assert observed == expected


@pytest.mark.parametrize("scenario,files", [("async-ckpt-resume-pipeoptim", 4), ("async-ckpt-resume-2x2-pipedream", 0)])
def test_async_checkpoint_resume_is_exact(results, scenario, files):
    r = results[scenario]
    assert r["max_param_diff"] == 0.0
    assert len([f for f in r["files"] if f.startswith("ds_chimera_predictor")]) == files


@pytest.mark.parametrize("scenario,message", [
    ("bad-async-tied", "weights tied across layers (TiedLayerSpec) would diverge"),
    ("bad-async-actckpt", "activation_checkpoint_interval=1: recomputation in the backward would see the live"),
    ("bad-async-bf16", "schedule 'spectrain' with bf16 and data parallelism: DeepSpeed's BF16_Optimizer shards"),
    ("bad-async-steps-ahead", "steps_ahead must be 'paper' (s = D-1-k), 'code' (s = D-k) or an integer >= 0; got 'later'"),
])
def test_bad_async_config_fails_at_initialize(results, scenario, message):
    assert message in (results[scenario]["error"] or "")


@pytest.mark.parametrize("scenario", CONTINUOUS)
def test_pipeline_kept_full_across_calls(rank_results, scenario):
    """fill='continuous': 2 calls of 8 then drain() equal one asynchronous 1F1B run over the 19 mini-batches,
    of the independent model (async_reference) and of LocalPipeline; on every rank."""
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["model_param_diff"] <= 1e-6 and r["max_param_diff"] <= 1e-6, rank
        assert abs(r["mean_loss"] - r["model_mean_loss"]) <= 1e-5, rank
        assert abs(r["mean_loss"] - r["ref_mean_loss"]) <= 1e-5, rank
        assert r["global_steps"] == r["total"]           # every mini-batch one update, the drained ones too


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_trains_with_its_schedule(results, name):
    """configs/NAME.json as shipped (optimizer, batch and schedule keys) runs its schedule and learns."""
    with open(os.path.join(CONFIG_DIR, f"{name}.json")) as fh:
        cfg = json.load(fh)
    r = results[f"config-{name}"]
    section = dict(cfg["pipeline"])
    assert r["schedule"] == section.pop("schedule")
    assert all(r["options"][key] == value for key, value in section.items())
    # the batch is the HF Trainer's to fill; the DeepSpeed run set train_batch_size "auto" aside
    assert all(cfg[key] == "auto" for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps"))
    assert r["micro_batches"] == 8
    # the same model, optimizer and data in one process (LocalPipeline for the asynchronous schedules)
    assert len(r["losses"]) == len(r["ref_losses"]) == 6
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(r["losses"], r["ref_losses"])), \
        (r["losses"], r["ref_losses"])
    assert r["losses"][-1] < r["losses"][0] - 0.05, r["losses"]      # and the run learns


@pytest.mark.parametrize("scenario,early", [("zero1-2x2-breadth-first", 2), ("zero1-2x2-zbv", 2),
                                            ("zero1-2x2-breadth-first-end", 0)])
def test_zero1_reduces_each_chunk_when_it_is_done(results, scenario, early):
    """ZeRO-1: a chunk's gradients go to ZeRO's reduction at its GradSync (both chunks per rank), or all at the end."""
    assert results[scenario]["zero1_early_chunks"] == early
