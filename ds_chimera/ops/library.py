"""The convolution ops registered with torch.library: ``torch.ops.ds_chimera.*``.

Eight ops (forward, input grad, weight grad and both grads together, of LightConv and
DynamicConv), each with a fake (meta) kernel so ``torch.compile`` can trace them, and
autograd on the two forward ops that calls only the gradient ops whose inputs need a
gradient (the fused one when both do). Each op dispatches to
the backend chosen for its device (see backends.py); ``backend`` forces one by name.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import backends
from .reference import check_shapes


def _impl(x: Tensor, backend: str):
    return backends.select(x.device, backend or None)


@torch.library.custom_op("ds_chimera::lightconv_forward", mutates_args=())
def lightconv_forward(x: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    check_shapes(x, weight, padding_l, dynamic=False)
    return _impl(x, backend).lightconv_forward(x, weight, padding_l).contiguous()


@torch.library.custom_op("ds_chimera::lightconv_backward_input", mutates_args=())
def lightconv_backward_input(grad: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    return _impl(grad, backend).lightconv_backward_input(grad, weight, padding_l).contiguous()


@torch.library.custom_op("ds_chimera::lightconv_backward_weight", mutates_args=())
def lightconv_backward_weight(grad: Tensor, x: Tensor, padding_l: int, heads: int, kernel: int,
                              backend: str = "") -> Tensor:
    return _impl(x, backend).lightconv_backward_weight(grad, x, padding_l, heads, kernel).contiguous()


@torch.library.custom_op("ds_chimera::dynamicconv_forward", mutates_args=())
def dynamicconv_forward(x: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    check_shapes(x, weight, padding_l, dynamic=True)
    return _impl(x, backend).dynamicconv_forward(x, weight, padding_l).contiguous()


@torch.library.custom_op("ds_chimera::dynamicconv_backward_input", mutates_args=())
def dynamicconv_backward_input(grad: Tensor, weight: Tensor, padding_l: int, backend: str = "") -> Tensor:
    return _impl(grad, backend).dynamicconv_backward_input(grad, weight, padding_l).contiguous()


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
    return gx.contiguous(), gw.contiguous()


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


# ---- fake kernels: shapes and dtypes only -----------------------------------------------
@lightconv_forward.register_fake
def _(x, weight, padding_l, backend=""):
    check_shapes(x, weight, padding_l, dynamic=False)
    return x.new_empty(x.shape)


@lightconv_backward_input.register_fake
def _(grad, weight, padding_l, backend=""):
    return grad.new_empty(grad.shape)


@lightconv_backward_weight.register_fake
def _(grad, x, padding_l, heads, kernel, backend=""):
    return x.new_empty((heads, kernel))


@dynamicconv_forward.register_fake
def _(x, weight, padding_l, backend=""):
    check_shapes(x, weight, padding_l, dynamic=True)
    return x.new_empty(x.shape)


@dynamicconv_backward_input.register_fake
def _(grad, weight, padding_l, backend=""):
    return grad.new_empty(grad.shape)


@dynamicconv_backward_weight.register_fake
def _(grad, x, padding_l, heads, kernel, backend=""):
    return x.new_empty((x.shape[0], heads, kernel, x.shape[2]))


@lightconv_backward.register_fake
def _(grad, x, weight, padding_l, backend=""):
    return grad.new_empty(grad.shape), x.new_empty(weight.shape)


@dynamicconv_backward.register_fake
def _(grad, x, weight, padding_l, backend=""):
    return grad.new_empty(grad.shape), x.new_empty(weight.shape)


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
    """Lightweight convolution of x (B, C, T) with a normalised kernel (H, K)."""
    return torch.ops.ds_chimera.lightconv_forward(x, weight, padding_l, backend or "")


def dynamicconv(x: Tensor, weight: Tensor, padding_l: int, backend: str | None = None) -> Tensor:
    """Dynamic convolution of x (B, C, T) with per-step kernels (B, H, K, T)."""
    return torch.ops.ds_chimera.dynamicconv_forward(x, weight, padding_l, backend or "")
