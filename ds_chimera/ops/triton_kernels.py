"""Triton kernels for lightweight and dynamic convolution (GPU; CPU only under TRITON_INTERPRET=1).

Two families, chosen per call by what measured faster on an H200 (tools/kernel_sweep.py):

* Tap loop (here): one program computes BLOCK_T time steps of one (batch, channel) row, the
  K taps a runtime loop of shifted, masked loads that hit the cache. Fastest below 5 taps,
  and the path for a reach over 64 steps on either side (a causal kernel of more than 65
  taps, any kernel over 129) and for fp64.
* Window bands (triton_window.py): all taps of a tile as tensor-core products over aligned
  windows, with a fused backward. Everything else.

Inputs have any strides (the layers pass T x B x C as a (B, C, T) view); outputs take the
input's layout. 16-bit and fp32 inputs accumulate in fp32, fp64 in fp64 (exact to fp64
rounding); any K, any H dividing C, padding_l in [0, K-1]. Layouts as in reference.py:
x (B, C, T), LightConv weight (H, K), DynamicConv weight (B, H, K, T). ``*_step`` are the
decoding steps: one output per channel from a ring buffer of the last K-1 inputs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_window
from .triton_window import LAUNCH_OPTIONS, dense

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TAP_TILE = 4096          # taps x steps held by one weight-gradient program of the tap loop


def _check_dtype(*tensors):
    """The Triton kernels compute in the input dtype's accumulator: refuse what they cannot."""
    for t in tensors:
        if t is not None and t.dtype not in SUPPORTED:
            raise TypeError(f"the triton backend supports {', '.join(str(d) for d in SUPPORTED)}; got {t.dtype}")


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def _lightconv_fwd(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, SB, SC, ST, BLOCK_T: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)                      # b * C + c
    tb = tl.program_id(1)
    c = row % C
    h = c // CPH
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < T
    base = (row // C).to(tl.int64) * SB + c.to(tl.int64) * SC
    acc = tl.zeros([BLOCK_T], dtype=ACC)
    for k in range(0, K):
        s = t + k - P
        xv = tl.load(x_ptr + base + s * ST, mask=in_t & (s >= 0) & (s < T), other=0.0)
        wk = tl.load(w_ptr + h * K + k)
        acc += wk.to(ACC) * xv.to(ACC)
    tl.store(y_ptr + base + t * ST, acc.to(y_ptr.dtype.element_ty), mask=in_t)


@triton.jit
def _lightconv_wgrad_partial(gy_ptr, x_ptr, part_ptr, C, T, K, P, SB, SC, ST, n_tb, KPAD, KB: tl.constexpr,
                             BLOCK_T: tl.constexpr, ACC: tl.constexpr):
    """part[row, tb, k] = sum over this program's t of gy[row, t] * x[row, t + k - P], for the
    KB taps of program axis 2."""
    row = tl.program_id(0)
    tb = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(2) * KB + tl.arange(0, KB)
    base = (row // C).to(tl.int64) * SB + (row % C).to(tl.int64) * SC
    gy = tl.load(gy_ptr + base + t * ST, mask=t < T, other=0.0).to(ACC)
    s = t[None, :] + k[:, None] - P
    mask = (t[None, :] < T) & (k[:, None] < K) & (s >= 0) & (s < T)
    xv = tl.load(x_ptr + base + s * ST, mask=mask, other=0.0).to(ACC)
    part = tl.sum(xv * gy[None, :], axis=1)
    out = (row.to(tl.int64) * n_tb + tb) * KPAD + k
    tl.store(part_ptr + out, part)


@triton.jit
def _dynamicconv_fwd(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, H, SB, SC, ST, WB, WH, WK, WT, BLOCK_T: tl.constexpr,
                     ACC: tl.constexpr):
    row = tl.program_id(0)
    tb = tl.program_id(1)
    b = row // C
    c = row % C
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < T
    base = b.to(tl.int64) * SB + c.to(tl.int64) * SC
    wbase = b.to(tl.int64) * WB + (c // CPH).to(tl.int64) * WH
    acc = tl.zeros([BLOCK_T], dtype=ACC)
    for k in range(0, K):
        s = t + k - P
        xv = tl.load(x_ptr + base + s * ST, mask=in_t & (s >= 0) & (s < T), other=0.0)
        wv = tl.load(w_ptr + wbase + k * WK + t * WT, mask=in_t, other=0.0)
        acc += wv.to(ACC) * xv.to(ACC)
    tl.store(y_ptr + base + t * ST, acc.to(y_ptr.dtype.element_ty), mask=in_t)


@triton.jit
def _dynamicconv_bwd_input(gy_ptr, w_ptr, gx_ptr, C, T, K, P, CPH, H, SB, SC, ST, WB, WH, WK, WT,
                           BLOCK_T: tl.constexpr, ACC: tl.constexpr):
    """gx[b, c, s] = sum_k w[b, h, k, t] * gy[b, c, t] with t = s - k + P."""
    row = tl.program_id(0)
    sb = tl.program_id(1)
    b = row // C
    c = row % C
    s = sb * BLOCK_T + tl.arange(0, BLOCK_T)
    in_s = s < T
    base = b.to(tl.int64) * SB + c.to(tl.int64) * SC
    wbase = b.to(tl.int64) * WB + (c // CPH).to(tl.int64) * WH
    acc = tl.zeros([BLOCK_T], dtype=ACC)
    for k in range(0, K):
        t = s - k + P
        m = in_s & (t >= 0) & (t < T)
        gv = tl.load(gy_ptr + base + t * ST, mask=m, other=0.0)
        wv = tl.load(w_ptr + wbase + k * WK + t * WT, mask=m, other=0.0)
        acc += wv.to(ACC) * gv.to(ACC)
    tl.store(gx_ptr + base + s * ST, acc.to(gx_ptr.dtype.element_ty), mask=in_s)


@triton.jit
def _dynamicconv_bwd_weight(gy_ptr, x_ptr, gw_ptr, C, T, K, P, CPH, H, SB, SC, ST, WB, WH, WK, WT,
                            KB: tl.constexpr, BLOCK_T: tl.constexpr, ACC: tl.constexpr):
    """gw[b, h, k, t] = sum over channels c of head h of gy[b, c, t] * x[b, c, t + k - P], for
    the KB taps of program axis 2."""
    bh = tl.program_id(0)
    tb = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(2) * KB + tl.arange(0, KB)
    s = t[None, :] + k[:, None] - P
    mask = (t[None, :] < T) & (k[:, None] < K) & (s >= 0) & (s < T)
    acc = tl.zeros([KB, BLOCK_T], dtype=ACC)
    for j in range(0, CPH):
        base = b.to(tl.int64) * SB + (h * CPH + j).to(tl.int64) * SC
        gv = tl.load(gy_ptr + base + t * ST, mask=t < T, other=0.0).to(ACC)
        xv = tl.load(x_ptr + base + s * ST, mask=mask, other=0.0).to(ACC)
        acc += xv * gv[None, :]
    out = b.to(tl.int64) * WB + h.to(tl.int64) * WH + k[:, None] * WK + t[None, :] * WT
    tl.store(gw_ptr + out, acc.to(gw_ptr.dtype.element_ty), mask=(k[:, None] < K) & (t[None, :] < T))


@triton.jit
def _conv_step(buf_ptr, x_ptr, w_ptr, y_ptr, B, C, K, CPH, H, position, DYNAMIC: tl.constexpr,
               BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """y[b, c] = sum_{j < K-1} w[j] * buf[(position + j) % (K-1), b, c] + w[K-1] * x[b, c],
    w the head's kernel (H, K) or the step's (B, H, K); buffer (K-1, B, C) and x contiguous."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < C
    wrow = ((b * H if DYNAMIC else 0) + c // CPH) * K
    xv = tl.load(x_ptr + b * C + c, mask=in_c, other=0.0).to(ACC)
    acc = xv * tl.load(w_ptr + wrow + K - 1, mask=in_c, other=0.0).to(ACC)
    for j in range(0, K - 1):
        slot = (position + j) % (K - 1)
        bv = tl.load(buf_ptr + (slot.to(tl.int64) * B + b) * C + c, mask=in_c, other=0.0).to(ACC)
        acc += bv * tl.load(w_ptr + wrow + j, mask=in_c, other=0.0).to(ACC)
    tl.store(y_ptr + b * C + c, acc.to(y_ptr.dtype.element_ty), mask=in_c)


def _block_t(time: int) -> int:
    return max(16, min(1024, triton.next_power_of_2(time)))


def _tap_block(kernel: int, time: int, cap: int):
    """(taps per program, steps per program) of a tap-loop weight gradient: at most TAP_TILE
    values per program, whatever K (the taps are split over program axis 2)."""
    block = min(_block_t(time), cap)
    taps = min(triton.next_power_of_2(kernel), max(1, TAP_TILE // block))
    return taps, block


def _tap_lightconv_forward(x, w, padding_l):
    x, w = dense(x), w.contiguous()
    batch, channels, time = x.shape
    heads, kernel = w.shape
    y = torch.empty_like(x)
    block = _block_t(time)
    _lightconv_fwd[(batch * channels, triton.cdiv(time, block))](
        x, w, y, channels, time, kernel, padding_l, channels // heads, *x.stride(), BLOCK_T=block,
        ACC=_acc(x.dtype), **LAUNCH_OPTIONS)
    return y


def _tap_lightconv_backward_weight(grad, x, padding_l, heads, kernel):
    x = dense(x)
    grad = grad if grad.stride() == x.stride() else torch.empty_like(x).copy_(grad)
    batch, channels, time = x.shape
    taps, block = _tap_block(kernel, time, 256)
    n_tb, n_kb = triton.cdiv(time, block), triton.cdiv(kernel, taps)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    part = torch.empty(batch * channels, n_tb, n_kb * taps, device=x.device, dtype=acc)
    _lightconv_wgrad_partial[(batch * channels, n_tb, n_kb)](
        grad, x, part, channels, time, kernel, padding_l, *x.stride(), n_tb, n_kb * taps, KB=taps, BLOCK_T=block,
        ACC=_acc(x.dtype), **LAUNCH_OPTIONS)
    gw = part.view(batch, heads, channels // heads, n_tb, n_kb * taps).sum(dim=(0, 2, 3))[:, :kernel]
    return gw.to(x.dtype)


def _tap_dynamicconv_forward(x, w, padding_l):
    x, w = dense(x), dense(w)
    batch, channels, time = x.shape
    heads, kernel = w.shape[1], w.shape[2]
    y = torch.empty_like(x)
    block = _block_t(time)
    _dynamicconv_fwd[(batch * channels, triton.cdiv(time, block))](
        x, w, y, channels, time, kernel, padding_l, channels // heads, heads, *x.stride(), *w.stride(),
        BLOCK_T=block, ACC=_acc(x.dtype), **LAUNCH_OPTIONS)
    return y


def _tap_dynamicconv_backward_input(grad, w, padding_l):
    grad, w = dense(grad), dense(w)
    batch, channels, time = grad.shape
    heads, kernel = w.shape[1], w.shape[2]
    gx = torch.empty_like(grad)
    block = _block_t(time)
    _dynamicconv_bwd_input[(batch * channels, triton.cdiv(time, block))](
        grad, w, gx, channels, time, kernel, padding_l, channels // heads, heads, *grad.stride(), *w.stride(),
        BLOCK_T=block, ACC=_acc(grad.dtype), **LAUNCH_OPTIONS)
    return gx


def _tap_dynamicconv_backward_weight(grad, x, padding_l, heads, kernel, like=None):
    """gw (B, H, K, T): in ``like``'s layout (the fused call's weight), else contiguous."""
    x = dense(x)
    grad = grad if grad.stride() == x.stride() else torch.empty_like(x).copy_(grad)
    batch, channels, time = x.shape
    taps, block = _tap_block(kernel, time, 1024)
    gw = torch.empty_like(dense(like)) if like is not None else \
        torch.empty(batch, heads, kernel, time, device=x.device, dtype=x.dtype)
    _dynamicconv_bwd_weight[(batch * heads, triton.cdiv(time, block), triton.cdiv(kernel, taps))](
        grad, x, gw, channels, time, kernel, padding_l, channels // heads, heads, *x.stride(), *gw.stride(),
        KB=taps, BLOCK_T=block, ACC=_acc(x.dtype), **LAUNCH_OPTIONS)
    return gw


def _use_window(x, kernel, padding_l, op=""):
    """The window-band kernels serve 5 to 129 taps reaching at most 64 steps either side
    (tiles of at most 64 steps, within Hopper's shared memory). Below 5 taps the tap loop was
    faster on an H200 (tools/kernel_sweep.py), except for LightConv's 16-bit backward;
    fp64 always takes the tap loop (exact fp64 accumulation)."""
    if not 1 <= kernel <= WINDOW_MAX_K or triton_window.reach(kernel, padding_l) > triton_window.MAX_REACH:
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
    if not _use_window(x, kernel, padding_l, op):
        return "tap loop"
    width, stages, sliding = triton_window.launch_config(op, x.dtype, kernel, padding_l)
    sliding = sliding and (op.endswith("forward") or triton_window.fits_one_block(channels_per_head))
    return f"window{' sliding' if sliding else ''} W={width} stages={stages}"


def lightconv_forward(x, w, padding_l):
    _check_dtype(x, w)
    if _use_window(x, w.shape[1], padding_l):
        return triton_window.window_forward(x, w, padding_l, dynamic=False)
    return _tap_lightconv_forward(x, w, padding_l)


def lightconv_backward_input(grad, w, padding_l):
    # gx[s] = sum_k w[k] gy[s - k + P]: the forward with the kernel reversed and padding K-1-P
    return lightconv_forward(grad, w.flip(-1), w.shape[1] - 1 - padding_l)


def lightconv_backward_weight(grad, x, padding_l, heads, kernel):
    _check_dtype(grad, x)
    if _use_window(x, kernel, padding_l):
        return triton_window.window_backward(grad, x, None, padding_l, heads, kernel, dynamic=False,
                                             need_input=False)[1]
    return _tap_lightconv_backward_weight(grad, x, padding_l, heads, kernel)


def lightconv_backward(grad, x, w, padding_l):
    """(grad_x, grad_w) in one pass over grad and x."""
    _check_dtype(grad, x, w)
    if _use_window(x, w.shape[1], padding_l, "lightconv_backward"):
        return triton_window.window_backward(grad, x, w, padding_l, w.shape[0], w.shape[1], dynamic=False)
    return (lightconv_backward_input(grad, w, padding_l),
            _tap_lightconv_backward_weight(grad, x, padding_l, w.shape[0], w.shape[1]))


def dynamicconv_forward(x, w, padding_l):
    _check_dtype(x, w)
    if _use_window(x, w.shape[2], padding_l):
        return triton_window.window_forward(x, w, padding_l, dynamic=True)
    return _tap_dynamicconv_forward(x, w, padding_l)


def dynamicconv_backward_input(grad, w, padding_l):
    _check_dtype(grad, w)
    if _use_window(grad, w.shape[2], padding_l):
        return triton_window.window_backward(grad, None, w, padding_l, w.shape[1], w.shape[2], dynamic=True,
                                             need_weight=False)[0]
    return _tap_dynamicconv_backward_input(grad, w, padding_l)


def dynamicconv_backward_weight(grad, x, padding_l, heads, kernel):
    _check_dtype(grad, x)
    if _use_window(x, kernel, padding_l):
        return triton_window.window_backward(grad, x, None, padding_l, heads, kernel, dynamic=True,
                                             need_input=False)[1]
    return _tap_dynamicconv_backward_weight(grad, x, padding_l, heads, kernel)


def dynamicconv_backward(grad, x, w, padding_l):
    """(grad_x, grad_w) in one pass over grad and x."""
    _check_dtype(grad, x, w)
    if _use_window(x, w.shape[2], padding_l):
        return triton_window.window_backward(grad, x, w, padding_l, w.shape[1], w.shape[2], dynamic=True)
    return (_tap_dynamicconv_backward_input(grad, w, padding_l),
            _tap_dynamicconv_backward_weight(grad, x, padding_l, w.shape[1], w.shape[2], like=w))


def _step(buffer, x, weight, position, dynamic):
    _check_dtype(buffer, x, weight)
    buffer, x, weight = buffer.contiguous(), x.contiguous(), weight.contiguous()
    batch, channels = x.shape
    heads, kernel = weight.shape[-2:]
    y = torch.empty_like(x)
    block = min(1024, max(16, triton.next_power_of_2(channels)))
    _conv_step[(batch, triton.cdiv(channels, block))](buffer, x, weight, y, batch, channels, kernel,
                                                     channels // heads, heads, position, DYNAMIC=dynamic,
                                                     BLOCK_C=block, ACC=_acc(x.dtype), **LAUNCH_OPTIONS)
    return y


def lightconv_step(buffer, x, weight, position):
    """One causal decoding step from a ring buffer (see reference.lightconv_step)."""
    return _step(buffer, x, weight, position, dynamic=False)


def dynamicconv_step(buffer, x, weight, position):
    """One causal decoding step with the step's own kernels (B, H, K)."""
    return _step(buffer, x, weight, position, dynamic=True)
