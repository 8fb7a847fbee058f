"""fairseq compatibility by outputs: our layers against fairseq's math on one loaded state dict.

fairseq is not installed here, so ``FairseqLightConv`` and ``FairseqDynamicConv`` below
re-derive fairseq's ``LightweightConv1dTBC`` / ``DynamicConv1dTBC`` forward passes from their
published definition (parameter names and shapes, the band-matrix "expanded" path, the
unfold + bmm path, and the incremental path that keeps the last K-1 inputs and unfolds
one step against them). Each test builds one of these, draws its parameters, loads its
``state_dict()`` into our layer and compares outputs. benchmarks/kernels.py times the same
incremental step against ours.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_chimera.nn import DynamicConv1dTBC, LightweightConv1dTBC


def _band(weight, time, kernel, padding_l, fill=0.0):
    """(N, T, T) banded matrices whose row t holds weight[n, t, k] at column t + k - padding_l.

    ``weight`` is (N, T, K); taps that fall outside [0, T) are dropped (left at ``fill``)."""
    n = weight.shape[0]
    full = weight.new_full((n, time, time + kernel - 1), fill)
    rows = torch.arange(time)[:, None]
    cols = rows + torch.arange(kernel)[None, :]                          # column t + k in the padded frame
    full[:, rows, cols] = weight
    return full[:, :, padding_l:padding_l + time]


def _unfold(x, kernel, padding_l):
    """T x B x C -> T x B x C x K with [t, ..., k] = x[t + k - padding_l] (zero outside)."""
    time = x.shape[0]
    padded = F.pad(x, (0, 0, 0, 0, padding_l, kernel - 1 - padding_l))
    return torch.stack([padded[k:k + time] for k in range(kernel)], dim=3)


class _Incremental(nn.Module):
    """fairseq's buffer: (T=1, B, C, K-1) of the last inputs, extended by one step per call."""

    def _window(self, x, incremental_state):
        key = id(self)
        buffer = incremental_state.get(key)
        window = x.unsqueeze(3) if buffer is None else torch.cat([buffer, x.unsqueeze(3)], dim=3)
        if self.kernel_size > 1:
            incremental_state[key] = window[:, :, :, -(self.kernel_size - 1):]
        return window


