"""The user's ``model_parameters`` (tensors or parameter groups) carried onto the schedule's chunks.

A user builds parameter groups over the stock stage DeepSpeed made for its rank (weight decay on
weights, none on biases and norms; DeepSpeed's own tests pass one named group holding everything).
ds_chimera replaces that stage with the chunks the schedule places on the rank, which hold other
layers (Chimera's second replica, a looped schedule's later stages) as new tensors. Each parameter
is therefore named by where it lives in the model, not by its tensor: ``(layer index, name inside
the layer)``, or ``(tied key, name)`` for a tied module. Every rank tells the others which group each
of its stock parameters is in (one object all-gather at ``initialize``), and together the stock
stages cover every layer, so every chunk parameter finds its group and the group's options.
"""
from __future__ import annotations

import inspect

import torch

Key = tuple


def stock_parameter_keys(module) -> dict:
    """id(parameter) -> key, for the stock stage's parameters (call before its layers are replaced)."""
    keys = {}
    for name, p in module.named_parameters():
        head, _, rest = name.partition(".")
        if head.isdigit():
            keys[id(p)] = ("layer", int(head), rest)
        elif head == "tied_modules":
            tied, _, inner = rest.partition(".")
            keys[id(p)] = ("tied", tied, inner)
        else:
            keys[id(p)] = ("module", name)         # a parameter of the PipelineModule itself (its loss_fn)
    return keys


def chunk_parameter_keys(module) -> list:
    """(key, parameter) for the chunks' trainable parameters, in ``module.parameters()`` order."""
    keys = {}
    for chunk in module.ds_chimera_chunks:
        for name, p in chunk.layers.named_parameters():
            head, _, rest = name.partition(".")
            keys[id(p)] = ("layer", int(head), rest)
    for name, p in module.ds_chimera_tied.named_parameters():
        tied, _, inner = name.partition(".")
        keys[id(p)] = ("tied", tied, inner)
    out = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            out.append((keys.get(id(p), ("module", name)), p))
    return out


def _as_groups(model_parameters) -> tuple[list, bool]:
    """(groups, plain): the argument as a list of group dicts, and whether it was a plain tensor list."""
    given = list(model_parameters)
    if all(isinstance(p, torch.Tensor) for p in given):
        return [{"params": given}], True
    if all(isinstance(g, dict) for g in given):
        groups = []
        for index, group in enumerate(given):
            if "params" not in group:
                raise ValueError(f"model_parameters group {index} has no 'params' key (keys: {sorted(group)})")
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            if not all(isinstance(p, torch.Tensor) for p in params):
                raise ValueError(f"model_parameters group {index}: 'params' must hold tensors, got "
                                 f"{sorted({type(p).__name__ for p in params})}")
            groups.append({**group, "params": params})
        return groups, False
    raise ValueError("model_parameters must be tensors (model.parameters()) or parameter groups (dicts with "
                     f"'params'), got {sorted({type(p).__name__ for p in given})}")


def _describe(groups: list, stock_keys: dict) -> dict:
    """What this rank tells the others: each group's options, and the group of each stock parameter."""
    member = {}
    for index, group in enumerate(groups):
        for p in group["params"]:
            if id(p) not in stock_keys:
                raise ValueError(f"model_parameters group {index} holds a tensor of shape {tuple(p.shape)} that is "
                                 f"not a parameter of this PipelineModule; pass the module's own parameters")
            key = stock_keys[id(p)]
            if member.get(key, index) != index:
                raise ValueError(f"parameter {_name(key)} is in model_parameters groups {member[key]} and {index}; "
                                 f"a parameter belongs to one group")
            member[key] = index
    options = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return {"options": options, "member": member}


