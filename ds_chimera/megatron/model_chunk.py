"""What ds_chimera reads off a Megatron model chunk: the module under its wrappers, its config, its stage."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class _DefaultConfig:
    """What Megatron's ModelParallelConfig provides, for chunks that carry no ``config``."""
    finalize_model_grads_func: object = None
    grad_scale_func: object = None
    no_sync_func: object = None
    calculate_per_token_loss: bool = False
    enable_autocast: bool = False
    autocast_dtype: object = None


def unwrap(module):
    """The model under its wrappers (Megatron's DDP, Float16Module...): each keeps it as ``.module``."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def model_config(chunk):
    """The chunk's Megatron config (on the chunk or the model it wraps), else the defaults."""
    for module in (chunk, unwrap(chunk)):
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "finalize_model_grads_func"):
            return config
    return _DefaultConfig()


def tagged_stage(chunk):
    """The stage ``build_model_chunks`` tagged the chunk with, or None for a chunk built elsewhere."""
    return getattr(chunk, "_ds_chimera_stage", getattr(unwrap(chunk), "_ds_chimera_stage", None))


def megatron_layout(chunk, num_stages: int):
    """(stage, description) of a Megatron chunk from its layers' global numbers, or None if unknown."""
    config = getattr(chunk, "config", None)
    total = getattr(config, "num_layers", None)
    numbers = sorted({m.layer_number for m in chunk.modules()
                      if type(m).__name__.endswith("TransformerLayer") and isinstance(getattr(m, "layer_number", None), int)})
    if not numbers or not total or total % num_stages:
        return None
    per_stage = total // num_stages
    parts = [f"decoder layers {numbers[0]}-{numbers[-1]}"]
    if getattr(chunk, "pre_process", False):
        parts.insert(0, "the embedding")
    if getattr(chunk, "post_process", False):
        parts.append("the output layer")
    return (numbers[0] - 1) // per_stage, ", ".join(parts)
