"""Elementwise error bounds for the kernels, for checks against an fp64 reference.

Every output of the ops is a sum of n products, z = sum_i a_i b_i: n = K for y and grad_x,
B * (C/H) * T for LightConv's weight grad, C/H for DynamicConv's. Computed from inputs
already rounded to the kernel's dtype, with products and sums in a precision of unit
roundoff u (any summation order), then rounded to the output dtype (unit roundoff v):

    |z_kernel - z| <= v |z| + (1 + v) gamma_n M + tiny,   gamma_n = n u / (1 - n u),

where M = sum_i |a_i b_i| is the magnitude of the contributing terms: the same op applied
to |a| and |b|, computed here in fp64 by the direct reference (not the torch backend's
algorithm, which is under test too). ``tiny`` is the output dtype's smallest normal number.

The bound is tight where it matters: in bf16 (v = 2^-8) an output scaled by 1.01 or missing
one of its taps exceeds it at almost every element, and in fp32 by orders of magnitude.
Tensor-core paths are modelled by a larger u (``accumulation_roundoff``).
"""
from __future__ import annotations

import torch

from .reference import direct_grads, dynamicconv_direct, lightconv_direct

_UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                  torch.bfloat16: 2.0 ** -8}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype`` (round to nearest)."""
    if dtype not in _UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for {dtype}; known: {', '.join(map(str, _UNIT_ROUNDOFF))}")
    return _UNIT_ROUNDOFF[dtype]


def accumulation_roundoff(dtype: torch.dtype, tensor_cores: bool = False) -> float:
    """u of the products and sums for inputs of ``dtype``: fp64 for fp64, else fp32. With
    ``tensor_cores`` (the Triton window kernels): fp32 inputs go through three-pass TF32,
    whose products carry about 3 * 2^-22 relative error, and the MMA's fp32 accumulation
    is taken at 2^-22."""
    if dtype == torch.float64:
        return 2.0 ** -50 if tensor_cores else 2.0 ** -53
    if tensor_cores:
        return 2.0 ** -20 if dtype == torch.float32 else 2.0 ** -22
    return 2.0 ** -24


ROUNDINGS = ("nearest", "truncate")


def bound(reference: torch.Tensor, magnitude: torch.Tensor, terms: int, out_dtype: torch.dtype,
          u_acc: float, rounding: str = "nearest") -> torch.Tensor:
    """The elementwise bound above, in fp64. ``rounding="truncate"`` doubles v, for a final
    conversion that truncates (Triton's interpreter converts fp32 to bf16 so; GPUs round)."""
    if terms * u_acc >= 0.5:
        raise ValueError(f"{terms} terms at unit roundoff {u_acc:.3g}: the bound is meaningless (n u >= 1/2)")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    gamma = terms * u_acc / (1 - terms * u_acc)
    v = unit_roundoff(out_dtype) * (2 if rounding == "truncate" else 1)
    tiny = torch.finfo(out_dtype).smallest_normal
    return v * reference.abs() + (1 + v) * gamma * magnitude + tiny


def references(dynamic: bool, x: torch.Tensor, w: torch.Tensor, padding_l: int, grad: torch.Tensor) -> dict:
    """name -> (fp64 reference, magnitude M, terms n) for y, grad_x and grad_w of the op on
    these (already rounded) inputs and output gradient, from the direct reference (its
    gradients written out tap by tap, not by autograd)."""
    fn = dynamicconv_direct if dynamic else lightconv_direct
    batch, channels, time = x.shape
    heads, kernel = (w.shape[1], w.shape[2]) if dynamic else w.shape
    out = {}
    for absolute in (False, True):
        xs, ws, gs = (t.detach().double() for t in (x, w, grad))
        if absolute:
            xs, ws, gs = xs.abs(), ws.abs(), gs.abs()
        out[absolute] = (fn(xs, ws, padding_l), *direct_grads(dynamic, xs, ws, padding_l, gs))
    weight_terms = channels // heads if dynamic else batch * (channels // heads) * time
    terms = {"y": kernel, "grad_x": kernel, "grad_w": max(1, weight_terms)}
    return {name: (out[False][i], out[True][i], terms[name]) for i, name in enumerate(("y", "grad_x", "grad_w"))}


def excess(got: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor, terms: int, u_acc: float,
           rounding: str = "nearest"):
    """(largest |error| / bound over the elements, index of that element); <= 1 passes."""
    if got.shape != reference.shape:
        raise ValueError(f"shape {tuple(got.shape)} != reference {tuple(reference.shape)}")
    if got.numel() == 0:
        return 0.0, None
    limit = bound(reference, magnitude, terms, got.dtype, u_acc, rounding)
    ratio = (got.double() - reference).abs() / limit
    worst = int(ratio.argmax())
    return ratio.flatten()[worst].item(), tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape))


def check(got: dict, refs: dict, u_acc: float, context: str = "", rounding: str = "nearest") -> list:
    """Messages for each of ``got`` (name -> tensor) beyond its bound; empty when all pass.
    Every name must have a reference, and at least one tensor is compared."""
    if not got:
        raise ValueError("nothing to compare")
    failures = []
    for name, tensor in got.items():
        reference, magnitude, terms = refs[name]
        ratio, where = excess(tensor, reference, magnitude, terms, u_acc, rounding)
        if not ratio <= 1.0:
            failures.append(f"{context} {name}: error {ratio:.3g}x its bound at {where} "
                            f"(got {tensor.dtype} {tensor.double()[where].item():.6g}, "
                            f"reference {reference[where].item():.6g})")
    return failures
