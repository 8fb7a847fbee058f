"""Pipeline weights back to a standard HF checkpoint (``save_pretrained``: config.json + safetensors).

The weights come either from the per-layer files ``engine.save_checkpoint`` writes
(``layer_XX-model_states.pt``, one per global layer index), or straight from a live
engine, gathered from the ranks that own each layer. Layer names are mapped to HF names
with the same :mod:`.layout` that built the layers, and the result is loaded into a model
of the right class, so ``from_pretrained`` reads it like any other checkpoint.
"""
from __future__ import annotations

import os
import re

import torch

from .layout import describe

LAYER_FILE = re.compile(r"^layer_(\d+)(?:-.*)?-model_states\.pt$")


def _hf_model(model_or_config):
    """A fresh model to load into (the given model is left as it is), of the given class or from a config."""
    if hasattr(model_or_config, "state_dict") and hasattr(model_or_config, "config"):
        return type(model_or_config)(model_or_config.config)
    if hasattr(model_or_config, "to_dict") and hasattr(model_or_config, "model_type"):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_config(model_or_config)
    raise TypeError(f"export_pretrained needs an HF model or config, got {type(model_or_config).__name__}")


def checkpoint_layer_dir(path: str) -> str:
    """The folder holding the layer files: ``path`` itself, or the tag its ``latest`` file names."""
    if any(LAYER_FILE.match(f) for f in os.listdir(path)):
        return path
    latest = os.path.join(path, "latest")
    if os.path.exists(latest):
        with open(latest) as fh:
            tagged = os.path.join(path, fh.read().strip())
        if os.path.isdir(tagged) and any(LAYER_FILE.match(f) for f in os.listdir(tagged)):
            return tagged
    raise FileNotFoundError(f"{path} holds no layer_XX-model_states.pt files (nor a 'latest' tag that does); "
                            f"pass the folder engine.save_checkpoint wrote")


def read_layer_files(path: str) -> dict:
    """Global layer index -> state dict, from a checkpoint folder."""
    folder = checkpoint_layer_dir(path)
    states = {}
    for name in sorted(os.listdir(folder)):
        match = LAYER_FILE.match(name)
        if match:
            states.setdefault(int(match.group(1)), torch.load(os.path.join(folder, name), map_location="cpu",
                                                              weights_only=True))
    return states


def engine_layer_states(engine) -> dict:
    """This rank's share of the layer states: the layers whose stage it is the first holder of (data-parallel 0).

    Under bf16 and fp16 the modules hold 16-bit copies; the weights trained are the optimizer's fp32 masters,
    and those are what an HF checkpoint gets (a plain ``--bf16`` or ``--fp16`` Trainer saves fp32 too).
    Collective over data parallelism then (DeepSpeed partitions the masters over it): call on every rank."""
    owned = engine.owned_layers()
    masters = {}
    if getattr(engine, "using_bf16_optimizer", False) or engine.plan.config.fp16:
        masters = _fp32_masters(engine)
    states = {}
    for idx, obj in owned.items():
        named = dict(obj.named_parameters())
        states[idx] = {k: (masters[id(named[k])] if k in named and id(named[k]) in masters else v.detach()
                           ).to("cpu", copy=True) for k, v in obj.state_dict().items()}
    return states


def _fp32_masters(engine) -> dict:
    """id(module parameter) -> its full fp32 master, for every layer on this rank in layer order (each
    parameter's all-reduce over the data-parallel group runs in the same order on every replica)."""
    from deepspeed.utils import safe_get_full_fp32_param
    own = getattr(engine.optimizer, "master_of", None)     # fp16 at ZeRO-0: ds_chimera's masters (fp16_masters.py)
    if own is not None:
        return {key: master.detach() for key, master in own.items()}
    out = {}
    for _, (_, obj) in sorted(engine._layer_objects().items()):
        for p in (obj.parameters() if hasattr(obj, "parameters") else ()):
            if id(p) not in out:
                full = safe_get_full_fp32_param(p)
                if full is not None:
                    out[id(p)] = full.detach()
    return out


def gathered_objects(local, dst: int | None = 0):
    """Every rank's ``local`` object, as a list on rank ``dst`` (None: on every rank), None on the others.
    Collective: call on all ranks."""
    import torch.distributed as dist
    if dst is None:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        return parts
    parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(local, parts, dst=dst)
    return parts


def gather_layer_states(engine, dst: int | None = 0) -> dict | None:
    """All layer states, gathered on rank ``dst`` (None: on every rank). Collective: call on all ranks."""
    parts = gathered_objects(engine_layer_states(engine), dst)
    if parts is None:
        return None
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def hf_state_dict(layout, states: dict) -> dict:
    """HF parameter name -> tensor, from layer states by global index."""
    if sorted(states) != list(range(len(layout.layers))):
        raise ValueError(f"the checkpoint has layers {sorted(states)[:6]}... but {layout.model_class} converts to "
                         f"{len(layout.layers)} layers (0..{len(layout.layers) - 1}); is it the same model config?")
    out = {}
    for idx, plan in enumerate(layout.layers):
        if plan.kind == "head" and layout.tied:
            continue                       # the tied head's file repeats the embedding
        for local, value in states[idx].items():
            out[plan.hf_name(local)] = value
    return out


def load_into(model, states: dict) -> None:
    """Copy layer states into an HF model; keys the model ties to a loaded one may be absent."""
    layout = describe(model)
    weights = hf_state_dict(layout, states)
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"layer files hold weights {result.unexpected_keys[:4]} that {layout.model_class} lacks")
    params = dict(model.state_dict(keep_vars=True))
    loaded = {params[k].data_ptr() for k in weights if k in params}
    missing = [k for k in result.missing_keys if params[k].data_ptr() not in loaded]
    if missing:
        raise ValueError(f"the checkpoint has no weights for {missing[:4]} of {layout.model_class}")


def export_pretrained(source, model_or_config, output_dir: str) -> str | None:
    """Write ``output_dir`` in ``save_pretrained`` format from pipeline weights.

    ``source``: a folder written by ``engine.save_checkpoint`` (the save dir or one tag), or a
    live ds_chimera engine; then this is collective (every rank calls it) and rank 0 writes.
    ``model_or_config``: the HF model that was converted, or its config. Returns ``output_dir``
    on the rank that wrote it, None on the others.
    """
    if isinstance(source, (str, os.PathLike)):
        states, writer = read_layer_files(os.fspath(source)), True
    elif hasattr(source, "_layer_objects") and hasattr(source, "placement"):
        import torch.distributed as dist
        states = gather_layer_states(source, dst=0)
        writer = dist.get_rank() == 0
    else:
        raise TypeError(f"export_pretrained reads a checkpoint folder or a ds_chimera engine, "
                        f"got {type(source).__name__}")
    if writer:
        model = _hf_model(model_or_config)
        load_into(model, states)
        model.save_pretrained(output_dir)     # config.json + model.safetensors
    if not isinstance(source, (str, os.PathLike)):
        import torch.distributed as dist
        dist.barrier()
    return output_dir if writer else None
