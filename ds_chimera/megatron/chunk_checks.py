"""What a call's model chunks must be, checked before the first forward.

Each chunk holds the stage the schedule puts on its rank (chunks built by
``build_model_chunks`` carry their stage; chunks Megatron built itself are read from their
layers), no weight is tied across stages, and a schedule that splits the backward gets a
configuration whose backward can be split.
"""
from __future__ import annotations

from ..schedules.actions import split_chunks
from .model_chunk import megatron_layout, tagged_stage, unwrap


def build_hint(name: str, options: dict) -> str:
    """The call that builds the chunks schedule ``name`` with ``options`` expects."""
    rendered = "".join(f", {k}={v!r}" for k, v in options.items())
    return f"ds_chimera.megatron.build_model_chunks(model_provider, {name!r}{rendered})"


def check_chunks(chunks, local, placement, name: str, options: dict, rank: int) -> None:
    """Each chunk must hold the stage the schedule puts there, before the first forward.

    Chunks built by ``build_model_chunks`` carry their stage; chunks Megatron built itself
    (its virtual-pipeline layout: stage v*D + r on rank r) are read from their layers'
    global numbers, embedding and output layer.
    """
    stages = [placement.chunks[c].stage for c in local]
    if len(chunks) != len(local):
        hint = f"build them with {build_hint(name, options)}"
        if len(local) == 1 and len(chunks) > 1 and all(tagged_stage(c) is None for c in chunks):
            hint = (f"{len(chunks)} chunks per rank is Megatron's virtual-pipeline layout: run it with "
                    f"install(\"interleaved\") (Megatron's interleaved 1F1B; chunks={len(chunks)}), or {hint}")
        raise ValueError(f"schedule {name!r} puts {len(local)} chunk(s) on pipeline rank {rank} "
                         f"(stages {stages}), but model has {len(chunks)}; {hint}")
    megatrons_own = [v * placement.num_ranks + rank for v in range(len(local))]
    if placement.num_stages > 1 and any(getattr(unwrap(c), "share_embeddings_and_output_weights", False)
                                        for c in chunks):
        raise ValueError("model chunks share the embedding and output weights (share_embeddings_and_output_weights"
                         "=True): ds_chimera's Megatron adapter does not sync a weight tied across stages yet; "
                         "build the model with untied embeddings")
    for i, (chunk, stage) in enumerate(zip(chunks, stages)):
        tagged = tagged_stage(chunk)
        if tagged is not None:
            if tagged != stage:
                built_name, built_options = getattr(chunk, "_ds_chimera_built_for", (None, {}))
                built = f" (built for {built_name!r} with {built_options or 'no options'})" if built_name else ""
                raise ValueError(f"model chunk {i} holds stage {tagged}{built}, but schedule {name!r} "
                                 f"with {options or 'no options'} puts stage {stage} there (pipeline rank "
                                 f"{rank} holds stages {stages}); build the chunks with the function's "
                                 f"schedule and options: {build_hint(name, options)}")
            continue
        found = megatron_layout(unwrap(chunk), placement.num_stages)
        if found is None and (stages != megatrons_own or placement.num_replicas > 1):
            raise ValueError(f"schedule {name!r} places its own stages (pipeline rank {rank} holds stages {stages}"
                             f"{', replicas of the model' if placement.num_replicas > 1 else ''}), and model chunk "
                             f"{i} was not built for it: it carries no stage (build_model_chunks tags each chunk) and "
                             f"its layers do not say which stage they are; build the chunks with "
                             f"{build_hint(name, options)}")
        if found is not None and found[0] != stage:
            held, what = found
            raise ValueError(f"model chunk {i} on pipeline rank {rank} holds {what}: stage {held} of "
                             f"{placement.num_stages} (as Megatron's own virtual-pipeline layout puts stage "
                             f"v*D + r on rank r), but schedule {name!r} puts stage {stage} there (this rank "
                             f"holds stages {stages}); build the chunks with {build_hint(name, options)}")


def check_split_backward(schedule, config, rank: int) -> None:
    """Configurations whose backward cannot be split into input- and weight-gradient passes."""
    if not split_chunks(schedule.orders[rank]):
        return
    for flag in ("gradient_accumulation_fusion", "fuse_wgrad_accumulation"):
        if getattr(config, flag, False):
            raise ValueError(f"schedule {schedule.name!r} splits the backward into input and weight gradients, but "
                             f"{flag}=True adds weight gradients during the input pass (they would count twice); "
                             f"set {flag}=False or use a schedule without a split backward")
    if getattr(config, "recompute_granularity", None):
        raise ValueError(f"schedule {schedule.name!r} splits the backward, which Megatron's activation recompute "
                         f"(recompute_granularity={config.recompute_granularity!r}) does not allow; turn recompute "
                         f"off or use a schedule without a split backward")
