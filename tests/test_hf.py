"""ds_chimera.hf: HF causal LMs as pipeline layers, HF checkpoints back, and the PipelineTrainer.

In-process tests check the conversion (same logits and loss as the HF model), the export
and the set-up checks. The multi-rank tests launch tests/distributed/hf_worker.py once per
world size (4 and 2 gloo ranks) and compare PipelineTrainer with single-process training.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from netutil import free_port

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from deepspeed.pipe import TiedLayerSpec  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from ds_chimera.hf import causal_lm_loss, export_pretrained, to_pipeline  # noqa: E402
from ds_chimera.hf.config import resolve  # noqa: E402
from ds_chimera.hf.convert import build_layers, run_layers  # noqa: E402
from ds_chimera.hf.layout import describe  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "hf_worker.py")
VOCAB = 61


def gpt2(**kw):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, **kw))


def llama(tied=False, **kw):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=16, intermediate_size=32,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, tie_word_embeddings=tied, bos_token_id=0,
                                        eos_token_id=0, **kw))


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 10), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, labels, mask


@pytest.mark.parametrize("make", [gpt2, llama, lambda: llama(tied=True)], ids=["gpt2-tied", "llama", "llama-tied"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_layers_give_the_models_logits_and_loss(make, impl):
    model = make().eval()
    model.config._attn_implementation = impl
    ids, labels, mask = batch()
    funcs = build_layers(to_pipeline(model))
    for f in funcs:
        if isinstance(f, torch.nn.Module):
            f.eval()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        logits = run_layers(funcs, ids)
        ref_masked = model(input_ids=ids, attention_mask=mask).logits
        masked = run_layers(funcs, (ids, mask))
    assert torch.allclose(logits, ref.logits, atol=1e-6, rtol=0)
    assert abs(causal_lm_loss(logits, labels).item() - ref.loss.item()) < 1e-6
    keep = mask.bool()          # padded positions' outputs are unspecified in both
    assert torch.allclose(masked[keep], ref_masked[keep], atol=1e-6, rtol=0)


@pytest.mark.parametrize("make,tied", [(gpt2, True), (llama, False), (lambda: llama(tied=True), True)])
def test_tied_embeddings_share_one_module(make, tied):
    specs = to_pipeline(make())
    assert len(specs) == 3 + 3       # embedding, 3 blocks, norm, head
    assert isinstance(specs[0], TiedLayerSpec) == tied and isinstance(specs[-1], TiedLayerSpec) == tied
    funcs = build_layers(specs)
    if tied:
        assert specs[0].key == specs[-1].key == "embed"
        embedding = funcs[0]
        ids, labels, _ = batch()
        causal_lm_loss(run_layers(funcs, ids), labels).backward()
        model = make()
        model(input_ids=ids, labels=labels).loss.backward()
        # one weight, gradient from both uses (embedding lookup + head)
        ref = model.get_input_embeddings().weight.grad
        assert torch.allclose(embedding.tokens.weight.grad, ref, atol=1e-6, rtol=0)


def test_loss_is_hfs_for_causal_lm_loss_and_weighted_sum():
    logits = torch.randn(2, 5, VOCAB)
    labels = torch.randint(0, VOCAB, (2, 5))
    labels[1, 2:] = -100
    assert torch.allclose(causal_lm_loss(logits, labels), ForCausalLMLoss(logits, labels, VOCAB))
    weighted = causal_lm_loss(logits, (labels, torch.tensor(0.25)))
    assert torch.allclose(weighted, ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=torch.tensor(4)))


def test_other_pp_plan_models_convert_after_a_numerical_check():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    ids, _, _ = batch()
    funcs = build_layers(to_pipeline(model))           # verify=None checks models other than GPT-2 / Llama
    with torch.no_grad():
        assert torch.allclose(run_layers(funcs, ids), model(input_ids=ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["mistral", "qwen2-alternating"])
def test_sliding_window_layers_get_their_mask(kind):
    """Sliding-window attention (Mistral everywhere, Qwen2 per layer_types) matches the model past the window."""
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=4, max_window_layers=1, **common))
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
    model.eval()
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    funcs = build_layers(to_pipeline(model))
    with torch.no_grad():
        ours, theirs = run_layers(funcs, ids), model(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


def test_unconvertible_models_are_refused_by_name():
    bert = transformers.BertLMHeadModel(transformers.BertConfig(num_hidden_layers=1, hidden_size=16,
                                                                num_attention_heads=2, intermediate_size=16,
                                                                vocab_size=VOCAB, is_decoder=True))
    with pytest.raises(ValueError, match="cannot convert BertLMHeadModel: it is not GPT-2 or Llama"):
        to_pipeline(bert)
    with pytest.raises(ValueError, match="cannot convert GPT2LMHeadModel: encoder-decoder / cross-attention"):
        to_pipeline(gpt2(add_cross_attention=True))
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    with pytest.raises(ValueError, match="cannot convert CohereForCausalLM: its pipeline layers give logits that "
                                         "differ"):                    # its logit_scale lives outside the plan
        to_pipeline(cohere)


@pytest.mark.parametrize("make", [gpt2, llama])
def test_export_from_layer_files_round_trips(make, tmp_path):
    """Layer files in engine.save_checkpoint's layout -> save_pretrained folder -> from_pretrained."""
    model = make()
    funcs = build_layers(to_pipeline(model))
    ckpt = tmp_path / "ckpt" / "global_step3"
    ckpt.mkdir(parents=True)
    with torch.no_grad():
        for module in {id(f): f for f in funcs if isinstance(f, torch.nn.Module)}.values():
            for p in module.parameters():
                p.add_(0.125)                                   # "trained": every weight moved once
    for idx, f in enumerate(funcs):
        module = f if isinstance(f, torch.nn.Module) else funcs[0]    # a tied head: the embedding's module
        torch.save(module.state_dict(), ckpt / f"layer_{idx:02d}-model_states.pt")
    (tmp_path / "ckpt" / "latest").write_text("global_step3")
    export_pretrained(str(tmp_path / "ckpt"), model.config, str(tmp_path / "hf"))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded) is type(model)
    expected = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.allclose(value, expected[name] + 0.125), name


