"""Megatron-style tensor-parallel linears, for models that run tensor x pipeline x data parallelism.

A column-parallel linear holds a slice of the output features; the row-parallel linear after it takes
that slice and sums the partial products over the tensor group (Shoeybi et al., arXiv:1909.08053). Each
weight is drawn whole from its own seed and then sliced, so a model with tensor size T computes what the
same model with T = 1 computes, which is how the tests compare a tensor-parallel pipeline with one
process. Sliced parameters carry ``tensor_model_parallel = True`` (DeepSpeed's ``is_model_parallel_parameter``
reads it): a gradient norm counts them on every tensor rank, a duplicated parameter (the row-parallel
bias) on tensor rank 0 only.

The communication is in autograd functions, so a pipeline schedule needs nothing else: every tensor rank
of a stage runs the same program, hence the same collectives in the same order. The input-gradient pass
of a split backward runs the column-parallel linear's all-reduce; the weight-gradient pass communicates
nothing.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class TensorGroup:
    """The tensor (slice) parallel group of this rank: ``size`` ranks, this one is ``rank``; ``group`` is
    None for one rank. Build it on every rank before the model (creating groups is collective)."""

    def __init__(self, group=None, rank: int = 0, size: int = 1):
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def of_topology(cls, topology) -> "TensorGroup":
        """The group of DeepSpeed's ``model`` axis of ``topology`` (a PipeModelDataParallelTopology)."""
        if "model" not in topology.get_axis_names() or topology.get_dim("model") == 1:
            return cls()
        me = dist.get_rank()
        mine = None
        for ranks in topology.get_axis_comm_lists("model"):
            group = dist.new_group(ranks)
            if me in ranks:
                mine = cls(group, sorted(ranks).index(me), len(ranks))
        return mine

    def all_reduce(self, tensor):
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor


class _CopyToTensorRanks(torch.autograd.Function):
    """Identity forward; the input gradient summed over the tensor group (each rank saw part of the output)."""

    @staticmethod
    def forward(ctx, x, tensor_group):
        ctx.tensor_group = tensor_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tensor_group.all_reduce(grad.contiguous()), None


class _SumOverTensorRanks(torch.autograd.Function):
    """The partial products summed over the tensor group; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x, tensor_group):
        return tensor_group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _whole(out_features: int, in_features: int, seed: int) -> tuple:
    """The whole layer's (weight, bias), as nn.Linear initialises them, from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    weight = (torch.rand(out_features, in_features, generator=generator) * 2 - 1) * bound
    bias = (torch.rand(out_features, generator=generator) * 2 - 1) * bound
    return weight, bias


def _sliced(tensor, dim: int, tensor_group: TensorGroup):
    if tensor.shape[dim] % tensor_group.size:
        raise ValueError(f"a tensor-parallel linear of {tensor.shape[dim]} features cannot be split over "
                         f"{tensor_group.size} tensor ranks: make the features a multiple of the tensor size")
    return tensor.chunk(tensor_group.size, dim=dim)[tensor_group.rank].clone()


def _mark_sliced(param) -> nn.Parameter:
    param.tensor_model_parallel = True
    return param


class ColumnParallelLinear(nn.Module):
    """``y[..., slice] = x @ W[slice].T + b[slice]``: this rank's slice of the output features."""

    def __init__(self, in_features: int, out_features: int, tensor_group: TensorGroup, seed: int, bias: bool = True):
        super().__init__()
        weight, whole_bias = _whole(out_features, in_features, seed)
        self.tensor_group = tensor_group
        self.weight = _mark_sliced(nn.Parameter(_sliced(weight, 0, tensor_group)))
        self.bias = _mark_sliced(nn.Parameter(_sliced(whole_bias, 0, tensor_group))) if bias else None

    def forward(self, x):
        return nn.functional.linear(_CopyToTensorRanks.apply(x, self.tensor_group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over tensor ranks of x[..., slice] @ W[:, slice].T``, plus a bias every rank holds whole."""

    def __init__(self, in_features: int, out_features: int, tensor_group: TensorGroup, seed: int, bias: bool = True):
        super().__init__()
        weight, whole_bias = _whole(out_features, in_features, seed)
        self.tensor_group = tensor_group
        self.weight = _mark_sliced(nn.Parameter(_sliced(weight, 1, tensor_group)))
        self.bias = nn.Parameter(whole_bias) if bias else None

    def forward(self, x):
        out = _SumOverTensorRanks.apply(nn.functional.linear(x, self.weight), self.tensor_group)
        return out + self.bias if self.bias is not None else out


class TensorParallelMLP(nn.Module):
    """A residual MLP block: column-parallel up-projection, GELU, row-parallel down-projection."""

    def __init__(self, width: int, tensor_group: TensorGroup, seed: int, hidden: int | None = None,
                 bias: bool = True):
        super().__init__()
        hidden = hidden or 4 * width
        self.up = ColumnParallelLinear(width, hidden, tensor_group, seed=2 * seed, bias=bias)
        self.down = RowParallelLinear(hidden, width, tensor_group, seed=2 * seed + 1, bias=bias)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))
