"""Build the pipeline engine a Trainer runs: its PipelineModule, optimizer and config (collective)."""
from __future__ import annotations

import copy
import os
import random

import torch

from .config import fill_scheduler
from .data import _rows, train_micro_batches
from .layout import pipeline_hf_names
from .optim import chunk_optimizer_factory


def build_engine(trainer, max_steps: int | None, profile_batch=None):
    """The ds_chimera engine for ``trainer``; every rank calls this together.

    ``profile_batch``: for ``"schedule": "auto"``, the micro-batch the planner times the layers on
    (:func:`profile_micro_batch`)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from ..integrations.deepspeed import initialize_pipeline
    setup = trainer.setup
    config = copy.deepcopy(setup.config)
    if isinstance((config.get("scheduler") or {}).get("params"), dict):
        if max_steps is None:
            max_steps = trainer._planned_max_steps()
        fill_scheduler(config, trainer.args, max_steps)
    deepspeed.init_distributed(dist_backend=None)
    # with "auto", partition_method only makes DeepSpeed's stock stage: the planner's cut ("parts") is what runs
    net = PipelineModule(layers=trainer.layer_specs, num_stages=setup.stages, loss_fn=trainer.pipeline_loss,
                         partition_method=trainer.partition_method, dynamic_shape=True,
                         activation_checkpoint_interval=trainer.activation_checkpoint_interval)
    optimizer = None
    if "optimizer" not in config:
        hf_optimizer = trainer.create_optimizer()            # the Trainer's own (args, subclass, optimizers=)
        trainer.hf_optimizer = hf_optimizer
        optimizer = chunk_optimizer_factory(hf_optimizer, trainer.model,
                                            lambda: pipeline_hf_names(net.ds_chimera_chunks, trainer.layout))
    pipeline = setup.pipeline.with_clip(setup.engine_clip)   # the norm is reported even when clipping is off
    engine, _, _, _ = initialize_pipeline(pipeline, model=net, config=config, optimizer=optimizer,
                                          profile_batch=profile_batch)
    return engine


def profile_micro_batch(trainer):
    """``"schedule": "auto"``: the first micro-batch of the Trainer's data, as the engine's
    ``(inputs, (labels, weight, tag))`` pair, for the planner to time the layers on; None where the
    section's ``profile_file`` already exists (the planner reuses it).

    It is the first ``per_device_train_batch_size`` rows of the train dataloader's first batch (of the
    eval dataloader's without a train dataset). The dataloader is read without moving any random
    stream (torch's, Python's, NumPy's), so training then draws exactly the data it would draw with
    the schedule named. Every rank calls this together (accelerate's dataloader may synchronise its
    generator across the ranks)."""
    import numpy as np
    path = trainer.setup.pipeline.options.get("profile_file")
    if path and os.path.exists(path):
        return None
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            batch = _first_batch(trainer)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    uses_mask = trainer._uses_mask(batch)          # refuses columns the layers cannot honour, by name
    rows = min(int(batch["input_ids"].shape[0]), trainer.setup.micro_batch)
    batch = _rows(dict(batch), torch.arange(rows))
    (pair,) = train_micro_batches([batch], n=1, dp=1, dp_rank=0, num_items=None, accumulation=1,
                                  uses_mask=uses_mask)
    return pair


def _first_batch(trainer) -> dict:
    if trainer.train_dataset is not None:
        loader, what = trainer.get_train_dataloader(), "train_dataset"
    elif trainer.eval_dataset is not None:
        evals = trainer.eval_dataset
        loader = trainer.get_eval_dataloader(next(iter(evals)) if isinstance(evals, dict) else None)
        what = "eval_dataset"
    else:
        raise ValueError('"pipeline": {"schedule": "auto"} times the layers on the first batch of the Trainer\'s '
                         "data, but it has neither a train_dataset nor an eval_dataset: pass one, name a "
                         "profile_file an earlier run wrote, or name a schedule")
    iterator = iter(loader)
    try:
        return next(iterator)
    except StopIteration:
        raise ValueError(f'"pipeline": {{"schedule": "auto"}} times the layers on the first batch of the Trainer\'s '
                         f"{what}, which yields none") from None
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
        end = getattr(loader, "end", None)
        if callable(end):
            end()      # accelerate's loader, left unfinished: take it off the gradient state's active loaders
