"""The Trainer's batches as the engine's micro-batches, weighted so the engine computes the Trainer's loss.

Every rank reads the same batches from the Trainer's dataloader (see :mod:`.accel`). A
training step's batches are the Trainer's accumulation batches; with data parallelism each is
cut into ``dp`` row slices, one per replica, as HF's distributed sampler would deal them out.
An evaluation batch is cut into ``N x dp`` row slices, so one eval batch fills the pipeline.
Missing micro-batches (a short last accumulation, an eval batch with fewer rows than slices)
are one-row fillers whose labels score nothing.

The engine returns, and back-propagates, the mean of the micro-batches' losses over ``N`` and
``dp``. Each micro-batch's loss is its summed token loss times a weight (:mod:`.loss`):

- with HF's ``num_items_in_batch`` (models that take loss kwargs), ``N * dp / num_items``, so
  the mean is the summed loss over the whole step's tokens divided by HF's count;
- without it, ``N / (accumulation * tokens of the slice)``: the mean of the per-micro-batch
  token means divided by the accumulation steps, as HF does then.
"""
from __future__ import annotations

import torch

from .loss import IGNORE_INDEX, count_targets

USED_KEYS = {"input_ids", "attention_mask", "labels"}


def check_batch(batch) -> None:
    """Refuse what the pipeline layers cannot honour, naming it."""
    unknown = sorted(set(batch) - USED_KEYS)
    if unknown:
        # e.g. packed sequences' position_ids: dropping them would train something else, silently
        raise ValueError(f"a pipelined Trainer feeds only {sorted(USED_KEYS)} to the pipeline; the batch also has "
                         f"{unknown}, which its layers cannot honour (positions are 0..T-1). Remove those columns "
                         f"or train without a \"pipeline\" section")
    if "input_ids" not in batch:
        raise ValueError(f"a pipelined Trainer needs input_ids in each batch; it has {sorted(batch)}")


def _rows(batch: dict, index: torch.Tensor) -> dict:
    return {key: value.index_select(0, index.to(value.device)) for key, value in batch.items()}


def filler(batch: dict) -> dict:
    """One row of ``batch`` whose labels score nothing: a micro-batch that changes no loss or gradient."""
    row = _rows(batch, torch.tensor([0]))
    labels = row.get("labels", row["input_ids"])
    row["labels"] = torch.full_like(labels, IGNORE_INDEX)
    return row


def split_rows(batch: dict, parts: int) -> list:
    """``parts`` contiguous row slices of ``batch`` (fillers where there are too few rows)."""
    rows = batch["input_ids"].shape[0]
    return [_rows(batch, index) if index.numel() else filler(batch)
            for index in torch.tensor_split(torch.arange(rows), parts)]


def _pair(batch: dict, weight: float, tag: int, uses_mask: bool):
    ids = batch["input_ids"]
    inputs = (ids, batch["attention_mask"].to(ids.dtype)) if uses_mask else ids
    labels = batch["labels"] if "labels" in batch else torch.full_like(ids, IGNORE_INDEX)
    return inputs, (labels, torch.tensor(float(weight), dtype=torch.float32), torch.tensor(tag))


def train_micro_batches(batches: list, n: int, dp: int, dp_rank: int, num_items, accumulation: int,
                        uses_mask: bool) -> list:
    """This data-parallel rank's ``n`` (inputs, (labels, weight, tag)) pairs for one training step."""
    if len(batches) > n:
        raise ValueError(f"a pipeline step runs {n} micro-batches, the Trainer gave {len(batches)}")
    slices = [split_rows(b, dp)[dp_rank] for b in batches]
    if num_items is not None:
        total = float(num_items)
        weights = [n * dp / total if total else 0.0 for _ in slices]
    else:
        weights = [n / (accumulation * count) if count else 0.0
                   for count in (count_targets(s["labels"]) for s in slices)]
    pairs = [_pair(s, w, -1, uses_mask) for s, w in zip(slices, weights)]
    pairs += [_pair(filler(batches[0]), 0.0, -1, uses_mask) for _ in range(n - len(batches))]
    return pairs


def eval_micro_batches(batch: dict, n: int, dp: int, dp_rank: int, weight: float, uses_mask: bool) -> list:
    """This data-parallel rank's ``n`` pairs for one evaluation batch; real slices are tagged 0..n*dp-1."""
    rows = batch["input_ids"].shape[0]
    parts = split_rows(batch, n * dp)
    pairs = []
    for k in range(dp_rank * n, (dp_rank + 1) * n):
        real = k < rows
        pairs.append(_pair(parts[k], weight if real else 0.0, k if real else -1, uses_mask))
    return pairs
