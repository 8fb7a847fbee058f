"""What a plain ``transformers.Trainer`` reads to resume a pipelined checkpoint exactly.

A plain Trainer (one process, no ds_chimera, no DeepSpeed) resuming from ``checkpoint-N``
loads ``model.safetensors``, ``trainer_state.json`` and ``rng_state.pth``, and the optimizer
and scheduler only when ``optimizer.pt`` and ``scheduler.pt`` both exist: without
``optimizer.pt`` it trains on with a fresh optimizer and a restarted scheduler, and says
nothing (transformers 5.24, ``Trainer._load_optimizer_and_scheduler``). The pipeline's
optimizer state is in each rank's engine checkpoint (``pipeline/``), so a pipelined
checkpoint also gets

- ``optimizer.pt``: the ``state_dict()`` one process's optimizer would have: the groups of the
  Trainer's own optimizer (``create_optimizer`` over the HF model, in its parameter order)
  with their live options (the scheduled learning rate), and each parameter's state gathered
  from the rank that holds it (under ZeRO-1 or bf16, DeepSpeed's full fp32 state of it);
- ``rng_state.pth``: rank 0's RNG state (every rank draws the same data-side numbers; the
  pipeline's compute draws from its own stream).

That needs the Trainer's own optimizer and scheduler: with an ``"optimizer"`` or ``"scheduler"``
section in the DeepSpeed config a plain Trainer would build other ones, so no ``optimizer.pt``
is written and the main process warns once; a plain Trainer in a process where ds_chimera is
imported warns when it resumes from such a checkpoint (:func:`warn_plain_resume`).
"""
from __future__ import annotations

import os
import shutil

import torch

OPTIMIZER_NAME = "optimizer.pt"
PLAIN_RNG_NAME = "rng_state.pth"
PIPELINE_DIR = "pipeline"


def unreadable_reason(trainer) -> str | None:
    """Why a plain Trainer could not take over this run's optimizer state (None: it can)."""
    if trainer.hf_optimizer is None:
        return "the DeepSpeed config's \"optimizer\" section built the optimizer, not the Trainer"
    if trainer.engine_owns_scheduler:
        return "the DeepSpeed config's \"scheduler\" section drives the learning rate, not the Trainer's scheduler"
    return None


