"""fairseq-compatible LightweightConv1dTBC and DynamicConv1dTBC on the ds_chimera ops.

Constructor arguments, defaults, parameter names and shapes follow fairseq's modules, so
their state dicts load with ``load_state_dict`` (tests/test_ops_fairseq.py compares the
outputs). Input and output are T x B x C. The convolution itself is
``torch.ops.ds_chimera.lightconv_forward`` / ``dynamicconv_forward`` (Triton on CUDA, C++
on CPU, pure torch elsewhere), called on a (B, C, T) view of the input: the ops read any
strides and return the input's layout, so the layer copies nothing.

Differences from fairseq, on purpose:

* ``padding_l=None`` means K // 2 (a centred window); fairseq leaves it undefined.
* Weight dropout is DropConnect on the normalised kernel with no renormalisation, drawn
  once per forward for LightConv (fairseq draws it per position in one code path and per
  (t, b, h) in the other) and per predicted kernel for DynamicConv (as fairseq).
* Incremental decoding keeps the last K-1 inputs in a ring buffer and computes a one-token
  call with the decoding-step op (one output per head and channel, no recomputation of the
  window); it is exact for any number of new tokens per call, where fairseq's buffer treats
  several new tokens as independent.
* Softmax runs in at least fp32 (fairseq: fp32 for LightConv, the input's dtype for
  DynamicConv; the two agree in fp32 and fp64).
"""
from __future__ import annotations

import uuid

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.library import conv_step, dynamicconv, lightconv


def _xavier_linear(in_features, out_features, bias=True):
    layer = nn.Linear(in_features, out_features, bias)
    nn.init.xavier_uniform_(layer.weight)
    if bias:
        nn.init.constant_(layer.bias, 0.0)
    return layer


