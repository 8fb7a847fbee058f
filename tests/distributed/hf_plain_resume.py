"""A pipelined Trainer's checkpoint, resumed by the plain single-process ``transformers.Trainer``.

    ds-chimera launch --torchrun --nproc_per_node 2 hf_plain_resume.py pipeline OUT
    python hf_plain_resume.py plain OUT

``pipeline``: each case trains a tiny GPT-2 for 4 steps with a checkpoint at step 2 (nothing
here imports ds_chimera: ``ds-chimera launch`` does). ``plain``: in one process without
ds_chimera or DeepSpeed, for each case the uninterrupted plain run (the reference), the plain
run resumed from the pipelined ``checkpoint-2``, and the same resumed from a copy without
``optimizer.pt`` (what a plain Trainer did before: fresh optimizer and schedule, without a
word); then, with ds_chimera imported, that last resume again, which must warn. Writes
OUT/pipeline.json and OUT/plain.json.
"""
import json
import logging
import os
import shutil
import sys

import torch

# name -> (DeepSpeed config for the pipelined run, gradient_accumulation_steps of the plain run)
CASES = {
    # 2 stages, tied embedding on both ends; ZeRO-0: each parameter's own optimizer state
    "1f1b-2x1": ({"pipeline": {"schedule": "1f1b", "stages": 2, "timeout": 60}}, 4),
    # 1 stage x 2 data-parallel replicas under ZeRO-1: DeepSpeed's flat partitions, assembled per parameter
    "zero1-1x2": ({"pipeline": {"schedule": "1f1b", "stages": 1, "timeout": 60},
                   "zero_optimization": {"stage": 1}}, 8),
}
STEPS, SAVE_AT = 4, 2


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(2, 50, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def train(out: str, accumulation: int, deepspeed=None, resume=None) -> list:
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
                             max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1, warmup_steps=2,
                             lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1, seed=11,
                             report_to="none", disable_tqdm=True, save_strategy="steps", save_steps=SAVE_AT,
                             deepspeed=deepspeed)
    trainer = Trainer(model=model(), args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    return [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate") if k in h}
            for h in trainer.state.log_history if "loss" in h]


def write(path: str, value) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh)


def main():
    mode, out = sys.argv[1], sys.argv[2]
    results = {}
    if mode == "pipeline":
        import torch.distributed as dist
        for name, (config, _) in CASES.items():
            results[name] = train(os.path.join(out, "pipe", name), 4, deepspeed=config)
        if dist.get_rank() == 0:
            write(os.path.join(out, "pipeline.json"), results)
        dist.barrier()
        dist.destroy_process_group()
        return
    assert "ds_chimera" not in sys.modules
    for name, (_, accumulation) in CASES.items():
        checkpoint = os.path.join(out, "pipe", name, f"checkpoint-{SAVE_AT}")
        bare = os.path.join(out, "bare", name)
        shutil.copytree(checkpoint, bare)
        os.remove(os.path.join(bare, "optimizer.pt"))
        results[name] = {"reference": train(os.path.join(out, "plain", name), accumulation),
                         "resumed": train(os.path.join(out, "resumed", name), accumulation, resume=checkpoint),
                         "bare": train(os.path.join(out, "resumed-bare", name), accumulation, resume=bare)}
    assert "ds_chimera" not in sys.modules          # a plain Trainer throughout (no "deepspeed" argument either)
    import ds_chimera  # noqa: F401
    from ds_chimera.logs import get_logger
    caught = []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage())
    get_logger().addHandler(handler)
    train(os.path.join(out, "warned"), 4, resume=os.path.join(out, "bare", "1f1b-2x1"))
    results["warnings"] = caught
    write(os.path.join(out, "plain.json"), results)


if __name__ == "__main__":
    main()
