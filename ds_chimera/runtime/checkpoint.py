"""Checkpoints of a scheduled pipeline: DeepSpeed's layout, written atomically.

Layer files keep DeepSpeed's names (``layer_XX[-<rank>]-model_states.pt``, by global layer
index), so a checkpoint moves between schedules and to the stock engine. Each stage is
written once even where it is replicated (by its lowest rank, on data-parallel rank 0).
A save goes to ``TAG.incomplete/`` and is renamed to ``TAG/`` once every rank is done;
only then does ``latest`` name it, so a crash mid-save leaves the previous checkpoint and
``latest`` untouched. ``ds_chimera_layout.json`` records what decides which parameters (and
so which optimizer state) each rank holds, so a load under another layout is refused
before it would misread the optimizer state.
"""
from __future__ import annotations

import os
import shutil

from ..atomic import torch_save_atomic, write_json_atomic, write_text_atomic

LAYOUT_FILE = "ds_chimera_layout.json"
INCOMPLETE = ".incomplete"
# written into every tag folder this package stages: only folders holding it are ever removed as stale
STAGING_MARKER = "ds_chimera_staged"


def layer_objects(engine) -> dict:
    """Global layer index -> (stage, built layer object) for every chunk of this rank."""
    from .chunks import layer_objects as chunk_layers
    out = {}
    for chunk in engine.module.ds_chimera_chunks:
        out.update({idx: (chunk.stage, obj) for idx, obj in chunk_layers(chunk).items()})
    return out


def layer_file(engine, path: str, idx: int) -> str:
    """DeepSpeed's name for a layer file: layer_XX[-<rank repr>]-model_states.pt."""
    repr_ = engine.grid._topo.get_rank_repr(rank=engine.global_rank)
    return os.path.join(path, f"layer_{idx:02d}{'-' + repr_ if repr_ else ''}-model_states.pt")


def owned_layers(engine) -> dict:
    """Global layer index -> layer, for the layers this rank writes out (checkpoints, HF export)."""
    if engine.grid.get_data_parallel_id() != 0:
        return {}
    placement, rank = engine.placement, engine.pipe_rank
    return {idx: obj for idx, (stage, obj) in sorted(layer_objects(engine).items())
            if placement.stage_owner(stage) == rank and hasattr(obj, "state_dict")}


def save_layers(engine, path: str, exclude_frozen_parameters: bool = False) -> None:
    if engine.grid.get_data_parallel_id() != 0:
        return
    os.makedirs(path, exist_ok=True)
    for idx, obj in owned_layers(engine).items():
        state = {k: v.detach().clone() for k, v in obj.state_dict().items()}
        if exclude_frozen_parameters:
            frozen = {n for n, p in obj.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        torch_save_atomic(state, layer_file(engine, path, idx))


def load_written(path: str, device):
    """A file this package wrote (tensors, numbers, strings and containers of them), loaded without
    unpickling anything else: a tampered checkpoint is refused instead of running its code."""
    import pickle

    import torch

    from ..named_files import READ_ERRORS, describe
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():          # a class or function to import: not a file this package wrote
            raise ValueError(f"checkpoint file {path} holds objects other than tensors and plain containers, which "
                             f"ds_chimera never writes; it is not loaded (unpickling it could run code): "
                             f"{str(exc).splitlines()[0]}") from None
        raise ValueError(f"checkpoint file {path} is damaged ({describe(exc)}): {DAMAGED_FIX}") from None
    except READ_ERRORS as exc:
        raise ValueError(f"checkpoint file {path} is damaged or truncated ({describe(exc)}): {DAMAGED_FIX}") from None


DAMAGED_FIX = "load another tag (load_checkpoint(dir, tag=...)), or restore the file"


def damaged_state_files(directory: str) -> list:
    """DeepSpeed's state files in a tag folder that are not whole torch.save archives (truncated, garbage).

    DeepSpeed's loader does not say which file it failed on, and a rank may read another rank's
    (the pipeline engine reads every model-states file): on a failed load this names the culprits.
    Reads every archive's checksums, so only after a failure."""
    import glob
    import zipfile
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "*_states.pt"))):
        try:
            with zipfile.ZipFile(path) as archive:
                if archive.testzip() is not None:
                    found.append(path)
        except (OSError, zipfile.BadZipFile, EOFError, ValueError):
            found.append(path)
    return found


def load_layers(engine, path: str, strict: bool = True) -> None:
    first_use = _tied_first_use(engine.module._layer_specs)
    for idx, (_, obj) in sorted(layer_objects(engine).items()):
        if not hasattr(obj, "load_state_dict"):
            continue
        file = layer_file(engine, path, idx)
        if not os.path.exists(file) and idx in first_use:
            # DeepSpeed's stock engine writes a tied module at its first layer only (a later use with a
            # forward_fn is a function to it), and takes the weights from there: so do we
            file = layer_file(engine, path, first_use[idx])
        if not os.path.exists(file):
            raise FileNotFoundError(f"checkpoint {path} has no weights for layer {idx} ({file})")
        obj.load_state_dict(load_written(file, engine.device), strict=strict)


