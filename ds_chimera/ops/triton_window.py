"""Window-band Triton kernels: every tap of a tile as tensor-core products over aligned windows.

Time is cut into tiles of W steps (W a power of two, at least 16 and at least the larger of
the left and right reach, P and K-1-P). A tile's outputs need only three aligned input
windows: the tile itself and its two neighbours. Each window meets a W x W band of the kernel
in one ``tl.dot``, so all K taps cost three small matrix products per tile, the loads are
aligned and vectorised, and each input element leaves HBM once (the neighbours' reads hit the
cache). A window the padding never reaches (no left reach when P = 0, no right reach when
P = K-1) is skipped at compile time.

* Forward (LightConv and DynamicConv): y = sum over windows of X_win @ band_win.
* Backward, fused: one pass over grad_y and x gives the input grad (the bands mirrored) and
  the weight grad, from the correlation of x's windows with grad_y's tile, whose diagonals
  are the taps. LightConv sums that correlation over the program's tiles and reads the
  diagonals once at the end; DynamicConv reads them per tile.

DynamicConv's bands are the per-step kernels sheared into band form with ``tl.gather``.
Each kernel has a sliding form that loads every window once and carries it through registers
(the reloading form reads each element through L2 three times, but Triton pipelines its
loads); ``launch_config`` picks per case what measured faster.
fp32 inputs use three-pass TF32 (fp32-level accuracy); 16-bit inputs accumulate in fp32.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Every launch asks for fused multiply-adds explicitly: Triton 3.9 fuses by default but warns that
# 3.10 will not, and the kernels' measured error bounds and speed are with fusion.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


@triton.jit
def _band_from_tile(wt, idx, KP: tl.constexpr, ON_ROWS: tl.constexpr):
    """band[i, j] = wt[idx[i, j], j] (ON_ROWS) or wt[i, idx[i, j]], zero where idx is outside [0, K)."""
    valid = (idx >= 0) & (idx < KP)
    safe = tl.minimum(tl.maximum(idx, 0), KP - 1)
    if ON_ROWS:
        band = tl.gather(wt, safe, 0)
    else:
        band = tl.gather(wt, safe, 1)
    return tl.where(valid, band, tl.zeros_like(band))


@triton.jit
def _rows_of_head(bh, g, CPH, H, SB, SC):
    """(head, row offsets, row mask) of channels ``g`` of the head of (batch, head) ``bh``;
    element (row, t) is at offset row + t * ST."""
    h = bh % H
    return h, (bh // H).to(tl.int64) * SB + (h * CPH + g).to(tl.int64) * SC, g < CPH


@triton.jit
def _kernel_base(w_ptr, bh, H, WB, WH):
    """Pointer to the per-step kernels of (batch, head) ``bh``: tap k, step t at + k*WK + t*WT."""
    return w_ptr + (bh // H).to(tl.int64) * WB + (bh % H).to(tl.int64) * WH


@triton.jit
def _head_band(w_ptr, h, K, k):
    """LightConv's band for tap indices k: w[h, k] where 0 <= k < K, else 0."""
    return tl.load(w_ptr + h * K + k, mask=(k >= 0) & (k < K), other=0.0)


@triton.jit
def _forward_bands(w_ptr, wt, h, K, P, d, DYNAMIC: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                   W: tl.constexpr, KP: tl.constexpr):
    """Bands of the windows before, at and after a tile, k = i - j + off + P (zero for a
    window the padding never reaches): from the head's kernel, or sheared from the tile's
    per-step kernels ``wt``."""
    if DYNAMIC:
        this = _band_from_tile(wt, d + P, KP, True)
    else:
        this = _head_band(w_ptr, h, K, d + P)
    before = tl.zeros_like(this)
    after = tl.zeros_like(this)
    if LEFT:
        if DYNAMIC:
            before = _band_from_tile(wt, d - W + P, KP, True)
        else:
            before = _head_band(w_ptr, h, K, d - W + P)
    if RIGHT:
        if DYNAMIC:
            after = _band_from_tile(wt, d + W + P, KP, True)
        else:
            after = _head_band(w_ptr, h, K, d + W + P)
    return before, this, after


