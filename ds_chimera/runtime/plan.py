"""Everything decided before DeepSpeed's engine is built: schedule, program, layer cut.

Validation happens here, on every rank, before any step runs, so bad configurations fail
at ``initialize`` with a message that names the bad value.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..schedules import registry
from ..schedules.actions import FORWARD
from ..schedules.base import Schedule
from ..schedules.lowering import Program, lower
from ..sim.simulator import simulate
from ..validation import check_choice, check_seconds, unknown_key_error

# keys of the "pipeline" section that DeepSpeed itself owns
DEEPSPEED_PIPELINE_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                           "pipe_partitioned", "grad_partitioned", "use_reentrant"}
RUNTIME_KEYS = {"schedule", "program", "timeout", "trace_dir", "partition_method", "zero1_reduce",
                "reshard_after_forward"}
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
    zero: int = 0                    # 2 or 3: the programs gather and release chunks' weight shards

    @property
    def placement(self):
        return self.schedule.placement

    def loads_data(self, pipe_rank: int) -> bool:
        """True if the rank runs a first or a last stage of some micro-batch's route."""
        placement = self.placement
        return any(placement.prev_chunk(c) is None or placement.next_chunk(c) is None
                   for c in placement.chunks_on(pipe_rank))


def wants_schedule(section) -> bool:
    """True if the DeepSpeed "pipeline" section asks for ds_chimera (any key DeepSpeed does not own).

    A section of DeepSpeed's keys only is DeepSpeed's (its stock 1F1B engine). One with any
    other key is ours, so a misspelt ``"Schedule"`` is refused with a hint instead of
    silently training on the stock engine.
    """
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ValueError(f'the DeepSpeed config\'s "pipeline" must be a JSON object such as '
                         f'{{"schedule": "chimera"}}, got {section!r}')
    return bool(set(section) - DEEPSPEED_PIPELINE_KEYS)


def schedule_options(section: dict) -> tuple:
    """Split the DeepSpeed "pipeline" section into (schedule name, schedule options, runtime options).

    Every key is checked: DeepSpeed's own, the runtime's, or the schedule's options. A loaded
    program (``"program": FILE``) takes the place of a schedule; the name is then ``"program"``.
    """
    if not isinstance(section, dict):
        wants_schedule(section)
    if "schedule" in section and "program" in section:
        raise ValueError('"pipeline" takes "schedule" (a name) or "program" (a program file), not both')
    if "program" in section:
        name, options = "program", {}
        if not isinstance(section["program"], (str, os.PathLike)):
            raise ValueError(f'"pipeline": {{"program": ...}} must be the path of a program file, '
                             f'got {section["program"]!r}')
    elif "schedule" in section:
        name = section["schedule"]
        if not isinstance(name, str):
            raise ValueError(f'"pipeline": {{"schedule": ...}} must be a schedule name, got {name!r}')
        options = registry.get(name).options
    else:
        ours = sorted(set(section) - DEEPSPEED_PIPELINE_KEYS)
        if set(ours) <= RUNTIME_KEYS:
            raise ValueError(f'"pipeline" has {", ".join(map(repr, ours))} but no "schedule": name one of '
                             f"{', '.join(sorted(registry.available()))}")
        raise unknown_key_error('"pipeline"', next(k for k in ours if k not in RUNTIME_KEYS),
                                RUNTIME_KEYS | DEEPSPEED_PIPELINE_KEYS)
    chosen, runtime = {}, {}
    for key, value in section.items():
        if key in RUNTIME_KEYS:
            runtime[key] = value
        elif key in options:
            chosen[key] = value
        elif key not in DEEPSPEED_PIPELINE_KEYS:
            where = f'"pipeline" (schedule {name!r})'
            raise unknown_key_error(where, key, set(options) | RUNTIME_KEYS | DEEPSPEED_PIPELINE_KEYS)
    return name, chosen, runtime


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def without_auto_batch_keys(config: dict) -> dict:
    """The config with its ``"auto"`` batch keys dropped, for a DeepSpeed script (no HF Trainer fills them).

    DeepSpeed derives what is missing from what is given; with every batch key ``"auto"``
    nothing can be derived, which is refused with the keys to set.
    """
    autos = [key for key in BATCH_KEYS if config.get(key) == "auto"]
    if not autos:
        return config
    if len(autos) == len(BATCH_KEYS):
        raise ValueError('the DeepSpeed config leaves every batch size to "auto" (' + ", ".join(BATCH_KEYS) +
                         '); "auto" is filled by the HF Trainer. A DeepSpeed script sets them, e.g. '
                         '"train_micro_batch_size_per_gpu": 2 and "gradient_accumulation_steps": 8 '
                         "(the micro-batches per pipeline step)")
    return {key: value for key, value in config.items() if key not in autos}


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


