"""Gradient clipping by norm: the one implementation every host uses.

The norm is over *unique* parameters: a stage replicated on two ranks (Chimera) or a
weight tied across stages counts once, however many ranks hold a copy. Each rank passes
the gradients it owns (``owned``) for the norm and every gradient it holds (``held``) for
the scaling; ``reduce`` sums the squared norm over the ranks that share the model (a
bounded all-reduce), or is None when one process holds all of it.
"""
from __future__ import annotations

import torch

EPS = 1e-6      # as torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + EPS)


def grad_norm(owned, reduce=None, device=None) -> float:
    """sqrt of the sum of squares of ``owned`` gradients (None entries skipped), summed by ``reduce``."""
    owned = [g for g in owned if g is not None]
    if device is None:
        device = owned[0].device if owned else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in owned:
        squares += g.detach().double().pow(2).sum()
    if reduce is not None:
        reduce(squares)
    return float(squares.sqrt())


def scale_to(held, max_norm: float, norm: float) -> None:
    """Scale ``held`` gradients in place so that a gradient of norm ``norm`` has norm ``max_norm``."""
    coef = max_norm / (norm + EPS)
    if coef < 1.0:
        for g in held:
            if g is not None:
                g.mul_(coef)


def clip_by_norm(owned, held, max_norm: float, reduce=None, device=None) -> float:
    """Clip ``held`` to the norm of ``owned`` (reduced over ranks); returns the norm before clipping."""
    norm = grad_norm(owned, reduce, device)
    scale_to(held, max_norm, norm)
    return norm
