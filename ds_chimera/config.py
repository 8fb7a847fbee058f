"""What the user asked of a pipeline, as one typed, immutable object parsed once per entry point.

:class:`PipelineConfig` is built by one parser per entry point, each checking everything it can
before any work starts:

- :meth:`PipelineConfig.from_deepspeed`: the DeepSpeed JSON (``deepspeed.initialize`` and the
  HF Trainer, whose TrainingArguments are first reconciled into that JSON by ``hf.config``);
- :meth:`PipelineConfig.from_megatron`: ``get_forward_backward_func`` / ``install`` arguments.

Everything below the entry points (the plan, the module set-up, the engines, the Megatron
runner) takes this object, never the raw dict. What needs the stage count and micro-batches
(a schedule's option values, ZeRO limits that depend on the placement) is checked when the
schedule is built (:meth:`PipelineConfig.build_schedule`, :meth:`PipelineConfig.check_schedule`),
still before the first step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from .validation import check_choice, check_int, check_seconds, unknown_key_error

# keys of the "pipeline" section that DeepSpeed itself owns
DEEPSPEED_PIPELINE_KEYS = frozenset({"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                                     "pipe_partitioned", "grad_partitioned", "use_reentrant"})
# keys of the "pipeline" section that ds_chimera's runtime reads (besides the schedule's own options)
RUNTIME_KEYS = frozenset({"schedule", "program", "timeout", "trace_dir", "partition_method", "zero1_reduce",
                          "reshard_after_forward", "parts"})
# "schedule": "auto": the planner's own keys (see ds_chimera.planner) and their defaults
PLANNER_OPTIONS = {"memory_limit_gb": None, "max_activations": None, "allow_asynchronous": False,
                   "plan_file": None, "profile_file": None}
# Megatron's "auto" plans among the schedules that run the chunks as built (their weights are the same for each),
# so only the activation budget and the plan file apply there (ds_chimera.megatron.auto)
MEGATRON_PLANNER_OPTIONS = {"max_activations": None, "plan_file": None}
ZERO1_REDUCE = ("chunk", "end")     # ZeRO-1: reduce each chunk's gradients when it is done, or all at the end
ZERO_STAGES = (0, 1, 2, 3)
PARTITION_METHODS = ("parameters", "uniform", "type:REGEX")
DEFAULT_TIMEOUT_S = 300.0
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
AUTO = "auto"
PROGRAM = "program"          # the schedule name of a loaded program file


@dataclass(frozen=True)
class BatchSizes:
    """DeepSpeed's batch keys as given (``None``: left out, or ``"auto"`` in a DeepSpeed script)."""

    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None

    def micro_batches(self, data_parallel: int) -> int:
        """Micro-batches per step, N: DeepSpeed's gradient_accumulation_steps, derived as DeepSpeed does."""
        if self.gradient_accumulation_steps is not None:
            return self.gradient_accumulation_steps
        tbs, mbs = self.train_batch_size, self.micro_batch_size
        if tbs is not None and mbs is not None:
            if tbs % (mbs * data_parallel):
                raise ValueError(f"train_batch_size {tbs} is not divisible by train_micro_batch_size_per_gpu {mbs} "
                                 f"x data-parallel size {data_parallel}")
            return tbs // (mbs * data_parallel)
        return 1


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline's configuration: the schedule and every runtime option, checked."""

    schedule: str                                   # a registered schedule name, or "program"
    options: Mapping = field(default_factory=dict)  # the schedule's own options (read-only)
    program_file: str | None = None                 # "program": a dumped program to run instead
    timeout_s: float = DEFAULT_TIMEOUT_S            # bound on every wait on a peer
    trace_dir: str | None = None                    # write each step's measured trace here
    partition_method: str | None = None             # None: the PipelineModule's own cut where it fits
    parts: tuple | None = None                      # an explicit layer cut (layer boundaries), as planned
    activation_checkpoint_interval: int | None = None   # None: the PipelineModule's own
    stages: int | None = None                       # "pipeline": {"stages": D} where given
    zero_stage: int = 0
    zero1_reduce: str = "chunk"
    reshard_after_forward: bool = True              # ZeRO-3: release a chunk's gathered weights after forward
    clip: float = 0.0                               # global gradient-norm clipping; 0 is off
    precision: str = "fp32"                         # "fp32", "bf16" or "fp16"
    loss_scale: object = None                       # fp16: runtime.loss_scale.LossScaleConfig
    batch: BatchSizes = BatchSizes()
    # "schedule": "auto": the planner's choice with its predicted step and peak memory (reports; not compared)
    planned_by: Mapping | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    # ---- derived ---------------------------------------------------------------------------
    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"

    @property
    def fp16_masters(self) -> bool:
        """fp16 whose fp32 masters and loss scale are ds_chimera's (runtime/fp16_masters.py), at ZeRO stage 0.
        Under ZeRO-1 DeepSpeed's ZeRO-1 optimizer keeps both (its fp32 partitions, its DynamicLossScaler)."""
        return self.fp16 and self.zero_stage == 0

    @property
    def sharded(self) -> bool:
        """ZeRO-2/3: ds_chimera shards each chunk's weights, gradients and optimizer state itself."""
        return self.zero_stage >= 2

    @property
    def global_norm(self) -> bool:
        """Whether each synchronous step computes the global gradient norm, a collective of every rank.

        Where the stock engine has one: to clip (``gradient_clipping`` > 0), or with bf16 or fp16, whose
        optimizers report their norm every step. Unclipped fp32 reports none (``get_global_grad_norm()``
        is None, as DeepSpeed's), and ZeRO-1's optimizer computes its own.
        """
        return self.zero_stage != 1 and (self.clip > 0 or self.bf16 or self.fp16)

    def checkpoint_interval(self, module_interval) -> int:
        """The "pipeline" section's activation_checkpoint_interval, else the PipelineModule's own."""
        if self.activation_checkpoint_interval is not None:
            return self.activation_checkpoint_interval
        return int(module_interval or 0)

    @property
    def planned(self) -> bool:
        """``"schedule": "auto"``: the planner picks the schedule, options and cut before anything is built."""
        return self.schedule == AUTO

    def with_plan(self, section: dict, decision: Mapping | None = None) -> "PipelineConfig":
        """This configuration with the planner's choice (a ``"pipeline"`` section: schedule, options, parts);
        ``decision``: how the planner came to it (kept as ``planned_by``, for reports)."""
        from .schedules import registry
        name = section["schedule"]
        options = {k: v for k, v in section.items() if k not in ("schedule", "parts")}
        registry.checked(name, options)
        return replace(self, schedule=name, options=options, parts=_parts(section["parts"]), planned_by=decision)

    def schedule_class(self):
        from .schedules import registry
        if self.planned:
            raise ValueError('"schedule": "auto" is resolved by the planner before a schedule is built')
        if self.schedule == PROGRAM:
            from .schedules.from_program import ProgramSchedule
            return ProgramSchedule
        return registry.get(self.schedule)

    def build_schedule(self, stages: int, micro_batches: int):
        """The schedule for ``stages`` ranks and ``micro_batches``; its option values are checked here."""
        if self.schedule == PROGRAM:
            from .schedules.from_program import ProgramSchedule
            schedule = ProgramSchedule.from_file(self.program_file, stages, micro_batches)
        else:
            schedule = self.schedule_class()(stages, micro_batches, **self.options)
        self.check_schedule(schedule)
        return schedule

    def check_schedule(self, schedule) -> None:
        """ZeRO limits that depend on the schedule's placement, refused with the reason."""
        zero, name = self.zero_stage, schedule.name
        if zero < 2:
            return
        if not schedule.synchronous:
            raise ValueError(f"ZeRO stage {zero} with schedule {name!r}: an asynchronous schedule steps each "
                             f"stage alone with its whole optimizer state (and weight versions); use ZeRO stage 0")
        if schedule.placement.num_replicas > 1:
            raise ValueError(f"ZeRO stage {zero} with schedule {name!r}: its stages are replicated across "
                             f"pipeline ranks, and a shard would have to span the replicas too; use a single-route "
                             f"schedule (breadth-first, interleaved, 1f1b, zbv...) or ZeRO stage 0/1")

    def with_clip(self, clip: float) -> "PipelineConfig":
        return replace(self, clip=_check_clip(clip))

    # ---- parsers ---------------------------------------------------------------------------
    @classmethod
    def from_deepspeed(cls, config: dict, *, sharding: bool = True) -> "PipelineConfig":
        """Parse and check a DeepSpeed config dict whose ``"pipeline"`` section asks for ds_chimera.

        ``sharding``: the caller runs ZeRO-2/3 on ds_chimera's DeepSpeed engine; without it
        (the HF Trainer's path) those stages are refused.
        """
        if not isinstance(config, dict):
            raise ValueError(f"the DeepSpeed config must be a JSON object (a dict), got {type(config).__name__}")
        section = config.get("pipeline")
        name, options, runtime = split_pipeline_section(section)
        precision = _precision(config)
        zero = _zero_stage(config)
        if zero >= 2 and not sharding:
            raise ValueError(f"ZeRO stage {zero} with pipeline schedules runs on ds_chimera's DeepSpeed engine "
                             f"only; here use stage 0 or 1")
        if zero >= 2 and precision == "fp16":
            raise ValueError(f"fp16 with ZeRO stage {zero} is not supported by ds_chimera schedules yet: use ZeRO "
                             f"stage 0 or 1 with fp16, or bf16 with ZeRO stage {zero}")
        if zero >= 2 and precision == "bf16":
            raise ValueError(f"ZeRO stage {zero} with pipeline schedules shards fp32 weights; bf16 is not supported "
                             f"with it yet: use fp32, or ZeRO stage 0/1 with bf16")
        reshard = runtime.get("reshard_after_forward", True)
        if not isinstance(reshard, bool):
            raise ValueError(f'"pipeline": reshard_after_forward must be true or false, got {reshard!r}')
        if "reshard_after_forward" in runtime and zero != 3:
            raise ValueError('"pipeline": reshard_after_forward applies to ZeRO stage 3 only; this config runs '
                             f"ZeRO stage {zero}")
        if name == AUTO:
            # the planner runs at initialize (deepspeed.initialize, or the HF Trainer's engine build); its own
            # keys are checked now, before any work
            _check_planner_options(options)
        parts = _parts(runtime["parts"]) if "parts" in runtime else None
        if parts is not None and runtime.get("partition_method") is not None:
            raise ValueError('"pipeline" takes "parts" (an explicit layer cut) or "partition_method", not both')
        trace_dir = runtime.get("trace_dir")
        if trace_dir is not None:
            trace_dir = check_writable_dir('"pipeline"', "trace_dir", trace_dir)
        interval = section.get("activation_checkpoint_interval")
        if interval is not None:
            interval = check_int('"pipeline"', "activation_checkpoint_interval", interval, 0)
        stages = section.get("stages")
        stages = None if stages in (None, AUTO) else check_int('"pipeline"', "stages", stages, 1)
        return cls(
            schedule=name, options=options,
            program_file=str(runtime[PROGRAM]) if name == PROGRAM else None,
            timeout_s=check_seconds('"pipeline"', "timeout", runtime.get("timeout", DEFAULT_TIMEOUT_S)),
            trace_dir=trace_dir,
            partition_method=_partition_method(runtime.get("partition_method")),
            parts=parts,
            activation_checkpoint_interval=interval,
            stages=stages,
            zero_stage=zero,
            zero1_reduce=check_choice('"pipeline"', "zero1_reduce", runtime.get("zero1_reduce", "chunk"),
                                      ZERO1_REDUCE),
            reshard_after_forward=reshard,
            clip=_check_clip(config.get("gradient_clipping", 0.0)),
            precision=precision,
            loss_scale=_loss_scale(config) if precision == "fp16" else None,
            batch=_batch_sizes(config),
        )

    @classmethod
    def from_megatron(cls, schedule: str, options: dict, where: str = "get_forward_backward_func") -> "PipelineConfig":
        """Megatron's routing: a schedule name and its options, where ``"timeout"`` (seconds) bounds
        every wait on a peer.

        Megatron's contract leaves the optimizer step to the caller, so asynchronous schedules
        (which step inside the pipeline) are refused.
        """
        from .schedules import registry
        if not isinstance(schedule, str):
            raise ValueError(f"{where}: schedule must be a schedule name, got {schedule!r}")
        options = dict(options)
        timeout = options.pop("timeout", DEFAULT_TIMEOUT_S)
        if schedule == AUTO:
            unknown = sorted(set(options) - set(MEGATRON_PLANNER_OPTIONS))
            if unknown:
                raise ValueError(f'{where}: "auto" on Megatron takes {sorted(MEGATRON_PLANNER_OPTIONS)} (it chooses '
                                 f"among the schedules that run the chunks as built, whose weights are the same), "
                                 f"got {unknown}")
            _check_planner_options(options, where)
        else:
            registry.checked(schedule, options, caller_steps=True)
        return cls(schedule=schedule, options=options, timeout_s=check_seconds(where, "timeout", timeout))

    def with_default_option(self, key: str, value) -> "PipelineConfig":
        """This configuration with option ``key`` set to ``value`` where the schedule has that option and the
        user left it out (Megatron's virtual-pipeline size as the chunks of a looped schedule)."""
        if self.planned or key in self.options or key not in self.schedule_class().options:
            return self
        return replace(self, options={**self.options, key: value})


