"""Turn a user's PipelineModule into the chunks a schedule needs, before DeepSpeed sees it."""
from __future__ import annotations


import dataclasses
import functools

from torch import nn

from ..logs import get_logger
from ..config import PipelineConfig, check_tensor_parallel
from .handoff import PreparedPipeline
from .param_groups import distinct_options, remap_groups, stock_parameter_keys
from .plan import make_plan

log = get_logger()


def prepare_module(module, config: PipelineConfig, stock_keys: dict | None = None,
                   stock_optimizer_order: list | None = None) -> PreparedPipeline:
    """Validate the schedule, build this rank's chunks and replace the stock stage's layers with them.

    Returns what the engine is built from (:class:`~.handoff.PreparedPipeline`); its ``regroup`` turns
    the script's ``model_parameters`` (or its optimizer's groups) into the chunks'. Raises ValueError for
    a bad schedule, option or layer count, on every rank and before any step. ``stock_keys``: the stock
    stage's parameter keys (``stock_parameter_keys``), where its layers were replaced already (a module
    built again for the plan "auto" makes at the first train_batch); read them (and the script's
    ``model_parameters``, often a generator over the stock stage) before calling this.
    ``stock_optimizer_order``: every rank's stock optimizer layout, kept on the plan for loading a stock
    checkpoint's optimizer state."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from .chunks import build_chunks, partition
    grid = module._grid
    num_stages = grid.pipe_parallel_size
    dp = grid.data_parallel_size
    if config.stages is not None and config.stages != num_stages:
        raise ValueError(f'"pipeline": "stages": {config.stages} differs from the PipelineModule\'s num_stages='
                         f"{num_stages}; with deepspeed.initialize the module's num_stages decides the pipeline size "
                         f'(\"stages\" sets it only for the HF Trainer, which builds the module): drop "stages" or '
                         f"build the PipelineModule with num_stages={config.stages}")
    if stock_keys is None:
        stock_keys = stock_parameter_keys(module)    # the stock stage's parameters, about to go

    def parts_fn(num_parts, method):
        if method is None and num_parts == num_stages:
            return list(module.parts)          # the user's own cut, whatever method made it
        return partition(module, num_parts, method or _infer_method(module, num_stages))

    if config.checkpoint_interval(module.activation_checkpoint_interval):
        # a schedule that chooses its order from costs (Chimera's auto) prices the recomputation
        config = config.with_default_option("recompute", True)
    plan = make_plan(config, num_stages, dp, len(module._layer_specs), parts_fn)
    plan = dataclasses.replace(plan, stock_optimizer_order=stock_optimizer_order)
    zero = config.zero_stage
    check_tensor_parallel(plan.schedule, grid.get_slice_parallel_world_size(), zero)
    check_fp16_zero1_device(config)
    if zero >= 2:
        _refuse_ties_under_sharding(module, zero)
    if not plan.schedule.synchronous:
        _check_async_setup(module, plan, config, zero)
    device = get_accelerator().device_name(module.local_rank)
    checkpoint_func = _checkpoint_function(module, plan)
    interval = config.checkpoint_interval(module.activation_checkpoint_interval)
    module.activation_checkpoint_interval = interval
    chunks, tied = build_chunks(module, plan.placement, grid.get_stage_id(), plan.parts, device,
                                interval, checkpoint_func)
    # Drop the stage DeepSpeed built; keep the module object (its grid, loss_fn, specs).
    for name in list(module._modules):
        if name.isdigit() or name == "tied_modules":     # the stock stage's layers, not loss_fn etc.
            del module._modules[name]
    module.forward_funcs = []
    module.fwd_map = {}
    module.tied_modules = nn.ModuleDict()
    module.tied_weight_attrs = {}
    module.tied_comms = {}
    # the chunks become the module's layers: DeepSpeed's engine takes its parameters from the module
    module.ds_chimera_chunks = chunks
    module.ds_chimera_tied = tied
    for p in module.parameters():
        p.ds_pipe_replicated = False
    if dist.get_rank() == 0:
        cut = ", ".join(f"stage {s}: layers [{plan.parts[s]}, {plan.parts[s + 1]})"
                        for s in range(plan.placement.num_stages))
        log.info("schedule %r; %s", plan.schedule, cut)
    shards = None
    if zero >= 2:
        # the optimizer steps this rank's shards: one flat 1/DP slice per chunk (see .sharding)
        from .sharding import ChunkShards
        shards = ChunkShards({chunk.index: chunk for chunk in chunks}, grid.get_data_parallel_group(),
                             grid.get_data_parallel_id(), dp, zero, plan.timeout_s)
    regroup = functools.partial(_regroup, module, shards, stock_keys=stock_keys, zero=zero)
    return PreparedPipeline(plan=plan, chunks=list(chunks), tied=tied, shards=shards, regroup=regroup)


def _regroup(module, shards, model_parameters, *, stock_keys: dict, zero: int, what: str, with_origin: bool = False):
    """``model_parameters`` (or an optimizer's groups) over the chunks: see :mod:`.param_groups`.

    ``with_origin``: return ``(groups, kept)``, ``kept[i]`` the index of the given group that ``groups[i]``
    came from (an LR scheduler's per-group state follows it: see :mod:`.schedulers`)."""
    result, kept = _regrouped(module, shards, model_parameters, stock_keys, zero, what)
    return (result, kept) if with_origin else result


def _regrouped(module, shards, model_parameters, stock_keys: dict, zero: int, what: str) -> tuple:
    if not model_parameters:
        # DeepSpeed then takes model.parameters(): the chunks' (or, under ZeRO-2/3, their shards)
        return (shards.shard_params if zero >= 2 else None), []
    groups, plain, kept = remap_groups(model_parameters, stock_keys, module, _all_gather_object)
    if zero >= 2:
        if distinct_options(groups) > 1:
            raise ValueError(f"{what} has parameter groups with different options, and ZeRO stage {zero} with "
                             f"pipeline schedules steps one flat shard per chunk, which takes one set of options; "
                             f"set zero_optimization.stage to 0 or 1, or give every group the same options")
        options = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}
        return (shards.shard_params if plain else [{**options, "params": shards.shard_params}]), kept[:1]
    if plain:
        return [p for group in groups for p in group["params"]], kept
    return groups, kept


def _all_gather_object(obj) -> list:
    import torch.distributed as tdist
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def _refuse_ties_under_sharding(module, zero: int) -> None:
    from deepspeed.runtime.pipe.module import TiedLayerSpec
    tied = sorted({spec.key for spec in module._layer_specs if isinstance(spec, TiedLayerSpec)})
    if tied:
        raise ValueError(f"ZeRO stage {zero} with weights tied across layers ({', '.join(tied)}) is not supported: "
                         f"a tied weight would belong to two chunks' shards; untie them or use ZeRO stage 0/1")


def check_fp16_zero1_device(config: PipelineConfig) -> None:
    """fp16 with ZeRO-1 runs DeepSpeed's ZeRO-1 fp16 optimizer, which DeepSpeed's engine builds only where its
    accelerator reports fp16 (its CPU accelerator does not): refused with what runs instead, at set-up (and by the
    HF Trainer's config check, before its data is prepared)."""
    if not (config.fp16 and config.zero_stage == 1):
        return
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        raise ValueError(f"fp16 with ZeRO stage 1 runs DeepSpeed's ZeRO-1 fp16 optimizer, which DeepSpeed refuses on "
                         f"the {accelerator.device_name()!r} accelerator (is_fp16_supported() is False); use fp16 "
                         f"with ZeRO stage 0 (ds_chimera's fp32 masters run on any device), or bf16 with ZeRO "
                         f"stage 1")


def _check_async_setup(module, plan, config: PipelineConfig, zero: int) -> None:
    """What asynchronous schedules cannot do yet, refused before any step."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec
    name = plan.schedule.name
    if config.fp16:
        from ..schedules.registry import synchronous_names
        raise ValueError(f"schedule {name!r} with fp16: each stage steps alone, and a loss-scale overflow must skip "
                         f"the same step on every rank; use bf16 or fp32 with {name!r}, or fp16 with a synchronous "
                         f"schedule: {synchronous_names()}")
    if any(isinstance(spec, TiedLayerSpec) for spec in module._layer_specs):
        raise ValueError(f"schedule {name!r} updates each stage on its own clock, so weights tied across layers "
                         f"(TiedLayerSpec) would diverge between their stages; untie them or use a synchronous schedule")
    interval = config.checkpoint_interval(module.activation_checkpoint_interval)
    if interval:
        raise ValueError(f"schedule {name!r} with activation_checkpoint_interval={interval}: recomputation in the "
                         f"backward would see the live weights, not the version the forward used; set it to 0")
    if zero:
        raise ValueError(f"schedule {name!r} with ZeRO stage {zero}: weight prediction and stashing need each "
                         f"stage's full optimizer state; use ZeRO stage 0")
    if config.bf16 and plan.schedule.weight_policy == "predict" and module._grid.data_parallel_size > 1:
        raise ValueError(f"schedule {name!r} with bf16 and data parallelism: DeepSpeed's BF16_Optimizer shards the "
                         f"fp32 master weights over data-parallel ranks, and weight prediction needs whole ones; "
                         f"use data-parallel size 1, fp32, or a stashing schedule (pipedream, pipedream-2bw)")


def _checkpoint_function(module, plan):
    """Activation checkpointing that works for every schedule.

    DeepSpeed's default (reentrant) checkpoint drops gradients when a chunk's input does
    not require grad (every first stage) and cannot serve a split backward, which asks
    autograd for some gradients only. torch's non-reentrant checkpoint handles both, so it
    replaces DeepSpeed's two built-in functions; a user's own function is kept unless the
    schedule splits the backward.
    """
    import torch.utils.checkpoint
    from deepspeed.runtime.activation_checkpointing import checkpointing
    user = module.activation_checkpoint_func
    if plan.schedule.splits_backward or user in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint):
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    return user


def _infer_method(module, num_stages: int) -> str:
    """PipelineModule does not keep its partition method: find the one that reproduces its cut."""
    from .chunks import partition
    for method in ("parameters", "uniform"):
        if list(partition(module, num_stages, method)) == list(module.parts):
            return method
    return "parameters"
