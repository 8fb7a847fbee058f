"""PipelineTrainer scenarios on a torchrun group (gloo, CPU), compared with single-process HF training.

Usage: torchrun --nproc_per_node W hf_worker.py OUT.json SCENARIO[,SCENARIO...]
Each scenario trains a tiny random GPT-2 or Llama with a ds_chimera schedule through
ds_chimera.hf.PipelineTrainer, and trains a copy of the same model in one process with
plain torch (same optimizer, weight-decay groups, LR schedule, clipping and global
batches, HF's own loss). Rank 0 writes {scenario: result} to OUT.json.
"""
import copy
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as tdist

from ds_chimera.hf import PipelineTrainer, export_pretrained  # noqa: I001  (before TrainingArguments)
from ds_chimera.hf.data import epoch_order
from ds_chimera.hf.export import gather_layer_states, hf_state_dict
from ds_chimera.hf.layout import describe
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainingArguments, default_data_collator)
from transformers.optimization import get_scheduler

SEQ, VOCAB, STEPS, SEED = 8, 61, 3, 7


def gpt2(layers=4):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def llama(layers=2, tied=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=16, intermediate_size=32,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, tie_word_embeddings=tied, bos_token_id=0,
                                        eos_token_id=0))


def dataset(size, padded=False, seed=1):
    """Random token sequences; ``padded``: right padding with mask 0 and labels -100 on some rows."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(size):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        labels, mask = ids.clone(), torch.ones(SEQ, dtype=torch.long)
        if padded and i % 3 == 1:
            keep = 3 + i % 4
            ids[keep:], mask[keep:], labels[keep:] = 0, 0, -100
        row = {"input_ids": ids, "labels": labels}
        if padded:
            row["attention_mask"] = mask
        rows.append(row)
    return rows


def shared_dir():
    holder = [tempfile.mkdtemp(prefix="dsc_hf_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    return holder[0]


def training_args(out, config, micro=2, **extra):
    kw = dict(output_dir=out, deepspeed=config, per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
              learning_rate=1e-2, max_steps=STEPS, logging_steps=1, max_grad_norm=0.5, weight_decay=0.1,
              lr_scheduler_type="linear", warmup_steps=1, optim="adamw_torch", report_to="none",
              save_strategy="no", seed=SEED, disable_tqdm=True)
    kw.update(extra)
    return TrainingArguments(**kw)


def hf_loss(model, batch, total):
    """HF's own loss, normalised by the global batch's scored tokens (HF Trainer's num_items_in_batch)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"],
                 num_items_in_batch=total).loss


def targets(batch):
    return int((batch["labels"][..., 1:] != -100).sum())


def reference(model, train, args, global_batch, micro):
    """Single-process training of a copy of ``model`` on the same global batches."""
    model = copy.deepcopy(model).train()
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    opt = cls([{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
               {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], **kwargs)
    sched = get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.get_warmup_steps(STEPS),
                          num_training_steps=STEPS)
    order = epoch_order(len(train), SEED, 0)
    losses, norms = [], []
    for step in range(STEPS):
        idx = order[step * global_batch:(step + 1) * global_batch]
        batches = [default_data_collator([train[i] for i in idx[k:k + micro]]) for k in range(0, global_batch, micro)]
        total = sum(targets(b) for b in batches)
        opt.zero_grad()
        loss = 0.0
        for b in batches:
            part = hf_loss(model, b, total)
            part.backward()
            loss += part.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
        opt.step()
        sched.step()
        losses.append(loss)
    return model, losses, norms


def reference_eval(model, data, micro):
    total, tokens = 0.0, 0
    with torch.no_grad():
        for k in range(0, len(data), micro):
            b = default_data_collator(data[k:k + micro])
            n = targets(b)
            total += hf_loss(model.eval(), b, n).item() * n
            tokens += n
    return total / tokens


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def train_and_compare(make_model, schedule, stages, world, n, padded=False, save_steps=None, **options):
    """PipelineTrainer vs single-process training; HF checkpoints round-trip the trained weights."""
    model = make_model()
    micro, dp = 2, world // stages
    global_batch = micro * n * dp
    train = dataset(global_batch * STEPS, padded)
    evals = dataset(global_batch + 3, padded, seed=2)          # a partial eval batch too
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro, "steps_per_print": 1000,
              "pipeline": {"schedule": schedule, "stages": stages, "timeout": 60, **options}}
    root = shared_dir()
    extra = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    args = training_args(os.path.join(root, "out"), config, micro, **extra)
    trainer = PipelineTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals,
                              data_collator=default_data_collator, partition_method="uniform")
    output = trainer.train()
    metrics = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    saved = os.path.join(root, "hf")
    trainer.save_model(saved)
    pipeline_states = gather_layer_states(trainer.engine, dst=0)
    result = {}
    if tdist.get_rank() == 0:
        ref_model, ref_losses, ref_norms = reference(model_copy_initial(make_model), train, args, global_batch, micro)
        loaded = AutoModelForCausalLM.from_pretrained(saved)
        ours = hf_state_dict(describe(loaded), pipeline_states)
        loaded_sd = {k: v for k, v in loaded.state_dict().items() if k in ours}
        result = {
            "losses": losses, "ref_losses": ref_losses, "ref_norms": ref_norms, "clip": args.max_grad_norm,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "train_loss_diff": abs(output.training_loss - sum(ref_losses) / STEPS),
            "eval_diff": abs(metrics["eval_loss"] - reference_eval(ref_model, evals, micro)),
            "global_step": output.global_step,
            "log_keys": sorted({k for h in trainer.state.log_history for k in h}),
            "files": sorted(os.listdir(saved)),
            "loaded_class": type(loaded).__name__,
            "saved_vs_pipeline": max_diff(loaded_sd, ours),
            "saved_vs_reference": max_diff(loaded.state_dict(), ref_model.state_dict()),
            "trainer_model_vs_reference": max_diff(trainer.model.state_dict(), ref_model.state_dict()),
            "tied_in_saved": saved_head_is_the_embedding(saved, loaded),
        }
        if save_steps:
            ckpt = os.path.join(root, "out", f"checkpoint-{save_steps}")
            result["checkpoint_files"] = sorted(os.listdir(ckpt))
            again = os.path.join(root, "from_layers")
            export_pretrained(os.path.join(ckpt, "pipeline"), loaded.config, again)
            result["layers_export_vs_saved"] = max_diff(AutoModelForCausalLM.from_pretrained(again).state_dict(),
                                                        loaded.state_dict())
    tdist.barrier()
    if tdist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return result


