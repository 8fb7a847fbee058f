"""Next-token loss for the pipeline's last stage, the same as HF's ``ForCausalLMLoss``.

Labels are shifted by one (position t predicts token t+1), -100 is ignored, logits are
upcast to fp32. Plain labels give the token mean of the micro-batch, as HF's model does.

Labels may also be ``(labels, weight)``: the loss is then the *sum* over the micro-batch's
tokens times ``weight``. The trainer sets ``weight = N * dp / tokens in the global batch``,
so the engine's mean over micro-batches and data-parallel copies becomes the token mean of
the whole global batch: what HF's Trainer computes with gradient accumulation
(``num_items_in_batch``), also when micro-batches hold different numbers of tokens.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels[..., 1:] padded with IGNORE_INDEX at the end: the target of each position."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count_targets(labels: torch.Tensor) -> int:
    """How many positions a micro-batch's labels score (HF's num_items_in_batch for it)."""
    return int((shifted_labels(labels) != IGNORE_INDEX).sum())


def causal_lm_loss(logits: torch.Tensor, labels) -> torch.Tensor:
    """Shifted cross entropy; ``labels`` is a tensor (token mean) or ``(labels, weight)`` (weighted sum)."""
    weight = None
    if isinstance(labels, (tuple, list)):
        labels, weight = labels
    targets = shifted_labels(labels).reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    if weight is None:
        return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total * weight.to(total.dtype).reshape(())
