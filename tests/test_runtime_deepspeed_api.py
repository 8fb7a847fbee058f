"""The scheduled engine behind DeepSpeed's API, 4 gloo ranks: checkpoints (own, across schedules, with the
stock engine), parameter groups, eval_batch's arguments, set_train_batch_size, monitors, traces, "auto",
the shipped configs and the refusals at initialize (one launch: tests/deepspeed_runs.py).
"""
import json
import os

import pytest

from tiers import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_DIR = os.path.join(os.path.dirname(HERE), "configs")
CONFIGS = sorted(name[:-5] for name in os.listdir(CONFIG_DIR) if name.endswith(".json"))
if not FULL:     # CI: one per engine family (every schedule's equivalence is tested either way)
    CONFIGS = [name for name in CONFIGS if name in ("chimera", "zbv", "pipeoptim")]
MONITORED = ["1f1b", "chimera", "zbv"]
LM = ["lm-zbv"] + (["lm-chimera"] if FULL else [])      # CI: one DynamicConv LM run (its layers in any schedule)
PARAM_GROUPS = [("param-groups", f"{s}/groups") for s in ("1f1b", "chimera", "interleaved", "zbv")] + [
    ("param-groups-forms", "chimera/instance"), ("param-groups-forms", "chimera/one-named-group"),
    ("param-groups-zero1-2x2", "breadth-first/groups"), ("param-groups-zero3-2x2", "breadth-first/one-named-group")]
BAD = ["bad-zero2", "bad-zero1-reduce", "bad-fp16", "bad-load-other-schedule",
       "bad-batch-split", "bad-unknown", "bad-zero3-async", "bad-zero3-bf16", "bad-zero3-tied", "bad-reshard-zero1",
       "bad-pipelines", "bad-interleaved-n", "bad-option", "bad-zero3-groups", "bad-groups-left-out",
       "bad-batch-size-interleaved", "bad-batch-size-async", "bad-eval-reduce", "bad-auto-no-data", "bad-stages"]
SCENARIOS = ["ckpt-resume-chimera", "ckpt-resume-2x2-zbv", "ckpt-cross-chimera-to-1f1b", "ckpt-cross-chimera-to-stock",
             "ckpt-cross-zbv-to-interleaved", "interop-stock-to-1f1b", "interop-1f1b-to-stock", "interop-stock-to-gpipe",
             *LM, "trace-chimera", "trace-zbv", "monitors", "param-groups", "param-groups-forms",
             "param-groups-zero1-2x2", "param-groups-zero3-2x2", "eval-arguments", "batch-size-change",
             "bf16-export-2x2-zbv", "auto-plan", "load-other-precision"] + BAD + [f"config-{name}" for name in CONFIGS]


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


@pytest.mark.parametrize("scenario,message", [
    ("bad-unknown", "unknown schedule 'chimaera'. Did you mean 'chimera'? Available: 1f1b, breadth-first, chimera"),
    ("bad-pipelines", "chimera: pipelines must divide stages/2 = 2 (allowed: [1, 2]), got 3"),
    ("bad-interleaved-n", "interleaved needs micro_batches to be a multiple of stages (4), got 6"),
    ("bad-option", "\"pipeline\" (schedule '1f1b'): unknown key 'chunks'."),
    ("bad-zero2", "ZeRO stage 2 with schedule 'chimera': its stages are replicated across pipeline ranks"),
    ("bad-zero3-async", "ZeRO stage 3 with schedule 'pipeoptim': an asynchronous schedule steps each stage alone"),
    ("bad-zero3-bf16", "ZeRO stage 3 with pipeline schedules shards fp32 weights; bf16 is not supported"),
    ("bad-zero3-tied", "ZeRO stage 3 with weights tied across layers (proj) is not supported"),
    ("bad-reshard-zero1", "reshard_after_forward applies to ZeRO stage 3 only; this config runs ZeRO stage 0"),
    ("bad-zero1-reduce", "\"pipeline\": zero1_reduce must be one of chunk, end; got 'later'"),
    ("bad-fp16", "fp16 with ZeRO stage 1 runs DeepSpeed's ZeRO-1 fp16 optimizer, which DeepSpeed refuses on the "
                 "'cpu' accelerator (is_fp16_supported() is False); use fp16 with ZeRO stage 0"),
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
    """"schedule": "auto": every rank runs the same plan, the plan_file holds it, and naming that
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


@pytest.mark.parametrize("scenario", LM)
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


def test_a_checkpoint_of_another_precision_loads_its_weights_only(rank_results):
    """bf16 saved, fp32 loading (and back): the optimizer state is refused by name on every rank; the weights
    load, and a bf16 run steps from them."""
    for rank, results in enumerate(rank_results):
        r = results["load-other-precision"]
        assert r["error"] is not None and "was saved by a bf16 run; this engine runs fp32" in r["error"], (rank, r)
        assert "load_optimizer_states=False" in r["error"]
        assert r["weights_only_diff"] == 0.0 and r["loaded_dtypes"] == ["torch.float32"], (rank, r)
        assert "was saved by a fp32 run; this engine runs bf16" in r["back_error"], (rank, r)
        # a bf16 run stepping from an fp32 run's weights: one step from them, not back at its initial weights
        assert r["back_step_from_saved"] < 0.5 * r["back_step_from_initial"], (rank, r)