def asks_for_schedule(section) -> bool:
    """True if a DeepSpeed "pipeline" section asks for ds_chimera (any key DeepSpeed does not own).

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


def split_pipeline_section(section) -> tuple:
    """(schedule name, schedule options, runtime options) of a "pipeline" section, every key checked.

    A loaded program (``"program": FILE``) takes the place of a schedule; the name is then ``"program"``.
    """
    from .schedules import registry
    asks_for_schedule(section)
    if section is None:
        raise ValueError('the DeepSpeed config has no "pipeline" section: add "pipeline": {"schedule": NAME} '
                         f"with NAME one of {', '.join(sorted(registry.available()))}")
    if "schedule" in section and PROGRAM in section:
        raise ValueError('"pipeline" takes "schedule" (a name) or "program" (a program file), not both')
    if PROGRAM in section:
        name, options = PROGRAM, {}
        if not isinstance(section[PROGRAM], (str, os.PathLike)):
            raise ValueError(f'"pipeline": {{"program": ...}} must be the path of a program file, '
                             f'got {section[PROGRAM]!r}')
    elif "schedule" in section:
        name = section["schedule"]
        if not isinstance(name, str):
            raise ValueError(f'"pipeline": {{"schedule": ...}} must be a schedule name, got {name!r}')
        options = PLANNER_OPTIONS if name == AUTO else registry.get(name).options
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


def without_auto_batch_keys(config: dict) -> dict:
    """The config with its ``"auto"`` batch keys dropped, for a DeepSpeed script (no HF Trainer fills them).

    DeepSpeed derives what is missing from what is given; with every batch key ``"auto"``
    nothing can be derived, which is refused with the keys to set.
    """
    autos = [key for key in BATCH_KEYS if config.get(key) == AUTO]
    if not autos:
        return config
    if len(autos) == len(BATCH_KEYS):
        raise ValueError('the DeepSpeed config leaves every batch size to "auto" (' + ", ".join(BATCH_KEYS) +
                         '); "auto" is filled by the HF Trainer. A DeepSpeed script sets them, e.g. '
                         '"train_micro_batch_size_per_gpu": 2 and "gradient_accumulation_steps": 8 '
                         "(the micro-batches per pipeline step)")
    return {key: value for key, value in config.items() if key not in autos}


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


# ---- the sections' parts ----------------------------------------------------------------------
def _parts(value) -> tuple:
    """An explicit layer cut: increasing layer indices from 0, one more than the stages (DeepSpeed's ``parts``)."""
    if not isinstance(value, (list, tuple)) or len(value) < 2 or \
            any(isinstance(v, bool) or not isinstance(v, int) for v in value) or value[0] != 0 or \
            any(b <= a for a, b in zip(value, value[1:])):
        raise ValueError(f'"pipeline": parts must be the layer boundaries of the stages, increasing integers from 0 '
                         f"(stage s holds layers [parts[s], parts[s+1])), e.g. [0, 3, 6, 8]; got {value!r}")
    return tuple(value)


def _check_planner_options(options: dict, where: str = '"pipeline"') -> None:
    """The planner's keys, checked before any profiling."""
    limit = options.get("memory_limit_gb")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
        raise ValueError(f'{where}: memory_limit_gb must be a number of GiB > 0 per rank, got {limit!r}')
    acts = options.get("max_activations")
    if acts is not None and (isinstance(acts, bool) or not isinstance(acts, (int, float)) or not acts >= 1):
        raise ValueError(f'{where}: max_activations must be a number of micro-batches >= 1 per rank, got {acts!r}')
    allow = options.get("allow_asynchronous", False)
    if not isinstance(allow, bool):
        raise ValueError(f'{where}: allow_asynchronous must be true or false, got {allow!r}')
    for key in ("plan_file", "profile_file"):
        path = options.get(key)
        if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path)):
            raise ValueError(f'{where}: {key} must be a file path, got {path!r}')



