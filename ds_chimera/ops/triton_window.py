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
fp32 inputs use three-pass TF32 (fp32-level accuracy); 16-bit inputs accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _win_forward(x_ptr, w_ptr, y_ptr, C, T, K, P, CPH, H, TILES,
                 DYNAMIC: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                 BG: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, PREC: tl.constexpr):
    """y[g, t0 + j] = sum over windows off of X[g, t0 + off + i] * band_off[i, j], k = i - j + off + P."""
    bh = tl.program_id(0)
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    b = bh // H
    h = bh % H
    rows = (b * C + h * CPH + g).to(tl.int64) * T
    in_g = g < CPH
    i = tl.arange(0, W)
    j = tl.arange(0, W)
    d = i[:, None] - j[None, :]
    kk = tl.arange(0, KP)
    if not DYNAMIC:
        # one kernel per head: the three bands are built once for all the program's tiles
        bm = tl.load(w_ptr + h * K + (d + P), mask=(d + P >= 0) & (d + P < K), other=0.0)
        if LEFT:
            bl = tl.load(w_ptr + h * K + (d - W + P), mask=(d - W + P >= 0) & (d - W + P < K), other=0.0)
        if RIGHT:
            br = tl.load(w_ptr + h * K + (d + W + P), mask=(d + W + P >= 0) & (d + W + P < K), other=0.0)
    for step in range(TILES):
        tile = tl.program_id(2) * TILES + step
        t = tile * W + j
        if DYNAMIC:
            wt = tl.load(w_ptr + bh.to(tl.int64) * K * T + kk[:, None] * T + t[None, :],
                         mask=(kk[:, None] < K) & (t[None, :] < T), other=0.0)
            bm = _band_from_tile(wt, d + P, KP, True)
            if LEFT:
                bl = _band_from_tile(wt, d - W + P, KP, True)
            if RIGHT:
                br = _band_from_tile(wt, d + W + P, KP, True)
        xm = tl.load(x_ptr + rows[:, None] + t[None, :], mask=in_g[:, None] & (t[None, :] < T), other=0.0)
        acc = tl.dot(xm, bm.to(xm.dtype), input_precision=PREC)
        if LEFT:
            xl = tl.load(x_ptr + rows[:, None] + (t - W)[None, :],
                         mask=in_g[:, None] & (t[None, :] >= W) & (t[None, :] < T + W), other=0.0)
            acc = tl.dot(xl, bl.to(xm.dtype), acc, input_precision=PREC)
        if RIGHT:
            xr = tl.load(x_ptr + rows[:, None] + (t + W)[None, :], mask=in_g[:, None] & (t[None, :] + W < T),
                         other=0.0)
            acc = tl.dot(xr, br.to(xm.dtype), acc, input_precision=PREC)
        tl.store(y_ptr + rows[:, None] + t[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=in_g[:, None] & (t[None, :] < T))


@triton.jit
def _win_backward(gy_ptr, x_ptr, w_ptr, gx_ptr, gw_ptr, C, T, K, P, CPH, H, TILES,
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
            gbm = tl.load(w_ptr + h * K + (P - d), mask=(P - d >= 0) & (P - d < K), other=0.0)
            if RIGHT:
                gbp = tl.load(w_ptr + h * K + (W + P - d), mask=(W + P - d >= 0) & (W + P - d < K), other=0.0)
            if LEFT:
                gbn = tl.load(w_ptr + h * K + (P - W - d), mask=(P - W - d >= 0) & (P - W - d < K), other=0.0)
        if NEED_GW:
            cl = tl.zeros([W, W], dtype=tl.float32)
            cm = tl.zeros([W, W], dtype=tl.float32)
            cr = tl.zeros([W, W], dtype=tl.float32)
    for step in range(TILES):
        tile = tl.program_id(1) * TILES + step
        t = tile * W + j
        t_ok = t < T
        if DYNAMIC:
            wbase = w_ptr + bh.to(tl.int64) * K * T + kk[:, None] * T
            if NEED_GX:
                # the band of the grad window at offset off reads the kernels of that window's steps
                wm = tl.load(wbase + t[None, :], mask=tap_ok & t_ok[None, :], other=0.0)
                gbm = _band_from_tile(tl.trans(wm), -d + P, KP, False)
                if RIGHT:
                    wp = tl.load(wbase + (t - W)[None, :], mask=tap_ok & (t[None, :] >= W) & (t[None, :] < T + W),
                                 other=0.0)
                    gbp = _band_from_tile(tl.trans(wp), W + P - d, KP, False)
                if LEFT:
                    wn = tl.load(wbase + (t + W)[None, :], mask=tap_ok & (t[None, :] + W < T), other=0.0)
                    gbn = _band_from_tile(tl.trans(wn), P - W - d, KP, False)
            if NEED_GW:
                cl = tl.zeros([W, W], dtype=tl.float32)
                cm = tl.zeros([W, W], dtype=tl.float32)
                cr = tl.zeros([W, W], dtype=tl.float32)
        for g0 in range(0, CPH, BG):
            g = g0 + tl.arange(0, BG)
            in_g = g < CPH
            rows = (b * C + h * CPH + g).to(tl.int64) * T
            gym = tl.load(gy_ptr + rows[:, None] + t[None, :], mask=in_g[:, None] & t_ok[None, :], other=0.0)
            if NEED_GX:
                acc = tl.dot(gym, gbm.to(gym.dtype), input_precision=PREC)
                if RIGHT:
                    gyp = tl.load(gy_ptr + rows[:, None] + (t - W)[None, :],
                                  mask=in_g[:, None] & (t[None, :] >= W) & (t[None, :] < T + W), other=0.0)
                    acc = tl.dot(gyp, gbp.to(gym.dtype), acc, input_precision=PREC)
                if LEFT:
                    gyn = tl.load(gy_ptr + rows[:, None] + (t + W)[None, :],
                                  mask=in_g[:, None] & (t[None, :] + W < T), other=0.0)
                    acc = tl.dot(gyn, gbn.to(gym.dtype), acc, input_precision=PREC)
                tl.store(gx_ptr + rows[:, None] + t[None, :], acc.to(gx_ptr.dtype.element_ty),
                         mask=in_g[:, None] & t_ok[None, :])
            if NEED_GW:
                xm = tl.load(x_ptr + rows[:, None] + t[None, :], mask=in_g[:, None] & t_ok[None, :], other=0.0)
                cm = tl.dot(tl.trans(xm), gym.to(xm.dtype), cm, input_precision=PREC)
                if LEFT:
                    xl = tl.load(x_ptr + rows[:, None] + (t - W)[None, :],
                                 mask=in_g[:, None] & (t[None, :] >= W) & (t[None, :] < T + W), other=0.0)
                    cl = tl.dot(tl.trans(xl), gym.to(xm.dtype), cl, input_precision=PREC)
                if RIGHT:
                    xr = tl.load(x_ptr + rows[:, None] + (t + W)[None, :],
                                 mask=in_g[:, None] & (t[None, :] + W < T), other=0.0)
                    cr = tl.dot(tl.trans(xr), gym.to(xm.dtype), cr, input_precision=PREC)
        if DYNAMIC and NEED_GW:
            taps = _diagonals(cl, cm, cr, r, W, LEFT, RIGHT)
            tl.store(gw_ptr + bh.to(tl.int64) * K * T + kk[:, None] * T + t[None, :],
                     taps.to(gw_ptr.dtype.element_ty), mask=tap_ok & t_ok[None, :])
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

def window_width(kernel: int, padding_l: int) -> int:
    """The tile width: a power of two >= 16 that covers the kernel's reach on both sides."""
    return max(16, triton.next_power_of_2(max(padding_l, kernel - 1 - padding_l, 1)))


def tap_rows(kernel: int, width: int) -> int:
    """Rows of a kernel tile: a power of two >= K, and >= the tile width (Triton 3.6 cannot
    lower tl.gather from a source shorter than the index along the gathered axis)."""
    return max(width, triton.next_power_of_2(kernel))


def _group_block(channels_per_head: int) -> int:
    return max(16, min(64, triton.next_power_of_2(channels_per_head)))


def _precision(dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "ieee"


def launch_config(op: str, dtype, kernel: int, padding_l: int):
    """(tile width, pipeline stages) for ``op`` in {"lightconv_forward", "dynamicconv_forward",
    "lightconv_backward", "dynamicconv_backward"}, from benchmarks/kernel_sweep.py on an H200.

    16-bit: tiles of at least 32 steps, except DynamicConv's forward (its sheared bands grow
    with the tile). fp32: the narrowest tile; its three-pass TF32 products fill shared memory,
    so the backward runs unpipelined. DynamicConv's forward drops pipelining at 32-step tiles.
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
    return width, stages


def _tiles_per_program(n_tiles: int, other_programs: int, device, target_waves: int = 4) -> int:
    """Enough tiles per program to amortise its set-up, while keeping a few waves of programs."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = max(1, target_waves * sms // max(1, other_programs))
    return max(1, triton.cdiv(n_tiles, want))


def window_forward(x, w, padding_l, dynamic, tiles=None, num_warps=4, width=None, num_stages=None):
    batch, channels, time = x.shape
    heads, kernel = (w.shape[1], w.shape[2]) if dynamic else w.shape
    cph = channels // heads
    best_width, best_stages = launch_config("dynamicconv_forward" if dynamic else "lightconv_forward", x.dtype,
                                            kernel, padding_l)
    width, num_stages = width or best_width, num_stages or best_stages
    bg = _group_block(cph)
    n_tiles = triton.cdiv(time, width)
    groups = triton.cdiv(cph, bg)
    tiles = tiles or _tiles_per_program(n_tiles, batch * heads * groups, x.device)
    y = torch.empty_like(x)
    grid = (batch * heads, groups, triton.cdiv(n_tiles, tiles))
    _win_forward[grid](x, w, y, channels, time, kernel, padding_l, cph, heads, tiles,
                       DYNAMIC=dynamic, LEFT=padding_l > 0, RIGHT=kernel - 1 - padding_l > 0,
                       BG=bg, W=width, KP=tap_rows(kernel, width), PREC=_precision(x.dtype),
                       num_warps=num_warps, num_stages=num_stages)
    return y


def window_backward(grad, x, w, padding_l, heads, kernel, dynamic, need_input=True, need_weight=True, tiles=None,
                    num_warps=4, width=None, num_stages=None):
    """(grad_x or None, grad_w or None) in one pass over grad and x; x may be None without
    need_weight, and w None without need_input."""
    batch, channels, time = grad.shape
    cph = channels // heads
    best_width, best_stages = launch_config("dynamicconv_backward" if dynamic else "lightconv_backward",
                                            grad.dtype, kernel, padding_l)
    width, num_stages = width or best_width, num_stages or best_stages
    kp = tap_rows(kernel, width)
    n_tiles = triton.cdiv(time, width)
    tiles = tiles or _tiles_per_program(n_tiles, batch * heads, grad.device)
    n_parts = triton.cdiv(n_tiles, tiles)
    gx = torch.empty_like(grad) if need_input else grad
    if not need_weight:
        gw = grad
    elif dynamic:
        gw = torch.empty(batch, heads, kernel, time, device=grad.device, dtype=x.dtype)
    else:
        gw = torch.empty(batch, heads, n_parts, kp, device=grad.device, dtype=torch.float32)
    _win_backward[(batch * heads, n_parts)](
        grad, x if need_weight else grad, w if need_input else grad, gx, gw, channels, time, kernel, padding_l,
        cph, heads, tiles, DYNAMIC=dynamic, LEFT=padding_l > 0, RIGHT=kernel - 1 - padding_l > 0,
        NEED_GX=need_input, NEED_GW=need_weight, BG=_group_block(cph), W=width, KP=kp,
        PREC=_precision(grad.dtype), num_warps=num_warps, num_stages=num_stages)
    if need_weight and not dynamic:
        gw = gw.sum(dim=(0, 2))[:, :kernel].to(x.dtype)
    return (gx if need_input else None), (gw if need_weight else None)
