"""Everything decided before DeepSpeed's engine is built: schedule, program, layer cut.

The configuration arrives parsed and checked (:class:`~ds_chimera.config.PipelineConfig`);
what depends on the stage count and micro-batches (the schedule's option values, the
program's proof, the layer count) is checked here, on every rank, before any step runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import PipelineConfig
from ..schedules.base import Schedule
from ..schedules.lowering import Program, lower_forward_only, without_global_clip
from ..sim.simulator import simulate


@dataclass
class Plan:
    schedule: Schedule
    program: Program          # training: lowered with grad syncs and the optimizer step
    eval_program: Program     # forward only
    parts: list               # layer boundaries of the placement's stages
    config: PipelineConfig    # what the user asked (timeout, tracing, ZeRO, clipping...)
    # per global rank, the stock engine's optimizer layout (param_groups.optimizer_order): what maps a stock
    # checkpoint's optimizer state onto the chunks; set at initialize
    stock_optimizer_order: list | None = None

    @property
    def placement(self):
        return self.schedule.placement

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

    @property
    def trace_dir(self) -> str | None:
        return self.config.trace_dir

    @property
    def clip(self) -> float:
        return self.config.clip

    @property
    def zero(self) -> int:
        """2 or 3: the programs gather and release chunks' weight shards."""
        return self.config.zero_stage

    @property
    def zero1_reduce(self) -> str:
        return self.config.zero1_reduce

    def loads_data(self, pipe_rank: int) -> bool:
        """True if the rank runs a first or a last stage of some micro-batch's route."""
        placement = self.placement
        return any(placement.prev_chunk(c) is None or placement.next_chunk(c) is None
                   for c in placement.chunks_on(pipe_rank))


def proven_programs(schedule: Schedule) -> tuple:
    """(training program, forward-only program) of a schedule, after the simulator accepts it.

    A plugin schedule can be wrong: one the simulator rejects never runs.
    """
    program = schedule.lower()
    proof = simulate(program)
    if not proof.valid:
        raise ValueError(f"schedule {schedule.name!r} is invalid for stages={schedule.ranks}, "
                         f"micro_batches={schedule.micro_batches}: "
                         f"{(proof.errors or list(proof.deadlock.values()))[:3]}")
    eval_program = lower_forward_only(schedule.name + "-eval", schedule.placement, schedule.orders)
    return program, eval_program


def make_plan(config: PipelineConfig, num_stages: int, dp: int, num_layers: int, parts_fn) -> Plan:
    """The schedule, its proven programs and the layer cut for ``num_stages`` ranks x ``dp`` copies."""
    schedule = config.build_schedule(num_stages, config.batch.micro_batches(dp))
    if num_layers < schedule.placement.num_stages:
        per_rank = schedule.placement.num_stages // num_stages
        hint = f"; it puts {per_rank} stages on each rank: use fewer pipeline stages or a schedule with one (1f1b)"
        if "chunks" in schedule.config and schedule.config["chunks"] > 1:
            most = num_layers // num_stages
            hint = (f'; set "chunks": {most} (at most layers / stages = {num_layers} // {num_stages}) in the "pipeline" '
                    f"section" if most >= 1 else "; use fewer pipeline stages")
        raise ValueError(f"schedule {config.schedule!r} cuts the model into {schedule.placement.num_stages} stages "
                         f"but the PipelineModule has only {num_layers} layers{hint}")
    program, eval_program = _programs(config, schedule)
    num_stages = schedule.placement.num_stages
    if config.parts is not None:
        parts = list(config.parts)
        if len(parts) != num_stages + 1 or parts[-1] != num_layers:
            raise ValueError(f'"pipeline": parts {parts} must cut the {num_layers} layers into the {num_stages} stages '
                             f"schedule {config.schedule!r} places here: {num_stages + 1} boundaries from 0 to "
                             f"{num_layers}")
    else:
        parts = parts_fn(num_stages, config.partition_method)
    return Plan(schedule, program, eval_program, parts, config)


def _programs(config: PipelineConfig, schedule: Schedule) -> tuple:
    program, eval_program = proven_programs(schedule)
    if config.sharded:
        program, eval_program = sharded_programs(program, eval_program, config.zero_stage,
                                                 config.reshard_after_forward)
    if schedule.synchronous and not config.global_norm:
        program = without_global_clip(program)
    return program, eval_program


def with_micro_batches(plan: Plan, micro_batches: int, what: str) -> Plan:
    """The same schedule, options and layer cut with its programs built for another micro-batch count
    (``set_train_batch_size``, ``eval_batch(num_micro_batches=)``). ``what`` names the caller's argument
    in the error a count the schedule cannot run raises."""
    try:
        schedule = plan.config.build_schedule(plan.schedule.ranks, micro_batches)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from exc
    if schedule.placement.chunks != plan.placement.chunks:
        raise ValueError(f"{what}: schedule {plan.schedule.name!r} places its chunks differently for "
                         f"{micro_batches} micro-batches than for {plan.schedule.micro_batches}, so the layers "
                         f"built on each rank would not serve it; build a new engine")
    program, eval_program = _programs(plan.config, schedule)
    return Plan(schedule, program, eval_program, plan.parts, plan.config, plan.stock_optimizer_order)


def sharded_programs(program: Program, eval_program: Program, zero: int, reshard: bool) -> tuple:
    """The programs with their GATHER and RELEASE ops (ZeRO-2/3); the training one proven again
    (the forward-only one has no backward for the simulator's completeness check)."""
    from ..schedules.sharding import shard
    sharded = shard(program, zero, reshard)
    proof = simulate(sharded)
    if not proof.valid:
        raise ValueError(f"internal error: the ZeRO-{zero} program of {program.name!r} is invalid: "
                         f"{(proof.errors or list(proof.deadlock.values()))[:3]}")
    return sharded, shard(eval_program, zero, reshard)
