"""ds_chimera.hf: HF causal LMs as pipeline layers, HF checkpoints back, and the PipelineTrainer.

In-process tests check the conversion (same logits and loss as the HF model), the export,
the set-up checks, the loss weighting and the routing. The multi-rank comparison with the
plain Trainer is tests/test_hf_trainer.py.
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from deepspeed.pipe import TiedLayerSpec  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from ds_chimera.hf import causal_lm_loss, export_pretrained, to_pipeline  # noqa: E402
from ds_chimera.hf.config import checkpoint_interval, resolve  # noqa: E402
from ds_chimera.hf.convert import build_layers, run_layers  # noqa: E402
from ds_chimera.hf.layout import describe  # noqa: E402

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
    per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm = 2, 4, 1.0
    learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay = 1e-3, 0.9, 0.999, 1e-8, 0.0
    fp16 = bf16 = False


def args(**kw):
    a = Args()
    for key, value in kw.items():
        setattr(a, key, value)
    return a


def pipe_config(**kw):
    return {"train_batch_size": 8, "pipeline": {"schedule": "chimera"}, **kw}


def test_resolve_takes_the_arguments_and_the_pipelines_data_parallel_size():
    setup = resolve({"train_batch_size": 16, "pipeline": {"schedule": "1f1b", "stages": 2}}, Args(), world_size=4)
    assert (setup.stages, setup.data_parallel, setup.micro_batches, setup.global_batch) == (2, 2, 4, 16)
    assert setup.config["gradient_accumulation_steps"] == 4 and setup.config["gradient_clipping"] == 1.0
    auto = resolve({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                    "train_batch_size": "auto", "gradient_clipping": "auto",
                    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
                    "pipeline": {"schedule": "gpipe"}}, args(gradient_accumulation_steps=3), world_size=2)
    assert (auto.micro_batches, auto.config["train_batch_size"], auto.config["train_micro_batch_size_per_gpu"]) \
        == (3, 6, 2)
    assert auto.config["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.999]}
    bare = resolve({"pipeline": {"schedule": "zbv"}}, args(max_grad_norm=0.0), world_size=4)   # all keys missing
    assert bare.config["train_batch_size"] == 8 and bare.max_grad_norm == 0.0 and bare.engine_clip == float("inf")


@pytest.mark.parametrize("config,world,message", [
    (pipe_config(zero_optimization={"stage": 3}), 4, "ZeRO stage 3 with pipeline schedules runs on ds_chimera's DeepSpeed engine only"),
    (pipe_config(train_batch_size=9), 4, "train_batch_size=9 disagrees with per_device_train_batch_size 2 x "
                                          "gradient_accumulation_steps 4 x data-parallel size 1 (world size 4 / 4 "
                                          "pipeline stages) = 8; set it to \"auto\""),
    (pipe_config(train_batch_size=16), 4, "set it to \"auto\" or pass --gradient_accumulation_steps 8"),
    (pipe_config(train_micro_batch_size_per_gpu=4), 4, "train_micro_batch_size_per_gpu=4 disagrees with "
                                                       "per_device_train_batch_size=2; set it to \"auto\" or pass "
                                                       "--per_device_train_batch_size 4"),
    (pipe_config(gradient_accumulation_steps=8), 4, "gradient_accumulation_steps=8 disagrees with "
                                                    "gradient_accumulation_steps=4"),
    (pipe_config(gradient_clipping=0.5), 4, "gradient_clipping=0.5 disagrees with max_grad_norm=1.0"),
    (pipe_config(optimizer={"type": "AdamW", "params": {"lr": 0.003}}), 4,
     "optimizer.params.lr=0.003 disagrees with learning_rate=0.001"),
    (pipe_config(bf16={"enabled": True}), 4, "bf16.enabled=True disagrees with bf16=False"),
    (pipe_config(pipeline={"schedule": "chimera", "stages": 3}), 4, "\"stages\": 3} must divide the world size 4"),
    (pipe_config(pipeline={"schedule": "chimaera"}), 4, "unknown schedule 'chimaera'"),
    (pipe_config(train_batch_size=6, pipeline={"schedule": "interleaved"}), 4,
     "interleaved needs micro_batches to be a multiple of stages (4), got 3"),
    ({"train_batch_size": 8, "pipeline": {"stages": 2}}, 4, "\"pipeline\" section needs a schedule"),
    (pipe_config(fp16={"enabled": True}), 4, "the DeepSpeed config's fp16.enabled=True disagrees with fp16=False; "
                                             "set it to \"auto\" or pass --fp16 True"),
])
def test_resolve_refuses_bad_setups_by_value(config, world, message):
    a = args(gradient_accumulation_steps=3) if "interleaved" in str(config) and world == 4 else Args()
    with pytest.raises(ValueError) as info:
        resolve(config, a, world_size=world)
    assert message in str(info.value)


@pytest.mark.parametrize("attr,value", [("label_smoothing_factor", 0.1), ("use_liger_kernel", True),
                                        ("load_best_model_at_end", True), ("torch_compile", True),
                                        ("neftune_noise_alpha", 5.0)])
def test_resolve_refuses_arguments_the_pipeline_would_ignore(attr, value):
    with pytest.raises(ValueError, match=f"does not support TrainingArguments\\({attr}={value!r}\\)"):
        resolve(pipe_config(), args(**{attr: value}), world_size=4)
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'"):
        resolve(pipe_config(), args(train_sampling_strategy="group_by_length"), world_size=4)


def test_schedule_auto_is_taken_and_what_the_planner_cannot_fix_is_refused_at_setup():
    """"auto" on the HF path: its planner keys are checked, schedule checks wait for the plan; an asynchronous
    choice for a tied model, and fewer layers than pipeline ranks, are refused before any work."""
    from ds_chimera.hf.checks import check_model_fits
    setup = resolve(pipe_config(pipeline={"schedule": "auto", "max_activations": 4}), Args(), world_size=4)
    assert setup.pipeline.planned and setup.options == {"max_activations": 4}
    for model in (gpt2(), llama()):
        assert check_model_fits(describe(model), setup, 4) is None
    with pytest.raises(ValueError, match="max_activations must be a number of micro-batches >= 1"):
        resolve(pipe_config(pipeline={"schedule": "auto", "max_activations": 0}), Args(), world_size=4)
    with pytest.raises(ValueError, match="unknown key 'chunks'"):
        resolve(pipe_config(pipeline={"schedule": "auto", "chunks": 2}), Args(), world_size=4)
    lets_async = resolve(pipe_config(pipeline={"schedule": "auto", "allow_asynchronous": True}), Args(), world_size=4)
    assert check_model_fits(describe(llama()), lets_async, 4) is None           # untied: the planner may choose one
    for tied in (gpt2(), llama(tied=True)):
        with pytest.raises(ValueError, match="allow_asynchronous") as info:
            check_model_fits(describe(tied), lets_async, 4)
        assert "cannot keep" in str(info.value) and "tied embedding and head equal" in str(info.value)
    eight = resolve({"pipeline": {"schedule": "auto"}}, args(gradient_accumulation_steps=8), world_size=8)
    with pytest.raises(ValueError, match="has only 6 \\(embedding, 3 blocks, final norm, head\\); use a model with "
                                         "at least 5 decoder blocks, or fewer ranks per pipeline: "
                                         "\"pipeline\": {\"stages\": 4}"):
        check_model_fits(describe(gpt2()), eight, 8)


def test_the_planners_micro_batch_leaves_every_random_stream_alone():
    """The first micro-batch for "auto" (per_device_train_batch_size rows of the first batch, as the engine's
    pair), read without moving torch's, Python's or NumPy's stream; the eval data without a train dataset."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from ds_chimera.config import PipelineConfig
    from ds_chimera.hf.build import profile_micro_batch

    def collate(rows):
        random.random(), np.random.rand(), torch.rand(1)           # a collator that draws from all three
        return {"input_ids": torch.stack(rows), "labels": torch.stack(rows)}

    rows = torch.arange(40).reshape(8, 5)

    def loader(data):
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, collate_fn=collate)

    pipeline = PipelineConfig.from_deepspeed({"train_batch_size": 8, "pipeline": {"schedule": "auto"}}, sharding=False)
    trainer = SimpleNamespace(setup=SimpleNamespace(pipeline=pipeline, micro_batch=2), train_dataset=list(rows),
                              eval_dataset=None, get_train_dataloader=lambda: loader(trainer.train_dataset),
                              get_eval_dataloader=lambda name=None: loader(trainer.eval_dataset),
                              _uses_mask=lambda batch: False)

    def draws():
        return torch.rand(1).item(), random.random(), np.random.rand()

    def seed():
        torch.manual_seed(5), random.seed(5), np.random.seed(5)

    seed()
    expected = draws()
    seed()
    inputs, (labels, weight, tag) = profile_micro_batch(trainer)
    assert draws() == expected
    seed()
    first = next(iter(loader(trainer.train_dataset)))["input_ids"]
    assert torch.equal(inputs, first[:2]) and torch.equal(labels, first[:2])       # the batch training starts with
    assert weight.item() == pytest.approx(1 / 8) and tag.item() == -1             # 2 rows x 4 shifted targets
    trainer.train_dataset, trainer.eval_dataset = None, list(rows[:1])
    assert profile_micro_batch(trainer)[0].shape == (1, 5)                         # fewer rows than a micro-batch
    trainer.eval_dataset = None
    with pytest.raises(ValueError, match="neither a train_dataset nor an eval_dataset"):
        profile_micro_batch(trainer)


