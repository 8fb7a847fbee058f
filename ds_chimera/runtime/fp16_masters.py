"""fp16 training on the scheduled engine: fp16 weights in the chunks, fp32 master weights in the optimizer.

DeepSpeed's own fp16 optimizers sit inside its engine's backward and step, which the scheduled engine
does not run (the program runs the backwards), and its CPU accelerator refuses fp16 altogether. So the
engine is built as an fp32 one, and this wrapper takes over its optimizer, with DeepSpeed's semantics:

- the chunks compute in fp16; the optimizer steps fp32 copies of their weights (the masters), which are
  rounded back into the chunks after each step;
- the loss is multiplied by the loss scale before each backward (:mod:`.loss_scale`); the gradients are
  synchronised as they are (fp16, scaled), then unscaled into the masters' fp32 gradients, where the
  clipping norm is taken;
- an inf or NaN in any rank's gradients skips the step on every rank (``overflow``: DeepSpeed's engine
  then counts a skipped step and leaves the LR scheduler alone), and the scale is updated either way.
"""
from __future__ import annotations

import torch

from .loss_scale import LossScale, has_overflow, overflow_anywhere


class Fp16MasterOptimizer:
    """The engine's optimizer under fp16: ``step``, ``zero_grad``, ``state_dict`` and the groups of the inner
    (fp32) optimizer, whose parameters become fp32 masters of the chunks' fp16 parameters."""

    def __init__(self, optimizer, loss_scale: LossScale, modules=()):
        """``modules``: the chunks (and tied layers), converted to fp16 whole (frozen weights and buffers too)."""
        if optimizer.state:
            raise ValueError("fp16: the optimizer has stepped already; it must be wrapped before any step")
        self.optimizer, self.loss_scale = optimizer, loss_scale
        self.overflow = False
        self.pairs = []                       # (fp16 parameter in a chunk, its fp32 master in the optimizer)
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = p.detach().clone().float()
                p.grad = None
                self.pairs.append((p, master))
                masters.append(master)
            group["params"] = masters
        for module in modules:
            module.half()                     # the same Parameter objects, their data in fp16
        for p, _ in self.pairs:
            p.data = p.data.half()            # an optimizer's parameter outside ``modules``
        self.master_of = {id(p): master for p, master in self.pairs}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def cur_scale(self) -> float:
        """The loss scale, by the name DeepSpeed's fp16 optimizers give it (Megatron-DeepSpeed logs it)."""
        return self.loss_scale.scale

    def unscale(self, reduce, device=None) -> bool:
        """After the gradient syncs: whether any rank overflowed (``reduce``: a MAX over every rank); if none
        did, each master's gradient is its fp16 gradient over the scale, in fp32."""
        local = has_overflow(p.grad for p, _ in self.pairs)
        self.overflow = overflow_anywhere(local, reduce, device)
        if not self.overflow:
            inverse = 1.0 / self.loss_scale.scale
            for p, master in self.pairs:
                master.grad = None if p.grad is None else p.grad.float().mul_(inverse)
        return self.overflow

    def master_grads(self, params) -> list:
        return [self.master_of[id(p)].grad for p in params]

    def step(self, closure=None) -> None:
        """The masters' step and their rounding into the chunks, unless a rank overflowed; the scale's update."""
        if not self.overflow:
            self.optimizer.step()
            with torch.no_grad():
                for p, master in self.pairs:
                    p.data.copy_(master)
        for _, master in self.pairs:
            master.grad = None               # DeepSpeed's fp32 step clears the module's gradients, not these
        self.loss_scale.update(self.overflow)

    def refresh_fp32_params(self) -> None:
        """The masters from the chunks' weights: after a load that brought weights but no optimizer state
        (DeepSpeed calls this for ``load_module_only``; the engine for ``load_optimizer_states=False``)."""
        with torch.no_grad():
            for p, master in self.pairs:
                master.copy_(p.data.float())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in self.pairs:
            p.grad = None
            master.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach() for _, m in self.pairs],
                "loss_scale": self.loss_scale.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for (p, master), saved in zip(self.pairs, state["masters"], strict=True):
                master.copy_(saved)
                p.data.copy_(master)
        self.loss_scale.load_state_dict(state["loss_scale"])
