"""Small helpers for the tensors a chunk takes and returns (one tensor, or a tuple of them)."""
from __future__ import annotations

import torch

from ..tensor_tree import map_tensors, to_device  # noqa: F401  (the runtime's names for them)


def as_tuple(x) -> tuple:
    """A chunk's input or output as a tuple: tuples and lists are unpacked, anything else wrapped."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def pack(tensors):
    """The inverse of :func:`as_tuple` for what a chunk receives: one tensor stays one tensor."""
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def to_half(x):
    """``x`` with its floating-point tensors (inside tuples, lists and dicts too) in fp16: the first stage's
    inputs under fp16 (integer ids stay as they are)."""
    return map_tensors(x, lambda t: t.half() if t.is_floating_point() else t)


def as_leaves(tensors, train: bool) -> list:
    """Detached copies that start a new autograd graph and collect this chunk's input grads."""
    out = []
    for t in tensors:
        leaf = t.detach()
        if train and leaf.is_floating_point():
            leaf.requires_grad_(True)
        out.append(leaf)
    return out


def versions(out) -> tuple:
    """In-place modification counters of a block output's tensors."""
    return tuple(t._version for t in as_tuple(out) if isinstance(t, torch.Tensor))