def test_micro_batch_weights_make_the_engines_mean_the_trainers_loss():
    """Engine loss = mean over N x dp of (summed token loss x weight); it must be HF's loss for the step."""
    from ds_chimera.hf.data import eval_micro_batches, train_micro_batches
    g = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, generator=g)     # "model": logits of a token, the same in any slice
    batches = []
    for rows in (4, 4, 3):                             # a short last batch; accumulation 3 of N = 4
        ids = torch.randint(0, VOCAB, (rows, 6), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        batches.append({"input_ids": ids, "labels": labels})

    def engine_mean(num_items):
        losses = []
        for rank in range(2):                          # dp = 2
            pairs = train_micro_batches(batches, 4, 2, rank, num_items, len(batches), False)
            assert len(pairs) == 4 and all(int(target[2]) == -1 for _, target in pairs)
            losses += [causal_lm_loss(table[ids], target).item() for ids, target in pairs]
        return sum(losses) / len(losses)
    count = sum(int((b["labels"] != -100).sum()) for b in batches)       # HF's count for GPT-2 (loss_type None)
    summed = sum(ForCausalLMLoss(table[b["input_ids"]], b["labels"], VOCAB, num_items_in_batch=1).item()
                 for b in batches)
    assert engine_mean(torch.tensor(float(count))) == pytest.approx(summed / count, rel=1e-5)
    # without num_items_in_batch HF averages each micro-batch, divides by the accumulation, and DDP averages
    means = [ForCausalLMLoss(table[b["input_ids"][half]], b["labels"][half], VOCAB).item()
             for b in batches for half in torch.tensor_split(torch.arange(b["input_ids"].shape[0]), 2)]
    assert engine_mean(None) == pytest.approx(sum(means) / len(batches) / 2, rel=1e-5)
    pairs = eval_micro_batches(batches[2], 4, 1, 0, 0.5, False)          # 3 rows over 4 slices: one filler
    assert [int(target[2]) for _, target in pairs] == [0, 1, 2, -1] and float(pairs[3][1][1]) == 0.0
    assert (pairs[3][1][0] == -100).all()


def test_compute_randomness_leaves_the_data_stream_alike_on_every_rank():
    """Ranks collate their own copy of each batch: compute that draws differently must not shift the data's draws."""
    from ds_chimera.hf.rng import ComputeRNG
    draws = []
    for rank, work in ((0, 3), (1, 11)):
        torch.manual_seed(5)
        compute = ComputeRNG(seed=5, rank=rank)
        with compute.active():
            torch.rand(work)                         # dropout, layer init: different per rank
        draws.append((torch.rand(4), compute))
    assert torch.equal(draws[0][0], draws[1][0])
    with draws[0][1].active():
        a = torch.rand(3)
    with draws[1][1].active():
        b = torch.rand(3)
    assert not torch.equal(a, b)                     # and the ranks' compute streams differ


def test_batches_the_layers_cannot_honour_are_refused():
    from ds_chimera.hf.data import check_batch
    with pytest.raises(ValueError, match="the batch also has \\['position_ids'\\]"):
        check_batch({"input_ids": torch.zeros(1, 2), "labels": torch.zeros(1, 2), "position_ids": torch.zeros(1, 2)})


def test_trainer_subclasses_are_routed_or_refused_by_name():
    from transformers import Trainer

    import ds_chimera  # noqa: F401  (installs the routing)
    from ds_chimera.hf.routing import check_overrides, pipelined_class
    from ds_chimera.hf.trainer import PipelineTrainer

    class Logging(Trainer):
        def log(self, logs, start_time=None):
            super().log(logs, start_time)

    class CustomLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 0

    assert pipelined_class(Trainer) is PipelineTrainer
    routed = pipelined_class(Logging)
    assert routed.__mro__[1:3] == (Logging, PipelineTrainer) and routed.__name__ == "Logging"
    check_overrides(Logging)
    with pytest.raises(ValueError, match="CustomLoss overrides compute_loss\\(\\), which a pipelined Trainer cannot run"):
        check_overrides(CustomLoss)
    assert getattr(Trainer.__init__, "_ds_chimera_routed", False)


def test_describe_maps_layers_to_hf_names():
    layout = describe(llama())
    assert [p.kind for p in layout.layers] == ["embed", "block", "block", "block", "norm", "head"]
    assert layout.layers[2].hf_name("block.self_attn.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert layout.layers[-1].hf_name("proj.weight") == "lm_head.weight"
    assert describe(gpt2()).layers[0].hf_name("positions.weight") == "transformer.wpe.weight"


# ---- an unsupported model family is refused before the script's data work ------------------------

def bart_config():
    return transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                   decoder_ffn_dim=16, max_position_embeddings=32, pad_token_id=1, bos_token_id=0,
                                   eos_token_id=0, decoder_start_token_id=0)


def pipeline_args(tmp_path):
    from transformers import TrainingArguments

    import ds_chimera  # noqa: F401  (the hooks)
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none",
                             deepspeed={"pipeline": {"schedule": "1f1b"}})


