"""``"pipeline": {"schedule": NAME}`` in a DeepSpeed config selects a ds_chimera schedule.

``ds_chimera.initialize`` has ``deepspeed.initialize``'s signature. ``import ds_chimera``
installs it as ``deepspeed.initialize`` (now if DeepSpeed is imported, else the moment it
is), so unchanged scripts pick the schedule from their JSON. Without the key, or for a
model that is not a ``PipelineModule``, DeepSpeed's own function runs untouched.
"""
from __future__ import annotations

import contextlib
import os

from ..config_reader import read_config
from ..runtime.handoff import deepspeed_builds

_ORIGINAL = {}


def _load_config(args, config, config_params):
    if config is None and config_params is not None:
        config = config_params
    if config is None:
        for attr in ("deepspeed_config", "deepscale_config"):
            path = getattr(args, attr, None)
            if path:
                config = path
                break
    if isinstance(config, (str, os.PathLike)):
        try:   # as DeepSpeed reads it: JSON, HJSON or base64, a key given twice refused
            config = read_config(config)
        except Exception:
            return None   # not ours to judge: DeepSpeed's initialize reports it
    return config


def _wants_schedule(model, config) -> bool:
    """A PipelineModule whose config's "pipeline" section has any key DeepSpeed does not own.

    Such a section is validated as ours (a misspelt key is refused, not ignored); one with
    DeepSpeed's keys only goes to the stock engine.
    """
    from deepspeed.runtime.pipe.module import PipelineModule

    from ..config import asks_for_schedule
    if not isinstance(config, dict) or "pipeline" not in config:
        return False
    wanted = asks_for_schedule(config.get("pipeline"))
    if wanted and not isinstance(model, PipelineModule):
        raise ValueError(f'the DeepSpeed config has a "pipeline" section for ds_chimera '
                         f'({sorted(config["pipeline"])}), but the model is a {type(model).__name__}, not a '
                         f"deepspeed.pipe.PipelineModule: build the model as a PipelineModule (or drop the section)")
    return wanted


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None, **kwargs):
    """``deepspeed.initialize`` that honours ``"pipeline": {"schedule": ...}``."""
    import deepspeed
    original = _ORIGINAL.get("initialize", deepspeed.initialize)
    call = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                mesh_param=mesh_param, config_params=config_params, **kwargs)
    if distributed_port is not None:
        call["distributed_port"] = distributed_port
    loaded = _load_config(args, config, config_params)
    if _wants_wavelet(loaded):
        return _initialize_wavelet(original, call, args, model, loaded)
    if not _wants_schedule(model, loaded):
        return original(**call)
    from ..config import PipelineConfig
    return _initialize_pipeline(original, call, PipelineConfig.from_deepspeed(loaded), loaded)


def initialize_pipeline(pipeline, model, config: dict, optimizer=None, profile_batch=None, **kwargs):
    """``deepspeed.initialize(model=model, config=config, ...)`` with ``pipeline`` already parsed from
    ``config`` (the HF Trainer's path, whose TrainingArguments were reconciled into it).

    ``profile_batch``: for ``"schedule": "auto"``, the (inputs, labels) micro-batch the planner times the
    layers on (rank 0's is used), in place of ``training_data``'s first."""
    import deepspeed
    original = _ORIGINAL.get("initialize", deepspeed.initialize)
    call = dict(model=model, config=config, optimizer=optimizer, **kwargs)
    return _initialize_pipeline(original, call, pipeline, config, profile_batch)


