"""Checkpoints of a pipelined Trainer: HF's ``checkpoint-N`` folder, written whole or not at all.

The folder holds what HF writes (``model.safetensors`` of the gathered weights, the trainer
state, each rank's RNG state, the scheduler) plus ``pipeline/``: the engine's own checkpoint
(each rank's stages and optimizer state) and each rank's compute RNG. A pipelined resume reads
``pipeline/``; for a plain one-process Trainer the folder also holds ``optimizer.pt`` (the
gathered optimizer state) and ``rng_state.pth`` (:mod:`.plain_resume`). Everything is written
into a hidden staging folder first; once every rank is done, the main process renames it to
``checkpoint-N``, so ``resume_from_checkpoint=True`` never picks a half-written one.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from .plain_resume import save_plain_optimizer

PIPELINE_DIR = "pipeline"
SCHEDULER_NAME = "scheduler.pt"


def staging_dir(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, f".{name}.partial")


def begin(run_dir: str, name: str, writer: bool) -> str:
    """A fresh staging folder (made by the writer, seen by all)."""
    staging = staging_dir(run_dir, name)
    if writer:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    return staging


def commit(staging: str, run_dir: str, name: str, writer: bool) -> str:
    """Rename the staged ``name`` into ``run_dir`` once every rank has written its part."""
    dist.barrier()
    final = os.path.join(run_dir, name)
    if writer:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(os.path.join(staging, name), final)
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    return final


def save_pipeline_state(trainer, output_dir: str) -> None:
    """The engine's checkpoint (collective), this rank's compute RNG, and the Trainer's scheduler."""
    folder = os.path.join(output_dir, PIPELINE_DIR)
    trainer.engine.save_checkpoint(folder)
    torch.save(trainer.compute_rng.state_dict(), os.path.join(folder, f"compute_rng_{dist.get_rank()}.pt"))
    scheduler = trainer.lr_scheduler
    if trainer.args.should_save and scheduler is not None and not trainer.engine_owns_scheduler:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
    save_plain_optimizer(trainer, output_dir)          # what a plain Trainer resumes from (collective)
    dist.barrier()


def load_pipeline_state(trainer, checkpoint: str) -> None:
    """Restore what :func:`save_pipeline_state` wrote; refuse a checkpoint without pipeline state."""
    folder = os.path.join(checkpoint, PIPELINE_DIR)
    if not os.path.isdir(folder):
        raise ValueError(f"{checkpoint} has no {PIPELINE_DIR}/ folder: it was not written by a pipelined Trainer, "
                         f"so its optimizer state cannot be restored; resume from a checkpoint of this run")
    path, _ = trainer.engine.load_checkpoint(folder)
    if path is None:
        raise ValueError(f"{folder} holds no engine checkpoint (no 'latest' tag)")
    rng = os.path.join(folder, f"compute_rng_{dist.get_rank()}.pt")
    if os.path.isfile(rng):
        trainer.compute_rng.load_state_dict(torch.load(rng, weights_only=True))
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if not trainer.engine_owns_scheduler and trainer.lr_scheduler is not None and os.path.isfile(scheduler_file):
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
