"""The pipeline layers an HF causal LM is cut into: embedding, decoder block, norm, head.

What passes between layers (and so between stages) is the hidden state, or the pair
``(hidden, attention_mask)`` when the batch carries a 2-D padding mask. Position ids are
``0..T-1`` as in HF's own forward without a cache, so no layer needs them sent: the
embedding adds GPT-2's position table, and each block builds its causal mask and (Llama)
its rotary cos/sin itself. Both are cheap and this keeps messages to one float tensor.

Each layer is built from recipes (see :mod:`.layout`) and, when ``state`` is given, loads
those weights (a strict load: a wrong mapping fails at build time, not silently).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .layout import build


def split(x):
    """(hidden or input_ids, attention mask or None) from what a layer received."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"ds_chimera.hf layers take a tensor or (tensor, attention_mask); got {len(x)} tensors")
        return x[0], x[1]
    return x, None


def join(hidden, mask):
    return hidden if mask is None else (hidden, mask)


def positions(hidden: torch.Tensor) -> torch.Tensor:
    """HF's default position ids without a cache: 0..T-1, shape (1, T)."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class _Loaded(nn.Module):
    def _load(self, state):
        if state is not None:
            with torch.no_grad():
                self.load_state_dict(state, strict=True)


class EmbeddingLayer(_Loaded):
    """Token embedding (+ GPT-2's learned positions and dropout). Also the tied head's weight holder."""

    def __init__(self, tokens: tuple, positions: tuple | None = None, dropout: float = 0.0, state: dict | None = None):
        super().__init__()
        self.tokens = build(tokens)
        self.positions = build(positions) if positions is not None else None
        self.drop = nn.Dropout(dropout)
        self._load(state)

    def forward(self, x):
        ids, mask = split(x)
        hidden = self.tokens(ids)
        if self.positions is not None:
            hidden = hidden + self.positions(positions(hidden))
        return join(self.drop(hidden), mask)


def tied_head(embedding: EmbeddingLayer, x):
    """The LM head of a model with tied embeddings: logits = hidden @ token_weight^T."""
    hidden, _ = split(x)
    return F.linear(hidden, embedding.tokens.weight)


def attention_kind(config, layer_idx) -> str:
    """HF's per-layer attention type: the config's ``layer_types`` entry (Qwen2, Gemma-style
    alternation), else sliding everywhere when the config has a ``sliding_window`` (Mistral),
    else full causal attention."""
    types = getattr(config, "layer_types", None)
    if types and layer_idx is not None:
        return types[layer_idx]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


class DecoderBlockLayer(_Loaded):
    """One HF decoder block; it builds its own causal mask and rotary embedding from the positions."""

    def __init__(self, config, block: tuple, rotary: tuple | None = None, state: dict | None = None):
        super().__init__()
        self.config = config
        self.block = build(block)
        self.rotary = build(rotary) if rotary is not None else None   # buffers only, not in state_dict
        self.sliding = attention_kind(config, block[2].get("layer_idx")) == "sliding_attention"
        self._load(state)

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        hidden, mask = split(x)
        pos = positions(hidden)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        causal = make_mask(self.config, hidden, mask, None, position_ids=pos)
        kwargs = {"attention_mask": causal, "position_ids": pos}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, pos)
        out = self.block(hidden, **kwargs)
        if isinstance(out, tuple):       # blocks of older transformers return (hidden, ...)
            out = out[0]
        return join(out, mask)


class NormLayer(_Loaded):
    """The final norm."""

    def __init__(self, norm: tuple, state: dict | None = None):
        super().__init__()
        self.norm = build(norm)
        self._load(state)

    def forward(self, x):
        hidden, mask = split(x)
        return join(self.norm(hidden), mask)


class HeadLayer(_Loaded):
    """An untied LM head: hidden -> logits (the attention mask ends here)."""

    def __init__(self, proj: tuple, state: dict | None = None):
        super().__init__()
        self.proj = build(proj)
        self._load(state)

    def forward(self, x):
        hidden, _ = split(x)
        return self.proj(hidden)