def _cpu(value):
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _state_keys(opt) -> list:
    """The per-element state keys of a flat (ZeRO-1 / bf16) optimizer: exp_avg, exp_avg_sq, ..."""
    keys = set()
    for state in opt.state.values():
        keys.update(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return sorted(keys)


def _flat_scalars(opt) -> dict:
    """The scalar state of a flat optimizer (AdamW's ``step``: every group has stepped as often)."""
    for state in opt.state.values():
        return {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
    return {}


def local_optimizer_state(trainer) -> tuple:
    """This rank's share: ({HF name: parameter state}, {Trainer group index: live group options}).

    Collective over data parallelism under ZeRO-1 / bf16 (DeepSpeed assembles each full state there):
    every rank walks all its layers in layer order; only the layers it writes out are kept."""
    from .layout import pipeline_hf_names
    from .optim import torch_optimizer
    engine = trainer.engine
    opt = torch_optimizer(engine.optimizer)
    names = pipeline_hf_names(engine.module.ds_chimera_chunks, trainer.layout)
    hf_names = {id(p): n for n, p in trainer.model.named_parameters()}
    group_of = {hf_names[id(p)]: i for i, g in enumerate(trainer.hf_optimizer.param_groups) for p in g["params"]
                if id(p) in hf_names}
    direct = {id(p) for g in opt.param_groups for p in g["params"]}
    # fp16 at ZeRO-0: the optimizer steps ds_chimera's fp32 masters (runtime/fp16_masters.py), whose state it is
    master_of = getattr(engine.optimizer, "master_of", {})
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed's ZeRO-1/2 link each parameter to its optimizer state after stepping the first
        # group, when the other groups have none yet (their fragments stay empty): link them again
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    keys, scalars = _state_keys(opt), _flat_scalars(opt)
    owned = {id(p) for obj in engine.owned_layers().values() for p in obj.parameters()}
    states, seen = {}, set()
    for _, (_, obj) in sorted(engine._layer_objects().items()):
        for p in (obj.parameters() if hasattr(obj, "parameters") else ()):
            if id(p) in seen:
                continue
            seen.add(id(p))
            stepped = master_of.get(id(p), p)
            if id(stepped) in direct:                              # ZeRO-0: the parameter's (or master's) state
                state = {k: _cpu(v) for k, v in opt.state.get(stepped, {}).items()}
            else:                                                  # ZeRO-1 / bf16: assembled (collective)
                from deepspeed.utils import safe_get_full_optimizer_state
                full = {k: safe_get_full_optimizer_state(p, k) for k in keys}
                full = {k: _cpu(v).reshape(p.shape) for k, v in full.items() if v is not None}
                # each parameter its own scalars: a step tensor shared after loading would count every step
                # once per parameter (fused AdamW adds to it in place)
                state = {**{k: _cpu(v) for k, v in scalars.items()}, **full} if full else {}
            name = names.get(id(p))
            if id(p) in owned and name is not None and state:
                states.setdefault(name, state)
    # the rank's optimizer has the Trainer's groups that hold any of its parameters, in order (.optim),
    # also where DeepSpeed flattened each group (ZeRO-1 / bf16): their live options, by Trainer group
    present = sorted({group_of[names[id(p)]] for p in engine.module.parameters() if names.get(id(p)) in group_of})
    options = {index: {k: _cpu(v) for k, v in group.items() if k != "params"}
               for index, group in zip(present, opt.param_groups)}
    return states, options


def plain_state_dict(trainer, states: dict, options: dict) -> dict:
    """The Trainer optimizer's state_dict() as one process would have saved it."""
    hf_optimizer = trainer.hf_optimizer
    hf_names = {id(p): n for n, p in trainer.model.named_parameters()}
    packed = hf_optimizer.state_dict()
    state, unknown = {}, set(states)
    for index, (saved, group) in enumerate(zip(packed["param_groups"], hf_optimizer.param_groups)):
        for slot, p in zip(saved["params"], group["params"]):
            name = hf_names.get(id(p))
            if name in states:
                state[slot] = states[name]
                unknown.discard(name)
        saved.update({k: v for k, v in options.get(index, {}).items() if k in saved or k == "initial_lr"})
    if unknown:
        raise ValueError(f"optimizer state for {sorted(unknown)[:4]} matches no parameter of the Trainer's optimizer")
    packed["state"] = state
    return packed


def save_plain_optimizer(trainer, output_dir: str) -> None:
    """Write ``optimizer.pt`` for a plain Trainer (collective: every rank calls it), or warn once why not."""
    reason = unreadable_reason(trainer)
    if reason is not None:
        if trainer.args.should_save and not getattr(trainer, "_warned_plain_resume", False):
            trainer._warned_plain_resume = True
            from ..logs import get_logger
            get_logger().warning("%s has no %s a plain transformers.Trainer can read (%s): resumed by a plain "
                                 "Trainer, it would train on with a fresh optimizer and scheduler; resume it "
                                 "pipelined", os.path.basename(output_dir), OPTIMIZER_NAME, reason)
        return
    local = local_optimizer_state(trainer)
    from .export import gathered_objects
    parts = gathered_objects(local, None if trainer.args.save_on_each_node else 0)
    if trainer.args.should_save and parts is not None:
        states, options = {}, {}
        for part_states, part_options in parts:
            for name, state in part_states.items():
                states.setdefault(name, state)
            for index, opts in part_options.items():
                options.setdefault(index, opts)
        try:
            packed = plain_state_dict(trainer, states, options)
        except ValueError as exc:         # a bug, not the run's: the checkpoint stays good for a pipelined resume
            from ..logs import get_logger
            get_logger().warning("%s: no %s for a plain Trainer: %s", os.path.basename(output_dir), OPTIMIZER_NAME,
                                 exc)
            return
        from ..atomic import torch_save_atomic
        torch_save_atomic(packed, os.path.join(output_dir, OPTIMIZER_NAME))


def save_plain_rng(trainer, output_dir: str) -> None:
    """``rng_state.pth``, which a one-process Trainer reads: rank 0's (written as ``rng_state_0.pth``)."""
    ranked = os.path.join(output_dir, "rng_state_0.pth")
    if trainer.args.should_save and trainer.args.world_size > 1 and os.path.isfile(ranked):
        shutil.copyfile(ranked, os.path.join(output_dir, PLAIN_RNG_NAME))


def warn_plain_resume(trainer, checkpoint) -> None:
    """A plain Trainer resuming from a pipelined checkpoint that holds no ``optimizer.pt``: say so."""
    if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, PIPELINE_DIR)):
        return
    if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
        return
    from ..logs import get_logger
    get_logger().warning("%s was written by a pipelined Trainer whose optimizer state only the pipeline can read "
                         "(%s/): this %s resumes its weights and step but starts a fresh optimizer and learning-rate "
                         "schedule; resume it with the \"pipeline\" config to continue exactly", checkpoint,
                         PIPELINE_DIR, type(trainer).__name__)