def _merge(described: list) -> tuple[list, dict]:
    """One group list and one key -> group map from every rank's description, or a clear error."""
    counts = {len(d["options"]) for d in described}
    if len(counts) != 1:
        per_rank = {rank: len(d["options"]) for rank, d in enumerate(described)}
        raise ValueError(f"ranks pass different numbers of model_parameters groups ({per_rank}); every rank must "
                         f"build the same groups (by parameter name or kind) over its own stage")
    options = described[0]["options"]
    member: dict = {}
    for rank, d in enumerate(described):
        for index, (mine, first) in enumerate(zip(d["options"], options)):
            if not _same_options(mine, first):
                raise ValueError(f"model_parameters group {index} has options {mine} on rank {rank} but {first} "
                                 f"on rank 0; the groups must agree across ranks")
        for key, index in d["member"].items():
            if member.get(key, index) != index:
                raise ValueError(f"parameter {_name(key)} is in model_parameters group {member[key]} on one rank "
                                 f"and group {index} on rank {rank}; the groups must agree across ranks")
            member[key] = index
    return options, member


def _same_options(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x.cpu(), y.cpu())):
                return False
        elif x != y:
            return False
    return True


def _name(key: Key) -> str:
    if key[0] == "layer":
        return f"{key[2]} of layer {key[1]}"
    if key[0] == "tied":
        return f"{key[2]} of tied module {key[1]!r}"
    return key[1]


def remap_groups(model_parameters, stock_keys: dict, module, gather) -> tuple[list, bool, list]:
    """The user's groups over the chunks' parameters: ``(groups, plain, kept)``, ``kept[i]`` being the index
    of the user's group that ``groups[i]`` came from.

    ``gather(obj)`` all-gathers one object over every rank (collective: each rank calls this once
    per ``initialize``). A trainable chunk parameter in no group is refused, as a silently frozen
    layer would be; so is a parameter two ranks put in different groups. Groups left empty on this
    rank are dropped (DeepSpeed's mixed-precision wrappers flatten each group).
    """
    groups, plain = _as_groups(model_parameters)
    options, member = _merge(gather(_describe(groups, stock_keys)))
    buckets: list = [[] for _ in options]
    for key, p in chunk_parameter_keys(module):
        if key not in member:
            raise ValueError(f"model_parameters leaves out the trainable parameter {_name(key)}: ds_chimera rebuilds "
                             f"the stages and cannot leave it untrained as the stock engine would; put it in a "
                             f"group, or freeze it with requires_grad=False in the layer")
        buckets[member[key]].append(p)
    kept = [index for index, bucket in enumerate(buckets) if bucket]
    return [{**options[index], "params": buckets[index]} for index in kept], plain, kept


def optimizer_order(groups_or_params, stock_keys: dict) -> list:
    """The stock engine's optimizer layout on this rank: per parameter group, ``(key, shape)`` of each parameter
    in order. A stock checkpoint indexes its optimizer state by position in that layout, so this is what maps
    the state onto other chunks (see ``checkpoint.stock_optimizer_state``). Call before the stock stage goes."""
    groups, _ = _as_groups(groups_or_params)
    return [[(stock_keys.get(id(p)), tuple(p.shape)) for p in group["params"]] for group in groups]


def distinct_options(groups: list) -> int:
    """How many different option sets the groups carry (ZeRO-2/3 shards steps one flat tensor per chunk)."""
    seen: list = []
    for group in groups:
        opts = {k: v for k, v in group.items() if k != "params"}
        if not any(_same_options(opts, other) for other in seen):
            seen.append(opts)
    return len(seen)


def rebuild_optimizer(optimizer, groups: list, into=None):
    """``optimizer``'s class over ``groups``, with the defaults its constructor takes (``defaults`` can
    hold more: AdamW's inherited ``decoupled_weight_decay``). ``into``: an optimizer of that class to
    construct again in place, instead of a new object."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    try:
        if into is not None:
            cls.__init__(into, groups, **defaults)
            return into
        return cls(groups, **defaults)
    except TypeError as exc:
        raise ValueError(f"ds_chimera cannot rebuild the optimizer {cls.__name__} over the pipeline's parameters "
                         f"from its defaults ({exc}); pass it as a callable (lambda params: ...) or configure it "
                         f"in the DeepSpeed config's \"optimizer\" section") from exc
