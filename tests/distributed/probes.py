"""A layer that reports which weight version each forward and backward sees.

Its single weight starts at 0 and always receives gradient -1, so under SGD with lr = 1 and
no momentum it holds exactly the number of updates applied: the value a forward or backward
reads *is* the version it sees. The values are logged against the action being executed.
"""
import torch
from torch import nn

from ds_chimera.runtime import executor

LOG = []     # (kind, chunk, mb, value seen)


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, v):
        ctx.save_for_backward(v)
        action = executor.current_action
        LOG.append(("F", action.chunk, action.mb, float(v)))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (v,) = ctx.saved_tensors
        action = executor.current_action
        LOG.append(("B", action.chunk, action.mb, float(v)))
        return grad, torch.full_like(v, -1.0)


class VersionProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.zeros(1))   # 1-d: DeepSpeed cannot broadcast 0-d parameters

    def forward(self, x):
        return _Probe.apply(x, self.v)