@pytest.fixture
def one_process(monkeypatch):
    import gc
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("DS_CHIMERA_EARLY_MODEL_CHECK", raising=False)
    gc.collect()          # pipeline arguments of an earlier test (kept by a traceback's cycle) are gone
    yield
    gc.collect()


def test_an_unsupported_family_is_refused_before_the_run_clm_script_tokenizes(tmp_path, one_process):
    """The run_clm-shaped script parses its arguments, builds the model, then tokenizes: BART stops at the model."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed"))
    import hf_clm
    from hf_assets import make_assets

    import ds_chimera  # noqa: F401  (the explicit path: imported before the arguments are built)
    assets = make_assets(str(tmp_path / "assets"))
    bart_config().save_pretrained(tmp_path / "bart")
    with open(tmp_path / "ds.json", "w") as fh:
        fh.write('{"pipeline": {"schedule": "1f1b"}}')
    argv = ["--config_name", str(tmp_path / "bart"), "--tokenizer_name", os.path.join(assets, "tokenizer"),
            "--train_file", os.path.join(assets, "train.txt"), "--output_dir", str(tmp_path / "out"),
            "--deepspeed", str(tmp_path / "ds.json"), "--report_to", "none", "--do_train", "--max_steps", "1"]
    tokenized, blocks = [], hf_clm.blocks
    verbosity = transformers.utils.logging.get_verbosity()
    try:
        hf_clm.blocks = lambda *a: tokenized.append(1) or blocks(*a)
        with pytest.raises(ValueError) as refused:
            hf_clm.main(argv)
    finally:
        hf_clm.blocks = blocks
        transformers.utils.logging.set_verbosity(verbosity)
    assert not tokenized
    message = str(refused.value)
    assert "cannot convert BartForCausalLM: encoder-decoder / cross-attention models (model type 'bart')" in message
    assert "supported: GPT2LMHeadModel, LlamaForCausalLM, causal LMs whose config has base_model_pp_plan" in message
    assert "refused when BartForCausalLM is created from its config" in message


def test_the_family_is_checked_at_model_creation_and_at_the_arguments(tmp_path, one_process, monkeypatch):
    import gc

    from transformers import AutoModelForSeq2SeqLM, BartForCausalLM
    # no pipeline arguments yet: any model may be created; a BART saved for from_pretrained below
    model = AutoModelForCausalLM.from_config(bart_config())
    model.save_pretrained(tmp_path / "bart")
    # arguments built after the model: refused there, naming it
    with pytest.raises(ValueError, match="model type 'bart'.*refused as the TrainingArguments are built \\(the "
                                         "model BartForCausalLM was created before them\\)"):
        pipeline_args(tmp_path)
    del model
    gc.collect()
    args = pipeline_args(tmp_path)
    assert type(AutoModelForCausalLM.from_config(gpt2().config)).__name__ == "GPT2LMHeadModel"   # supported
    with pytest.raises(ValueError, match="cannot convert T5ForConditionalGeneration: encoder-decoder.*model type "
                                         "'t5'.*refused when T5ForConditionalGeneration is created from its config"):
        AutoModelForSeq2SeqLM.from_config(transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=16,
                                                                num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match="refused when BartForCausalLM.from_pretrained is called, before its "
                                         "weights load"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "bart")
    with pytest.raises(ValueError, match="refused when BartForCausalLM.from_pretrained returns"):
        BartForCausalLM.from_pretrained(tmp_path / "bart")
    # a model built for another use: the check can be turned off (the Trainer still checks what it is given)
    monkeypatch.setenv("DS_CHIMERA_EARLY_MODEL_CHECK", "0")
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "bart")
    monkeypatch.delenv("DS_CHIMERA_EARLY_MODEL_CHECK")
    from ds_chimera.hf import PipelineTrainer
    with pytest.raises(ValueError, match="cannot convert BartForCausalLM: it is not GPT-2 or Llama and its config "
                                         "\\(BartConfig, model type 'bart'\\) has no base_model_pp_plan"):
        PipelineTrainer(model=other, args=args)
    del args, other
    gc.collect()
    AutoModelForCausalLM.from_config(bart_config())      # no pipeline arguments alive: nothing to check


def test_models_transformers_builds_for_itself_are_not_checked(tmp_path, one_process):
    from ds_chimera.hf.early import _created_by_script
    args = pipeline_args(tmp_path)  # noqa: F841
    assert _created_by_script()                                    # called from this test: the script
    caller = {"__name__": "transformers.pipelines.base", "check": _created_by_script}
    assert not eval("check()", caller)                             # called from transformers: not checked


def test_a_checkpoint_a_plain_trainer_cannot_resume_exactly_says_so_when_written(tmp_path):
    """With the DeepSpeed config's optimizer or scheduler, no optimizer.pt: the main process warns, once."""
    import logging
    from types import SimpleNamespace

    from ds_chimera.hf.plain_resume import save_plain_optimizer, unreadable_reason
    from ds_chimera.logs import get_logger
    args = SimpleNamespace(should_save=True, save_on_each_node=False)
    own = SimpleNamespace(hf_optimizer=object(), engine_owns_scheduler=False, args=args)
    config_optimizer = SimpleNamespace(hf_optimizer=None, engine_owns_scheduler=False, args=args)
    config_scheduler = SimpleNamespace(hf_optimizer=object(), engine_owns_scheduler=True, args=args)
    assert unreadable_reason(own) is None
    assert "\"optimizer\" section built the optimizer" in unreadable_reason(config_optimizer)
    assert "\"scheduler\" section drives the learning rate" in unreadable_reason(config_scheduler)
    caught, handler = [], logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        for step in (2, 4):
            save_plain_optimizer(config_optimizer, str(tmp_path / f"checkpoint-{step}"))
    finally:
        get_logger().removeHandler(handler)
    assert len(caught) == 1 and caught[0].startswith("checkpoint-2 has no optimizer.pt a plain transformers.Trainer "
                                                     "can read (the DeepSpeed config's \"optimizer\" section")
    assert not os.listdir(tmp_path)