def test_export_refuses_a_checkpoint_of_another_model(tmp_path):
    model = gpt2()
    for idx, f in enumerate(build_layers(to_pipeline(model))[:3]):
        torch.save(f.state_dict(), tmp_path / f"layer_{idx:02d}-model_states.pt")
    with pytest.raises(ValueError, match="converts to 6 layers"):
        export_pretrained(str(tmp_path), model, str(tmp_path / "hf"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no layer_XX-model_states.pt"):
        export_pretrained(str(empty), model, str(tmp_path / "x"))


class Args:
    """The TrainingArguments fields resolve() reads."""
    per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm = 2, 1, 1.0
    learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay = 1e-3, 0.9, 0.999, 1e-8, 0.0
    fp16 = bf16 = False


def pipe_config(**kw):
    return {"train_batch_size": 16, "pipeline": {"schedule": "chimera"}, **kw}


def test_resolve_derives_micro_batches_from_the_pipelines_data_parallel_size():
    setup = resolve(pipe_config(pipeline={"schedule": "1f1b", "stages": 2}), Args(), world_size=4)
    assert (setup.stages, setup.data_parallel, setup.micro_batches, setup.global_batch) == (2, 2, 4, 16)
    assert setup.config["gradient_accumulation_steps"] == 4 and setup.config["gradient_clipping"] == 1.0
    auto = resolve({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                    "pipeline": {"schedule": "gpipe"}}, Args(), world_size=2)
    assert auto.micro_batches == 1 and auto.config["optimizer"]["params"]["lr"] == 1e-3


@pytest.mark.parametrize("config,world,message", [
    (pipe_config(zero_optimization={"stage": 3}), 4, "ZeRO stage 3 does not compose with pipeline schedules"),
    (pipe_config(train_batch_size=9), 4, "train_batch_size 9 is not divisible by per_device_train_batch_size 2 x "
                                          "data-parallel size 1"),
    (pipe_config(train_micro_batch_size_per_gpu=4), 4, "train_micro_batch_size_per_gpu=4 disagrees with "
                                                       "per_device_train_batch_size=2"),
    (pipe_config(pipeline={"schedule": "chimera", "stages": 3}), 4, "\"stages\": 3} must divide the world size 4"),
    (pipe_config(pipeline={"schedule": "chimaera"}), 4, "unknown schedule 'chimaera'"),
    (pipe_config(train_batch_size=6, pipeline={"schedule": "interleaved"}), 2,
     "interleaved needs micro_batches to be a multiple of stages (2), got 3"),
    ({"train_batch_size": 8}, 4, "needs a \"pipeline\": {\"schedule\": NAME} section"),
    (pipe_config(fp16={"enabled": True}), 4, "fp16 training (loss scaling) is not supported"),
    (pipe_config(zero_optimization={"stage": 1}), 4, "ZeRO stage 1 with schedule 'chimera' is not supported"),
])
def test_resolve_refuses_bad_setups_by_value(config, world, message):
    with pytest.raises(ValueError) as info:
        resolve(config, Args(), world_size=world)
    assert message in str(info.value)


def test_resolve_refuses_conflicting_accumulation():
    args = Args()
    args.gradient_accumulation_steps = 3
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 disagrees with the DeepSpeed config's 8"):
        resolve(pipe_config(), args, world_size=4)


@pytest.mark.parametrize("attr,value", [("label_smoothing_factor", 0.1), ("gradient_checkpointing", True),
                                        ("load_best_model_at_end", True), ("average_tokens_across_devices", False)])
def test_resolve_refuses_arguments_the_pipeline_would_ignore(attr, value):
    args = Args()
    setattr(args, attr, value)
    with pytest.raises(ValueError, match=f"does not support TrainingArguments\\({attr}={value!r}\\)"):
        resolve(pipe_config(), args, world_size=4)


def test_a_random_collator_draws_the_same_numbers_on_every_rank():
    """Ranks collate the global batch themselves: a random collator must agree whatever each rank's RNG did."""
    from ds_chimera.hf.data import Batches
    rows = [{"input_ids": torch.arange(6), "labels": torch.arange(6)}] * 8

    def noisy(items):
        ids = torch.stack([item["input_ids"] for item in items])
        return {"input_ids": ids, "labels": torch.where(torch.rand(ids.shape) < 0.5, -100, ids)}
    draws = []
    for burn in (0, 7):                  # two "ranks" whose RNGs were used differently before
        torch.rand(burn)
        batches = Batches(rows, noisy, micro_batch=2, micro_batches=2, data_parallel=1, seed=3)
        draws.append([labels for _ in range(2) for _, (labels, _) in batches.step(list(range(4)), 0)[0]])
    assert all(torch.equal(a, b) for a, b in zip(*draws))
    assert not torch.equal(draws[0][0], draws[0][2])          # and the draws still change from step to step


def test_collator_keys_the_layers_cannot_honour_are_refused():
    from ds_chimera.hf.data import Batches
    rows = [{"input_ids": torch.arange(6), "labels": torch.arange(6), "position_ids": torch.arange(6)}] * 4

    def collate(items):
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}
    batches = Batches(rows, collate, micro_batch=2, micro_batches=2, data_parallel=1)
    with pytest.raises(ValueError, match="also returned \\['position_ids'\\]"):
        batches.step([0, 1, 2, 3], dp_rank=0)


def test_describe_maps_layers_to_hf_names():
    layout = describe(llama())
    assert [p.kind for p in layout.layers] == ["embed", "block", "block", "block", "norm", "head"]
    assert layout.layers[2].hf_name("block.self_attn.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert layout.layers[-1].hf_name("proj.weight") == "lm_head.weight"
    assert describe(gpt2()).layers[0].hf_name("positions.weight") == "transformer.wpe.weight"


# ---- multi-rank: PipelineTrainer against single-process training ------------------------------------
RUNS = {4: ["config-file", "chimera-4x1-gpt2", "1f1b-2x2-llama-padded", "bad-zero2", "bad-batch", "bad-micro",
            "bad-model"],
        2: ["gpipe-2x1-llama-tied"]}
_RESULTS = {}


def hf_results(tmp_path_factory, world):
    if world not in _RESULTS:
        out = tmp_path_factory.mktemp(f"hf{world}") / "results.json"
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(free_port()), WORKER, str(out), ",".join(RUNS[world])]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"hf worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        _RESULTS[world] = json.loads(out.read_text())
    return _RESULTS[world]


@pytest.mark.parametrize("world,scenario", [(4, "chimera-4x1-gpt2"), (4, "1f1b-2x2-llama-padded"),
                                            (2, "gpipe-2x1-llama-tied")])
def test_trainer_matches_single_process_training(tmp_path_factory, world, scenario):
    r = hf_results(tmp_path_factory, world)[scenario]
    assert max(r["ref_norms"]) > r["clip"], "clipping must be active for this test to mean anything"
    assert r["global_step"] == 3 and len(r["losses"]) == 3          # Trainer logging: one loss per step
    assert r["max_loss_diff"] <= 1e-5 and r["train_loss_diff"] <= 1e-5
    assert r["eval_diff"] <= 1e-5                                    # evaluate() through eval_batch
    assert {"loss", "learning_rate", "grad_norm", "eval_loss", "train_loss"} <= set(r["log_keys"])
    # save_model -> from_pretrained gives the pipeline's trained weights (and the reference's)
    assert {"config.json", "model.safetensors"} <= set(r["files"])
    assert r["saved_vs_pipeline"] == 0.0
    assert r["saved_vs_reference"] <= 1e-5 and r["trainer_model_vs_reference"] <= 1e-5


def test_trainer_ties_survive_saving(tmp_path_factory):
    assert hf_results(tmp_path_factory, 4)["chimera-4x1-gpt2"]["tied_in_saved"] is True
    assert hf_results(tmp_path_factory, 2)["gpipe-2x1-llama-tied"]["tied_in_saved"] is True
    assert hf_results(tmp_path_factory, 4)["1f1b-2x2-llama-padded"]["tied_in_saved"] is False


def test_trainer_checkpoints_export_from_their_layer_files(tmp_path_factory):
    r = hf_results(tmp_path_factory, 4)["chimera-4x1-gpt2"]
    assert {"config.json", "model.safetensors", "pipeline", "trainer_state.json"} <= set(r["checkpoint_files"])
    assert r["layers_export_vs_saved"] == 0.0


def test_trainer_accepts_a_configs_file_without_zero_section(tmp_path_factory):
    r = hf_results(tmp_path_factory, 4)["config-file"]
    assert r["schedule"] == "chimera" and r["stages"] == 4 and r["micro_batches"] >= 1


@pytest.mark.parametrize("scenario,message", [
    ("bad-zero2", "ZeRO stage 2 does not compose with pipeline schedules; use stage 0 or 1"),
    ("bad-batch", "train_batch_size 10 is not divisible by per_device_train_batch_size 4 x data-parallel size 1"),
    ("bad-micro", "train_micro_batch_size_per_gpu=3 disagrees with per_device_train_batch_size=2"),
    ("bad-model", "cannot convert BertLMHeadModel"),
])
def test_trainer_refuses_bad_setups_before_work(tmp_path_factory, scenario, message):
    assert message in (hf_results(tmp_path_factory, 4)[scenario]["error"] or "")


def test_readme_example_trains_and_reloads(tmp_path):
    """examples/hf_trainer.py as the README runs it (4 ranks), here with Llama on zbv: loss falls, HF folder reloads."""
    root = os.path.dirname(HERE)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           os.path.join(root, "examples", "hf_trainer.py"), "--model", "llama", "--deepspeed",
           os.path.join(root, "configs", "zbv.json"), "--steps", "10", "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("[hf_trainer]"))
    assert "schedule zbv, 4 stages x 1 data-parallel" in line and "reloaded LlamaForCausalLM" in line
    losses = json.loads(line.split("logged losses ")[1].split(";")[0])
    assert len(losses) == 2 and losses[-1] < losses[0], losses
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "out" / "final"))
