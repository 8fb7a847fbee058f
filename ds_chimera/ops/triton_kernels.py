"""Triton kernels for lightweight and dynamic convolution (GPU; CPU only under TRITON_INTERPRET=1).

Two families, chosen per call by what measured faster on an H200 (benchmarks/kernel_sweep.py):

* Tap loop (here): one program computes BLOCK_T time steps of one (batch, channel) row, the
  K taps a runtime loop of shifted, masked loads that hit the cache. Fastest below 5 taps,
  and the only path above 129.
* Window bands (triton_window.py): all taps of a tile as tensor-core products over aligned
  windows, with a fused backward. Everything else.

Inputs are read in their own dtype and accumulated in fp32; any K, any H dividing C,
padding_l in [0, K-1]. Layouts as in reference.py: x (B, C, T), LightConv weight (H, K),
DynamicConv weight (B, H, K, T).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_window


@triton.jit
def _lightconv_fwd(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, BLOCK_T: tl.constexpr):
    row = tl.program_id(0)                      # b * C + c
    tb = tl.program_id(1)
    h = (row % C) // CPH
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < T
    base = row.to(tl.int64) * T
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k in range(0, K):
        s = t + k - P
        xv = tl.load(x_ptr + base + s, mask=in_t & (s >= 0) & (s < T), other=0.0)
        wk = tl.load(w_ptr + h * K + k)
        acc += wk.to(tl.float32) * xv.to(tl.float32)
    tl.store(y_ptr + base + t, acc.to(y_ptr.dtype.element_ty), mask=in_t)


@triton.jit
def _lightconv_wgrad_partial(gy_ptr, x_ptr, part_ptr, T, K, P, n_tb, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """part[row, tb, k] = sum over this program's t of gy[row, t] * x[row, t + k - P]."""
    row = tl.program_id(0)
    tb = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, KP)
    base = row.to(tl.int64) * T
    gy = tl.load(gy_ptr + base + t, mask=t < T, other=0.0).to(tl.float32)
    s = t[None, :] + k[:, None] - P
    mask = (t[None, :] < T) & (k[:, None] < K) & (s >= 0) & (s < T)
    xv = tl.load(x_ptr + base + s, mask=mask, other=0.0).to(tl.float32)
    part = tl.sum(xv * gy[None, :], axis=1)
    out = (row.to(tl.int64) * n_tb + tb) * KP + k
    tl.store(part_ptr + out, part)


@triton.jit
def _dynamicconv_fwd(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, H, BLOCK_T: tl.constexpr):
    row = tl.program_id(0)
    tb = tl.program_id(1)
    b = row // C
    h = (row % C) // CPH
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < T
    base = row.to(tl.int64) * T
    wbase = (b * H + h).to(tl.int64) * K * T
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k in range(0, K):
        s = t + k - P
        xv = tl.load(x_ptr + base + s, mask=in_t & (s >= 0) & (s < T), other=0.0)
        wv = tl.load(w_ptr + wbase + k * T + t, mask=in_t, other=0.0)
        acc += wv.to(tl.float32) * xv.to(tl.float32)
    tl.store(y_ptr + base + t, acc.to(y_ptr.dtype.element_ty), mask=in_t)


@triton.jit
def _dynamicconv_bwd_input(gy_ptr, w_ptr, gx_ptr, C, T, K, P, CPH, H, BLOCK_T: tl.constexpr):
    """gx[b, c, s] = sum_k w[b, h, k, t] * gy[b, c, t] with t = s - k + P."""
    row = tl.program_id(0)
    sb = tl.program_id(1)
    b = row // C
    h = (row % C) // CPH
    s = sb * BLOCK_T + tl.arange(0, BLOCK_T)
    in_s = s < T
    base = row.to(tl.int64) * T
    wbase = (b * H + h).to(tl.int64) * K * T
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k in range(0, K):
        t = s - k + P
        m = in_s & (t >= 0) & (t < T)
        gv = tl.load(gy_ptr + base + t, mask=m, other=0.0)
        wv = tl.load(w_ptr + wbase + k * T + t, mask=m, other=0.0)
        acc += wv.to(tl.float32) * gv.to(tl.float32)
    tl.store(gx_ptr + base + s, acc.to(gx_ptr.dtype.element_ty), mask=in_s)