def test_hfs_activation_checkpointing_becomes_a_checkpoint_of_every_pipeline_layer():
    from transformers import TrainingArguments
    plain = TrainingArguments(output_dir="unused", report_to=[])
    assert checkpoint_interval(plain, 0) == 0 and checkpoint_interval(plain, 3) == 3
    for flag in ("gradient_checkpointing", "activation_checkpointing"):
        args = TrainingArguments(output_dir="unused", report_to=[], **{flag: True})
        assert checkpoint_interval(args, 0) == 1 and checkpoint_interval(args, 1) == 1
        with pytest.raises(ValueError, match="disagrees with PipelineTrainer's activation_checkpoint_interval=2"):
            checkpoint_interval(args, 2)
    args = TrainingArguments(output_dir="unused", report_to=[], activation_checkpointing=True,
                             activation_checkpointing_kwargs={"use_reentrant": False})
    assert checkpoint_interval(args, 0) == 1
    for kwargs in ({"every_n_layers": 2}, {"offload": True}, {"preserve_rng_state": False}):
        args = TrainingArguments(output_dir="unused", report_to=[], activation_checkpointing=True,
                                 activation_checkpointing_kwargs=kwargs)
        with pytest.raises(ValueError, match="only as every_n_layers=1.*activation_checkpoint_interval=K"):
            checkpoint_interval(args, 0)