def _initialize_pipeline(original, call: dict, pipeline, loaded: dict, profile_batch=None, rebuild=None):
    """Build the schedule's chunks on the PipelineModule, then DeepSpeed's engine of our class.

    ``rebuild``: (stock parameter keys, stock optimizer order, the optimizer to rebuild in place) when the
    plan "auto" made at the first train_batch is built on a module whose stock stage is gone already."""
    import torch

    from ..runtime.engine import ScheduledPipelineEngine
    from ..runtime.param_groups import stock_parameter_keys
    from ..runtime.setup import prepare_module
    model, optimizer, lr_scheduler, args = call["model"], call.get("optimizer"), call.get("lr_scheduler"), \
        call.get("args")
    model_parameters = call.get("model_parameters")
    if model_parameters is not None:
        model_parameters = list(model_parameters)     # a generator: read once, here
    if rebuild is None:
        stock_keys = stock_parameter_keys(model)
        stock_order = _stock_optimizer_order(model, optimizer, model_parameters, stock_keys)
        in_place = None
    else:
        stock_keys, stock_order, in_place = rebuild
    deferred = None
    if pipeline.planned:      # "schedule": "auto": profile the layers on the first micro-batch, plan, then go on
        from ..planner.deepspeed import resolve
        from ..runtime import faults
        from ..runtime.host_cost import measure_dispatch
        # a rank's failure while profiling (a tensor rank's, in a collective with rank 0) ends every rank
        epoch = faults.start_new_job(pipeline.timeout_s)

        def guard():
            return faults.guard('"schedule": "auto" (profiling and planning in deepspeed.initialize)',
                                pipeline.timeout_s, epoch)
        planned = resolve(model, pipeline, loaded, call.get("training_data"), call.get("collate_fn"), optimizer,
                          micro_batch=profile_batch, defer=True, host_cost=measure_dispatch, guard=guard)
        if planned is None:   # no data until the first train_batch: plan there (planner/deferred.py)
            from ..planner.deferred import DeferredPlan
            deferred = DeferredPlan(None, pipeline, loaded, optimizer, host_cost=measure_dispatch, guard=faults.guard)
            planned = DeferredPlan.provisional(model, pipeline)
        pipeline = planned
    # the provisional engine leaves the random streams as it found them (planner/deferred.py)
    if deferred is not None:
        from deepspeed.accelerator import get_accelerator

        from ..planner.profile import rng_devices
        rng = torch.random.fork_rng(devices=rng_devices(get_accelerator().device_name(model.local_rank)))
    else:
        rng = contextlib.nullcontext()
    with rng:
        prepared = prepare_module(model, pipeline, stock_keys, stock_order)
        engine_parameters = prepared.regroup(model_parameters, what="model_parameters")
        rebound, kept = _rebind_optimizer(optimizer, prepared, into=in_place)
        if rebound is not optimizer and lr_scheduler is not None and not callable(lr_scheduler):
            # DeepSpeed calls a callable with the optimizer it builds; an instance is moved onto the rebuilt one
            from ..runtime.schedulers import repoint_scheduler
            repoint_scheduler(lr_scheduler, optimizer, rebound, kept)
        call = dict(call, config=_stock_engine_config(loaded, pipeline), config_params=None,
                    model_parameters=engine_parameters, optimizer=rebound)
        if args is not None and (getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)):
            # DeepSpeed refuses a config both in args and as a dict; the dict (already read) wins.
            call["args"] = _without_config_path(args)
        engine_cls = ScheduledPipelineEngine
        if not prepared.plan.schedule.synchronous:
            from ..runtime.async_engine import AsyncPipelineEngine
            engine_cls = AsyncPipelineEngine
        with deepspeed_builds(engine_cls, prepared):
            result = original(**call)
    if deferred is not None:
        first_call = dict(call, model_parameters=model_parameters, optimizer=optimizer, config=loaded)
        deferred.build = lambda plan: _initialize_pipeline(
            original, first_call, plan, loaded, rebuild=(stock_keys, stock_order, rebound))
        result[0]._deferred_plan = deferred
    return result


def _stock_optimizer_order(model, optimizer, model_parameters, stock_keys: dict) -> list:
    """Every rank's stock optimizer layout (:func:`~ds_chimera.runtime.param_groups.optimizer_order`), gathered:
    the groups an optimizer instance holds, else ``model_parameters``, else the stock stage's parameters, as
    DeepSpeed would build its optimizer from them."""
    import torch
    import torch.distributed as dist

    from ..runtime.param_groups import optimizer_order
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
    else:
        groups = model_parameters if model_parameters else list(model.parameters())
    mine = optimizer_order(groups, stock_keys) if groups else []
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _stock_engine_config(config: dict, pipeline) -> dict:
    """The dict DeepSpeed's engine is built from: the user's, with what ds_chimera does itself switched off."""
    from ..config import without_auto_batch_keys
    config = dict(without_auto_batch_keys(config))
    if pipeline.sharded:
        # ds_chimera shards the chunks itself (runtime/sharding.py); DeepSpeed sees stage 0
        config["zero_optimization"] = {**config["zero_optimization"], "stage": 0}
    if pipeline.bf16:
        # Backward order is the schedule's, not 1F1B's: each parameter's gradient must reach the
        # fp32 accumulator as it is produced, which is DeepSpeed's immediate_grad_update mode.
        key = "bf16" if config.get("bf16") else "bfloat16"
        config[key] = {**config[key], "immediate_grad_update": True}
    if pipeline.fp16_masters:
        # ZeRO-0: fp16 weights, fp32 masters and the loss scale are ds_chimera's (runtime/fp16_masters.py):
        # DeepSpeed's fp16 optimizers run inside its own backward and step, and its CPU accelerator refuses fp16.
        # Under ZeRO-1 the "fp16" section stays: DeepSpeed's ZeRO-1 optimizer keeps the masters and the scale.
        config.pop("fp16", None)
    config["gradient_clipping"] = pipeline.clip
    return config


