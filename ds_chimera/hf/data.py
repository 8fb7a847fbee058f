"""Turn an HF dataset into the engine's steps: N micro-batches of (inputs, labels) per data-parallel rank.

Every rank computes the same global batches (a seeded permutation per epoch), so ranks
agree without communication. A step's global batch of ``micro x N x dp`` samples is cut
into dp contiguous shards of N micro-batches. Each rank collates the whole global batch:
it needs the number of scored tokens of all of it to weight the loss as HF's Trainer does
(see :mod:`.loss`), and collating is cheap next to a pipeline step.

Inputs are ``input_ids``, or ``(input_ids, attention_mask)`` when the collator returns a
mask. Training drops a last partial global batch (the engine's N is fixed); evaluation
pads it with samples whose labels are all ignored, so every sample counts once.
"""
from __future__ import annotations

import torch

from .loss import IGNORE_INDEX, count_targets

USED_KEYS = {"input_ids", "attention_mask", "labels"}


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> list:
    """Sample order of one epoch: a permutation seeded by ``seed + epoch`` (the same on every rank)."""
    if not shuffle:
        return list(range(size))
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


class Batches:
    """Global batches of a dataset, collated into per-rank micro-batches for ``train_batch``/``eval_batch``."""

    def __init__(self, dataset, collator, micro_batch: int, micro_batches: int, data_parallel: int, seed: int = 0):
        self.dataset, self.collator = dataset, collator
        self.micro, self.n, self.dp = micro_batch, micro_batches, data_parallel
        self.uses_mask = None             # fixed by the first batch: every message must keep one structure
        self.seed, self.calls = seed, 0

    @property
    def size(self) -> int:
        return self.micro * self.n * self.dp

    def train_steps(self, order: list) -> list:
        """Index lists of the full global batches in ``order`` (a last partial one is dropped)."""
        return [order[i:i + self.size] for i in range(0, len(order) - self.size + 1, self.size)]

    def eval_steps(self) -> list:
        """Index lists covering the dataset once; None marks padding that scores nothing."""
        indices = list(range(len(self.dataset)))
        steps = [indices[i:i + self.size] for i in range(0, len(indices), self.size)]
        if steps and len(steps[-1]) < self.size:
            steps[-1] = steps[-1] + [None] * (self.size - len(steps[-1]))
        return steps

    def _collate(self, indices: list) -> dict:
        real = [i for i in indices if i is not None]
        filler = real[0] if real else 0
        batch = self.collator([self.dataset[filler if i is None else i] for i in indices])
        unknown = sorted(set(batch) - USED_KEYS)
        if unknown:
            # e.g. packed sequences' position_ids: dropping them would train something else, silently
            raise ValueError(f"PipelineTrainer uses only {sorted(USED_KEYS)} from each batch; the collator also "
                             f"returned {unknown}, which the pipeline layers cannot honour (positions are 0..T-1)")
        if "labels" not in batch:
            raise ValueError("PipelineTrainer needs labels in each batch (e.g. DataCollatorForLanguageModeling("
                             f"tokenizer, mlm=False), or a 'labels' column); the collator returned {sorted(batch)}")
        if len(real) < len(indices):
            labels = batch["labels"].clone()
            labels[[k for k, i in enumerate(indices) if i is None]] = IGNORE_INDEX
            batch["labels"] = labels
        return batch

    def step(self, indices: list, dp_rank: int) -> tuple:
        """(this rank's N (inputs, (labels, weight)) pairs, scored tokens, input tokens), both of the global batch."""
        # Every rank collates the global batch itself. A collator that draws random numbers (masking,
        # noise) must draw the same ones everywhere, whatever else each rank's RNG did meanwhile.
        self.calls += 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + self.calls)
            micro = [self._collate(indices[k * self.micro:(k + 1) * self.micro]) for k in range(self.n * self.dp)]
        total = sum(count_targets(b["labels"]) for b in micro)
        weight = torch.tensor(self.n * self.dp / total if total else 0.0, dtype=torch.float32)
        seen = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in micro)
        mine = micro[dp_rank * self.n:(dp_rank + 1) * self.n]
        return [(self._inputs(b), (b["labels"], weight)) for b in mine], total, seen

    def _inputs(self, batch: dict):
        has_mask = "attention_mask" in batch
        if self.uses_mask is None:
            self.uses_mask = has_mask
        if has_mask != self.uses_mask:
            raise ValueError("the collator returned attention_mask for some batches and not for others; the pipeline "
                             "sends one structure between stages: make it return one always or never")
        ids = batch["input_ids"]
        return (ids, batch["attention_mask"].to(ids.dtype)) if has_mask else ids
