"""Megatron's distributed checkpoints of a chunk list, for every schedule.

``dist_checkpointing`` stores each tensor under a global key (the layer number is an axis
of the decoder's tensors), so a checkpoint does not depend on how the model was cut: it
loads into any layout, Megatron's plain pipeline among them. Two things stand in the way
of a ds_chimera chunk list, and are handled here:

- Megatron computes a chunk's layer offset from its pipeline and virtual-pipeline rank at
  the time of the call: each chunk's ``sharded_state_dict`` runs under the rank view it
  was built with (:func:`~.stages.megatron_stage`), so its keys are its stage's;
- a replicated stage (Chimera) is held by two ranks, and two main replicas of one shard
  are an invalid access pattern: the copies on every rank but the stage's lowest are
  marked as non-main replicas.

The outer keys are ``model0``, ``model1``... (one per local chunk), as Megatron's training
loop names its virtual-pipeline chunks.
"""
from __future__ import annotations

import torch.distributed as dist

from .model_chunk import megatron_layout, tagged_stage, unwrap
from .stages import chosen_config, megatron_stage, pipeline_group


def _stage_of(chunk, num_stages: int) -> int:
    stage = tagged_stage(chunk)
    if stage is None:
        found = megatron_layout(unwrap(chunk), num_stages)
        if found is None:
            raise ValueError("cannot tell which stage a model chunk holds: build the chunks with "
                             "ds_chimera.megatron.build_model_chunks, or pass Megatron chunks whose layers carry "
                             "their global layer numbers")
        stage = found[0]
    return stage


def _mark_replica(value, copy_index: int) -> None:
    """A shard's copy on a rank other than its stage's lowest: not the main replica."""
    replica = value.replica_id
    if isinstance(replica, tuple):
        value.replica_id = (replica[0] + copy_index,) + tuple(replica[1:])
    else:
        value.replica_id = replica + copy_index


def sharded_state_dict(model, schedule: str | None = None, **options) -> dict:
    """``{"model0": ..., "model1": ...}``: this rank's chunks' sharded state dicts with global keys,
    each replicated stage's main copy on its lowest rank. ``schedule`` and ``options`` are the
    ones the chunks were built for (by default the installed routing's, as build_model_chunks)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase
    config = chosen_config(schedule, options, "sharded_state_dict")
    group = pipeline_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    placement = config.build_schedule(size, 4 * size).placement
    total = placement.num_stages
    out = {}
    for i, chunk in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        stage = _stage_of(chunk, total)
        holders = sorted(placement.stage_group(stage))
        if rank not in holders:
            raise ValueError(f"model chunk {i} holds stage {stage}, which schedule {config.schedule!r} does not put on "
                             f"pipeline rank {rank}; pass the schedule and options the chunks were built for")
        with megatron_stage(stage, size, total, group):
            state = unwrap(chunk).sharded_state_dict()
        copy_index = holders.index(rank)
        if copy_index:
            for value in nested_values(state):
                if isinstance(value, ShardedBase):
                    _mark_replica(value, copy_index)
        out[f"model{i}"] = state
    return out


def save_checkpoint(model, checkpoint_dir: str, schedule: str | None = None, **options) -> None:
    """Save a chunk list ``model`` (collective: every rank of the job). The folder must exist and be empty."""
    from megatron.core import dist_checkpointing
    dist_checkpointing.save(sharded_state_dict(model, schedule, **options), checkpoint_dir)


def load_checkpoint(model, checkpoint_dir: str, schedule: str | None = None, strict: bool = True,
                    **options) -> None:
    """Load a checkpoint saved from any layout into this rank's chunk list ``model`` (collective)."""
    from megatron.core import dist_checkpointing
    model = model if isinstance(model, (list, tuple)) else [model]
    state = dist_checkpointing.load(sharded_state_dict(model, schedule, **options), checkpoint_dir)
    for i, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(state[f"model{i}"], strict=strict)