@triton.jit
def _mirrored_head_bands(w_ptr, h, K, P, d, LEFT: tl.constexpr, RIGHT: tl.constexpr, W: tl.constexpr):
    """LightConv's input-grad bands for grad_y's windows before, at and after a tile,
    k = j - i - off + P: the window before matters when the kernel reaches right, the one
    after when it reaches left."""
    this = _head_band(w_ptr, h, K, P - d)
    before = tl.zeros_like(this)
    after = tl.zeros_like(this)
    if RIGHT:
        before = _head_band(w_ptr, h, K, W + P - d)
    if LEFT:
        after = _head_band(w_ptr, h, K, P - W - d)
    return before, this, after


@triton.jit
def _win_forward(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, H, TILES, SB, SC, ST, WB, WH, WK, WT,
                 DYNAMIC: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                 BG: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, PREC: tl.constexpr):
    """y[g, t0 + j] = sum over windows off of X[g, t0 + off + i] * band_off[i, j], k = i - j + off + P."""
    bh = tl.program_id(0)
    h, rows, in_g = _rows_of_head(bh, tl.program_id(1) * BG + tl.arange(0, BG), CPH, H, SB, SC)
    j = tl.arange(0, W)
    d = tl.arange(0, W)[:, None] - j[None, :]
    kk = tl.arange(0, KP)
    wbase = _kernel_base(w_ptr, bh, H, WB, WH) + kk[:, None] * WK
    if not DYNAMIC:
        # one kernel per head: the three bands are built once for all the program's tiles
        bl, bm, br = _forward_bands(w_ptr, w_ptr, h, K, P, d, False, LEFT, RIGHT, W, KP)
    for step in range(TILES):
        tile = tl.program_id(2) * TILES + step
        t = tile * W + j
        if DYNAMIC:
            wt = tl.load(wbase + t[None, :] * WT, mask=(kk[:, None] < K) & (t[None, :] < T), other=0.0)
            bl, bm, br = _forward_bands(w_ptr, wt, h, K, P, d, True, LEFT, RIGHT, W, KP)
        xm = tl.load(x_ptr + rows[:, None] + t[None, :] * ST, mask=in_g[:, None] & (t[None, :] < T), other=0.0)
        acc = tl.dot(xm, bm.to(xm.dtype), input_precision=PREC)
        if LEFT:
            xl = tl.load(x_ptr + rows[:, None] + (t - W)[None, :] * ST,
                         mask=in_g[:, None] & (t[None, :] >= W) & (t[None, :] < T + W), other=0.0)
            acc = tl.dot(xl, bl.to(xm.dtype), acc, input_precision=PREC)
        if RIGHT:
            xr = tl.load(x_ptr + rows[:, None] + (t + W)[None, :] * ST, mask=in_g[:, None] & (t[None, :] + W < T),
                         other=0.0)
            acc = tl.dot(xr, br.to(xm.dtype), acc, input_precision=PREC)
        tl.store(y_ptr + rows[:, None] + t[None, :] * ST, acc.to(y_ptr.dtype.element_ty),
                 mask=in_g[:, None] & (t[None, :] < T))


@triton.jit
def _load_window(ptr, rows, in_g, t, T, ST):
    """The [BG, W] window of rows ``rows`` at steps ``t``, zero outside [0, T)."""
    return tl.load(ptr + rows[:, None] + t[None, :] * ST,
                   mask=in_g[:, None] & (t[None, :] >= 0) & (t[None, :] < T), other=0.0)


@triton.jit
def _load_taps(wbase, tap_ok, t, T, WT):
    """The [KP, W] tile of per-step kernels at steps ``t`` (rows: taps), zero outside [0, T)."""
    return tl.load(wbase + t[None, :] * WT, mask=tap_ok & (t[None, :] >= 0) & (t[None, :] < T), other=0.0)


