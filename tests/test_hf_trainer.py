"""An unchanged HF Trainer script, pipelined on 4 ranks, against the plain single-process Trainer.

tests/distributed/hf_clm.py is a run_clm-shaped script (tiny local model, generated text,
locally trained tokenizer). tests/distributed/hf_worker.py runs it for several cases in one
launch: under ``ds-chimera launch --torchrun`` with a DeepSpeed config that has a
``"pipeline"`` section (nothing in the script or the worker imports ds_chimera), and in one
plain process without DeepSpeed (the reference: ``transformers.Trainer`` itself). Every
rank's log history, metrics, predictions and weights must equal the reference's.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from netutil import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
DIST = os.path.join(HERE, "distributed")
sys.path.insert(0, DIST)
from hf_assets import make_assets  # noqa: E402
from hf_worker import CASES, FP16, RESUMED  # noqa: E402

RANKS = 4
TRAINED = list(CASES)
PIPELINE = TRAINED + list(RESUMED) + list(FP16) + ["example"]
REFUSALS = ["refuse-zbv-layers", "refuse-batch", "refuse-schedule"]
UNTIMED = ("runtime", "per_second")          # wall-clock values differ by nature
STEPS = {"chimera-gpt2": 6, "1f1b-llama-padded": 5, "zbv-gpt2": 5, "gpipe-2x2-llama-tied": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_trainer")
    assets = make_assets(str(root / "assets"))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    # transformers lets its log records also reach the root logger when CI is set, where the
    # script's own basicConfig handler prints them a second time; the count below is of the
    # Trainer's messages as a user sees them
    env.pop("CI", None)
    worker = os.path.join(DIST, "hf_worker.py")
    plain = subprocess.Popen([sys.executable, worker, "plain", assets, str(root / "plain"),
                              ",".join(TRAINED + REFUSALS)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    launch = [sys.executable, "-m", "ds_chimera.cli", "launch", "--torchrun", "--nproc_per_node", str(RANKS),
              "--master_port", str(free_port()), worker, "pipeline", assets, str(root / "pipe"), ",".join(PIPELINE)]
    pipe = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=600)
    plain_out, _ = plain.communicate(timeout=600)
    if plain.returncode != 0:
        pytest.fail(f"plain Trainer run failed (rc={plain.returncode}):\n{plain_out[-6000:]}")
    if pipe.returncode != 0:
        pytest.fail(f"pipelined run failed (rc={pipe.returncode}):\n{pipe.stdout[-3000:]}\n{pipe.stderr[-6000:]}")
    return {"root": root, "stdout": pipe.stdout + pipe.stderr}


def result(runs, kind, case, rank=0):
    with open(runs["root"] / kind / case / f"result-rank{rank}.json") as fh:
        return json.load(fh)


def weights(runs, kind, case, rank=0):
    return torch.load(runs["root"] / kind / case / f"weights-rank{rank}.pt", weights_only=True)


def assert_same_logs(ours: list, theirs: list, skip=()) -> None:
    """Every entry of the log history, every key, within 1e-4 relative."""
    assert len(ours) == len(theirs) and len(theirs) > 0
    for mine, ref in zip(ours, theirs):
        assert set(mine) == set(ref), (mine, ref)
        for key, value in ref.items():
            if any(word in key for word in UNTIMED) or key in skip:
                continue
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (key, mine, ref)
            else:
                assert mine[key] == value, (key, mine, ref)


def steps(history: list, key: str) -> list:
    return [h[key] for h in history if key in h]


@pytest.mark.parametrize("case", TRAINED)
def test_unchanged_script_logs_what_the_plain_trainer_logs_on_every_rank(runs, case):
    """loss, grad_norm, learning_rate, epoch per step, eval metrics, train_loss: all of log_history, all ranks."""
    ref = result(runs, "plain", case)
    assert ref["class"] == "Trainer"
    history = ref["log_history"]
    assert len(steps(history, "loss")) == STEPS[case] and len(steps(history, "grad_norm")) == STEPS[case]
    assert len(steps(history, "learning_rate")) == STEPS[case] and steps(history, "eval_accuracy")
    # 2 x 2: one step holds a plain run's 4 accumulation batches; its epoch counts batches as an HF
    # run with 2 processes does (dataloader length per process), so only epoch differs
    skip = ("epoch",) if case.startswith("gpipe-2x2") else ()
    for rank in range(RANKS):
        ours = result(runs, "pipe", case, rank)
        assert ours["class"] == "PipelineTrainer" and ref["mro"][0] == "Trainer"     # routed
        assert_same_logs(ours["log_history"], history, skip)
        assert ours["results"]["train"]["train_loss"] == pytest.approx(ref["results"]["train"]["train_loss"],
                                                                      rel=1e-4)


@pytest.mark.parametrize("case", TRAINED)
def test_trained_weights_equal_the_plain_trainers(runs, case):
    """trainer.model on every rank after train(), and the folder save_model() wrote, within 1e-5."""
    from safetensors.torch import load_file
    ref = weights(runs, "plain", case)
    for rank in range(RANKS):
        ours = weights(runs, "pipe", case, rank)
        assert sorted(ours) == sorted(ref)
        assert max((ours[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5
    saved = load_file(runs["root"] / "pipe" / case / "out" / "model.safetensors")
    saved_ref = load_file(runs["root"] / "plain" / case / "out" / "model.safetensors")
    assert sorted(saved) == sorted(saved_ref)
    assert max((saved[k] - saved_ref[k]).abs().max().item() for k in saved_ref) <= 1e-5


@pytest.mark.parametrize("case", list(FP16))
def test_fp16_runs_the_engine_in_fp16_and_a_skipped_step_holds_hfs_scheduler(runs, case):
    """``--fp16`` with ``"fp16": {"enabled": "auto"}``: the stages hold fp16 weights, the first steps overflow at
    scale 2^18 and are skipped on every rank (DeepSpeed's rule), HF's own LR scheduler does not step on them (its
    loop reads ``optimizer_step_was_skipped``, as with DeepSpeed's own fp16), and the exported model is fp32.
    The plain Trainer on CPU trains this case in fp32: the first loss (no update yet) agrees to fp16 resolution."""
    ref = result(runs, "plain", FP16[case])["log_history"]
    ref_lrs = steps(ref, "learning_rate")
    for rank in range(RANKS):
        ours = result(runs, "pipe", case, rank)
        engine, history = ours["engine"], ours["log_history"]
        assert engine["stage_dtypes"] == ["torch.float16"] and engine["model_dtypes"] == ["torch.float32"]
        train = [h for h in history if "loss" in h and "eval_loss" not in h]
        assert len(train) == engine["global_steps"] == STEPS[FP16[case]]
        skipped = [i for i, h in enumerate(train) if h.get("grad_norm") is None]      # no norm on a skipped step
        assert len(skipped) == engine["skipped_steps"] and 0 < len(skipped) < len(train), (rank, engine)
        assert engine["lr_scheduler_steps"] == len(train) - len(skipped)
        # the learning rate each step logs is the schedule's at the number of steps applied before it
        applied = [sum(1 for j in range(i) if j not in skipped) for i in range(len(train))]
        assert [h["learning_rate"] for h in train] == [ref_lrs[k] for k in applied], (rank, train)
        assert train[0]["loss"] == pytest.approx(steps(ref, "loss")[0], rel=2e-3)
        assert train[-1]["loss"] < train[0]["loss"]
    # the checkpoint's optimizer.pt (for a plain Trainer) holds the state the fp32 masters were stepped with
    packed = torch.load(runs["root"] / "pipe" / case / "out" / "checkpoint-3" / "optimizer.pt", weights_only=False)
    slots = [slot for group in packed["param_groups"] for slot in group["params"]]
    assert sorted(packed["state"]) == sorted(slots) and slots
    for state in packed["state"].values():
        assert state["exp_avg"].dtype == torch.float32 and torch.isfinite(state["exp_avg_sq"]).all()
        assert state["exp_avg_sq"].abs().sum() > 0


def test_the_gradient_scale_is_tested_clipped_and_unclipped(runs):
    """A clipped step hides a wrong gradient scale: the cases cover active, inactive and disabled clipping."""
    norms = {case: steps(result(runs, "plain", case)["log_history"], "grad_norm") for case in TRAINED}
    assert max(norms["chimera-gpt2"]) > 0.5                        # --max_grad_norm 0.5: clips
    assert 0 < max(norms["1f1b-llama-padded"]) < 1000             # --max_grad_norm 1000: never clips
    assert len(norms["zbv-gpt2"]) == STEPS["zbv-gpt2"] and min(norms["zbv-gpt2"]) > 0   # 0: off, norm still logged


@pytest.mark.parametrize("case", TRAINED)
def test_predict_returns_the_plain_trainers_predictions_on_every_rank(runs, case):
    ref = result(runs, "plain", case)
    assert len(ref["predictions"]) == 14 and len(ref["predictions"][0]) > 1
    for rank in range(RANKS):
        ours = result(runs, "pipe", case, rank)
        assert ours["predictions"] == ref["predictions"] and ours["label_ids"] == ref["label_ids"]
        for key, value in ref["predict_metrics"].items():
            if not any(word in key for word in UNTIMED):
                assert ours["predict_metrics"][key] == pytest.approx(value, rel=1e-4), key


def test_resume_from_checkpoint_continues_exactly(runs):
    """Resumed at step 3 of 6: steps 4-6 and the final weights equal the uninterrupted run's, on every rank."""
    base = runs["root"] / "pipe" / "chimera-gpt2" / "out"
    assert {"model.safetensors", "pipeline", "trainer_state.json", "scheduler.pt",
            "rng_state_3.pth"} <= set(os.listdir(base / "checkpoint-3"))
    assert not [name for name in os.listdir(base) if name.endswith(".partial")]     # no half-written checkpoint
    for rank in range(RANKS):
        whole = result(runs, "pipe", "chimera-gpt2", rank)["log_history"]
        resumed = result(runs, "pipe", "chimera-gpt2-resumed", rank)["log_history"]
        later = [h for h in whole if h["step"] > 3]
        assert len(later) >= 4
        assert_same_logs([h for h in resumed if h["step"] > 3 and "train_loss" not in h],
                         [h for h in later if "train_loss" not in h])
        ours, ref = weights(runs, "pipe", "chimera-gpt2-resumed", rank), weights(runs, "pipe", "chimera-gpt2", rank)
        assert max((ours[k] - ref[k]).abs().max().item() for k in ref) <= 1e-6


def test_only_the_main_process_logs(runs):
    """HF's should_log rules hold: each rank knows its rank, and the Trainer's logs appear once per run."""
    out = runs["stdout"]
    for case in TRAINED:
        flags = [result(runs, "pipe", case, rank)["should_log"] for rank in range(RANKS)]
        assert flags == [True, False, False, False]
    assert sorted(set(int(r) for r in re.findall(r"Process rank: (\d+)", out))) == list(range(RANKS))
    assert out.count("***** Running training *****") == len(TRAINED) + len(RESUMED) + len(FP16) + 1   # + example
    assert out.count("'train_loss'") == len(TRAINED) + len(RESUMED) + len(FP16) + 1


def test_the_explicit_example_trains_and_reloads(runs):
    """examples/hf_trainer.py (PipelineTrainer): Llama on zbv, loss falls, the saved folder reloads."""
    line = next(line for line in runs["stdout"].splitlines() if line.startswith("[hf_trainer]"))
    assert "schedule zbv, 4 stages x 1 data-parallel" in line and "reloaded LlamaForCausalLM" in line
    losses = json.loads(line.split("logged losses ")[1].split(";")[0])
    assert len(losses) == 2 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("case,message,before_data", [
    ("refuse-zbv-layers", "schedule 'zbv' on 4 pipeline ranks cuts the model into 8 stages (2 per rank), but "
                          "GPT2LMHeadModel with 4 decoder blocks has only 7 pipeline layers", False),
    ("refuse-batch", "train_batch_size=16 disagrees with per_device_train_batch_size 2 x gradient_accumulation_steps "
                     "4 x data-parallel size 1 (world size 4 / 4 pipeline stages) = 8; set it to \"auto\" or pass "
                     "--gradient_accumulation_steps 8", True),
    ("refuse-schedule", "unknown schedule 'chimaera'. Did you mean 'chimera'? Available: 1f1b", True),
])
def test_refusals_name_the_value_and_come_early(runs, case, message, before_data):
    with open(runs["root"] / "plain" / "refusals.json") as fh:
        refusal = json.load(fh)[case]
    assert message in (refusal["error"] or "")
    # config / argument errors come as the arguments are parsed, before the script tokenizes anything;
    # the model's layer count is known once the Trainer is built (after the script's data work)
    assert refusal["tokenized"] is (not before_data)
    if case == "refuse-zbv-layers":
        assert "at least 5 decoder blocks" in refusal["error"] and "\"stages\": 2" in refusal["error"]
