"""One Trainer prediction step through the pipeline's forward passes.

HF's ``evaluation_loop`` drives evaluation and prediction unchanged (batches, loss repetition,
concatenation, ``compute_metrics``); only its per-batch step runs here. The batch is cut into
``N x dp`` micro-batches, so one eval batch fills the pipeline. The last stage(s) record each
micro-batch's loss and, when metrics or predictions are wanted, its logits after
``preprocess_logits_for_metrics``; the records are gathered so every rank returns the batch's
loss and predictions, as a single process would.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .data import eval_micro_batches
from .loss import count_targets


def _concat(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    raise TypeError(f"preprocess_logits_for_metrics returned a {type(first).__name__}; a pipelined Trainer "
                    f"concatenates tensors (or tuples / dicts of them) over the micro-batches of a batch")


def _gathered(records: dict) -> dict:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, records)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def predict_batch(trainer, inputs: dict, has_labels: bool, want_predictions: bool) -> tuple:
    """(loss or None, predictions or None) of one eval batch, on every rank."""
    setup, loss_fn = trainer.setup, trainer.pipeline_loss
    weight = 0.0
    if has_labels:
        count = trainer._get_num_items_in_batch([inputs], trainer.args.device)
        count = float(count) if count is not None else count_targets(inputs["labels"])
        weight = 1.0 / count if count else 0.0
    uses_mask = trainer._uses_mask(inputs)
    pairs = eval_micro_batches(inputs, setup.micro_batches, setup.data_parallel, trainer.dp_rank, weight, uses_mask)
    loss_fn.records, loss_fn.want_predictions = {}, want_predictions
    try:
        with trainer.compute_rng.active():
            trainer.engine.eval_batch(iter(pairs))
        records = _gathered(loss_fn.records)
    finally:
        loss_fn.records, loss_fn.want_predictions = None, False
    real = min(inputs["input_ids"].shape[0], setup.micro_batches * setup.data_parallel)
    missing = [k for k in range(real) if k not in records]
    if missing:
        raise RuntimeError(f"ds_chimera: no last stage reported micro-batches {missing[:4]} of an eval batch")
    device = trainer.args.device
    loss = torch.stack([records[k][0] for k in range(real)]).sum().to(device) if has_labels else None
    predictions = _concat([records[k][1] for k in range(real)]) if want_predictions else None
    if isinstance(predictions, torch.Tensor):
        predictions = predictions.to(device)
    return loss, predictions
