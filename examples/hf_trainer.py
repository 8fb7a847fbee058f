"""Train a tiny random HF causal LM with the Hugging Face Trainer on a ds_chimera pipeline schedule.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/hf_trainer.py --schedule chimera
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/hf_trainer.py --deepspeed configs/chimera.json

This is the explicit path: ``ds_chimera.hf.PipelineTrainer``. (An unchanged script using
``transformers.Trainer`` gets the same by importing ds_chimera, or by running under
``ds-chimera launch``: see docs/hf.md.) The model (GPT-2 or Llama) is built from a small
config, so nothing is downloaded. The data is generated: sequences that count upwards modulo
the vocabulary with a random stride per sequence, so the model must read the context to
predict the next token. The DeepSpeed config is ``{"pipeline": {"schedule": NAME}}`` (batch sizes,
clipping and the optimizer come from the TrainingArguments), or a file such as configs/chimera.json,
whose concrete values the arguments below agree with (16 samples per step on 4 ranks: 2 x 8
micro-batches; AdamW at 3e-3 with weight decay 0.01; clipping at 1). The saved folder is
a standard HF checkpoint, which rank 0 reloads with ``AutoModelForCausalLM.from_pretrained``.
"""
import argparse
import json
import os

import torch

from ds_chimera.hf import PipelineTrainer
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          TrainingArguments, default_data_collator)

VOCAB, SEQ = 64, 32


def counting_dataset(size: int, seed: int) -> list:
    """Sequences start + stride * t (mod VOCAB); labels = input_ids (the loss shifts them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(size):
        start, stride = torch.randint(0, VOCAB, (1,), generator=g), torch.randint(1, 6, (1,), generator=g)
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def tiny_model(kind: str, layers: int):
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                          bos_token_id=0, eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="chimera", help="any ds_chimera schedule (ds-chimera schedules)")
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config file instead of --schedule")
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro_batches", type=int, default=8, help="gradient_accumulation_steps: N per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output_dir", default="demo_out/hf_trainer")
    parser.add_argument("--local_rank", type=int, default=0)   # passed by the deepspeed launcher
    args = parser.parse_args(argv)

    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed or {"pipeline": {"schedule": args.schedule}},
        per_device_train_batch_size=2, per_device_eval_batch_size=4, gradient_accumulation_steps=args.micro_batches,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=0.01, warmup_steps=2, logging_steps=5,
        eval_strategy="steps", eval_steps=max(1, args.steps // 2), save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0)
    model = tiny_model(args.model, args.layers)
    trainer = PipelineTrainer(model=model, args=training_args, train_dataset=counting_dataset(4096, seed=1),
                              eval_dataset=counting_dataset(64, seed=2), data_collator=default_data_collator)
    trainer.train()
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)                       # every rank takes part; the main process writes
    if trainer.is_world_process_zero():
        reloaded = AutoModelForCausalLM.from_pretrained(final).eval()
        prompt = counting_dataset(1, seed=3)[0]["input_ids"][None, :SEQ // 2]
        with torch.no_grad():
            guess = reloaded(input_ids=prompt).logits[0, -1].argmax().item()
        losses = [round(h["loss"], 3) for h in trainer.state.log_history if "loss" in h]
        setup = trainer.setup
        print(f"[hf_trainer] schedule {setup.schedule}, {setup.stages} stages x {setup.data_parallel} data-parallel, "
              f"{setup.micro_batches} micro-batches per step; logged losses {json.dumps(losses)}; saved "
              f"{sorted(os.listdir(final))} to {final}; reloaded {type(reloaded).__name__} continues "
              f"{prompt[0, -3:].tolist()} with {guess}", flush=True)
    return trainer


if __name__ == "__main__":
    main()