def _wants_wavelet(config) -> bool:
    if not isinstance(config, dict):
        return False
    section = config.get("wavelet")
    enabled = bool(section.get("enabled")) if isinstance(section, dict) else False
    return enabled or os.environ.get("DS_CHIMERA_WAVELET") == "1"


def _initialize_wavelet(original, call, args, model, config):
    """``"wavelet": {"enabled": true}`` (or ``ds-chimera launch --wavelet``): tick-tock data parallel."""
    from deepspeed.runtime.pipe.module import PipelineModule

    from ..wavelet.engine import WaveletEngine, wavelet_options
    if isinstance(model, PipelineModule):
        raise ValueError("wavelet runs data-parallel training of a non-pipelined model; this model is a "
                         "PipelineModule (choose a pipeline schedule instead, or drop \"wavelet\")")
    import torch.distributed as dist

    from ..wavelet.layout import WaveLayout, WaveMPU
    config = dict(config)
    config["wavelet"] = {**(config.get("wavelet") or {}), "enabled": True}
    wavelet_options(config)              # bad options fail here, before any engine work
    if call.get("mpu") is not None:
        raise ValueError("wavelet makes its own data-parallel groups (one per wave); do not pass mpu=")
    if not dist.is_initialized():
        import deepspeed
        deepspeed.init_distributed()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", dist.get_world_size())))
    mpu = WaveMPU(WaveLayout(dist.get_rank(), dist.get_world_size(), local_world), dist)
    _wave_batch_size(config, dist.get_world_size(), mpu.get_data_parallel_world_size())
    call.update(config=config, config_params=None, mpu=mpu)
    if args is not None and (getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)):
        call["args"] = args = _without_config_path(args)
    if args is not None and getattr(args, "local_rank", None) is not None and "LOCAL_RANK" in os.environ:
        # ds-chimera launch --wavelet maps LOCAL_RANK onto the devices; the launcher's --local_rank
        # argument still counts processes, and DeepSpeed insists the two agree
        import copy
        call["args"] = args = copy.copy(args)
        args.local_rank = int(os.environ["LOCAL_RANK"])
    with deepspeed_builds(WaveletEngine, name="DeepSpeedEngine"):
        return original(**call)


def _wave_batch_size(config: dict, world: int, wave_size: int) -> None:
    """DeepSpeed checks train_batch_size against its data-parallel size, which is now one wave:
    the config's batch (both waves' samples per step) is restated per wave."""
    micro = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps") or 1
    total = config.get("train_batch_size")
    if micro is None and total is not None:
        micro = total // (gas * world)
    if micro is not None:
        config["train_micro_batch_size_per_gpu"] = micro
        config["train_batch_size"] = micro * gas * wave_size


def _rebind_optimizer(optimizer, prepared, into=None):
    """An optimizer built on the stock stage's parameters is rebuilt on the schedule's chunks, with
    its parameter groups and their options (see runtime/param_groups.py): ``(optimizer, kept)``, ``kept``
    the index of the given group each rebuilt group came from. ``into``: an optimizer of the same class
    rebuilt in place (it keeps its identity: the object ``initialize`` returned stays the live one)."""
    import torch
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, []    # None (config optimizer) or a callable taking the parameters
    if optimizer.state:
        raise ValueError("ds_chimera rebuilds the pipeline stages, so an optimizer instance that has already "
                         "stepped (it has state) cannot follow its parameters; pass it before any step, as a "
                         "callable (lambda params: torch.optim.AdamW(params, ...)), or in the config")
    from ..runtime.param_groups import rebuild_optimizer
    groups, kept = prepared.regroup(optimizer.param_groups, with_origin=True,
                                    what=f"the optimizer's ({type(optimizer).__name__}) param_groups")
    return rebuild_optimizer(optimizer, groups, into=into), kept


def _without_config_path(args):
    import copy
    args = copy.copy(args)
    for attr in ("deepspeed_config", "deepscale_config"):
        if hasattr(args, attr):
            setattr(args, attr, None)
    return args


def install() -> None:
    """Replace ``deepspeed.initialize`` with :func:`initialize` (idempotent)."""
    import deepspeed
    if getattr(deepspeed.initialize, "_ds_chimera", False):
        return
    _ORIGINAL["initialize"] = deepspeed.initialize
    initialize._ds_chimera = True
    deepspeed.initialize = initialize


def install_when_imported() -> None:
    """:func:`install` as soon as DeepSpeed is imported (now, if it already is)."""
    from .._import_hooks import call_after_import
    call_after_import("deepspeed", lambda module: install())
