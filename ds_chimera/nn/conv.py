"""fairseq-compatible LightweightConv1dTBC and DynamicConv1dTBC on the ds_chimera ops.

Constructor arguments, defaults, parameter names and shapes follow fairseq's modules, so
their state dicts load with ``load_state_dict``. Input and output are T x B x C. The
convolution itself is ``torch.ops.ds_chimera.lightconv_forward`` / ``dynamicconv_forward``
(Triton on CUDA, C++ on CPU, pure torch elsewhere).

Differences from fairseq, on purpose:

* ``padding_l=None`` means K // 2 (a centred window); fairseq leaves it undefined.
* Weight dropout is DropConnect on the normalised kernel with no renormalisation, drawn
  once per forward for LightConv (fairseq draws it per position in one code path and per
  (t, b, h) in the other) and per predicted kernel for DynamicConv (as fairseq).
* Incremental decoding keeps the last K-1 inputs and is exact for any number of new
  tokens per call; fairseq's buffer treats several new tokens as independent.
"""
from __future__ import annotations

import uuid

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.library import dynamicconv, lightconv


def _xavier_linear(in_features, out_features, bias=True):
    layer = nn.Linear(in_features, out_features, bias)
    nn.init.xavier_uniform_(layer.weight)
    if bias:
        nn.init.constant_(layer.bias, 0.0)
    return layer


class _IncrementalConv(nn.Module):
    """Shared validation and the decoding buffer (the last K-1 inputs, T x B x C)."""

    def _check(self, input_size, kernel_size, padding_l, num_heads, weight_dropout):
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if num_heads < 1 or input_size % num_heads:
            raise ValueError(f"num_heads must divide input_size: num_heads={num_heads}, input_size={input_size}")
        padding_l = kernel_size // 2 if padding_l is None else padding_l
        if not 0 <= padding_l < kernel_size:
            raise ValueError(f"padding_l must be in [0, kernel_size-1] = [0, {kernel_size - 1}], got {padding_l}")
        if not 0.0 <= weight_dropout < 1.0:
            raise ValueError(f"weight_dropout must be in [0, 1), got {weight_dropout}")
        self._state_key = f"{type(self).__name__}.{uuid.uuid4().hex}"
        return padding_l

    def _extend(self, x, incremental_state):
        """Prepend the buffered inputs to x and store the new buffer; returns (window, new tokens)."""
        if self.padding_l != self.kernel_size - 1:
            raise ValueError("incremental decoding needs causal padding, padding_l = kernel_size - 1 = "
                             f"{self.kernel_size - 1}; got {self.padding_l}")
        key = self._state_key + ".input_buffer"
        buffer = incremental_state.get(key)
        window = x if buffer is None else torch.cat([buffer, x], dim=0)
        if self.kernel_size > 1:
            incremental_state[key] = window[-(self.kernel_size - 1):]
        return window, x.shape[0]

    def reorder_incremental_state(self, incremental_state, new_order):
        key = self._state_key + ".input_buffer"
        if incremental_state.get(key) is not None:
            incremental_state[key] = incremental_state[key].index_select(1, new_order)


class LightweightConv1dTBC(_IncrementalConv):
    """Lightweight convolution: a softmax-normalised depthwise kernel shared by each head's channels."""

    def __init__(self, input_size, kernel_size=1, padding_l=None, num_heads=1, weight_dropout=0.0,
                 weight_softmax=False, bias=False, backend=None):
        super().__init__()
        self.padding_l = self._check(input_size, kernel_size, padding_l, num_heads, weight_dropout)
        self.input_size, self.kernel_size, self.num_heads = input_size, kernel_size, num_heads
        self.weight_dropout, self.weight_softmax, self.backend = weight_dropout, weight_softmax, backend
        self.weight = nn.Parameter(torch.empty(num_heads, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(input_size)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.weight)
        if self.bias is not None:
            nn.init.constant_(self.bias, 0.0)

    def kernel(self):
        """The (H, K) kernel the convolution applies: softmax-normalised, then DropConnect."""
        weight = self.weight.view(self.num_heads, self.kernel_size)
        if self.weight_softmax:
            weight = F.softmax(weight.float(), dim=1).type_as(weight)
        return F.dropout(weight, self.weight_dropout, training=self.training)

    def forward(self, x, incremental_state=None, unfold=False):
        """x: T x B x C -> T x B x C. ``unfold`` is accepted for fairseq compatibility and ignored."""
        if x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"expected T x B x {self.input_size} input, got {tuple(x.shape)}")
        new = x.shape[0]
        if incremental_state is not None:
            x, new = self._extend(x, incremental_state)
        out = lightconv(x.permute(1, 2, 0), self.kernel().to(x.dtype), self.padding_l, self.backend)
        out = out.permute(2, 0, 1)[-new:]
        if self.bias is not None:
            out = out + self.bias.view(1, 1, -1)
        return out

    def extra_repr(self):
        return (f"{self.input_size}, kernel_size={self.kernel_size}, padding_l={self.padding_l}, "
                f"num_heads={self.num_heads}, weight_softmax={self.weight_softmax}, bias={self.bias is not None}, "
                f"weight_dropout={self.weight_dropout}")


