"""Build the model chunks a placement asks for from a PipelineModule's layers.

DeepSpeed builds one stage per rank. A schedule may need other cuts (D*V stages for
looped schedules, 2D for V-shapes) and several chunks per rank (two replicas' stages for
Chimera), so the chunks are rebuilt here from ``module._layer_specs``:

- a ``LayerSpec`` is built under a fork of the RNG seeded with ``base_seed + global layer
  index``: replicas of a stage start identical on every rank, and the initial model does
  not depend on the schedule, the number of ranks or the placement;
- an ``nn.Module`` instance (as DeepSpeedExamples and many scripts write: every rank
  constructs every layer) is taken as it is, so the weights are the script's own, as
  under stock DeepSpeed; a layer this rank needs twice gets a deep copy;
- a plain function (``lambda x: x.flatten(1)``) is called as it is.
"""
from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn

from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec


def partition(module: PipelineModule, num_stages: int, method: str) -> list:
    """Layer boundaries of ``num_stages`` stages, with DeepSpeed's partition methods."""
    specs = module._layer_specs
    method = (method or "parameters").lower()
    if len(specs) < num_stages:
        raise ValueError(f"the model has {len(specs)} layers but the schedule cuts it into {num_stages} stages; "
                         f"use fewer stages or chunks")
    from ..partition import deepspeed_cut
    if method == "uniform":
        return deepspeed_cut(method, [1] * len(specs), num_stages)
    if method == "parameters":
        counts = []
        for layer in specs:
            if isinstance(layer, LayerSpec):
                built = layer.build()
            elif isinstance(layer, nn.Module):
                built = layer
            else:
                counts.append(0)
                continue
            counts.append(sum(p.numel() for p in built.parameters() if p.requires_grad))
        return deepspeed_cut(method, counts, num_stages)
    if method.startswith("type:"):
        marks = [0] * len(specs)
        for idx in module._find_layer_type(method.split(":", 1)[1]):
            marks[idx] = 1
        return deepspeed_cut(method, marks, num_stages)
    raise ValueError(f"partition method must be uniform, parameters or type:REGEX; got {method!r}")


class ChunkModule(nn.Module):
    """The layers of one (replica, stage): runs them in order, with optional checkpointing."""

    def __init__(self, index: int, stage: int, start: int, layers: list, funcs: list,
                 checkpoint_interval: int = 0, checkpoint_func=None, checkpointable=None):
        super().__init__()
        self.index, self.stage, self.start = index, stage, start
        self.layers = nn.ModuleDict({str(start + i): m for i, m in enumerate(layers) if isinstance(m, nn.Module)
                                     and not getattr(m, "_ds_chimera_tied", False)})
        self.funcs = funcs                         # callables, in order (modules, tied partials, lambdas)
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_func = checkpoint_func
        # which blocks of checkpoint_interval layers are recomputed: DeepSpeed's rule by default
        # (a block with parameters), so a parameter-free in-place layer (ReLU(inplace=True)) runs as it is
        rule = checkpointable or has_parameters
        self.checkpointed = [rule(funcs[i:i + checkpoint_interval])
                             for i in range(0, len(funcs), checkpoint_interval)] if checkpoint_interval else []
        self._block_params: dict = {}          # (start, stop) -> every parameter of those layers (see _params)

    def _run(self, start: int, stop: int):
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for func in self.funcs[start:stop]:
                x = func(x)
            return x
        return run

    def _params(self, start: int, stop: int) -> list:
        """The trainable parameters of layers ``start:stop``, each once. The parameter objects are walked
        once per block and kept (the optimizer holds the same objects); ``requires_grad`` is read each time,
        so a layer frozen later drops out."""
        every = self._block_params.get((start, stop))
        if every is None:
            seen, every = set(), []
            for func in self.funcs[start:stop]:
                module = _bound_module(func)
                if isinstance(module, nn.Module):
                    for p in module.parameters():
                        if id(p) not in seen:
                            seen.add(id(p))
                            every.append(p)
            self._block_params[(start, stop)] = every
        return [p for p in every if p.requires_grad]

    def forward(self, x, capture: list | None = None):
        """Run the layers. ``capture`` collects (block output, block params) for a split backward.

        A block is one layer, or one checkpointed group of layers. The weight-grad pass
        then differentiates each block from its own output to its own parameters, so it
        never walks the input-grad chain again.
        """
        n = len(self.funcs)
        checkpointing = bool(self.checkpoint_interval) and torch.is_grad_enabled()
        step = self.checkpoint_interval if checkpointing else 1
        for block, start in enumerate(range(0, n, step)):
            stop = min(start + step, n)
            if checkpointing and self.checkpointed[block]:
                args = x if isinstance(x, tuple) else (x,)
                x = self.checkpoint_func(self._run(start, stop), *args)
            else:
                for func in self.funcs[start:stop]:
                    x = func(x)
            if capture is not None:
                params = self._params(start, stop)
                if params:
                    capture.append((x, params))
        return x