def _precision(config: dict) -> str:
    """"fp16", "bf16" or "fp32"; fp16 through torch_autocast (DeepSpeed's GradScaler path) is refused."""
    fp16 = config.get("fp16") or {}
    autocast = config.get("torch_autocast") or {}
    dtype = str(autocast.get("dtype", ""))
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    fp16_on = fp16.get("enabled") not in (None, False, 0, AUTO)     # "auto": the HF Trainer decides (fp32 here)
    if autocast.get("enabled") and "16" in dtype and "bfloat" not in dtype:
        raise ValueError("\"torch_autocast\" with float16 is not supported by ds_chimera schedules; use \"fp16\": "
                         "{\"enabled\": true} (fp16 weights, fp32 masters, loss scaling) or bf16")
    if fp16_on and bf16.get("enabled"):
        raise ValueError('"fp16" and "bf16" are both enabled; enable one of them')
    if fp16_on:
        return "fp16"
    return "bf16" if bf16.get("enabled") else "fp32"       # truthy, as DeepSpeed reads it


def _loss_scale(config: dict):
    from .runtime.loss_scale import LossScaleConfig
    return LossScaleConfig.from_section(config.get("fp16") or {})


def _zero_stage(config: dict) -> int:
    zero = (config.get("zero_optimization") or {}).get("stage", 0)
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f'"zero_optimization": {{"stage": ...}} must be 0, 1, 2 or 3; got {zero!r}')
    return int(zero)