def test_a_config_file_is_read_as_deepspeed_reads_it_a_key_given_twice_refused(tmp_path):
    """One reader on every path (ds_chimera/config_reader.py): the HF Trainer's, like DeepSpeed's initialize."""
    from ds_chimera.config_reader import read_config
    from ds_chimera.hf.config import load_config
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "pipeline": {"schedule": "chimera"}, "train_batch_size": 16}')
    with pytest.raises(ValueError, match="TrainingArguments\\(deepspeed=...\\) .*ds.json.* cannot be used: .*Duplicate"):
        load_config(str(path))
    with pytest.raises(ValueError, match="Duplicate"):
        read_config(str(path))
    path.write_text('{train_batch_size: 8, pipeline: {schedule: "chimera"}}')        # HJSON, as DeepSpeed reads
    assert load_config(str(path)) == {"train_batch_size": 8, "pipeline": {"schedule": "chimera"}}


def test_fp16_follows_the_trainers_argument_as_bf16_does():
    """--fp16 with "fp16": {"enabled": "auto"} (HF's DeepSpeed configs) turns fp16 on, keeping the section's loss-scale
    keys; no --fp16 turns an "auto" section off; a section without "enabled" follows the argument too."""
    on = resolve(pipe_config(fp16={"enabled": "auto", "initial_scale_power": 12}), args(fp16=True), world_size=4)
    assert on.config["fp16"] == {"enabled": True, "initial_scale_power": 12} and on.pipeline.fp16
    assert on.pipeline.loss_scale.initial_scale_power == 12
    off = resolve(pipe_config(fp16={"enabled": "auto"}), args(), world_size=4)
    assert off.config["fp16"]["enabled"] is False and off.pipeline.precision == "fp32"
    assert resolve(pipe_config(), args(fp16=True), world_size=4).pipeline.fp16
    with pytest.raises(ValueError, match="bf16.enabled=True disagrees with bf16=False"):
        resolve(pipe_config(bf16={"enabled": True}), args(fp16=True), world_size=4)


def test_fp16_with_zero1_on_an_accelerator_without_fp16_is_refused_before_the_data(monkeypatch):
    """DeepSpeed's ZeRO-1 fp16 optimizer is built only where the accelerator reports fp16: the config check says so
    (and names ZeRO-0) before the Trainer prepares any data. DeepSpeed's CPU accelerator reports fp16 where the CPU
    has oneDNN fp16 (AVX512-FP16/AMX): the test sets the report of a CPU without it, so it runs on any host."""
    from deepspeed.accelerator import get_accelerator
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    with pytest.raises(ValueError, match="fp16 with ZeRO stage 1 runs DeepSpeed's ZeRO-1 fp16 optimizer, which "
                                         "DeepSpeed refuses on the 'cpu' accelerator.*use fp16 with ZeRO stage 0"):
        resolve(pipe_config(fp16={"enabled": "auto"}, zero_optimization={"stage": 1}), args(fp16=True), world_size=4)

