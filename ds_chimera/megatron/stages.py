"""Build the model chunks a schedule's placement puts on this rank from a ``model_provider``.

Megatron builds one chunk per virtual stage, ``vp_stage`` v of pipeline rank r holding
stage v*D + r. That is the looped placement (interleaved, breadth-first). Chimera puts the
stages of two replicas on each rank (r and D-1-r), and the V-shapes (zbv, dualpipev) put
stages r and 2D-1-r there. :func:`build_model_chunks` calls the provider once per local
chunk, making Megatron believe it is pipeline rank ``stage % D``, virtual stage
``stage // D``. Megatron's layer offsets then give each chunk its stage's layers.
Replicated stages are broadcast from their lowest rank, so the replicas start identical
whatever RNG the provider uses.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

from ..config import PipelineConfig
from .choice import installed_choice, virtual_pipeline_size

DEFAULT_SEED = 1234


class _PipelineRankView:
    """A pipeline process group that reports another rank, for the duration of a model build."""

    def __init__(self, group, rank: int, size: int):
        self._group, self._rank, self._size = group, rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __getattr__(self, name):
        return getattr(self._group, name)


def pipeline_group():
    """Megatron's pipeline-parallel group, or the whole world when Megatron is not initialised."""
    from megatron.core import parallel_state
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_pipeline_model_parallel_group()
    return dist.group.WORLD


def call_pipeline_group(pg_collection):
    """The pipeline group of one forward-backward call: ``pg_collection.pp`` where given, else Megatron's."""
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp
    return pipeline_group()


def chunks_device(chunks):
    """The device of the chunks' parameters (CPU for chunks without any)."""
    return next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))


def virtual_stages(schedule: str, pipeline_size: int, **options):
    """Megatron's ``virtual_pipeline_model_parallel_size`` for a schedule's placement (None for one).

    The model config needs it so that Megatron's layer offsets cut the model into the
    schedule's stages: 2 for zbv and dualpipev, V for interleaved and breadth-first. ``"auto"`` plans among the
    schedules of the layout the model is built with, and this gives that layout's default: None, Megatron's one
    stage per rank (set a virtual-pipeline size yourself for the planner to schedule V chunks per rank).
    """
    config = PipelineConfig.from_megatron(schedule, options, where="virtual_stages")
    if config.planned:
        return None
    placement = config.build_schedule(pipeline_size, 4 * pipeline_size).placement
    per_rank = placement.num_stages // pipeline_size
    return per_rank if per_rank > 1 else None


@contextlib.contextmanager
def megatron_stage(stage: int, pipeline_size: int, stages_total: int, group):
    """Megatron's notion of (pipeline rank, virtual stage) set to that of ``stage`` while a chunk is built."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    vpp = stages_total // pipeline_size
    saved = (parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK,
             parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK,
             parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE)
    original = ProcessGroupCollection.__dict__["use_mpu_process_groups"]
    view = _PipelineRankView(group, stage % pipeline_size, pipeline_size)

    def use_mpu_process_groups(cls, required_pgs=None):
        collection = original.__func__(cls, required_pgs)
        if getattr(collection, "pp", None) is not None:
            collection.pp = view
        return collection

    parallel_state.set_pipeline_model_parallel_rank(stage % pipeline_size)
    parallel_state.set_virtual_pipeline_model_parallel_rank(stage // pipeline_size if vpp > 1 else None)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    ProcessGroupCollection.use_mpu_process_groups = classmethod(use_mpu_process_groups)
    try:
        yield stage // pipeline_size if vpp > 1 else None
    finally:
        ProcessGroupCollection.use_mpu_process_groups = original
        (parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK,
         parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK,
         parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE) = saved


def _call_provider(model_provider, pre_process: bool, post_process: bool, vp_stage):
    params = inspect.signature(model_provider).parameters
    kwargs = {"pre_process": pre_process, "post_process": post_process}
    if "vp_stage" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["vp_stage"] = vp_stage
    elif vp_stage is not None:
        raise ValueError("the schedule puts several virtual stages on each rank, so model_provider must accept "
                         "vp_stage (Megatron's model_provider(pre_process, post_process, vp_stage=None))")
    return model_provider(**kwargs)


def chosen_config(schedule: str | None, options: dict, where: str) -> PipelineConfig:
    """The schedule and options to build for: the ones given, else the installed routing's
    (``install()``, ``--pipeline-schedule[-options]``), else 1f1b; a looped schedule's ``chunks``
    defaults to Megatron's virtual-pipeline size, as the installed routing does."""
    installed = installed_choice()
    if schedule is None:
        schedule = installed.schedule if installed is not None else "1f1b"
    if installed is not None and schedule == installed.schedule:
        options = {**installed.options, **options}
    config = PipelineConfig.from_megatron(schedule, options, where=where)
    virtual = virtual_pipeline_size()
    if virtual and virtual > 1:
        config = config.with_default_option("chunks", virtual)
    return config


