"""Triton kernels for lightweight and dynamic convolution (GPU; CPU only under TRITON_INTERPRET=1).

One program computes BLOCK_T time steps of one (batch, channel) row. Inputs are read in
their own dtype and accumulated in fp32; any K, any H dividing C, padding_l in [0, K-1].
The K taps are a runtime loop of shifted, masked loads: the shifted reads of a row hit
the cache, so HBM traffic stays near one read of x (and of the dynamic kernel) and one
write of y per element. Layouts as in reference.py: x (B, C, T), LightConv weight (H, K),
DynamicConv weight (B, H, K, T).
"""
from __future__ import annotations

import os

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


# ---- banded-matmul kernels ------------------------------------------------------------------
# For K > 4 the tap loop above re-reads x K times. These kernels read a tile of x (with its
# K-1 halo) once per (batch, head, time tile, channel block) and apply all K taps as one
# tl.dot with a (BT+K-1) x BT band matrix built from the kernel. The band is shared by the
# channels of a head, so the kernel weights are read once per tile, not once per channel.
# fp32 uses three-pass TF32 (tf32x3) for fp32-level accuracy on the tensor cores.

@triton.jit
def _band_fwd(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, H, DYNAMIC: tl.constexpr, BG: tl.constexpr,
              BT: tl.constexpr, BTK: tl.constexpr, PREC: tl.constexpr):
    """y[g, t0+j] = sum_i X[g, i] * band[i, j], X[g, i] = x[g, t0 - P + i], band[i, j] = w[i - j (, t0+j)]."""
    bh = tl.program_id(0)
    t0 = tl.program_id(1) * BT
    g0 = tl.program_id(2) * BG
    b = bh // H
    h = bh % H
    g = g0 + tl.arange(0, BG)
    i = tl.arange(0, BTK)
    j = tl.arange(0, BT)
    rows = (b * C + h * CPH + g).to(tl.int64) * T
    s = t0 - P + i
    xmask = (g[:, None] < CPH) & (i[None, :] < BT + K - 1) & (s[None, :] >= 0) & (s[None, :] < T)
    X = tl.load(x_ptr + rows[:, None] + s[None, :], mask=xmask, other=0.0)
    k = i[:, None] - j[None, :]
    bmask = (k >= 0) & (k < K) & (t0 + j[None, :] < T)
    if DYNAMIC:
        wptr = w_ptr + bh.to(tl.int64) * K * T + k * T + (t0 + j)[None, :]
    else:
        wptr = w_ptr + h * K + k
    band = tl.load(wptr, mask=bmask, other=0.0).to(X.dtype)
    acc = tl.dot(X, band, input_precision=PREC)
    ymask = (g[:, None] < CPH) & (t0 + j[None, :] < T)
    tl.store(y_ptr + rows[:, None] + (t0 + j)[None, :], acc.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _band_dyn_bwd_input(gy_ptr, w_ptr, gx_ptr, C, T, K, P, CPH, H, BG: tl.constexpr, BT: tl.constexpr,
                        BTK: tl.constexpr, PREC: tl.constexpr):
    """gx[g, s0+j] = sum_i GY[g, i] * band[i, j], t_i = s0 - (K-1) + P + i, band[i, j] = w[j - i + K - 1, t_i]."""
    bh = tl.program_id(0)
    s0 = tl.program_id(1) * BT
    g0 = tl.program_id(2) * BG
    b = bh // H
    h = bh % H
    g = g0 + tl.arange(0, BG)
    i = tl.arange(0, BTK)
    j = tl.arange(0, BT)
    rows = (b * C + h * CPH + g).to(tl.int64) * T
    t = s0 - (K - 1) + P + i
    valid_t = (i < BT + K - 1) & (t >= 0) & (t < T)
    GY = tl.load(gy_ptr + rows[:, None] + t[None, :], mask=(g[:, None] < CPH) & valid_t[None, :], other=0.0)
    k = j[None, :] - i[:, None] + K - 1
    bmask = (k >= 0) & (k < K) & valid_t[:, None]
    band = tl.load(w_ptr + bh.to(tl.int64) * K * T + k * T + t[:, None], mask=bmask, other=0.0).to(GY.dtype)
    acc = tl.dot(GY, band, input_precision=PREC)
    mask = (g[:, None] < CPH) & (s0 + j[None, :] < T)
    tl.store(gx_ptr + rows[:, None] + (s0 + j)[None, :], acc.to(gx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _band_wgrad_shear(gy_ptr, x_ptr, out_ptr, scratch_ptr, C, T, K, P, CPH, H, n_t, n_tiles,
                      DYNAMIC: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr, BTK: tl.constexpr,
                      KP: tl.constexpr, PREC: tl.constexpr):
    """Weight grads from the correlation tile corr = X^T GY (tensor cores), sheared through scratch.

    Tap k is the diagonal corr[j + k, j]. The tile is written to this program's scratch slot
    and read back skewed, one [K, BT] load, instead of K full-tile reductions. A persistent
    grid keeps the scratch small (one slot per program).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    i = tl.arange(0, BTK)
    j = tl.arange(0, BT)
    kk = tl.arange(0, KP)
    slot = scratch_ptr + pid.to(tl.int64) * BTK * BT
    for tile in range(pid, n_tiles, nprog):
        tile64 = tl.full([], 0, tl.int64) + tile     # int64 offsets (and a tensor under the interpreter)
        bh = tile64 // n_t
        tb = tile64 % n_t
        t0 = tb * BT
        b = bh // H
        h = bh % H
        s = t0 - P + i
        xcols = (i < BT + K - 1) & (s >= 0) & (s < T)
        corr = tl.zeros([BTK, BT], dtype=tl.float32)
        for g0 in range(0, CPH, BG):
            g = g0 + tl.arange(0, BG)
            rows = (b * C + h * CPH + g) * T
            X = tl.load(x_ptr + rows[:, None] + s[None, :], mask=(g[:, None] < CPH) & xcols[None, :], other=0.0)
            GY = tl.load(gy_ptr + rows[:, None] + (t0 + j)[None, :],
                         mask=(g[:, None] < CPH) & (t0 + j[None, :] < T), other=0.0)
            corr += tl.dot(tl.trans(X), GY.to(X.dtype), input_precision=PREC)
        tl.store(slot + i[:, None] * BT + j[None, :], corr)
        tl.debug_barrier()
        kmask = (kk[:, None] < K) & (t0 + j[None, :] < T)
        taps = tl.load(slot + (j[None, :] + kk[:, None]) * BT + j[None, :], mask=kmask, other=0.0)   # [KP, BT]
        tl.debug_barrier()
        if DYNAMIC:
            tl.store(out_ptr + bh * K * T + kk[:, None] * T + (t0 + j)[None, :],
                     taps.to(out_ptr.dtype.element_ty), mask=kmask)
        else:
            tl.store(out_ptr + tile64 * K + kk, tl.sum(taps, axis=1), mask=kk < K)


BAND_MIN_K = 5
BAND_MAX_K = 129


def _band_config(kernel, channels_per_head, dtype):
    bt = 64
    btk = triton.next_power_of_2(bt + kernel - 1)
    bg = max(16, min(64, triton.next_power_of_2(channels_per_head)))
    prec = "tf32x3" if dtype == torch.float32 else "ieee"
    return bg, bt, btk, prec


def _use_band(x, kernel):
    if not BAND_MIN_K <= kernel <= BAND_MAX_K:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        # Triton's CPU interpreter computes tl.dot on 16-bit inputs wrongly (numpy has no bf16);
        # there the 16-bit cases take the tap loop. The GPU run checks the 16-bit band kernels.
        return x.dtype == torch.float32
    return x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _band_forward(x, w, padding_l, dynamic):
    batch, channels, time = x.shape
    heads, kernel = (w.shape[1], w.shape[2]) if dynamic else w.shape
    cph = channels // heads
    bg, bt, btk, prec = _band_config(kernel, cph, x.dtype)
    y = torch.empty_like(x)
    grid = (batch * heads, triton.cdiv(time, bt), triton.cdiv(cph, bg))
    _band_fwd[grid](x, w, y, channels, time, kernel, padding_l, cph, heads, DYNAMIC=dynamic, BG=bg, BT=bt, BTK=btk,
                    PREC=prec)
    return y


def _band_weight_grad(grad, x, padding_l, heads, kernel, dynamic):
    batch, channels, time = x.shape
    cph = channels // heads
    bg, bt, btk, prec = _band_config(kernel, cph, x.dtype)
    n_t = triton.cdiv(time, bt)
    n_tiles = batch * heads * n_t
    if x.device.type == "cuda":
        programs = min(n_tiles, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:
        programs = min(n_tiles, 4)
    scratch = torch.empty(programs, btk, bt, device=x.device, dtype=torch.float32)
    if dynamic:
        out = torch.empty(batch, heads, kernel, time, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(n_tiles, kernel, device=x.device, dtype=torch.float32)
    _band_wgrad_shear[(programs,)](grad, x, out, scratch, channels, time, kernel, padding_l, cph, heads, n_t, n_tiles,
                                   DYNAMIC=dynamic, BG=bg, BT=bt, BTK=btk, KP=triton.next_power_of_2(kernel),
                                   PREC=prec)
    if dynamic:
        return out
    return out.view(batch, heads, n_t, kernel).sum(dim=(0, 2)).to(x.dtype)


def lightconv_forward(x, w, padding_l):
    x, w = x.contiguous(), w.contiguous()
    if _use_band(x, w.shape[1]):
        return _band_forward(x, w, padding_l, dynamic=False)
    return _tap_lightconv_forward(x, w, padding_l)


def lightconv_backward_weight(grad, x, padding_l, heads, kernel):
    grad, x = grad.contiguous(), x.contiguous()
    if _use_band(x, kernel):
        return _band_weight_grad(grad, x, padding_l, heads, kernel, dynamic=False)
    return _tap_lightconv_backward_weight(grad, x, padding_l, heads, kernel)


def dynamicconv_forward(x, w, padding_l):
    x, w = x.contiguous(), w.contiguous()
    if _use_band(x, w.shape[2]):
        return _band_forward(x, w, padding_l, dynamic=True)
    return _tap_dynamicconv_forward(x, w, padding_l)


def dynamicconv_backward_input(grad, w, padding_l):
    grad, w = grad.contiguous(), w.contiguous()
    if not _use_band(grad, w.shape[2]):
        return _tap_dynamicconv_backward_input(grad, w, padding_l)
    batch, channels, time = grad.shape
    heads, kernel = w.shape[1], w.shape[2]
    cph = channels // heads
    bg, bt, btk, prec = _band_config(kernel, cph, grad.dtype)
    gx = torch.empty_like(grad)
    grid = (batch * heads, triton.cdiv(time, bt), triton.cdiv(cph, bg))
    _band_dyn_bwd_input[grid](grad, w, gx, channels, time, kernel, padding_l, cph, heads, BG=bg, BT=bt, BTK=btk,
                              PREC=prec)
    return gx


def dynamicconv_backward_weight(grad, x, padding_l, heads, kernel):
    grad, x = grad.contiguous(), x.contiguous()
    if _use_band(x, kernel):
        return _band_weight_grad(grad, x, padding_l, heads, kernel, dynamic=True)
    return _tap_dynamicconv_backward_weight(grad, x, padding_l, heads, kernel)
