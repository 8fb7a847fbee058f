"""A model whose layers sleep for their cost: schedules, not the 2 CPU cores, are measured.

Forward sleeps F; the input-grad path sleeps I; the weight-grad path sleeps W. They are
separate autograd functions, so a fused backward pays I + W and a split backward pays
each once, where the schedule puts it. Sleeping frees the cores, so 4 ranks on 2 cores
measure the schedule and the runtime's own overhead.
"""
import time

import torch
from torch import nn

WIDTH = 16


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, igrad_s):
        time.sleep(fwd_s)
        ctx.igrad_s = igrad_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.igrad_s)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, like, wgrad_s):
        ctx.wgrad_s = wgrad_s
        return weight.expand_as(like).clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.wgrad_s)
        return grad.sum().reshape(1), None, None


class TimedLayer(nn.Module):
    def __init__(self, fwd_s: float, igrad_s: float, wgrad_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.costs = (fwd_s, igrad_s, wgrad_s)

    def forward(self, x):
        fwd_s, igrad_s, wgrad_s = self.costs
        return _InputPath.apply(x, fwd_s, igrad_s) + _WeightPath.apply(self.weight, x.detach(), wgrad_s)
