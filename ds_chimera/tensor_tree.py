"""Walks over nested tensors (tuples, lists, dicts): shared by the runtime and the planner, importing neither."""
from __future__ import annotations

import torch


def map_tensors(x, fn):
    """``x`` with ``fn`` applied to each of its tensors (inside tuples, lists and dicts too; a namedtuple keeps its
    type)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        items = [map_tensors(t, fn) for t in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    return x


def to_device(x, device):
    """``x`` with its tensors (inside tuples, lists and dicts too) on ``device``."""
    return map_tensors(x, lambda t: t.to(device))
