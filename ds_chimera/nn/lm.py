"""A small DynamicConv language model, as a plain module and as a PipelineModule LayerSpec list.

Tokens (B x T) -> embedding -> causal conv layers (T x B x C between layers, so every
pipeline stage hands one tensor to the next) -> head -> logits (B x T x V). The data
generator makes the counting task used by the demo and the tests: each sequence counts
upward modulo the vocabulary with its own stride, so the next token follows from context.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import ConvLayer


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, max_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        self.scale = math.sqrt(d_model)
        self.max_len = max_len

    def forward(self, ids):
        if ids.shape[1] > self.max_len:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_len {self.max_len}")
        pos = torch.arange(ids.shape[1], device=ids.device)
        return (self.tokens(ids) * self.scale + self.positions(pos)).transpose(0, 1)   # T x B x C


class LMHead(nn.Module):
    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x):
        return self.out(self.norm(x)).transpose(0, 1)                                  # B x T x V


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def lm_layer_specs(vocab_size: int = 32, d_model: int = 64, num_layers: int = 4, kernel_sizes=(3, 7, 15, 31),
                   num_heads: int = 4, max_len: int = 64, dynamic: bool = True, dropout: float = 0.0,
                   weight_dropout: float = 0.0, backend=None):
    """LayerSpecs for ``deepspeed.pipe.PipelineModule``: embedding, conv layers, head.

    Layer i uses kernel_sizes[i] (the last size repeats), as the paper grows kernels with depth.
    """
    from deepspeed.pipe import LayerSpec
    specs = [LayerSpec(TokenEmbedding, vocab_size, d_model, max_len)]
    for i in range(num_layers):
        kernel = kernel_sizes[min(i, len(kernel_sizes) - 1)]
        specs.append(LayerSpec(ConvLayer, d_model, kernel, num_heads, dynamic=dynamic, causal=True,
                               dropout=dropout, weight_dropout=weight_dropout, backend=backend))
    specs.append(LayerSpec(LMHead, d_model, vocab_size))
    return specs


class ConvLM(nn.Module):
    """The same model as one module (single process), with incremental decoding."""

    def __init__(self, vocab_size: int = 32, d_model: int = 64, num_layers: int = 4, kernel_sizes=(3, 7, 15, 31),
                 num_heads: int = 4, max_len: int = 64, dynamic: bool = True, dropout: float = 0.0,
                 weight_dropout: float = 0.0, backend=None):
        super().__init__()
        self.embed = TokenEmbedding(vocab_size, d_model, max_len)
        self.layers = nn.ModuleList(
            ConvLayer(d_model, kernel_sizes[min(i, len(kernel_sizes) - 1)], num_heads, dynamic=dynamic, causal=True,
                      dropout=dropout, weight_dropout=weight_dropout, backend=backend) for i in range(num_layers))
        self.head = LMHead(d_model, vocab_size)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def counting_batches(batch_size: int, seq_len: int = 16, vocab_size: int = 32, seed: int = 0):
    """Endless (inputs, targets) pairs of the counting task; deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab_size
        yield seq[:, :-1], seq[:, 1:]