def build_model_chunks(model_provider, schedule: str | None = None, *, micro_batches: int | None = None,
                       seed: int = DEFAULT_SEED, **options) -> list:
    """This rank's model chunks for ``schedule``, in the order the forward-backward function expects.

    ``schedule`` and ``options`` default to the installed routing's (see :func:`chosen_config`),
    so a Megatron launch with ``--pipeline-schedule NAME`` builds what it will run.
    ``micro_batches`` only matters to schedules whose placement depends on it (none built in).
    ``"auto"`` builds Megatron's own layout (V from its virtual-pipeline size), which the planner
    then schedules.
    Each chunk is built under ``torch.manual_seed(seed + stage)`` and tagged with its stage and
    what it was built for.
    """
    config = chosen_config(schedule, options, "build_model_chunks")
    built_for = (config.schedule, dict(config.options))
    if config.planned:
        # "auto" plans among the schedules that run Megatron's own layout (ds_chimera.megatron.auto)
        virtual = virtual_pipeline_size()
        config = PipelineConfig.from_megatron("interleaved", {"chunks": virtual}) if virtual and virtual > 1 \
            else PipelineConfig.from_megatron("1f1b", {})
    group = pipeline_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    placement = config.build_schedule(size, micro_batches or 4 * size).placement
    total = placement.num_stages
    if total % size:
        raise ValueError(f"schedule {config.schedule!r} has {total} stages, not a multiple of the pipeline size "
                         f"{size}")
    chunks = []
    for c in placement.chunks_on(rank):
        stage = placement.chunks[c].stage
        with megatron_stage(stage, size, total, group) as vp_stage, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + stage)
            chunk = _call_provider(model_provider, stage == 0, stage == total - 1, vp_stage)
        chunk._ds_chimera_stage = stage
        chunk._ds_chimera_built_for = built_for
        chunks.append(chunk)
    _broadcast_replicas(chunks, placement, rank, group)
    return chunks


def _broadcast_replicas(chunks: list, placement, rank: int, group) -> None:
    """Replicas of a stage start identical: the lowest rank holding it broadcasts its weights."""
    replicated = placement.replicated_stages()
    if not replicated:
        return
    ranks = dist.get_process_group_ranks(group) if group is not dist.group.WORLD else \
        list(range(dist.get_world_size()))
    mine = {chunk._ds_chimera_stage: chunk for chunk in chunks}
    for stage in replicated:           # each pair talks point to point; every rank walks the same list
        holders = sorted(placement.stage_group(stage))
        if rank not in holders:
            continue
        src = placement.stage_owner(stage)
        for p in mine[stage].state_dict(keep_vars=True).values():
            if not isinstance(p, torch.Tensor):
                continue
            data = p.data
            if rank == src:
                for dst in holders[1:]:
                    dist.send(data.contiguous(), ranks[dst])
            else:
                buf = torch.empty_like(data)
                dist.recv(buf, ranks[src])
                data.copy_(buf)