class FairseqLightConv(_Incremental):
    """fairseq's LightweightConv1dTBC (weight (H, 1, K), bias (C,)), in eval mode."""

    def __init__(self, input_size, kernel_size, padding_l, num_heads, weight_softmax=False, bias=False):
        super().__init__()
        self.input_size, self.kernel_size, self.padding_l = input_size, kernel_size, padding_l
        self.num_heads, self.weight_softmax = num_heads, weight_softmax
        self.weight = nn.Parameter(torch.randn(num_heads, 1, kernel_size))
        self.bias = nn.Parameter(torch.randn(input_size)) if bias else None

    def forward(self, x, incremental_state=None, unfold=False):
        if incremental_state is not None or unfold:
            out = self._unfolded(x, incremental_state)
        else:
            out = self._expanded(x)
        return out if self.bias is None else out + self.bias.view(1, 1, -1)

    def _kernel(self):
        weight = self.weight.view(self.num_heads, self.kernel_size)
        if not self.weight_softmax:
            return weight
        return F.softmax(weight, dim=1, dtype=torch.float32).type_as(weight)     # fairseq's utils.softmax

    def _unfolded(self, x, incremental_state):
        time, batch, channels = x.shape
        heads, per_head = self.num_heads, channels // self.num_heads
        if incremental_state is not None:
            x_unfold = self._window(x, incremental_state)                      # T x B x C x K'
        else:
            x_unfold = _unfold(x, self.kernel_size, self.padding_l)
        weight = self._kernel()[:, -x_unfold.shape[3]:]                      # the newest K' taps
        x_unfold = x_unfold.reshape(time * batch * heads, per_head, -1)
        weight = weight.unsqueeze(0).expand(time * batch, heads, -1).reshape(time * batch * heads, -1, 1)
        return torch.bmm(x_unfold, weight).view(time, batch, channels)

    def _expanded(self, x):
        time, batch, channels = x.shape
        heads, kernel, padding_l = self.num_heads, self.kernel_size, self.padding_l
        weight = self._kernel()
        if kernel > time and padding_l == kernel - 1:                        # fairseq trims the unreachable taps
            weight, kernel, padding_l = weight[:, kernel - time:], time, time - 1
        weight = weight.unsqueeze(0).expand(batch, heads, kernel).reshape(batch * heads, 1, kernel)
        band = _band(weight.expand(-1, time, -1), time, kernel, padding_l)   # (B*H, T, T)
        xh = x.reshape(time, batch * heads, channels // heads).transpose(0, 1)
        return torch.bmm(band, xh).transpose(0, 1).reshape(time, batch, channels)


class FairseqDynamicConv(_Incremental):
    """fairseq's DynamicConv1dTBC (weight_linear, conv_bias), in eval mode."""

    def __init__(self, input_size, kernel_size, padding_l, num_heads, weight_softmax=False, renorm_padding=False,
                 bias=False, conv_bias=False, in_proj=False):
        super().__init__()
        self.input_size, self.kernel_size, self.padding_l = input_size, kernel_size, padding_l
        self.num_heads, self.weight_softmax, self.renorm_padding = num_heads, weight_softmax, renorm_padding
        self.in_proj = in_proj
        out = input_size + num_heads * kernel_size if in_proj else num_heads * kernel_size
        self.weight_linear = nn.Linear(input_size, out, bias=bias or in_proj)
        self.conv_bias = nn.Parameter(torch.randn(input_size)) if conv_bias else None

    def forward(self, x, incremental_state=None, query=None, unfold=None):
        time = x.shape[0]
        unfold = time > 512 if unfold is None else unfold
        if incremental_state is not None or unfold:
            out = self._unfolded(x, incremental_state, x if query is None else query)
        else:
            out = self._expanded(x, x if query is None else query)
        return out if self.conv_bias is None else out + self.conv_bias.view(1, 1, -1)

    def _logits(self, x, query):
        time, batch, _ = x.shape
        if self.in_proj:
            proj = self.weight_linear(x)
            return proj[..., :self.input_size], proj[..., self.input_size:].reshape(time * batch * self.num_heads, -1)
        return x, self.weight_linear(query).reshape(time * batch * self.num_heads, -1)

    def _unfolded(self, x, incremental_state, query):
        time, batch, channels = x.shape
        heads, kernel, padding_l = self.num_heads, self.kernel_size, self.padding_l
        x, weight = self._logits(x, query)
        if incremental_state is not None:
            x_unfold = self._window(x, incremental_state)
        else:
            if kernel > time and padding_l == kernel - 1:                    # trimmed before the softmax
                weight, kernel, padding_l = weight[:, kernel - time:], time, time - 1
            x_unfold = _unfold(x, kernel, padding_l)
        if self.weight_softmax and not self.renorm_padding:
            weight = F.softmax(weight, dim=1)
        weight = weight[:, -x_unfold.shape[3]:]
        if self.weight_softmax and self.renorm_padding:
            weight = F.softmax(weight, dim=1)
        x_unfold = x_unfold.reshape(time * batch * heads, channels // heads, -1)
        return torch.bmm(x_unfold, weight.unsqueeze(2)).view(time, batch, channels)

    def _expanded(self, x, query):
        time, batch, channels = x.shape
        heads, kernel, padding_l = self.num_heads, self.kernel_size, self.padding_l
        x, weight = self._logits(x, query)
        if self.weight_softmax and not self.renorm_padding:
            weight = F.softmax(weight, dim=1)
        weight = weight.view(time, batch * heads, kernel).transpose(0, 1)    # (B*H, T, K)
        if self.weight_softmax and self.renorm_padding:
            # softmax over the taps that land inside the sequence, like self-attention's mask
            band = F.softmax(_band(weight, time, kernel, padding_l, fill=float("-inf")), dim=2)
        else:
            if kernel > time and padding_l == kernel - 1:
                weight, kernel, padding_l = weight[:, :, kernel - time:], time, time - 1
            band = _band(weight, time, kernel, padding_l)
        xh = x.reshape(time, batch * heads, channels // heads).transpose(0, 1)
        return torch.bmm(band, xh).transpose(0, 1).reshape(time, batch, channels)


# ---- tests ----------------------------------------------------------------------------------
LIGHT = [dict(kernel_size=5, padding_l=2, num_heads=2, weight_softmax=True, bias=True),
         dict(kernel_size=4, padding_l=3, num_heads=4, weight_softmax=False, bias=False),
         dict(kernel_size=7, padding_l=0, num_heads=1, weight_softmax=True, bias=True)]
DYNAMIC = [dict(kernel_size=5, padding_l=2, num_heads=2, weight_softmax=True, bias=True, conv_bias=True),
           dict(kernel_size=4, padding_l=3, num_heads=4, weight_softmax=True, renorm_padding=True),
           dict(kernel_size=3, padding_l=2, num_heads=2, weight_softmax=False, in_proj=True, conv_bias=True),
           dict(kernel_size=6, padding_l=1, num_heads=8, weight_softmax=True, renorm_padding=True, in_proj=True)]


def _tolerance(dynamic, config):
    """fairseq's LightConv softmax runs in fp32 even for fp64 weights (ours in the weights' dtype)."""
    return 1e-6 if not dynamic and config["weight_softmax"] else 1e-12


def _pair(dynamic, config, channels=8):
    torch.manual_seed(0)
    theirs = (FairseqDynamicConv if dynamic else FairseqLightConv)(channels, **config).double().eval()
    ours = (DynamicConv1dTBC if dynamic else LightweightConv1dTBC)(channels, **config).double().eval()
    state = theirs.state_dict()
    ours.load_state_dict(state)                          # strict: the same names and shapes
    assert set(ours.state_dict()) == set(state) and len(state) >= 1
    return theirs, ours


@pytest.mark.parametrize("dynamic,config", [(False, c) for c in LIGHT] + [(True, c) for c in DYNAMIC])
@pytest.mark.parametrize("time", [1, 3, 11])
def test_outputs_equal_fairseq_on_a_loaded_state_dict(dynamic, config, time):
    """Both of fairseq's full-sequence paths where they agree (the unfolded one trims a causal
    kernel longer than the sequence before its softmax, so there it is the expanded one)."""
    theirs, ours = _pair(dynamic, config)
    x = torch.randn(time, 3, 8, dtype=torch.float64)
    got = ours(x)
    tol = _tolerance(dynamic, config)
    torch.testing.assert_close(got, theirs(x, unfold=False), rtol=tol, atol=tol)
    trims = dynamic and config["kernel_size"] > time and config["padding_l"] == config["kernel_size"] - 1 \
        and config["weight_softmax"] and not config.get("renorm_padding")
    if not trims and not config.get("renorm_padding"):     # fairseq's unfolded path has no full-sequence renorm
        torch.testing.assert_close(got, theirs(x, unfold=True), rtol=tol, atol=tol)


def test_dynamicconv_query_predicts_the_kernels_as_in_fairseq():
    theirs, ours = _pair(True, DYNAMIC[0])
    x, query = torch.randn(6, 2, 8, dtype=torch.float64), torch.randn(6, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(ours(x, query=query), theirs(x, query=query), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dynamic,config", [(False, c) for c in LIGHT if c["padding_l"] == c["kernel_size"] - 1]
                         + [(True, c) for c in DYNAMIC if c["padding_l"] == c["kernel_size"] - 1])
def test_incremental_decoding_equals_fairseq_step_by_step(dynamic, config):
    theirs, ours = _pair(dynamic, config)
    x = torch.randn(9, 3, 8, dtype=torch.float64)
    mine, ref = {}, {}
    tol = _tolerance(dynamic, config)
    with torch.no_grad():
        for t in range(9):
            torch.testing.assert_close(ours(x[t:t + 1], incremental_state=mine),
                                       theirs(x[t:t + 1], incremental_state=ref), rtol=tol, atol=tol)