def _tied_first_use(specs) -> dict:
    """Layer index -> the first layer index of the same tied key, for every tied layer but the first."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec
    first, out = {}, {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key in first:
                out[idx] = first[spec.key]
            else:
                first[spec.key] = idx
    return out


def layout(engine) -> dict:
    """What decides which parameters (and so which optimizer state) each rank holds."""
    out = {"schedule": engine.schedule.name, "stages": engine.num_stages, "data_parallel": engine.dp_size,
           "parts": [int(p) for p in engine.plan.parts],
           "stage_ranks": [[int(r) for r in ranks] for ranks in engine.placement.stage_ranks]}
    options = dict(engine.plan.config.options)
    if options and _json_safe(options):
        out[OPTIONS] = options                 # to rebuild the plan ("auto" loading before its first call)
    if engine.plan.zero >= 2:
        out["zero"] = engine.plan.zero         # the optimizer state is in per-rank shards
    out[PRECISION] = engine.plan.config.precision      # what the optimizer state holds (masters, loss scale)
    return out


OPTIONS = "options"      # in the layout file, not compared: stage_ranks and parts say where the state lives
WEIGHTS_ONLY = "load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False)"
PRECISION = "precision"  # compared on its own (a layout file written before it was recorded has none)


def placement_of(found: dict) -> dict:
    """A layout without the schedule's options and the precision: what decides where the optimizer state lives."""
    return {k: v for k, v in found.items() if k not in (OPTIONS, PRECISION)}


def _json_safe(value) -> bool:
    import json
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def shards_file(engine, directory: str) -> str:
    return os.path.join(directory, f"ds_chimera_zero_shards-rank{engine.global_rank:04d}.pt")


def save_shards(engine, directory: str) -> None:
    """ZeRO-2/3: this rank's weight shards and the optimizer state over them (DeepSpeed keeps rank 0's only)."""
    shards = engine.host.shards
    torch_save_atomic({"shards": [s.detach().clone() for s in shards.shard_params],
                       "optimizer": engine.optimizer.state_dict()}, shards_file(engine, directory))


def load_shards(engine, directory: str) -> None:
    path = shards_file(engine, directory)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {directory} has no ZeRO shard file for rank {engine.global_rank} "
                                f"({path}); load its weights only: load_optimizer_states=False")
    state = load_written(path, engine.device)
    for param, saved in zip(engine.host.shards.shard_params, state["shards"], strict=True):
        param.data.copy_(saved)
    engine.optimizer.load_state_dict(state["optimizer"])