def check_precision_and_zero(config: dict, schedule: Schedule | None = None, sharding: bool = False) -> None:
    """fp16 and ZeRO limits of ds_chimera schedules, refused before any work (DeepSpeed and the HF Trainer).

    With ``schedule``, also ZeRO-1 on a placement whose stages are replicated (Chimera):
    ZeRO-1's gradient norm would count the replicas twice. ``sharding``: the caller runs
    ZeRO-2/3 itself (the DeepSpeed engine, :mod:`.sharding`); their limits are checked too.
    """
    fp16 = config.get("fp16") or {}
    autocast = config.get("torch_autocast") or {}
    dtype = str(autocast.get("dtype", ""))
    fp16_on = fp16.get("enabled") not in (None, False, 0, "auto")     # "auto": the HF Trainer decides (fp32 here)
    if fp16_on or (autocast.get("enabled") and "16" in dtype and "bfloat" not in dtype):
        raise ValueError("fp16 training (loss scaling) is not supported by ds_chimera schedules yet; "
                         "use bf16 (\"bf16\": {\"enabled\": true}) or fp32")
    zero = (config.get("zero_optimization") or {}).get("stage", 0)
    if zero not in (0, 1, 2, 3):
        raise ValueError(f'"zero_optimization": {{"stage": ...}} must be 0, 1, 2 or 3; got {zero!r}')
    if zero >= 2 and not sharding:
        raise ValueError(f"ZeRO stage {zero} with pipeline schedules runs on ds_chimera's DeepSpeed engine only; "
                         f"here use stage 0 or 1")
    if zero >= 2:
        check_sharding(config, zero, schedule)
    if schedule is None or zero != 1:
        return
    placement = schedule.placement
    replicated = [s for s in range(placement.num_stages) if len(placement.stage_group(s)) > 1]
    if replicated:
        raise ValueError(f"ZeRO stage 1 with schedule {schedule.name!r} is not supported: its stages are "
                         f"replicated across pipeline ranks (stages {replicated[:4]}...), and ZeRO-1's gradient "
                         f"norm would count them twice; use ZeRO stage 0 or a schedule without replicas")


def check_sharding(config: dict, zero: int, schedule: Schedule | None) -> None:
    """What ZeRO-2/3 with a pipeline schedule cannot do (yet), refused with the reason."""
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled"):
        raise ValueError(f"ZeRO stage {zero} with pipeline schedules shards fp32 weights; bf16 is not supported "
                         f"with it yet: use fp32, or ZeRO stage 0/1 with bf16")
    if schedule is None:
        return
    if not schedule.synchronous:
        raise ValueError(f"ZeRO stage {zero} with schedule {schedule.name!r}: an asynchronous schedule steps each "
                         f"stage alone with its whole optimizer state (and weight versions); use ZeRO stage 0")
    if schedule.placement.num_replicas > 1:
        raise ValueError(f"ZeRO stage {zero} with schedule {schedule.name!r}: its stages are replicated across "
                         f"pipeline ranks, and a shard would have to span the replicas too; use a single-route "
                         f"schedule (breadth-first, interleaved, 1f1b, zbv...) or ZeRO stage 0/1")


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
    if name == "program":
        from ..schedules.from_program import ProgramSchedule
        schedule = ProgramSchedule.from_file(runtime["program"], num_stages, micro_batches)
    else:
        schedule = registry.get(name)(num_stages, micro_batches, **options)
    timeout = check_seconds('"pipeline"', "timeout", runtime.get("timeout", DEFAULT_TIMEOUT_S))
    trace_dir = runtime.get("trace_dir")
    if trace_dir is not None:
        check_writable_dir('"pipeline"', "trace_dir", trace_dir)
    if num_layers < schedule.placement.num_stages:
        raise ValueError(f"schedule {name!r} cuts the model into {schedule.placement.num_stages} stages "
                         f"but the PipelineModule has only {num_layers} layers")
    program, eval_program = proven_programs(schedule)
    zero = (config.get("zero_optimization") or {}).get("stage", 0)
    reshard = runtime.get("reshard_after_forward", True)
    if not isinstance(reshard, bool):
        raise ValueError(f'"pipeline": reshard_after_forward must be true or false, got {reshard!r}')
    if "reshard_after_forward" in runtime and zero != 3:
        raise ValueError('"pipeline": reshard_after_forward applies to ZeRO stage 3 only; this config runs '
                         f"ZeRO stage {zero}")
    if zero >= 2:
        check_sharding(config, zero, schedule)
        program, eval_program = sharded_programs(program, eval_program, zero, reshard)
    parts = parts_fn(schedule.placement.num_stages, runtime.get("partition_method"))
    clip = float(config.get("gradient_clipping", 0.0))       # DeepSpeed's default: no clipping
    zero1_reduce = check_choice('"pipeline"', "zero1_reduce", runtime.get("zero1_reduce", "chunk"), ZERO1_REDUCE)
    return Plan(schedule, program, eval_program, parts, timeout, trace_dir, clip, zero1_reduce, zero)


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


def check_writable_dir(where: str, name: str, path) -> str:
    """Create ``path`` if needed and prove it writable now, not after the first step."""
    import tempfile
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{where}: {name} must be a directory path, got {path!r}")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ds_chimera_probe"):
            pass
    except OSError as exc:
        raise ValueError(f"{where}: {name} {str(path)!r} cannot be created or written: {exc}") from None
    return str(path)
