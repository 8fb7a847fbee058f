"""Plain PyTorch lightweight and dynamic convolution: the reference every kernel is tested against.

Layout of the ops: x is (B, C, T); a LightConv kernel is (H, K) (already normalised and
dropped out by the layer); a DynamicConv kernel is (B, H, K, T), one kernel per time step.
Channel c uses head h(c) = c // (C // H). Output at time t reads x at t + k - padding_l for
k = 0..K-1, zero outside [0, T): padding_l = K // 2 is the encoder's centred window, K - 1
the decoder's causal one. Any K, any H dividing C, any padding_l in [0, K-1].

Three pure-torch algorithms:

* ``unfold``: gathers the K shifted copies of x (B, C, T, K) and contracts them; memory
  O(B C T K). The torch backend runs this one.
* ``band``: builds the (T, T) banded matrix of each head's kernel and multiplies; memory
  O(H T^2), fast for short sequences.
* ``direct``: the sum over taps of shifted slices, term by term as the formula reads; the
  tests' independent reference (the torch backend must not be checked against itself).

Decoding: ``*_step`` compute one causal output from a ring buffer of the last K-1 inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def check_shapes(x: torch.Tensor, weight: torch.Tensor, padding_l: int, dynamic: bool) -> tuple:
    if x.dim() != 3:
        raise ValueError(f"x must be (B, C, T), got shape {tuple(x.shape)}")
    batch, channels, time = x.shape
    if dynamic:
        if weight.dim() != 4 or weight.shape[0] != batch or weight.shape[3] != time:
            raise ValueError(f"dynamic weight must be (B={batch}, H, K, T={time}), got {tuple(weight.shape)}")
        heads, kernel = weight.shape[1], weight.shape[2]
    else:
        if weight.dim() != 2:
            raise ValueError(f"lightconv weight must be (H, K), got shape {tuple(weight.shape)}")
        heads, kernel = weight.shape
    if heads < 1 or channels % heads:
        raise ValueError(f"the number of heads must divide the channels: H={heads}, C={channels}")
    if not 0 <= padding_l < kernel:
        raise ValueError(f"padding_l must be in [0, K-1] = [0, {kernel - 1}], got {padding_l}")
    return batch, channels, time, heads, kernel


def check_step(buffer: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, position: int, dynamic: bool) -> tuple:
    """Shapes of a decoding step: x (B, C), weight (H, K) or (B, H, K), buffer (K-1, B, C)."""
    if x.dim() != 2:
        raise ValueError(f"x must be (B, C), got shape {tuple(x.shape)}")
    batch, channels = x.shape
    if dynamic:
        if weight.dim() != 3 or weight.shape[0] != batch:
            raise ValueError(f"dynamic step weight must be (B={batch}, H, K), got {tuple(weight.shape)}")
    elif weight.dim() != 2:
        raise ValueError(f"lightconv step weight must be (H, K), got shape {tuple(weight.shape)}")
    heads, kernel = weight.shape[-2:]
    if heads < 1 or channels % heads:
        raise ValueError(f"the number of heads must divide the channels: H={heads}, C={channels}")
    if tuple(buffer.shape) != (kernel - 1, batch, channels):
        raise ValueError(f"buffer must be (K-1, B, C) = {(kernel - 1, batch, channels)}, got {tuple(buffer.shape)}")
    if kernel > 1 and not 0 <= position < kernel - 1:
        raise ValueError(f"position must be in [0, K-2] = [0, {kernel - 2}], got {position}")
    if not (x.dtype == buffer.dtype == weight.dtype):
        raise TypeError(f"x, buffer and weight must have one dtype, got {x.dtype}, {buffer.dtype}, {weight.dtype}")
    return batch, channels, heads, kernel


def accum_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 accumulation for fp16/bf16/fp32, fp64 for fp64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _windows(x: torch.Tensor, kernel: int, padding_l: int) -> torch.Tensor:
    """(B, C, T, K): window[..., t, k] = x[..., t + k - padding_l], zero outside."""
    padded = F.pad(x, (padding_l, kernel - 1 - padding_l))
    return padded.unfold(2, kernel, 1)


def lightconv_unfold(x: torch.Tensor, weight: torch.Tensor, padding_l: int) -> torch.Tensor:
    batch, channels, time, heads, kernel = check_shapes(x, weight, padding_l, dynamic=False)
    w = weight.repeat_interleave(channels // heads, dim=0)            # (C, K)
    acc = accum_dtype(x)
    out = torch.einsum("bctk,ck->bct", _windows(x.to(acc), kernel, padding_l), w.to(acc))
    return out.to(x.dtype)


def dynamicconv_unfold(x: torch.Tensor, weight: torch.Tensor, padding_l: int) -> torch.Tensor:
    batch, channels, time, heads, kernel = check_shapes(x, weight, padding_l, dynamic=True)
    acc = accum_dtype(x)
    win = _windows(x.to(acc), kernel, padding_l).reshape(batch, heads, channels // heads, time, kernel)
    out = torch.einsum("bhgtk,bhkt->bhgt", win, weight.to(acc))
    return out.reshape(batch, channels, time).to(x.dtype)


def _band(weight: torch.Tensor, time: int, padding_l: int) -> torch.Tensor:
    """(H, T, T) matrices M with (x @ M^T)[t] = sum_k w[k] x[t + k - padding_l]."""
    heads, kernel = weight.shape
    idx = torch.arange(time, device=weight.device)
    offset = idx[None, :] - idx[:, None] + padding_l                   # k = s - t + P
    valid = (offset >= 0) & (offset < kernel)
    band = weight[:, offset.clamp(0, kernel - 1)]                      # (H, T, T)
    return band * valid.to(weight.dtype)


def lightconv_band(x: torch.Tensor, weight: torch.Tensor, padding_l: int) -> torch.Tensor:
    batch, channels, time, heads, kernel = check_shapes(x, weight, padding_l, dynamic=False)
    acc = accum_dtype(x)
    band = _band(weight.to(acc), time, padding_l)                      # (H, T, T)
    xh = x.to(acc).reshape(batch, heads, channels // heads, time)
    out = torch.einsum("bhgs,hts->bhgt", xh, band)
    return out.reshape(batch, channels, time).to(x.dtype)


def dynamicconv_band(x: torch.Tensor, weight: torch.Tensor, padding_l: int) -> torch.Tensor:
    batch, channels, time, heads, kernel = check_shapes(x, weight, padding_l, dynamic=True)
    idx = torch.arange(time, device=x.device)
    offset = idx[None, :] - idx[:, None] + padding_l                   # (T, T): k for (t, s)
    valid = (offset >= 0) & (offset < kernel)
    acc = accum_dtype(x)
    w = weight.to(acc)                                                 # (B, H, K, T)
    gathered = torch.gather(w.permute(0, 1, 3, 2), 3,                  # (B, H, T, K) -> pick k per (t, s)
                            offset.clamp(0, kernel - 1).expand(batch, heads, time, time))
    band = gathered * valid.to(w.dtype)                                # (B, H, T, T)
    xh = x.to(acc).reshape(batch, heads, channels // heads, time)
    out = torch.einsum("bhgs,bhts->bhgt", xh, band)
    return out.reshape(batch, channels, time).to(x.dtype)


def _direct(x: torch.Tensor, coef, kernel: int, padding_l: int) -> torch.Tensor:
    """sum_k coef(k) * x[..., t + k - padding_l], one shifted slice per tap."""
    time = x.shape[-1]
    out = torch.zeros_like(x)
    for k in range(kernel):
        shift = k - padding_l                                         # y[t] += c_k * x[t + shift]
        lo, hi = max(0, -shift), min(time, time - shift)
        if lo < hi:
            out[..., lo:hi] += coef(k, lo, hi) * x[..., lo + shift:hi + shift]
    return out


def lightconv_direct(x: torch.Tensor, weight: torch.Tensor, padding_l: int) -> torch.Tensor:
    batch, channels, time, heads, kernel = check_shapes(x, weight, padding_l, dynamic=False)
    acc = accum_dtype(x)
    xh, w = x.to(acc).reshape(batch, heads, channels // heads, time), weight.to(acc)
    out = _direct(xh, lambda k, lo, hi: w[:, k, None, None], kernel, padding_l)      # (H, 1, 1) per tap
    return out.reshape(batch, channels, time).to(x.dtype)


def dynamicconv_direct(x: torch.Tensor, weight: torch.Tensor, padding_l: int) -> torch.Tensor:
    batch, channels, time, heads, kernel = check_shapes(x, weight, padding_l, dynamic=True)
    acc = accum_dtype(x)
    xh, w = x.to(acc).reshape(batch, heads, channels // heads, time), weight.to(acc)
    out = _direct(xh, lambda k, lo, hi: w[:, :, None, k, lo:hi], kernel, padding_l)  # (B, H, 1, steps)
    return out.reshape(batch, channels, time).to(x.dtype)


def direct_grads(dynamic: bool, x: torch.Tensor, weight: torch.Tensor, padding_l: int, grad: torch.Tensor):
    """(grad_x, grad_w) of the op, tap by tap from the formula (no autograd), in x's accumulator:
    grad_x[t + k - P] += w[k(, t)] grad[t]; grad_w[h, k] (or [b, h, k, t]) = sum of
    grad[t] x[t + k - P] over the head's channels (and, for LightConv, batch and steps)."""
    batch, channels, time, heads, kernel = check_shapes(x, weight, padding_l, dynamic)
    acc = accum_dtype(x)
    xh = x.to(acc).reshape(batch, heads, channels // heads, time)
    gh = grad.to(acc).reshape(batch, heads, channels // heads, time)
    w = weight.to(acc)
    gx = torch.zeros_like(xh)
    gw = torch.zeros(weight.shape, dtype=acc, device=x.device)
    for k in range(kernel):
        shift = k - padding_l                                         # y[t] reads x[t + shift]
        lo, hi = max(0, -shift), min(time, time - shift)              # the t with t + shift inside
        if lo >= hi:
            continue
        g, xs = gh[..., lo:hi], xh[..., lo + shift:hi + shift]
        coef = w[:, :, None, k, lo:hi] if dynamic else w[:, k, None, None]
        gx[..., lo + shift:hi + shift] += coef * g
        if dynamic:
            gw[:, :, k, lo:hi] = (g * xs).sum(2)
        else:
            gw[:, k] = (g * xs).sum((0, 2, 3))
    return gx.reshape(batch, channels, time).to(x.dtype), gw.to(x.dtype)


def _step_window(buffer: torch.Tensor, x: torch.Tensor, position: int) -> torch.Tensor:
    """(K, B, C): the buffer's rows oldest first, then x."""
    rows = buffer.shape[0]
    order = (torch.arange(rows, device=buffer.device) + position) % max(rows, 1)
    return torch.cat([buffer[order], x.unsqueeze(0)], dim=0)


def lightconv_step(buffer: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, position: int) -> torch.Tensor:
    """y[b, c] = sum_k w[h(c), k] * window[k, b, c], window = the last K-1 inputs then x."""
    batch, channels, heads, kernel = check_step(buffer, x, weight, position, dynamic=False)
    acc = accum_dtype(x)
    w = weight.to(acc).repeat_interleave(channels // heads, dim=0)    # (C, K)
    return torch.einsum("kbc,ck->bc", _step_window(buffer, x, position).to(acc), w).to(x.dtype)


def dynamicconv_step(buffer: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, position: int) -> torch.Tensor:
    """lightconv_step with per-batch kernels, weight (B, H, K)."""
    batch, channels, heads, kernel = check_step(buffer, x, weight, position, dynamic=True)
    acc = accum_dtype(x)
    w = weight.to(acc).repeat_interleave(channels // heads, dim=1)    # (B, C, K)
    return torch.einsum("kbc,bck->bc", _step_window(buffer, x, position).to(acc), w).to(x.dtype)
