"""``"pipeline": {"schedule": "auto"}`` through the HF Trainer, for tests/test_hf_trainer_auto.py.

    ds-chimera launch --torchrun --nproc_per_node 2 hf_auto.py OUT

Trains a tiny GPT-2 (tied embedding, dropout on, shuffled data, a collator that draws random
numbers) on 2 pipeline stages twice in one process group: once with ``"schedule": "auto"`` (the
planner profiles the Trainer's first micro-batch and writes its choice to a plan_file), then with
the section that plan_file holds, named by hand. Nothing here imports ds_chimera: ``ds-chimera
launch`` does. Each rank writes OUT/CASE-rankR.json (losses, what the engine built) and
OUT/CASE-rankR.pt (the trained weights).
"""
import json
import os
import sys

import torch

STEPS = 3


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(2, 50, (48, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def collate(rows: list) -> dict:
    """Stacks the rows and hides a random fifth of the labels: a collator that draws from torch's global
    stream, so a profile read that moved that stream would change what training sees."""
    ids = torch.stack([row["input_ids"] for row in rows])
    labels = ids.clone()
    labels[torch.rand(labels.shape) < 0.2] = -100
    return {"input_ids": ids, "labels": labels}


def model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.1,
                                      embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))


def train(out: str, name: str, pipeline: dict) -> None:
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments
    config = {"pipeline": {**pipeline, "stages": 2, "timeout": 60}}
    args = TrainingArguments(output_dir=os.path.join(out, name), per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1,
                             warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1, seed=11,
                             report_to="none", disable_tqdm=True, save_strategy="no", deepspeed=config)
    trainer = Trainer(model=model(), args=args, train_dataset=Tokens(), data_collator=collate)
    trainer.train()
    plan = trainer.engine.plan
    rank = dist.get_rank()
    record = {"class": type(trainer).__name__,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
              "schedule": plan.schedule.name, "options": dict(plan.config.options), "parts": list(plan.parts),
              "auto": trainer.engine.auto_decision}
    with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
        json.dump(record, fh)
    torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()},
               os.path.join(out, f"{name}-rank{rank}.pt"))


def main():
    import torch.distributed as dist
    out = sys.argv[1]
    plan_file = os.path.join(out, "plan.json")
    train(out, "auto", {"schedule": "auto", "plan_file": plan_file})
    dist.barrier()                                  # rank 0 wrote the plan file
    with open(plan_file) as fh:
        chosen = json.load(fh)["pipeline"]
    train(out, "named", chosen)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
