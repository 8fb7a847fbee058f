"""The paper's convolution blocks and layers (Wu et al. 2019, Fig. 2), T x B x C.

Block: input projection d -> 2d, GLU, LightConv or DynamicConv, output projection d -> d.
Layer: pre-norm residual block, then a pre-norm residual feed-forward network. Causal
layers (decoder / LM) use padding_l = K - 1 and support incremental decoding.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .conv import DynamicConv1dTBC, LightweightConv1dTBC


class ConvBlock(nn.Module):
    def __init__(self, d_model: int, kernel_size: int, num_heads: int, dynamic: bool = True, causal: bool = True,
                 weight_dropout: float = 0.1, weight_softmax: bool = True, backend=None):
        super().__init__()
        self.input_projection = nn.Linear(d_model, 2 * d_model)
        padding_l = kernel_size - 1 if causal else kernel_size // 2
        if dynamic:
            self.conv = DynamicConv1dTBC(d_model, kernel_size, padding_l=padding_l, num_heads=num_heads,
                                         weight_dropout=weight_dropout, weight_softmax=weight_softmax, bias=True,
                                         backend=backend)
        else:
            self.conv = LightweightConv1dTBC(d_model, kernel_size, padding_l=padding_l, num_heads=num_heads,
                                             weight_dropout=weight_dropout, weight_softmax=weight_softmax,
                                             bias=True, backend=backend)
        self.output_projection = nn.Linear(d_model, d_model)

    def forward(self, x, incremental_state=None):
        x = F.glu(self.input_projection(x), dim=-1)
        return self.output_projection(self.conv(x, incremental_state=incremental_state))


class ConvLayer(nn.Module):
    """Encoder (causal=False) or decoder (causal=True) layer."""

    def __init__(self, d_model: int, kernel_size: int, num_heads: int, ffn_dim: int | None = None,
                 dynamic: bool = True, causal: bool = True, dropout: float = 0.1, weight_dropout: float = 0.1,
                 backend=None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.block = ConvBlock(d_model, kernel_size, num_heads, dynamic, causal, weight_dropout, backend=backend)
        ffn_dim = ffn_dim or 4 * d_model
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_dim), nn.ReLU(), nn.Linear(ffn_dim, d_model))
        self.dropout = dropout

    def forward(self, x, incremental_state=None):
        x = x + F.dropout(self.block(self.norm1(x), incremental_state), self.dropout, self.training)
        return x + F.dropout(self.ffn(self.norm2(x)), self.dropout, self.training)
