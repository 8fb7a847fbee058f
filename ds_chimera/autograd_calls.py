"""The executor's backward calls: torch's engine entered directly where torch's per-call checks cannot fail.

``torch.autograd.backward`` and ``torch.autograd.grad`` check every call in Python before they enter the
engine: tensor-or-tuple conversion, ``__torch_function__`` dispatch, and each gradient's shape against its
output through the symbolic-shape helpers. A split-backward schedule makes two or three such calls per
micro-batch and chunk (I, then W per block), and on near-free layers those checks were about a tenth of a
zbv step's host time (docs/investigations/zero-bubble-host-time.md). The executor's calls are on plain dense
tensors with gradients that have their outputs' shape, dtype and device; those enter
``torch.autograd.graph._engine_run_backward``, the call both public functions end in (Megatron-LM's pipeline
skips the same checks one level lower, for its own reasons). Anything else (a tensor subclass, a mismatch,
an implicit gradient, a torch without that entry) takes the public function, with its checks and messages.
"""
from __future__ import annotations

import torch
from torch import nn

try:
    from torch.autograd.graph import _engine_run_backward as _ENGINE
except ImportError:          # another torch: the public functions only
    _ENGINE = None

_PLAIN = (torch.Tensor, nn.Parameter)


def _implicit(tensors, grads):
    """``grads``, or for scalar floating-point outputs without one the ones torch would create."""
    if grads is None and all(type(t) in _PLAIN and t.numel() == 1 and t.is_floating_point() for t in tensors):
        return [torch.ones_like(t, memory_format=torch.preserve_format) for t in tensors]
    return grads


def _direct(tensors, grads, inputs) -> bool:
    """Whether the engine may be entered without torch's checks: every tensor plain and dense, each gradient
    given, plain, and of its output's shape, dtype and device."""
    if _ENGINE is None or grads is None or len(grads) != len(tensors):
        return False
    for t, g in zip(tensors, grads):
        if type(t) not in _PLAIN or type(g) is not torch.Tensor or t.is_nested or g.shape != t.shape or \
                g.dtype != t.dtype or g.device != t.device:
            return False
    return all(type(p) in _PLAIN for p in inputs)


def backward(tensors, grads=None, inputs=None, retain_graph: bool = False) -> None:
    """``torch.autograd.backward(tensors, grads, retain_graph, inputs=inputs)``: gradients accumulate into
    ``.grad`` of ``inputs`` (every leaf the graph reaches when None)."""
    wanted = tuple(inputs) if inputs is not None else ()
    if inputs is not None and not wanted:
        raise RuntimeError("backward: `inputs` is empty (None means every leaf)")
    grads = _implicit(tensors, grads)
    if _direct(tensors, grads, wanted):
        _ENGINE(tuple(tensors), tuple(grads), retain_graph, False, wanted, allow_unreachable=True,
                accumulate_grad=True)
    else:
        torch.autograd.backward(tensors, grad_tensors=grads, retain_graph=retain_graph, inputs=inputs)


def grad(tensors, inputs, grads, retain_graph: bool = False, allow_unused: bool = False) -> tuple:
    """``torch.autograd.grad(tensors, inputs, grads, retain_graph, allow_unused=allow_unused)``: the gradients
    of ``inputs``, returned (None for one the graph does not reach, with ``allow_unused``)."""
    wanted = tuple(inputs)
    grads = _implicit(tensors, grads)
    if _direct(tensors, grads, wanted) and wanted:
        return _ENGINE(tuple(tensors), tuple(grads), retain_graph, False, wanted, allow_unused,
                       accumulate_grad=False)
    return torch.autograd.grad(tensors, wanted, grad_outputs=grads, retain_graph=retain_graph,
                               allow_unused=allow_unused)