@triton.jit
def _win_forward_sliding(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, H, TILES, SB, SC, ST, WB, WH, WK, WT,
                         DYNAMIC: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                         BG: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, PREC: tl.constexpr):
    """_win_forward with each window loaded once: it slides from 'after' to 'this' to 'before'
    through registers, and the window two tiles ahead is loaded a tile early."""
    bh = tl.program_id(0)
    h, rows, in_g = _rows_of_head(bh, tl.program_id(1) * BG + tl.arange(0, BG), CPH, H, SB, SC)
    j = tl.arange(0, W)
    d = tl.arange(0, W)[:, None] - j[None, :]
    kk = tl.arange(0, KP)
    wbase = _kernel_base(w_ptr, bh, H, WB, WH) + kk[:, None] * WK
    if not DYNAMIC:
        bl, bm, br = _forward_bands(w_ptr, w_ptr, h, K, P, d, False, LEFT, RIGHT, W, KP)
    first = tl.program_id(2) * TILES * W + j
    if LEFT:
        before = _load_window(x_ptr, rows, in_g, first - W, T, ST)
    this = _load_window(x_ptr, rows, in_g, first, T, ST)
    after = _load_window(x_ptr, rows, in_g, first + W, T, ST)
    for step in range(TILES):
        t = first + step * W
        ahead = _load_window(x_ptr, rows, in_g, t + 2 * W, T, ST)
        if DYNAMIC:
            wt = tl.load(wbase + t[None, :] * WT, mask=(kk[:, None] < K) & (t[None, :] < T), other=0.0)
            bl, bm, br = _forward_bands(w_ptr, wt, h, K, P, d, True, LEFT, RIGHT, W, KP)
        acc = tl.dot(this, bm.to(this.dtype), input_precision=PREC)
        if LEFT:
            acc = tl.dot(before, bl.to(this.dtype), acc, input_precision=PREC)
            before = this
        if RIGHT:
            acc = tl.dot(after, br.to(this.dtype), acc, input_precision=PREC)
        tl.store(y_ptr + rows[:, None] + t[None, :] * ST, acc.to(y_ptr.dtype.element_ty),
                 mask=in_g[:, None] & (t[None, :] < T))
        this = after
        after = ahead


