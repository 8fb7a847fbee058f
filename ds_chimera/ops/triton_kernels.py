"""Triton kernels for lightweight and dynamic convolution (GPU; CPU only under TRITON_INTERPRET=1).

One program computes BLOCK_T time steps of one (batch, channel) row. Inputs are read in
their own dtype and accumulated in fp32; any K, any H dividing C, padding_l in [0, K-1].
The K taps are a runtime loop of shifted, masked loads: the shifted reads of a row hit
the cache, so HBM traffic stays near one read of x (and of the dynamic kernel) and one
write of y per element. Layouts as in reference.py: x (B, C, T), LightConv weight (H, K),
DynamicConv weight (B, H, K, T).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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


def lightconv_forward(x, w, padding_l):
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


def lightconv_backward_weight(grad, x, padding_l, heads, kernel):
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


def dynamicconv_forward(x, w, padding_l):
    x, w = x.contiguous(), w.contiguous()
    batch, channels, time = x.shape
    heads, kernel = w.shape[1], w.shape[2]
    y = torch.empty_like(x)
    block = _block_t(time)
    _dynamicconv_fwd[(batch * channels, triton.cdiv(time, block))](x, w, y, channels, time, kernel, padding_l,
                                                                    channels // heads, heads, BLOCK_T=block)
    return y


def dynamicconv_backward_input(grad, w, padding_l):
    grad, w = grad.contiguous(), w.contiguous()
    batch, channels, time = grad.shape
    heads, kernel = w.shape[1], w.shape[2]
    gx = torch.empty_like(grad)
    block = _block_t(time)
    _dynamicconv_bwd_input[(batch * channels, triton.cdiv(time, block))](grad, w, gx, channels, time, kernel,
                                                                          padding_l, channels // heads, heads,
                                                                          BLOCK_T=block)
    return gx


def dynamicconv_backward_weight(grad, x, padding_l, heads, kernel):
    grad, x = grad.contiguous(), x.contiguous()
    batch, channels, time = x.shape
    kp = triton.next_power_of_2(kernel)
    block = max(16, min(_block_t(time), max(16, 8192 // kp)))
    gw = torch.empty(batch, heads, kernel, time, device=x.device, dtype=x.dtype)
    _dynamicconv_bwd_weight[(batch * heads, triton.cdiv(time, block))](grad, x, gw, channels, time, kernel,
                                                                        padding_l, channels // heads, heads,
                                                                        KP=kp, BLOCK_T=block)
    return gw