class DynamicConv1dTBC(_IncrementalConv):
    """Dynamic convolution: each time step predicts its own kernel, softmax(Linear(x_t)) per head."""

    def __init__(self, input_size, kernel_size=1, padding_l=None, num_heads=1, weight_dropout=0.0,
                 weight_softmax=False, renorm_padding=False, bias=False, conv_bias=False, query_size=None,
                 in_proj=False, backend=None):
        super().__init__()
        self.padding_l = self._check(input_size, kernel_size, padding_l, num_heads, weight_dropout)
        self.input_size, self.kernel_size, self.num_heads = input_size, kernel_size, num_heads
        self.query_size = input_size if query_size is None else query_size
        self.weight_dropout, self.weight_softmax, self.renorm_padding = weight_dropout, weight_softmax, renorm_padding
        self.backend = backend
        if in_proj:
            self.weight_linear = _xavier_linear(input_size, input_size + num_heads * kernel_size)
        else:
            self.weight_linear = _xavier_linear(self.query_size, num_heads * kernel_size, bias=bias)
        self.conv_bias = nn.Parameter(torch.zeros(input_size)) if conv_bias else None

    @property
    def in_proj(self):
        return self.weight_linear.out_features == self.input_size + self.num_heads * self.kernel_size

    def reset_parameters(self):
        self.weight_linear.reset_parameters()
        if self.conv_bias is not None:
            nn.init.constant_(self.conv_bias, 0.0)

    def forward(self, x, incremental_state=None, query=None, unfold=None):
        """x: T x B x C -> T x B x C. ``query`` (T x B x query_size) predicts the kernels instead of x."""
        if x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"expected T x B x {self.input_size} input, got {tuple(x.shape)}")
        if query is not None and self.in_proj:
            raise ValueError("query cannot be used with in_proj=True")
        heads, kernel = self.num_heads, self.kernel_size
        if self.in_proj:
            proj = self.weight_linear(x)
            x, logits = proj[..., :self.input_size], proj[..., self.input_size:]
        else:
            logits = self.weight_linear(x if query is None else query)
        new = x.shape[0]
        if incremental_state is not None:
            x, new = self._extend(x, incremental_state)
            # only the new steps' kernels are needed; earlier window positions get zero kernels
            pad = logits.new_zeros(x.shape[0] - new, *logits.shape[1:])
            logits = torch.cat([pad, logits], dim=0)
        time, batch = x.shape[0], x.shape[1]
        logits = logits.reshape(time, batch, heads, kernel).permute(1, 2, 3, 0)      # B x H x K x T
        weight = self._normalise(logits, time)
        out = dynamicconv(x.permute(1, 2, 0), weight.to(x.dtype).contiguous(), self.padding_l, self.backend)
        out = out.permute(2, 0, 1)[-new:]
        if self.conv_bias is not None:
            out = out + self.conv_bias.view(1, 1, -1)
        return out

    def _normalise(self, logits, time):
        if self.weight_softmax:
            if self.renorm_padding:   # softmax over the taps that fall inside the sequence only
                k = torch.arange(self.kernel_size, device=logits.device)[:, None]
                t = torch.arange(time, device=logits.device)[None, :]
                src = t + k - self.padding_l
                valid = (src >= 0) & (src < time)
                logits = logits.float().masked_fill(~valid, float("-inf"))
            weight = F.softmax(logits.float(), dim=2).type_as(logits)
        else:
            weight = logits
        return F.dropout(weight, self.weight_dropout, training=self.training)

    def extra_repr(self):
        return (f"{self.input_size}, kernel_size={self.kernel_size}, padding_l={self.padding_l}, "
                f"num_heads={self.num_heads}, weight_softmax={self.weight_softmax}, "
                f"conv_bias={self.conv_bias is not None}, renorm_padding={self.renorm_padding}, "
                f"in_proj={self.in_proj}, weight_dropout={self.weight_dropout}")
