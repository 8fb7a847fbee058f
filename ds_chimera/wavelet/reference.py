"""The Wavelet update recurrence in one process: what the engine must compute, exactly."""
from __future__ import annotations

import copy

import torch


def wavelet_reference(model: torch.nn.Module, make_optimizer, loss_fn, wave_batches, steps: int):
    """Train ``model`` in place by W(n) = W(n-1) - opt(g(W(n-2))), updates alternating tick, tock.

    ``wave_batches(wave, step)`` returns the (x, y) batches of that wave's tasks at that step;
    an update's gradient is the mean over those tasks of each task's mean loss gradient.
    Returns the per-update losses. After ``steps`` steps of both waves the model holds all
    2 * steps updates (as the engine after ``drain()``).
    """
    optimizer = make_optimizer(model.parameters())
    older = copy.deepcopy(model)           # W(n-2): the weights an update's gradient is computed on
    losses = []
    for n in range(2 * steps):
        wave, step = n % 2, n // 2
        batches = wave_batches(wave, step)
        older.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in batches:
            loss = loss_fn(older(x), y) / len(batches)
            loss.backward()
            total += loss.item()
        losses.append(total)
        snapshot = copy.deepcopy(model)    # W(n-1) becomes the next update's W(n-2)
        for p, q in zip(model.parameters(), older.parameters()):
            p.grad = q.grad.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        older = snapshot
    return losses
