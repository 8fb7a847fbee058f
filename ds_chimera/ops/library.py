"""The convolution ops registered with torch.library: ``torch.ops.ds_chimera.*``.

Ten ops: forward, input grad, weight grad and both grads together, of LightConv and
DynamicConv, and one causal decoding step of each. Each has a fake (meta) kernel so
``torch.compile`` can trace it; the two forward ops have autograd that calls only the
gradient ops whose inputs need a gradient (the fused one when both do). Each op dispatches
to the backend chosen for its device (see backends.py); ``backend`` forces one by name.

Inputs may have any strides: the layers pass their T x B x C activations as a (B, C, T)
view. Outputs take the layout ``torch.empty_like`` gives their input (so a T x B x C view in
gives one out, and the layer's ``permute`` back is free): y and grad_x like x and grad_y,
DynamicConv's fused weight grad like its weight; the other weight grads are contiguous.
A backend that returns another layout is copied into this one.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import backends
from .reference import check_shapes, check_step


def _impl(x: Tensor, backend: str):
    return backends.select(x.device, backend or None)


def _like(out: Tensor, like: Tensor) -> Tensor:
    """``out`` in the layout the fake kernels promise: that of ``torch.empty_like(like)``."""
    if out.stride() == torch.empty_like(like, device="meta").stride():
        return out
    return torch.empty_like(like).copy_(out)


@torch.library.custom_op("ds_chimera::lightconv_forward", mutates_args=())
def lightconv_forward(x: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    check_shapes(x, weight, padding_l, dynamic=False)
    return _like(_impl(x, backend).lightconv_forward(x, weight, padding_l), x)


@torch.library.custom_op("ds_chimera::lightconv_backward_input", mutates_args=())
def lightconv_backward_input(grad: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    return _like(_impl(grad, backend).lightconv_backward_input(grad, weight, padding_l), grad)


@torch.library.custom_op("ds_chimera::lightconv_backward_weight", mutates_args=())
def lightconv_backward_weight(grad: Tensor, x: Tensor, padding_l: int, heads: int, kernel: int,
                              backend: str = "") -> Tensor:
    return _impl(x, backend).lightconv_backward_weight(grad, x, padding_l, heads, kernel).contiguous()


@torch.library.custom_op("ds_chimera::dynamicconv_forward", mutates_args=())
def dynamicconv_forward(x: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    check_shapes(x, weight, padding_l, dynamic=True)
    return _like(_impl(x, backend).dynamicconv_forward(x, weight, padding_l), x)


@torch.library.custom_op("ds_chimera::dynamicconv_backward_input", mutates_args=())
def dynamicconv_backward_input(grad: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    return _like(_impl(grad, backend).dynamicconv_backward_input(grad, weight, padding_l), grad)


@torch.library.custom_op("ds_chimera::dynamicconv_backward_weight", mutates_args=())
def dynamicconv_backward_weight(grad: Tensor, x: Tensor, padding_l: int, heads: int, kernel: int,
                                backend: str = "") -> Tensor:
    return _impl(x, backend).dynamicconv_backward_weight(grad, x, padding_l, heads, kernel).contiguous()


def _both_gradients(kind, grad, x, weight, padding_l, heads, kernel, backend):
    impl = _impl(x, backend)
    fused = getattr(impl, f"{kind}_backward", None)
    if fused is not None:
        gx, gw = fused(grad, x, weight, padding_l)
    else:
        gx = getattr(impl, f"{kind}_backward_input")(grad, weight, padding_l)
        gw = getattr(impl, f"{kind}_backward_weight")(grad, x, padding_l, heads, kernel)
    return _like(gx, grad), (_like(gw, weight) if kind == "dynamicconv" else gw.contiguous())


@torch.library.custom_op("ds_chimera::lightconv_backward", mutates_args=())
def lightconv_backward(grad: Tensor, x: Tensor, weight: Tensor, padding_l: int,
                       backend: str = "") -> tuple[Tensor, Tensor]:
    """Both gradients; a backend with a fused kernel reads grad and x once for the two."""
    return _both_gradients("lightconv", grad, x, weight, padding_l, weight.shape[0], weight.shape[1], backend)


@torch.library.custom_op("ds_chimera::dynamicconv_backward", mutates_args=())
def dynamicconv_backward(grad: Tensor, x: Tensor, weight: Tensor, padding_l: int,
                         backend: str = "") -> tuple[Tensor, Tensor]:
    """Both gradients; a backend with a fused kernel reads grad and x once for the two."""
    return _both_gradients("dynamicconv", grad, x, weight, padding_l, weight.shape[1], weight.shape[2], backend)


@torch.library.custom_op("ds_chimera::lightconv_step", mutates_args=())
def lightconv_step(buffer: Tensor, x: Tensor, weight: Tensor, position: int, backend: str = "") -> Tensor:
    """One causal output step (B, C) from a ring ``buffer`` (K-1, B, C) whose oldest row is at
    ``position``, the new input x (B, C) and the kernel (H, K)."""
    check_step(buffer, x, weight, position, dynamic=False)
    return backends.step_function(_impl(x, backend), "lightconv_step")(buffer, x, weight, position).contiguous()


@torch.library.custom_op("ds_chimera::dynamicconv_step", mutates_args=())
def dynamicconv_step(buffer: Tensor, x: Tensor, weight: Tensor, position: int, backend: str = "") -> Tensor:
    """lightconv_step with the new step's own kernels, weight (B, H, K)."""
    check_step(buffer, x, weight, position, dynamic=True)
    return backends.step_function(_impl(x, backend), "dynamicconv_step")(buffer, x, weight, position).contiguous()


