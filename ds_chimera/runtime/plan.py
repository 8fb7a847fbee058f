"""Everything decided before DeepSpeed's engine is built: schedule, program, layer cut.

Validation happens here, on every rank, before any step runs, so bad configurations fail
at ``initialize`` with a message that names the bad value.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedules import registry
from ..schedules.actions import FORWARD
from ..schedules.base import Schedule
from ..schedules.lowering import Program, lower
from ..sim.simulator import simulate

# keys of the "pipeline" section that DeepSpeed itself owns
DEEPSPEED_PIPELINE_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                           "pipe_partitioned", "grad_partitioned", "use_reentrant"}
RUNTIME_KEYS = {"schedule", "timeout", "trace_dir", "partition_method", "zero1_reduce"}
ZERO1_REDUCE = ("chunk", "end")     # ZeRO-1: reduce each chunk's gradients when it is done, or all at the end
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class Plan:
    schedule: Schedule
    program: Program          # training: lowered with grad syncs and the optimizer step
    eval_program: Program     # forward only
    parts: list               # layer boundaries of the placement's stages
    timeout_s: float
    trace_dir: str | None
    clip: float
    zero1_reduce: str = "chunk"

    @property
    def placement(self):
        return self.schedule.placement

    def loads_data(self, pipe_rank: int) -> bool:
        """True if the rank runs a first or a last stage of some micro-batch's route."""
        placement = self.placement
        return any(placement.prev_chunk(c) is None or placement.next_chunk(c) is None
                   for c in placement.chunks_on(pipe_rank))


def schedule_options(section: dict) -> tuple:
    """Split the DeepSpeed "pipeline" section into (schedule name, schedule options, runtime options)."""
    name = section["schedule"]
    if not isinstance(name, str):
        raise ValueError(f'"pipeline": {{"schedule": ...}} must be a schedule name, got {name!r}')
    cls = registry.get(name)
    options, runtime = {}, {}
    for key, value in section.items():
        if key in RUNTIME_KEYS:
            runtime[key] = value
        elif key in cls.options:
            options[key] = value
        elif key not in DEEPSPEED_PIPELINE_KEYS:
            allowed = sorted(set(cls.options) | (RUNTIME_KEYS - {"schedule"}))
            raise ValueError(f'"pipeline" option {key!r} is not understood by schedule {name!r}; '
                             f"allowed: {', '.join(allowed)} (plus DeepSpeed's own pipeline keys)")
    return name, options, runtime


def micro_batches_from_config(config: dict, dp: int) -> int:
    """DeepSpeed's gradient_accumulation_steps, derived from the batch keys as DeepSpeed does."""
    tbs = config.get("train_batch_size")
    mbs = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps")
    if gas is not None:
        return int(gas)
    if tbs is not None and mbs is not None:
        if tbs % (mbs * dp):
            raise ValueError(f"train_batch_size {tbs} is not divisible by train_micro_batch_size_per_gpu {mbs} "
                             f"x data-parallel size {dp}")
        return tbs // (mbs * dp)
    return 1


def check_precision_and_zero(config: dict, schedule: Schedule | None = None) -> None:
    """fp16 and ZeRO limits of ds_chimera schedules, refused before any work (DeepSpeed and the HF Trainer).

    With ``schedule``, also ZeRO-1 on a placement whose stages are replicated (Chimera):
    ZeRO-1's gradient norm would count the replicas twice.
    """
    fp16 = config.get("fp16") or {}
    autocast = config.get("torch_autocast") or {}
    dtype = str(autocast.get("dtype", ""))
    fp16_on = fp16.get("enabled") not in (None, False, 0, "auto")     # "auto": the HF Trainer decides (fp32 here)
    if fp16_on or (autocast.get("enabled") and "16" in dtype and "bfloat" not in dtype):
        raise ValueError("fp16 training (loss scaling) is not supported by ds_chimera schedules yet; "
                         "use bf16 (\"bf16\": {\"enabled\": true}) or fp32")
    zero = (config.get("zero_optimization") or {}).get("stage", 0)
    if zero >= 2:
        raise ValueError(f"ZeRO stage {zero} does not compose with pipeline schedules; use stage 0 or 1")
    if schedule is None or zero != 1:
        return
    placement = schedule.placement
    replicated = [s for s in range(placement.num_stages) if len(placement.stage_group(s)) > 1]
    if replicated:
        raise ValueError(f"ZeRO stage 1 with schedule {schedule.name!r} is not supported: its stages are "
                         f"replicated across pipeline ranks (stages {replicated[:4]}...), and ZeRO-1's gradient "
                         f"norm would count them twice; use ZeRO stage 0 or a schedule without replicas")


def proven_programs(schedule: Schedule) -> tuple:
    """(training program, forward-only program) of a schedule, after the simulator accepts it.

    A plugin schedule can be wrong: one the simulator rejects never runs.
    """
    program = schedule.lower()
    proof = simulate(program)
    if not proof.valid:
        raise ValueError(f"schedule {schedule.name!r} is invalid for stages={schedule.stages}, "
                         f"micro_batches={schedule.micro_batches}: "
                         f"{(proof.errors or list(proof.deadlock.values()))[:3]}")
    forward_orders = [[a for a in order if a.kind == FORWARD] for order in schedule.orders]
    eval_program = lower(schedule.name + "-eval", schedule.placement, forward_orders, synchronous=False)
    return program, eval_program


def make_plan(config: dict, num_stages: int, dp: int, num_layers: int, parts_fn) -> Plan:
    section = config.get("pipeline") or {}
    name, options, runtime = schedule_options(section)
    micro_batches = micro_batches_from_config(config, dp)
    schedule = registry.get(name)(num_stages, micro_batches, **options)
    timeout = runtime.get("timeout", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f'"pipeline": {{"timeout": ...}} must be a number of seconds > 0, got {timeout!r}')
    if num_layers < schedule.placement.num_stages:
        raise ValueError(f"schedule {name!r} cuts the model into {schedule.placement.num_stages} stages "
                         f"but the PipelineModule has only {num_layers} layers")
    program, eval_program = proven_programs(schedule)
    parts = parts_fn(schedule.placement.num_stages, runtime.get("partition_method"))
    clip = float(config.get("gradient_clipping", 1.0))
    zero1_reduce = runtime.get("zero1_reduce", "chunk")
    if zero1_reduce not in ZERO1_REDUCE:
        raise ValueError(f'"pipeline": {{"zero1_reduce": ...}} must be one of {", ".join(ZERO1_REDUCE)}; '
                         f"got {zero1_reduce!r}")
    return Plan(schedule, program, eval_program, parts, float(timeout), runtime.get("trace_dir"), clip, zero1_reduce)