def _softmax(logits, dim):
    """Softmax in at least fp32, returned in the logits' dtype."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.softmax(logits, dim=dim, dtype=dtype).to(logits.dtype)


class _IncrementalConv(nn.Module):
    """Shared validation and the decoding state: a ring buffer of the last K-1 inputs
    (K-1 x B x C, zeros before the first token), the slot of its oldest row, and the
    number of tokens seen."""

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

    def _state(self, x, incremental_state):
        """(buffer, position, steps) for this layer, created on the first call."""
        if self.padding_l != self.kernel_size - 1:
            raise ValueError("incremental decoding needs causal padding, padding_l = kernel_size - 1 = "
                             f"{self.kernel_size - 1}; got {self.padding_l}")
        state = incremental_state.get(self._state_key)
        if state is None:
            state = incremental_state[self._state_key] = {
                "input_buffer": x.new_zeros(self.kernel_size - 1, x.shape[1], x.shape[2]), "position": 0, "steps": 0}
        return state

    def _window(self, state, x):
        """The full window for several new tokens (or gradients): the buffer oldest first, then
        x; the buffer becomes the last K-1 rows, oldest first."""
        buffer, position = state["input_buffer"], state["position"]
        window = torch.cat([buffer.roll(-position, dims=0), x], dim=0)
        state["input_buffer"] = window[window.shape[0] - buffer.shape[0]:].detach().clone()
        state["position"] = 0
        return window

    def _advance(self, state, x):
        """After a one-token step: x replaces the oldest row."""
        if self.kernel_size > 1:
            state["input_buffer"][state["position"]].copy_(x[0])
            state["position"] = (state["position"] + 1) % (self.kernel_size - 1)

    @staticmethod
    def _needs_grad(*tensors):
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    def input_buffer(self, incremental_state):
        """The last K-1 inputs, oldest first (zeros before the first token), or None."""
        state = incremental_state.get(self._state_key)
        if state is None:
            return None
        return state["input_buffer"].roll(-state["position"], dims=0)

    def reorder_incremental_state(self, incremental_state, new_order):
        state = incremental_state.get(self._state_key)
        if state is not None:
            state["input_buffer"] = state["input_buffer"].index_select(1, new_order)


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
            weight = _softmax(weight, dim=1)
        return F.dropout(weight, self.weight_dropout, training=self.training)

    def forward(self, x, incremental_state=None, unfold=False):
        """x: T x B x C -> T x B x C. ``unfold`` is accepted for fairseq compatibility and ignored."""
        if x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"expected T x B x {self.input_size} input, got {tuple(x.shape)}")
        kernel = self.kernel().to(x.dtype)
        if incremental_state is None:
            out = lightconv(x.permute(1, 2, 0), kernel, self.padding_l, self.backend).permute(2, 0, 1)
        else:
            state = self._state(x, incremental_state)
            new = x.shape[0]
            if new == 1 and not self._needs_grad(x, kernel):
                out = conv_step(state["input_buffer"], x[0], kernel, state["position"], False, self.backend)[None]
                self._advance(state, x)
            else:
                window = self._window(state, x)
                out = lightconv(window.permute(1, 2, 0), kernel, self.padding_l, self.backend).permute(2, 0, 1)[-new:]
            state["steps"] += new
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
        if self.in_proj:
            proj = self.weight_linear(x)
            x, logits = proj[..., :self.input_size], proj[..., self.input_size:]
        else:
            logits = self.weight_linear(x if query is None else query)
        time, batch = x.shape[0], x.shape[1]
        logits = logits.reshape(time, batch, self.num_heads, self.kernel_size)          # T x B x H x K
        if incremental_state is None:
            weight = self._normalise(logits, self._inside(time, time, 0)).to(x.dtype)
            out = dynamicconv(x.permute(1, 2, 0), weight.permute(1, 2, 3, 0), self.padding_l, self.backend)
            out = out.permute(2, 0, 1)
        else:
            state = self._state(x, incremental_state)
            # window positions before the first token are padding (renorm_padding masks them)
            first = self.kernel_size - 1 - min(state["steps"], self.kernel_size - 1)
            weight = self._normalise(logits, self._inside(time, time + self.kernel_size - 1, first)).to(x.dtype)
            if time == 1 and not self._needs_grad(x, weight):
                out = conv_step(state["input_buffer"], x[0], weight[0], state["position"], True, self.backend)[None]
                self._advance(state, x)
            else:
                window = self._window(state, x)
                # only the new steps' kernels are needed; earlier window positions get zero kernels
                weight = torch.cat([weight.new_zeros(window.shape[0] - time, *weight.shape[1:]), weight])
                out = dynamicconv(window.permute(1, 2, 0), weight.permute(1, 2, 3, 0), self.padding_l,
                                  self.backend).permute(2, 0, 1)[-time:]
            state["steps"] += time
        if self.conv_bias is not None:
            out = out + self.conv_bias.view(1, 1, -1)
        return out

    def _inside(self, new, length, first):
        """(new, K) mask of the taps of the last ``new`` steps of a sequence of ``length`` that
        read a position in [first, length), or None without renorm_padding."""
        if not (self.weight_softmax and self.renorm_padding):
            return None
        t = torch.arange(length - new, length)[:, None]
        src = t + torch.arange(self.kernel_size)[None, :] - self.padding_l
        return (src >= first) & (src < length)

    def _normalise(self, logits, inside):
        """T x B x H x K kernels: softmax over the taps (those inside the sequence with
        renorm_padding), then DropConnect."""
        if self.weight_softmax:
            if inside is not None:
                logits = logits.masked_fill(~inside.to(logits.device)[:, None, None, :], float("-inf"))
            weight = _softmax(logits, dim=3)
        else:
            weight = logits
        return F.dropout(weight, self.weight_dropout, training=self.training)

    def extra_repr(self):
        return (f"{self.input_size}, kernel_size={self.kernel_size}, padding_l={self.padding_l}, "
                f"num_heads={self.num_heads}, weight_softmax={self.weight_softmax}, "
                f"conv_bias={self.conv_bias is not None}, renorm_padding={self.renorm_padding}, "
                f"in_proj={self.in_proj}, weight_dropout={self.weight_dropout}")