def tied_holders(specs: list, placement, parts: list) -> dict:
    """Tied key -> the pipeline ranks holding a layer of it under ``placement`` cut at ``parts``."""
    holders: dict = {}
    for chunk in placement.chunks:
        for idx in range(parts[chunk.stage], parts[chunk.stage + 1]):
            if isinstance(specs[idx], TiedLayerSpec):
                holders.setdefault(specs[idx].key, set()).add(chunk.rank)
    return holders


def has_parameters(funcs) -> bool:
    """DeepSpeed's default test of a block for checkpointing: some module in it has parameters."""
    return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))


def deepspeed_checkpointable(module: PipelineModule):
    """``PipelineModule._is_checkpointable`` for a block of layers, as DeepSpeed decides it: its
    ``checkpointable_layers`` (class names) where given, Megatron-DeepSpeed's GPT pipe classes
    their transformer layers, else the blocks that have parameters."""
    from deepspeed.runtime.activation_checkpointing import checkpointing
    names = module.checkpointable_layers

    def checkpointable(funcs) -> bool:
        if module.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint and \
                type(module).__name__ in ("GPTModelPipe", "GPT2ModelPipe"):
            return all("ParallelTransformerLayerPipe" in type(f).__name__ or
                       (names is not None and type(f).__name__ in names) for f in funcs)
        if names is not None:
            return all(type(f).__name__ in names for f in funcs)
        return has_parameters(funcs)
    return checkpointable


def build_chunks(module: PipelineModule, placement, rank: int, parts: list, device,
                 checkpoint_interval: int = 0, checkpoint_func=None):
    """Chunks of ``rank`` as a ModuleList, plus the tied modules they share (by key)."""
    checkpointable = deepspeed_checkpointable(module)
    specs = module._layer_specs
    first_use = {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            first_use.setdefault(spec.key, idx)
    tied: dict = {}
    chunks = []
    used: set = set()          # module instances already placed on this rank
    for index in placement.chunks_on(rank):
        stage = placement.chunks[index].stage
        start, stop = parts[stage], parts[stage + 1]
        layers, funcs = [], []
        for idx in range(start, stop):
            spec = specs[idx]
            seed_index = first_use.get(spec.key, idx) if isinstance(spec, TiedLayerSpec) else idx
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module.base_seed + seed_index)   # a tied module: its first use
                if isinstance(spec, TiedLayerSpec):
                    if spec.key not in tied:
                        tied[spec.key] = spec.build()
                        tied[spec.key]._ds_chimera_tied = True
                        tied[spec.key]._ds_chimera_tied_attrs = list(spec.tied_weight_attr)
                    shared = tied[spec.key]
                    layers.append(shared)
                    funcs.append(shared if spec.forward_fn is None else partial(spec.forward_fn, shared))
                elif isinstance(spec, LayerSpec):
                    built = spec.build()
                    layers.append(built)
                    funcs.append(built)
                elif isinstance(spec, nn.Module):
                    layer = copy.deepcopy(spec) if id(spec) in used else spec
                    used.add(id(spec))
                    layers.append(layer)
                    funcs.append(layer)
                else:
                    layers.append(spec)
                    funcs.append(spec)
        chunks.append(ChunkModule(index, stage, start, layers, funcs, checkpoint_interval, checkpoint_func,
                                  checkpointable))
    chunk_list = nn.ModuleList(chunks).to(device)
    tied_modules = nn.ModuleDict(tied).to(device)
    return chunk_list, tied_modules


def _bound_module(func):
    """The module behind a layer: itself, or a tied module bound as a forward_fn's first argument."""
    if isinstance(func, partial) and func.args and isinstance(func.args[0], nn.Module):
        return func.args[0]
    return func


def layer_objects(chunk: ChunkModule) -> dict:
    """Global layer index -> the built layer object (module, tied module or function)."""
    return {chunk.start + i: _bound_module(func) for i, func in enumerate(chunk.funcs)}