def read_latest(load_dir: str):
    path = os.path.join(load_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return fh.read().strip()


def saved_layout(load_dir: str, tag):
    """The layout a ds_chimera checkpoint recorded, or None for a checkpoint of DeepSpeed's stock engine."""
    from ..named_files import load_json, read_named_file
    path = os.path.join(load_dir, str(tag), LAYOUT_FILE) if tag is not None else ""
    if not (path and os.path.exists(path)):
        return None
    return read_named_file(f"checkpoint {load_dir}/{tag}: its layout file", path, load_json,
                           f"the checkpoint is damaged: load another tag, or its weights only with {WEIGHTS_ONLY}")


def check_layout(engine, saved: dict | None, load_dir: str, tag) -> None:
    """Refuse optimizer state saved by ds_chimera under another layout (``saved``, from :func:`saved_layout`: it
    would be misread); a stock checkpoint's is mapped by :func:`stock_optimizer_state` instead."""
    if saved is None:
        return
    mine = layout(engine)
    if saved.get(PRECISION, mine[PRECISION]) != mine[PRECISION]:
        raise ValueError(f"checkpoint {load_dir}/{tag} was saved by a {saved[PRECISION]} run; this engine runs "
                         f"{mine[PRECISION]}, whose optimizer state (fp32 masters, loss scale) is another: load the "
                         f"weights only, {WEIGHTS_ONLY}, or run {saved[PRECISION]} as the saved run did")
    if placement_of(saved) == placement_of(mine):
        return
    raise ValueError(f"checkpoint {load_dir}/{tag} was written under {placement_of(saved)}; this engine is "
                     f"{placement_of(mine)}: its optimizer state does not map onto these chunks. Load the weights "
                     f"only: {WEIGHTS_ONLY}")


def stock_optimizer_state(engine, load_dir: str, tag) -> dict:
    """This rank's optimizer state dict, taken from a checkpoint of DeepSpeed's stock engine.

    The stock engine saves, per pipeline stage, its optimizer's state indexed by position in that stage's
    parameter groups. ``engine.plan.stock_optimizer_order`` says which parameter (layer index and name, or
    tied key) each position was for the stock cut of this module, so every chunk parameter finds its state
    in whichever stage's file held it, whatever the schedule's cut and placement. Raises ValueError with the
    reason where that cannot be done (another pipeline size or parameter grouping, ZeRO or bf16 state).
    """
    import torch

    from ..named_files import read_named_file
    from .param_groups import chunk_parameter_keys
    weights_only = "load the weights only: load_checkpoint(..., load_optimizer_states=False)"
    if engine.zero_optimization_stage() or engine.using_bf16_optimizer or \
            not isinstance(engine.optimizer, torch.optim.Optimizer):
        raise ValueError(f"checkpoint {load_dir}/{tag} was written by DeepSpeed's stock engine, and ds_chimera maps "
                         f"a stock optimizer state onto a schedule's chunks only for an fp32 optimizer without ZeRO "
                         f"(this engine's is {type(engine.optimizer).__name__}); {weights_only}")
    order = engine.plan.stock_optimizer_order
    where = {}                      # key -> (stage, flat position in that stage's saved state)
    files = {}
    for stage in range(engine.num_stages):
        path = engine._get_ckpt_name(load_dir, tag, mp_placeholder=f"{stage:02d}")
        if not os.path.exists(path):
            raise ValueError(f"checkpoint {load_dir}/{tag} has no file for pipeline stage {stage} ({path}): it was "
                             f"written with another pipeline size than this run's {engine.num_stages}; {weights_only}")
        # DeepSpeed's own model-states file (its config, version, client state): DeepSpeed loads it alike
        saved = read_named_file(f"checkpoint {load_dir}/{tag}: stage {stage}'s state file", path,
                                lambda p: torch.load(p, map_location="cpu", weights_only=False), DAMAGED_FIX)
        optimizer = saved.get("optimizer") or {}
        layout_here = order[engine.grid.stage_to_global(stage_id=stage, data=0)]
        sizes = [len(g["params"]) for g in optimizer.get("param_groups", [])]
        if sizes != [len(group) for group in layout_here]:
            raise ValueError(f"checkpoint {load_dir}/{tag}: stage {stage}'s optimizer has parameter groups of sizes "
                             f"{sizes}, and this script builds {[len(g) for g in layout_here]} there: it was written "
                             f"with another cut or grouping of the parameters; {weights_only}")
        files[stage] = optimizer
        for group_index, group in enumerate(layout_here):
            for (key, shape), position in zip(group, optimizer["param_groups"][group_index]["params"]):
                for value in optimizer.get("state", {}).get(position, {}).values():
                    if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != tuple(shape):
                        raise ValueError(f"checkpoint {load_dir}/{tag}: stage {stage}'s optimizer state for "
                                         f"{key} has shape {tuple(value.shape)}, the parameter {tuple(shape)}; "
                                         f"{weights_only}")
                where.setdefault(key, (stage, group_index, position))
    keys = {id(p): key for key, p in chunk_parameter_keys(engine.module)}
    state, groups, index = {}, [], 0
    for group in engine.optimizer.param_groups:
        positions = []
        source = None
        for p in group["params"]:
            key = keys.get(id(p))
            if key not in where:
                raise ValueError(f"checkpoint {load_dir}/{tag}: the stock optimizer state has no entry for {key}; "
                                 f"{weights_only}")
            stage, group_index, position = where[key]
            source = source or (stage, group_index)
            saved_state = files[stage].get("state", {}).get(position)
            if saved_state is not None:
                state[index] = saved_state
            positions.append(index)
            index += 1
        options = {k: v for k, v in files[source[0]]["param_groups"][source[1]].items() if k != "params"} \
            if source else {k: v for k, v in group.items() if k != "params"}
        groups.append({**options, "params": positions})
    return {"state": state, "param_groups": groups}


def stage_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f"{tag}{INCOMPLETE}")


def start_staging(save_dir: str, tag: str) -> str:
    """Rank 0, before any rank writes: an empty ``TAG.incomplete/`` holding the marker that makes it ours."""
    staged = stage_dir(save_dir, tag)
    for path in (staged, os.path.join(save_dir, f"{tag}.old")):
        if os.path.exists(path) and not _ours(path):
            raise ValueError(f"save_checkpoint: {path} exists and was not made by ds_chimera, which uses that name "
                             f"while it writes tag {tag!r}: move it away or save under another tag")
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    write_text_atomic(os.path.join(staged, STAGING_MARKER), f"staged by ds_chimera for tag {tag}\n")
    return staged


def _ours(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STAGING_MARKER))


def publish(engine, save_dir: str, tag: str, save_latest: bool) -> None:
    """Rank 0, once every rank has written: record the layout, rename the staged tag, point ``latest`` at it."""
    final, staged = os.path.join(save_dir, tag), stage_dir(save_dir, tag)
    write_json_atomic(os.path.join(staged, LAYOUT_FILE), layout(engine))
    if os.path.isdir(final):
        old = f"{final}.old"          # start_staging checked that no folder of the user's has this name
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)
    if save_latest:
        write_text_atomic(os.path.join(save_dir, "latest"), tag)
    remove_stale(save_dir)


def remove_stale(save_dir: str) -> None:
    """Remove what interrupted saves left behind (``*.incomplete``, ``*.old``): a complete save supersedes them.
    Only folders this package staged (they hold :data:`STAGING_MARKER`) go; a user's own ``x.old`` stays."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if (name.endswith(INCOMPLETE) or name.endswith(".old")) and os.path.isdir(path) and _ours(path):
            shutil.rmtree(path, ignore_errors=True)