@triton.jit
def _dynamicconv_bwd_weight(gy_ptr, x_ptr, gw_ptr, C, T, K, P, CPH, H, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """gw[b, h, k, t] = sum over channels c of head h of gy[b, c, t] * x[b, c, t + k - P]."""
    bh = tl.program_id(0)
    tb = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, KP)
    s = t[None, :] + k[:, None] - P
    mask = (t[None, :] < T) & (k[:, None] < K) & (s >= 0) & (s < T)
    acc = tl.zeros([KP, BLOCK_T], dtype=tl.float32)
    for j in range(0, CPH):
        base = (b * C + h * CPH + j).to(tl.int64) * T
        gv = tl.load(gy_ptr + base + t, mask=t < T, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + base + s, mask=mask, other=0.0).to(tl.float32)
        acc += xv * gv[None, :]
    out = bh.to(tl.int64) * K * T + k[:, None] * T + t[None, :]
    tl.store(gw_ptr + out, acc.to(gw_ptr.dtype.element_ty), mask=(k[:, None] < K) & (t[None, :] < T))


def _block_t(time: int) -> int:
    return max(16, min(1024, triton.next_power_of_2(time)))


def _tap_lightconv_forward(x, w, padding_l):
    x, w = x.contiguous(), w.contiguous()
    batch, channels, time = x.shape
    heads, kernel = w.shape
    y = torch.empty_like(x)
    block = _block_t(time)
    _lightconv_fwd[(batch * channels, triton.cdiv(time, block))](x, w, y, channels, time, kernel, padding_l,
                                                                  channels // heads, BLOCK_T=block)
    return y


def lightconv_backward_input(grad, w, padding_l):
    # gx[s] = sum_k w[k] gy[s - k + P]: the forward with the kernel reversed and padding K-1-P
    return lightconv_forward(grad, w.flip(-1), w.shape[1] - 1 - padding_l)


def _tap_lightconv_backward_weight(grad, x, padding_l, heads, kernel):
    grad, x = grad.contiguous(), x.contiguous()
    batch, channels, time = x.shape
    block = min(_block_t(time), 256)
    n_tb = triton.cdiv(time, block)
    kp = triton.next_power_of_2(kernel)
    part = torch.empty(batch * channels, n_tb, kp, device=x.device, dtype=torch.float32)
    _lightconv_wgrad_partial[(batch * channels, n_tb)](grad, x, part, time, kernel, padding_l, n_tb,
                                                      KP=kp, BLOCK_T=block)
    gw = part.view(batch, heads, channels // heads, n_tb, kp).sum(dim=(0, 2, 3))[:, :kernel]
    return gw.to(x.dtype)


def _tap_dynamicconv_forward(x, w, padding_l):
    x, w = x.contiguous(), w.contiguous()
    batch, channels, time = x.shape
    heads, kernel = w.shape[1], w.shape[2]
    y = torch.empty_like(x)
    block = _block_t(time)
    _dynamicconv_fwd[(batch * channels, triton.cdiv(time, block))](x, w, y, channels, time, kernel, padding_l,
                                                                    channels // heads, heads, BLOCK_T=block)
    return y


def _tap_dynamicconv_backward_input(grad, w, padding_l):
    grad, w = grad.contiguous(), w.contiguous()
    batch, channels, time = grad.shape
    heads, kernel = w.shape[1], w.shape[2]
    gx = torch.empty_like(grad)
    block = _block_t(time)
    _dynamicconv_bwd_input[(batch * channels, triton.cdiv(time, block))](grad, w, gx, channels, time, kernel,
                                                                          padding_l, channels // heads, heads,
                                                                          BLOCK_T=block)
    return gx


def _tap_dynamicconv_backward_weight(grad, x, padding_l, heads, kernel):
    grad, x = grad.contiguous(), x.contiguous()
    batch, channels, time = x.shape
    kp = triton.next_power_of_2(kernel)
    block = max(16, min(_block_t(time), max(16, 8192 // kp)))
    gw = torch.empty(batch, heads, kernel, time, device=x.device, dtype=x.dtype)
    _dynamicconv_bwd_weight[(batch * heads, triton.cdiv(time, block))](grad, x, gw, channels, time, kernel,
                                                                        padding_l, channels // heads, heads,
                                                                        KP=kp, BLOCK_T=block)
    return gw


def _use_window(x, kernel, op=""):
    """The window-band kernels serve 5 to 129 taps (a tile of at most 64 steps). Below 5 taps
    the tap loop was faster on an H200 (benchmarks/kernel_sweep.py), except for LightConv's
    16-bit backward."""
    if not 1 <= kernel <= WINDOW_MAX_K:
        return False
    if kernel < 5 and not (op == "lightconv_backward" and x.dtype != torch.float32):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter computes tl.dot on 16-bit inputs wrongly; there those take the tap loop
        return x.dtype == torch.float32
    return x.dtype in (torch.float32, torch.float16, torch.bfloat16)


WINDOW_MAX_K = 129


def kernel_path(op, x, kernel, padding_l, channels_per_head):
    """Which kernel serves ``op`` (a FUSED or forward name) for this input, in words: what a
    benchmark row measured."""
    if not _use_window(x, kernel, op):
        return "tap loop"
    width, stages, sliding = triton_window.launch_config(op, x.dtype, kernel, padding_l)
    sliding = sliding and (op.endswith("forward") or triton_window.fits_one_block(channels_per_head))
    return f"window{' sliding' if sliding else ''} W={width} stages={stages}"


def lightconv_forward(x, w, padding_l):
    x, w = x.contiguous(), w.contiguous()
    if _use_window(x, w.shape[1]):
        return triton_window.window_forward(x, w, padding_l, dynamic=False)
    return _tap_lightconv_forward(x, w, padding_l)


def lightconv_backward_weight(grad, x, padding_l, heads, kernel):
    grad, x = grad.contiguous(), x.contiguous()
    if _use_window(x, kernel):
        return triton_window.window_backward(grad, x, None, padding_l, heads, kernel, dynamic=False,
                                             need_input=False)[1]
    return _tap_lightconv_backward_weight(grad, x, padding_l, heads, kernel)


def lightconv_backward(grad, x, w, padding_l):
    """(grad_x, grad_w) in one pass over grad and x."""
    grad, x, w = grad.contiguous(), x.contiguous(), w.contiguous()
    if _use_window(x, w.shape[1], "lightconv_backward"):
        return triton_window.window_backward(grad, x, w, padding_l, w.shape[0], w.shape[1], dynamic=False)
    return (lightconv_backward_input(grad, w, padding_l),
            _tap_lightconv_backward_weight(grad, x, padding_l, w.shape[0], w.shape[1]))


def dynamicconv_forward(x, w, padding_l):
    x, w = x.contiguous(), w.contiguous()
    if _use_window(x, w.shape[2]):
        return triton_window.window_forward(x, w, padding_l, dynamic=True)
    return _tap_dynamicconv_forward(x, w, padding_l)


def dynamicconv_backward_input(grad, w, padding_l):
    grad, w = grad.contiguous(), w.contiguous()
    if _use_window(grad, w.shape[2]):
        return triton_window.window_backward(grad, None, w, padding_l, w.shape[1], w.shape[2], dynamic=True,
                                             need_weight=False)[0]
    return _tap_dynamicconv_backward_input(grad, w, padding_l)


def dynamicconv_backward_weight(grad, x, padding_l, heads, kernel):
    grad, x = grad.contiguous(), x.contiguous()
    if _use_window(x, kernel):
        return triton_window.window_backward(grad, x, None, padding_l, heads, kernel, dynamic=True,
                                             need_input=False)[1]
    return _tap_dynamicconv_backward_weight(grad, x, padding_l, heads, kernel)


def dynamicconv_backward(grad, x, w, padding_l):
    """(grad_x, grad_w) in one pass over grad and x."""
    grad, x, w = grad.contiguous(), x.contiguous(), w.contiguous()
    if _use_window(x, w.shape[2]):
        return triton_window.window_backward(grad, x, w, padding_l, w.shape[1], w.shape[2], dynamic=True)
    return (_tap_dynamicconv_backward_input(grad, w, padding_l),
            _tap_dynamicconv_backward_weight(grad, x, padding_l, w.shape[1], w.shape[2]))