# ---- fake kernels: shapes, dtypes and layouts only ----------------------------------------
@lightconv_forward.register_fake
def _(x, weight, padding_l, backend=""):
    check_shapes(x, weight, padding_l, dynamic=False)
    return torch.empty_like(x)


@lightconv_backward_input.register_fake
def _(grad, weight, padding_l, backend=""):
    return torch.empty_like(grad)


@lightconv_backward_weight.register_fake
def _(grad, x, padding_l, heads, kernel, backend=""):
    return x.new_empty((heads, kernel))


@dynamicconv_forward.register_fake
def _(x, weight, padding_l, backend=""):
    check_shapes(x, weight, padding_l, dynamic=True)
    return torch.empty_like(x)


@dynamicconv_backward_input.register_fake
def _(grad, weight, padding_l, backend=""):
    return torch.empty_like(grad)


@dynamicconv_backward_weight.register_fake
def _(grad, x, padding_l, heads, kernel, backend=""):
    return x.new_empty((x.shape[0], heads, kernel, x.shape[2]))


@lightconv_backward.register_fake
def _(grad, x, weight, padding_l, backend=""):
    return torch.empty_like(grad), x.new_empty(weight.shape)


@dynamicconv_backward.register_fake
def _(grad, x, weight, padding_l, backend=""):
    return torch.empty_like(grad), torch.empty_like(weight)


@lightconv_step.register_fake
def _(buffer, x, weight, position, backend=""):
    check_step(buffer, x, weight, position, dynamic=False)
    return x.new_empty(x.shape)


@dynamicconv_step.register_fake
def _(buffer, x, weight, position, backend=""):
    check_step(buffer, x, weight, position, dynamic=True)
    return x.new_empty(x.shape)


# ---- autograd -------------------------------------------------------------------------
def _save(ctx, inputs, output):
    x, weight, padding_l, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.padding_l, ctx.backend = padding_l, backend


def _lightconv_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
        gx, gw = lightconv_backward(grad, x, weight, ctx.padding_l, ctx.backend)
        return gx, gw, None, None
    gx = gw = None
    if ctx.needs_input_grad[0]:
        gx = lightconv_backward_input(grad, weight, ctx.padding_l, ctx.backend)
    if ctx.needs_input_grad[1]:
        gw = lightconv_backward_weight(grad, x, ctx.padding_l, weight.shape[0], weight.shape[1], ctx.backend)
    return gx, gw, None, None


def _dynamicconv_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
        gx, gw = dynamicconv_backward(grad, x, weight, ctx.padding_l, ctx.backend)
        return gx, gw, None, None
    gx = gw = None
    if ctx.needs_input_grad[0]:
        gx = dynamicconv_backward_input(grad, weight, ctx.padding_l, ctx.backend)
    if ctx.needs_input_grad[1]:
        gw = dynamicconv_backward_weight(grad, x, ctx.padding_l, weight.shape[1], weight.shape[2], ctx.backend)
    return gx, gw, None, None


lightconv_forward.register_autograd(_lightconv_backward, setup_context=_save)
dynamicconv_forward.register_autograd(_dynamicconv_backward, setup_context=_save)


def lightconv(x: Tensor, weight: Tensor, padding_l: int, backend: str | None = None) -> Tensor:
    """Lightweight convolution of x (B, C, T), any strides, with a normalised kernel (H, K)."""
    return torch.ops.ds_chimera.lightconv_forward(x, weight, padding_l, backend or "")


def dynamicconv(x: Tensor, weight: Tensor, padding_l: int, backend: str | None = None) -> Tensor:
    """Dynamic convolution of x (B, C, T) with per-step kernels (B, H, K, T), any strides."""
    return torch.ops.ds_chimera.dynamicconv_forward(x, weight, padding_l, backend or "")


def conv_step(buffer: Tensor, x: Tensor, weight: Tensor, position: int, dynamic: bool,
              backend: str | None = None) -> Tensor:
    """One decoding step (see lightconv_step), for inference: it has no gradient. Outside
    tracing it calls the backend directly, as the registered op's Python wrapper costs about
    as much as the step itself."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or buffer.requires_grad):
        raise ValueError("the decoding step has no gradient: call it under torch.no_grad(), or run the "
                         "full-sequence op on the window (the layers do this when gradients are needed)")
    if torch.compiler.is_compiling():
        op = torch.ops.ds_chimera.dynamicconv_step if dynamic else torch.ops.ds_chimera.lightconv_step
        return op(buffer, x, weight, position, backend or "")
    check_step(buffer, x, weight, position, dynamic)
    name = "dynamicconv_step" if dynamic else "lightconv_step"
    return backends.step_function(_impl(x, backend or ""), name)(buffer, x, weight, position)