def saved_head_is_the_embedding(folder: str, loaded) -> bool:
    """What the file holds (from_pretrained would tie the weights whatever the export wrote).

    True when the head is absent from model.safetensors, or stored equal to the embedding.
    """
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    embed = next(name for name, p in loaded.named_parameters() if p is loaded.get_input_embeddings().weight)
    return "lm_head.weight" not in tensors or torch.equal(tensors["lm_head.weight"], tensors[embed])


def model_copy_initial(make_model):
    return make_model()      # seeded: the same initial weights the trainer started from


def bad_setup(kind):
    """PipelineTrainer refuses wrong set-ups in its constructor, before any model work."""
    configs = {"zero2": {"zero_optimization": {"stage": 2}},
               "batch": {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
               "micro": {"train_micro_batch_size_per_gpu": 3}}
    config = {"train_batch_size": 8, "pipeline": {"schedule": "1f1b"}, **configs.get(kind, {})}
    micro = 4 if kind == "batch" else 2
    model = gpt2(2)
    if kind == "model":
        from transformers import BertConfig, BertLMHeadModel
        model = BertLMHeadModel(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                           intermediate_size=16, vocab_size=VOCAB, is_decoder=True))
    try:
        PipelineTrainer(model=model, args=training_args(tempfile.mkdtemp(prefix="dsc_hf_bad_"), config, micro),
                        train_dataset=dataset(16))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def config_file():
    """TrainingArguments(deepspeed=<a configs/ file without zero_optimization>) is accepted and resolved."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                        "chimera.json")
    with open(path) as fh:
        micro = json.load(fh).get("train_micro_batch_size_per_gpu", 2)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="dsc_hf_cfg_"), deepspeed=path, report_to="none",
                             per_device_train_batch_size=micro)
    setup = PipelineTrainer(model=gpt2(4), args=args, train_dataset=dataset(64)).setup
    return {"schedule": setup.schedule, "stages": setup.stages, "micro_batches": setup.micro_batches}


SCENARIOS = {
    "config-file": config_file,
    "chimera-4x1-gpt2": lambda: train_and_compare(gpt2, "chimera", 4, 4, n=4, save_steps=STEPS),
    "1f1b-2x2-llama-padded": lambda: train_and_compare(llama, "1f1b", 2, 4, n=2, padded=True),
    "gpipe-2x1-llama-tied": lambda: train_and_compare(lambda: llama(tied=True), "gpipe", 2, 2, n=4),
}
for _kind in ("zero2", "batch", "micro", "model"):
    SCENARIOS[f"bad-{_kind}"] = (lambda kind=_kind: bad_setup(kind))


def main():
    import deepspeed
    from scenarios import run_scenarios
    deepspeed.init_distributed(dist_backend="gloo")
    run_scenarios(SCENARIOS, sys.argv[1], sys.argv[2].split(","))
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
