"""Next-token loss for the pipeline's last stage, the same as HF's ``ForCausalLMLoss``.

Labels are shifted by one (position t predicts token t+1), -100 is ignored, logits are
upcast to fp32. Plain labels give the token mean of the micro-batch, as HF's model does.

Labels may also be ``(labels, weight[, tag])``: the loss is then the *sum* over the
micro-batch's tokens times ``weight``. The trainer picks the weights so that the engine's mean
over micro-batches and data-parallel copies is exactly the Trainer's loss for the step (see
:mod:`.data`). ``tag`` numbers the micro-batch for :class:`PipelineLoss`'s records.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels[..., 1:] padded with IGNORE_INDEX at the end: the target of each position."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count_targets(labels: torch.Tensor) -> int:
    """How many positions a micro-batch's labels score (the token count of HF's mean loss)."""
    return int((shifted_labels(labels) != IGNORE_INDEX).sum())


def causal_lm_loss(logits: torch.Tensor, labels) -> torch.Tensor:
    """Shifted cross entropy; ``labels`` is a tensor (token mean) or ``(labels, weight[, tag])`` (weighted sum)."""
    weight = None
    if isinstance(labels, (tuple, list)):
        labels, weight = labels[0], labels[1]
    targets = shifted_labels(labels).reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    if weight is None:
        return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total * weight.to(total.dtype).reshape(())


class PipelineLoss:
    """The PipelineModule's ``loss_fn``: :func:`causal_lm_loss`, and, while evaluating, a record per tagged
    micro-batch of its loss and (if asked) its predictions, made where the logits are (the last stage).

    ``preprocess`` is the Trainer's ``preprocess_logits_for_metrics``: applied here, so only its
    (usually small) result leaves the last stage.
    """

    def __init__(self):
        self.records = None          # {tag: (loss, predictions or None)} while recording
        self.want_predictions = False
        self.preprocess = None

    def __call__(self, logits, labels):
        loss = causal_lm_loss(logits, labels)
        if self.records is not None and isinstance(labels, (tuple, list)) and len(labels) > 2:
            tag = int(labels[2])
            if tag >= 0:
                predictions = None
                if self.want_predictions:
                    predictions = logits.detach()
                    if self.preprocess is not None:
                        predictions = self.preprocess(predictions, labels[0])
                    predictions = _to_cpu(predictions)
                self.records[tag] = (loss.detach().float().cpu(), predictions)
        return loss

    def __repr__(self) -> str:           # DeepSpeed prints the loss function at start-up
        return "causal_lm_loss"


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