@triton.jit
def _win_backward(gy_ptr, x_ptr, w_ptr, gx_ptr, gw_ptr, C, T, K, P, CPH, H, TILES, SB, SC, ST, WB, WH, WK, WT,
                  DYNAMIC: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, NEED_GX: tl.constexpr,
                  NEED_GW: tl.constexpr, BG: tl.constexpr, W: tl.constexpr,
                  KP: tl.constexpr, PREC: tl.constexpr):
    """Input and weight grads of one (batch, head) over TILES tiles, all the head's channels.

    gx[s] = sum_k w[k(, t)] gy[t], t = s - k + P: grad_y's window at offset off meets the band
    k = j - i - off + P (window row i, output column j), so the window before the tile is
    needed when the kernel reaches right (RIGHT), the one after when it reaches left.
    gw[k(, t)] = sum_g gy[g, t] x[g, t + k - P]: corr_off = X_off^T GY holds tap k of output
    column j at row r = j + k - P - off.
    """
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    i = tl.arange(0, W)
    j = tl.arange(0, W)
    d = i[:, None] - j[None, :]
    kk = tl.arange(0, KP)
    r = j[None, :] + kk[:, None] - P                      # [KP, W]: row of tap k, column j, in the tile's window
    tap_ok = kk[:, None] < K
    if not DYNAMIC:
        if NEED_GX:
            gbp, gbm, gbn = _mirrored_head_bands(w_ptr, h, K, P, d, LEFT, RIGHT, W)
        if NEED_GW:
            cl = tl.zeros([W, W], dtype=tl.float32)
            cm = tl.zeros([W, W], dtype=tl.float32)
            cr = tl.zeros([W, W], dtype=tl.float32)
    for step in range(TILES):
        tile = tl.program_id(1) * TILES + step
        t = tile * W + j
        t_ok = t < T
        if DYNAMIC:
            wbase = _kernel_base(w_ptr, bh, H, WB, WH) + kk[:, None] * WK
            if NEED_GX:
                # the band of the grad window at offset off reads the kernels of that window's steps
                wm = tl.load(wbase + t[None, :] * WT, mask=tap_ok & t_ok[None, :], other=0.0)
                gbm = _band_from_tile(tl.trans(wm), -d + P, KP, False)
                if RIGHT:
                    wp = tl.load(wbase + (t - W)[None, :] * WT,
                                 mask=tap_ok & (t[None, :] >= W) & (t[None, :] < T + W), other=0.0)
                    gbp = _band_from_tile(tl.trans(wp), W + P - d, KP, False)
                if LEFT:
                    wn = tl.load(wbase + (t + W)[None, :] * WT, mask=tap_ok & (t[None, :] + W < T), other=0.0)
                    gbn = _band_from_tile(tl.trans(wn), P - W - d, KP, False)
            if NEED_GW:
                cl = tl.zeros([W, W], dtype=tl.float32)
                cm = tl.zeros([W, W], dtype=tl.float32)
                cr = tl.zeros([W, W], dtype=tl.float32)
        for g0 in range(0, CPH, BG):
            g = g0 + tl.arange(0, BG)
            in_g = g < CPH
            rows = b.to(tl.int64) * SB + (h * CPH + g).to(tl.int64) * SC
            gym = tl.load(gy_ptr + rows[:, None] + t[None, :] * ST, mask=in_g[:, None] & t_ok[None, :], other=0.0)
            if NEED_GX:
                acc = tl.dot(gym, gbm.to(gym.dtype), input_precision=PREC)
                if RIGHT:
                    gyp = tl.load(gy_ptr + rows[:, None] + (t - W)[None, :] * ST,
                                  mask=in_g[:, None] & (t[None, :] >= W) & (t[None, :] < T + W), other=0.0)
                    acc = tl.dot(gyp, gbp.to(gym.dtype), acc, input_precision=PREC)
                if LEFT:
                    gyn = tl.load(gy_ptr + rows[:, None] + (t + W)[None, :] * ST,
                                  mask=in_g[:, None] & (t[None, :] + W < T), other=0.0)
                    acc = tl.dot(gyn, gbn.to(gym.dtype), acc, input_precision=PREC)
                tl.store(gx_ptr + rows[:, None] + t[None, :] * ST, acc.to(gx_ptr.dtype.element_ty),
                         mask=in_g[:, None] & t_ok[None, :])
            if NEED_GW:
                xm = tl.load(x_ptr + rows[:, None] + t[None, :] * ST, mask=in_g[:, None] & t_ok[None, :], other=0.0)
                cm = tl.dot(tl.trans(xm), gym.to(xm.dtype), cm, input_precision=PREC)
                if LEFT:
                    xl = tl.load(x_ptr + rows[:, None] + (t - W)[None, :] * ST,
                                 mask=in_g[:, None] & (t[None, :] >= W) & (t[None, :] < T + W), other=0.0)
                    cl = tl.dot(tl.trans(xl), gym.to(xm.dtype), cl, input_precision=PREC)
                if RIGHT:
                    xr = tl.load(x_ptr + rows[:, None] + (t + W)[None, :] * ST,
                                 mask=in_g[:, None] & (t[None, :] + W < T), other=0.0)
                    cr = tl.dot(tl.trans(xr), gym.to(xm.dtype), cr, input_precision=PREC)
        if DYNAMIC and NEED_GW:
            taps = _diagonals(cl, cm, cr, r, W, LEFT, RIGHT)
            tl.store(_kernel_base(gw_ptr, bh, H, WB, WH) + kk[:, None] * WK + t[None, :] * WT,
                     taps.to(gw_ptr.dtype.element_ty), mask=tap_ok & t_ok[None, :])
    if not DYNAMIC and NEED_GW:
        taps = _diagonals(cl, cm, cr, r, W, LEFT, RIGHT)
        part = (bh * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * KP
        tl.store(gw_ptr + part + kk, tl.sum(taps, axis=1))


@triton.jit
def _win_backward_sliding(gy_ptr, x_ptr, w_ptr, gx_ptr, gw_ptr, C, T, K, P, CPH, H, TILES, SB, SC, ST, WB, WH, WK, WT,
                          DYNAMIC: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, NEED_GX: tl.constexpr,
                          NEED_GW: tl.constexpr, BG: tl.constexpr, W: tl.constexpr, KP: tl.constexpr,
                          PREC: tl.constexpr):
    """_win_backward for a head of at most BG channels, each window loaded once: grad_y's, x's
    and (DynamicConv) the kernels' windows slide through registers, loaded a tile early."""
    bh = tl.program_id(0)
    h, rows, in_g = _rows_of_head(bh, tl.arange(0, BG), CPH, H, SB, SC)
    j = tl.arange(0, W)
    d = tl.arange(0, W)[:, None] - j[None, :]
    kk = tl.arange(0, KP)
    r = j[None, :] + kk[:, None] - P
    tap_ok = kk[:, None] < K
    wbase = _kernel_base(w_ptr, bh, H, WB, WH) + kk[:, None] * WK
    if not DYNAMIC:
        if NEED_GX:
            gbp, gbm, gbn = _mirrored_head_bands(w_ptr, h, K, P, d, LEFT, RIGHT, W)
        if NEED_GW:
            cl = tl.zeros([W, W], dtype=tl.float32)
            cm = tl.zeros([W, W], dtype=tl.float32)
            cr = tl.zeros([W, W], dtype=tl.float32)
    first = tl.program_id(1) * TILES * W + j
    if NEED_GX and RIGHT:
        gy_before = _load_window(gy_ptr, rows, in_g, first - W, T, ST)
    gy_this = _load_window(gy_ptr, rows, in_g, first, T, ST)
    gy_after = _load_window(gy_ptr, rows, in_g, first + W, T, ST)
    if NEED_GW:
        if LEFT:
            x_before = _load_window(x_ptr, rows, in_g, first - W, T, ST)
        x_this = _load_window(x_ptr, rows, in_g, first, T, ST)
        x_after = _load_window(x_ptr, rows, in_g, first + W, T, ST)
    if DYNAMIC and NEED_GX:
        if RIGHT:
            w_before = _load_taps(wbase, tap_ok, first - W, T, WT)
        w_this = _load_taps(wbase, tap_ok, first, T, WT)
        w_after = _load_taps(wbase, tap_ok, first + W, T, WT)
    for step in range(TILES):
        t = first + step * W
        t_ok = t < T
        gy_ahead = _load_window(gy_ptr, rows, in_g, t + 2 * W, T, ST)
        if NEED_GW:
            x_ahead = _load_window(x_ptr, rows, in_g, t + 2 * W, T, ST)
        if NEED_GX:
            if DYNAMIC:
                w_ahead = _load_taps(wbase, tap_ok, t + 2 * W, T, WT)
                gbm = _band_from_tile(tl.trans(w_this), -d + P, KP, False)
                if RIGHT:
                    gbp = _band_from_tile(tl.trans(w_before), W + P - d, KP, False)
                if LEFT:
                    gbn = _band_from_tile(tl.trans(w_after), P - W - d, KP, False)
            acc = tl.dot(gy_this, gbm.to(gy_this.dtype), input_precision=PREC)
            if RIGHT:
                acc = tl.dot(gy_before, gbp.to(gy_this.dtype), acc, input_precision=PREC)
            if LEFT:
                acc = tl.dot(gy_after, gbn.to(gy_this.dtype), acc, input_precision=PREC)
            tl.store(gx_ptr + rows[:, None] + t[None, :] * ST, acc.to(gx_ptr.dtype.element_ty),
                     mask=in_g[:, None] & t_ok[None, :])
        if NEED_GW:
            if DYNAMIC:
                cl = tl.zeros([W, W], dtype=tl.float32)
                cm = tl.zeros([W, W], dtype=tl.float32)
                cr = tl.zeros([W, W], dtype=tl.float32)
            cm = tl.dot(tl.trans(x_this), gy_this.to(x_this.dtype), cm, input_precision=PREC)
            if LEFT:
                cl = tl.dot(tl.trans(x_before), gy_this.to(x_this.dtype), cl, input_precision=PREC)
            if RIGHT:
                cr = tl.dot(tl.trans(x_after), gy_this.to(x_this.dtype), cr, input_precision=PREC)
            if DYNAMIC:
                taps = _diagonals(cl, cm, cr, r, W, LEFT, RIGHT)
                tl.store(_kernel_base(gw_ptr, bh, H, WB, WH) + kk[:, None] * WK + t[None, :] * WT,
                         taps.to(gw_ptr.dtype.element_ty), mask=tap_ok & t_ok[None, :])
            if LEFT:
                x_before = x_this
            x_this = x_after
            x_after = x_ahead
        if NEED_GX and RIGHT:
            gy_before = gy_this
        gy_this = gy_after
        gy_after = gy_ahead
        if DYNAMIC and NEED_GX:
            if RIGHT:
                w_before = w_this
            w_this = w_after
            w_after = w_ahead
    if not DYNAMIC and NEED_GW:
        taps = _diagonals(cl, cm, cr, r, W, LEFT, RIGHT)
        part = (bh * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * KP
        tl.store(gw_ptr + part + kk, tl.sum(taps, axis=1))


@triton.jit
def _diagonals(cl, cm, cr, r, W: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """taps[k, j] = corr at row r[k, j] of the window [-W, 2W) that holds it (three W-row windows)."""
    taps = _rows_of(cm, r, W)
    if LEFT:
        taps += _rows_of(cl, r + W, W)
    if RIGHT:
        taps += _rows_of(cr, r - W, W)
    return taps


@triton.jit
def _rows_of(corr, r, W: tl.constexpr):
    valid = (r >= 0) & (r < W)
    picked = tl.gather(corr, tl.minimum(tl.maximum(r, 0), W - 1), 0)
    return tl.where(valid, picked, tl.zeros_like(picked))


# ---- launchers ------------------------------------------------------------------------------

MAX_REACH = 64


def reach(kernel: int, padding_l: int) -> int:
    """How far the kernel reaches on its longer side: max(P, K-1-P) steps."""
    return max(padding_l, kernel - 1 - padding_l)


def window_width(kernel: int, padding_l: int) -> int:
    """The tile width: a power of two >= 16 that covers the kernel's reach on both sides.
    At most 64 (reach <= MAX_REACH): a 128-step tile asks for more shared memory than
    Hopper has per block (256-330 KB in fp32), so longer reaches take the tap loop."""
    return max(16, triton.next_power_of_2(max(reach(kernel, padding_l), 1)))


def tap_rows(kernel: int, width: int) -> int:
    """Rows of a kernel tile: a power of two >= K, and >= the tile width (Triton 3.6 cannot
    lower tl.gather from a source shorter than the index along the gathered axis)."""
    return max(width, triton.next_power_of_2(kernel))


def _group_block(channels_per_head: int) -> int:
    return max(16, min(64, triton.next_power_of_2(channels_per_head)))


def fits_one_block(channels_per_head: int) -> bool:
    """Whether a head's channels fit one channel block, as the sliding backward needs."""
    return channels_per_head <= _group_block(channels_per_head)


def _precision(dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "ieee"


def launch_config(op: str, dtype, kernel: int, padding_l: int):
    """(tile width, pipeline stages, sliding windows) for ``op`` in {"lightconv_forward",
    "dynamicconv_forward", "lightconv_backward", "dynamicconv_backward"}, from
    tools/kernel_sweep.py on an H200 (its default sweep, then ``--sliding``).

    16-bit: tiles of at least 32 steps, except DynamicConv's forward (its sheared bands grow
    with the tile). fp32: the narrowest tile; its three-pass TF32 products fill shared memory,
    so the backward runs unpipelined. DynamicConv's forward drops pipelining at 32-step tiles.
    Sliding windows (each loaded once, carried through registers) won for both backwards and
    DynamicConv's forward in bf16, and for some fp32 cases; they lost for LightConv's forward.
    They are used in bf16 and fp32 only, the dtypes they were checked in on the GPU.
    """
    width = window_width(kernel, padding_l)
    wide = dtype != torch.float32 and op != "dynamicconv_forward"
    if wide:
        width = max(width, 32)
    if op.endswith("backward"):
        stages = 1 if dtype == torch.float32 else 3
    elif op == "dynamicconv_forward":
        stages = 1 if width >= 32 else 3
    else:
        stages = 3
    if dtype == torch.bfloat16:
        sliding = op != "lightconv_forward"
    elif dtype == torch.float32:
        sliding = (op == "dynamicconv_backward" or (op == "lightconv_backward" and width == 16)
                   or (op == "dynamicconv_forward" and padding_l == kernel - 1 and kernel > 1))
    else:
        sliding = False
    return width, stages, sliding


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tiles_per_program(n_tiles: int, other_programs: int, device, target_waves: int = 4) -> int:
    """Enough tiles per program to amortise its set-up, while keeping a few waves of programs."""
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    want = max(1, target_waves * sms // max(1, other_programs))
    return max(1, triton.cdiv(n_tiles, want))


def dense(t):
    """``t`` if ``torch.empty_like`` keeps its strides (so outputs can share them), else a copy."""
    return t if t.stride() == torch.empty_like(t, device="meta").stride() else t.contiguous()


def _weight_strides(w, dynamic):
    return tuple(w.stride()) if dynamic else (0, 0, 0, 0)


def window_forward(x, w, padding_l, dynamic, tiles=None, num_warps=4, width=None, num_stages=None, sliding=None):
    """y for x (B, C, T) and a kernel (H, K) or per-step kernels (B, H, K, T), any strides
    (y takes x's); launch settings default to ``launch_config``'s."""
    x = dense(x)
    w = dense(w) if dynamic else w.contiguous()
    batch, channels, time = x.shape
    heads, kernel = (w.shape[1], w.shape[2]) if dynamic else w.shape
    cph = channels // heads
    best_width, best_stages, best_sliding = launch_config("dynamicconv_forward" if dynamic else "lightconv_forward",
                                                          x.dtype, kernel, padding_l)
    width, num_stages = width or best_width, num_stages or best_stages
    sliding = best_sliding if sliding is None else sliding
    bg = _group_block(cph)
    n_tiles = triton.cdiv(time, width)
    groups = triton.cdiv(cph, bg)
    tiles = tiles or _tiles_per_program(n_tiles, batch * heads * groups, x.device)
    y = torch.empty_like(x)
    grid = (batch * heads, groups, triton.cdiv(n_tiles, tiles))
    (_win_forward_sliding if sliding else _win_forward)[grid](
        x, w, y, channels, time, kernel, padding_l, cph, heads, tiles, *x.stride(), *_weight_strides(w, dynamic),
        DYNAMIC=dynamic, LEFT=padding_l > 0, RIGHT=kernel - 1 - padding_l > 0, BG=bg, W=width,
        KP=tap_rows(kernel, width), PREC=_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
        **LAUNCH_OPTIONS)
    return y


def window_backward(grad, x, w, padding_l, heads, kernel, dynamic, need_input=True, need_weight=True, tiles=None,
                    num_warps=4, width=None, num_stages=None, sliding=None):
    """(grad_x or None, grad_w or None) in one pass over grad and x; x may be None without
    need_weight, and w None without need_input. Any strides: grad is read in x's layout
    (copied if it differs), grad_x takes that layout and DynamicConv's grad_w w's (contiguous
    without w). Sliding windows serve heads of at most 64 channels; by default only the
    fused call (both gradients) slides, as measured."""
    grad = dense(grad)
    if need_weight:
        x = dense(x)
        if grad.stride() != x.stride():
            grad = torch.empty_like(x).copy_(grad)
    if need_input and dynamic:
        w = dense(w)
    elif need_input:
        w = w.contiguous()
    batch, channels, time = grad.shape
    cph = channels // heads
    best_width, best_stages, best_sliding = launch_config(
        "dynamicconv_backward" if dynamic else "lightconv_backward", grad.dtype, kernel, padding_l)
    width, num_stages = width or best_width, num_stages or best_stages
    if sliding is None:
        sliding = best_sliding and need_input and need_weight
    kp = tap_rows(kernel, width)
    n_tiles = triton.cdiv(time, width)
    tiles = tiles or _tiles_per_program(n_tiles, batch * heads, grad.device)
    n_parts = triton.cdiv(n_tiles, tiles)
    gx = torch.empty_like(grad) if need_input else grad
    if not need_weight:
        gw = grad
    elif dynamic:
        gw = torch.empty_like(w) if need_input else torch.empty(batch, heads, kernel, time, device=grad.device,
                                                                 dtype=x.dtype)
    else:
        gw = torch.empty(batch, heads, n_parts, kp, device=grad.device, dtype=torch.float32)
    # DynamicConv's kernels and kernel gradient share one stride set (the gradient's without w)
    wstrides = _weight_strides(gw if need_weight and dynamic else w, dynamic) if dynamic else (0, 0, 0, 0)
    bg = _group_block(cph)
    kernel_fn = _win_backward_sliding if sliding and fits_one_block(cph) else _win_backward
    kernel_fn[(batch * heads, n_parts)](
        grad, x if need_weight else grad, w if need_input else grad, gx, gw, channels, time, kernel, padding_l,
        cph, heads, tiles, *grad.stride(), *wstrides, DYNAMIC=dynamic, LEFT=padding_l > 0,
        RIGHT=kernel - 1 - padding_l > 0, NEED_GX=need_input, NEED_GW=need_weight, BG=bg, W=width, KP=kp,
        PREC=_precision(grad.dtype), num_warps=num_warps, num_stages=num_stages, **LAUNCH_OPTIONS)
    if need_weight and not dynamic:
        gw = gw.sum(dim=(0, 2))[:, :kernel].to(x.dtype)
    return (gx if need_input else None), (gw if need_weight else None)