def _check_clip(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"gradient_clipping must be a number >= 0 (0: no clipping), got {value!r}")
    return float(value)


def _partition_method(method):
    if method is None:
        return None
    if not isinstance(method, str) or not (method.lower() in ("parameters", "uniform")
                                           or method.lower().startswith("type:")):
        raise ValueError(f'"pipeline": partition_method must be one of {", ".join(PARTITION_METHODS)}; '
                         f"got {method!r}")
    return method


def _batch_sizes(config: dict) -> BatchSizes:
    config = without_auto_batch_keys(config)
    values = {}
    for key in BATCH_KEYS:
        value = config.get(key)
        if value is not None:
            value = check_int("the DeepSpeed config", key, value, 1)
        values[key] = value
    return BatchSizes(values["train_batch_size"], values["train_micro_batch_size_per_gpu"],
                      values["gradient_accumulation_steps"])


def check_tensor_parallel(schedule, tensor_size: int, zero: int) -> None:
    """Tensor (slice) parallelism: every synchronous schedule with ZeRO stage 0 or 1; the rest refused here (and
    left out by the planner, which asks the same)."""
    if tensor_size == 1:
        return
    name = schedule.name
    if not schedule.synchronous:
        from .schedules.registry import synchronous_names
        raise ValueError(f"schedule {name!r} with tensor-parallel size {tensor_size}: the asynchronous schedules run "
                         f"with tensor-parallel size 1; use a synchronous schedule: {synchronous_names()}")
    if zero >= 2:
        raise ValueError(f"ZeRO stage {zero} with tensor-parallel size {tensor_size}: the pipeline schedules shard a "
                         f"chunk over data parallelism only; use ZeRO stage 0 or 1 (as Megatron-DeepSpeed runs 3D)")
