"""fp16 loss scaling with DeepSpeed's semantics, for engines that own their fp16 step.

DeepSpeed's fp16 optimizers scale the loss before each backward and, at the step, skip it where any
gradient is not finite. With dynamic scaling (``"fp16": {"loss_scale": 0}``) the scale then follows
DeepSpeed's ``DynamicLossScaler.update_scale`` rule, restated here from its documented behaviour:

- an overflow with hysteresis left (``cur_hysteresis > 1``) spends one unit of hysteresis and keeps the
  scale; otherwise the scale is divided by 2, not below ``min_loss_scale``;
- after ``loss_scale_window`` steps in a row without an overflow the scale doubles, and the hysteresis
  is refilled (at every step without an overflow instead, with ``consecutive_hysteresis``).

A static scale (``loss_scale`` > 0) never changes but still skips a step with non-finite gradients.
In a pipeline the decision must be one for all ranks: every stage, replica and tensor rank holds part
of the gradients, so each rank's finding is combined (:func:`overflow_anywhere`) before any rank steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import check_int

SCALE_FACTOR = 2.0


@dataclass(frozen=True)
class LossScaleConfig:
    """The ``"fp16"`` section's scaling keys, DeepSpeed's names and defaults."""

    loss_scale: float = 0.0              # 0: dynamic; > 0: this static scale
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @classmethod
    def from_section(cls, section: dict) -> "LossScaleConfig":
        """Parse and check ``config["fp16"]``: a bad value is named with what is allowed."""
        where = '"fp16"'
        scale = section.get("loss_scale", 0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0 or scale == float("inf"):
            raise ValueError(f"{where}: loss_scale must be 0 (dynamic) or a finite positive number, got {scale!r}")
        consecutive = section.get("consecutive_hysteresis", False)
        if not isinstance(consecutive, bool):
            raise ValueError(f"{where}: consecutive_hysteresis must be true or false, got {consecutive!r}")
        min_scale = section.get("min_loss_scale", 1)
        if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) or not min_scale > 0:
            raise ValueError(f"{where}: min_loss_scale must be a number > 0, got {min_scale!r}")
        return cls(loss_scale=float(scale),
                   initial_scale_power=check_int(where, "initial_scale_power",
                                                 section.get("initial_scale_power", 16), 0),
                   loss_scale_window=check_int(where, "loss_scale_window", section.get("loss_scale_window", 1000), 1),
                   hysteresis=check_int(where, "hysteresis", section.get("hysteresis", 2), 1),
                   consecutive_hysteresis=consecutive, min_loss_scale=float(min_scale))


class LossScale:
    """The current scale and its update after each step (see the module docstring)."""

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self.scale = float(2 ** config.initial_scale_power) if config.dynamic else config.loss_scale
        self.step = 0                       # steps seen, skipped ones included
        self.last_overflow_step = -1
        self.hysteresis = config.hysteresis
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        """After a step: ``overflow`` (on any rank) means the step was skipped."""
        config = self.config
        if overflow:
            self.skipped += 1
        if config.dynamic:
            if overflow:
                if config.hysteresis == 1 or self.hysteresis == 1:
                    if self.scale == config.min_loss_scale:
                        raise FloatingPointError(
                            f"fp16: the loss scale is at its minimum ({config.min_loss_scale:g}) and the gradients "
                            f"still overflow at step {self.step}: the run diverged; lower the learning rate, clip "
                            f"the gradients, or lower \"fp16\": min_loss_scale")
                    self.scale = max(self.scale / SCALE_FACTOR, config.min_loss_scale)
                else:
                    self.hysteresis -= 1
                self.last_overflow_step = self.step
            else:
                if config.consecutive_hysteresis:
                    self.hysteresis = config.hysteresis
                stable = self.step - self.last_overflow_step - 1
                if stable > 0 and stable % config.loss_scale_window == 0:
                    if not config.consecutive_hysteresis:
                        self.hysteresis = config.hysteresis
                    self.scale *= SCALE_FACTOR
        self.step += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "step": self.step, "last_overflow_step": self.last_overflow_step,
                "hysteresis": self.hysteresis, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.step = float(state["scale"]), int(state["step"])
        self.last_overflow_step, self.hysteresis = int(state["last_overflow_step"]), int(state["hysteresis"])
        self.skipped = int(state.get("skipped", 0))


def has_overflow(grads) -> bool:
    """Whether any of ``grads`` (None entries skipped) holds an inf or a NaN, on this rank."""
    for g in grads:
        if g is not None and not torch.isfinite(g).all():
            return True
    return False


def overflow_anywhere(local: bool, reduce, device=None) -> bool:
    """One decision for every rank: ``reduce`` (a MAX all-reduce over the ranks that hold gradients,
    bounded) combines each rank's ``local`` finding; None when one process holds every gradient."""
    flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float32, device=device)
    if reduce is not None:
        reduce(flag)
    return bool(flag.item() > 0)
