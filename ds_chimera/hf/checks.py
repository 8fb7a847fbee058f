"""Refusals that need the model as well as the config: checked in the constructor, before any data work."""
from __future__ import annotations


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _stages_of(name: str, ranks: int, micro_batches: int, options: dict):
    """How many model stages schedule ``name`` cuts on ``ranks`` pipeline ranks, or None if it cannot run there."""
    from ..schedules import registry
    try:
        return registry.get(name)(ranks, micro_batches, **options).placement.num_stages
    except ValueError:
        return None


def check_model_fits(layout, setup, world: int):
    """The schedule of ``setup`` (None for ``"auto"``, planned later), once the model has a layer for each of
    its stages; else a ValueError that says how many decoder blocks, or which pipeline sizes, would work."""
    if setup.pipeline.planned:
        return check_planned(layout, setup, world)
    options = setup.options
    schedule = setup.pipeline.build_schedule(setup.stages, setup.micro_batches)
    need, have = schedule.placement.num_stages, len(layout.layers)
    if layout.tied and not schedule.synchronous:
        raise ValueError(f"schedule {setup.schedule!r} updates stages on their own clocks and cannot keep "
                         f"{layout.model_class}'s tied embedding and head equal; use a synchronous schedule or a "
                         f"model with tie_word_embeddings=False")
    if have >= need:
        return schedule
    blocks = sum(1 for layer in layout.layers if layer.kind == "block")
    fits = []
    for ranks in _divisors(world):
        stages = _stages_of(setup.schedule, ranks, setup.micro_batches, options)
        if ranks < setup.stages and stages is not None and stages <= have:
            fits.append(ranks)
    instead = (f"or fewer ranks per pipeline: \"pipeline\": {{\"stages\": {fits[-1]}}} ({world // fits[-1]} "
               f"data-parallel replicas on {world} ranks)" if fits else f"no pipeline size on {world} ranks fits")
    raise ValueError(f"schedule {setup.schedule!r} on {setup.stages} pipeline ranks cuts the model into {need} stages "
                     f"({need // setup.stages} per rank), but {layout.model_class} with {blocks} decoder blocks has "
                     f"only {have} pipeline layers (embedding, {blocks} blocks, final norm, head); use a model with "
                     f"at least {blocks + need - have} decoder blocks, {instead}")


def check_planned(layout, setup, world: int) -> None:
    """``"schedule": "auto"``: what the planner cannot fix, refused now. The planner picks only schedules that
    build for these ranks and micro-batches, and the engine checks its choice again; the fewest stages any
    schedule cuts is one per pipeline rank."""
    if layout.tied and setup.options.get("allow_asynchronous"):
        raise ValueError(f"\"pipeline\": {{\"schedule\": \"auto\", \"allow_asynchronous\": true}} lets the planner "
                         f"choose an asynchronous schedule, which updates stages on their own clocks and cannot keep "
                         f"{layout.model_class}'s tied embedding and head equal; drop allow_asynchronous (or set it "
                         f"false) or use a model with tie_word_embeddings=False")
    have = len(layout.layers)
    if have < setup.stages:
        blocks = sum(1 for layer in layout.layers if layer.kind == "block")
        fits = [ranks for ranks in _divisors(world) if ranks <= have]
        raise ValueError(f"\"schedule\": \"auto\" on {setup.stages} pipeline ranks needs at least one pipeline "
                         f"layer per rank, but {layout.model_class} with {blocks} decoder blocks has only {have} "
                         f"(embedding, {blocks} blocks, final norm, head); use a model with at least "
                         f"{blocks + setup.stages - have} decoder blocks, or fewer ranks per pipeline: "
                         f"\"pipeline\": {{\"stages\": {fits[-1]}}} ({world // fits[-1]} data-parallel replicas on "
                         f"{world} ranks)")


def check_trainable(model) -> None:
    """The pipeline trains every parameter of the model; frozen ones would silently train."""
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(f"a pipelined Trainer trains every parameter, but {len(frozen)} of {type(model).__name__}'s "
                         f"have requires_grad=False (e.g. {frozen[:3]}); unfreeze them or train without a "
                         f"\"pipeline\" section")
