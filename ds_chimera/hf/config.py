"""The DeepSpeed config a PipelineTrainer runs, reconciled with its TrainingArguments.

HF's own reconciliation assumes pure data parallelism (train_batch_size = world size x
micro-batch x accumulation), which is wrong for a pipeline, so it is redone here with the
pipeline's data-parallel size. Everything is checked before any model work; each error
names the bad value and what is allowed. Rules:

- micro-batch size = ``per_device_train_batch_size``;
- micro-batches per step N = the config's ``gradient_accumulation_steps``, else
  ``train_batch_size / (micro x dp)``, else ``args.gradient_accumulation_steps``;
- stages D = ``"pipeline": {"stages": D}``, else the world size (data parallel = world / D);
- ``gradient_clipping`` and the optimizer/scheduler sections of the config win; their
  ``"auto"`` values (and a missing clipping) come from the TrainingArguments.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

AUTO = "auto"


@dataclass
class PipelineSetup:
    config: dict           # what goes to deepspeed.initialize (batch keys resolved)
    schedule: str
    stages: int            # D, ranks per pipeline
    data_parallel: int
    micro_batch: int
    micro_batches: int     # N per step

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.data_parallel


def load_config(value) -> dict:
    """args.deepspeed as a dict: a dict, or a path to a JSON/HJSON file."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        with open(value) as fh:
            text = fh.read()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            import hjson     # DeepSpeed's own config reader; a dependency of deepspeed
            return dict(hjson.loads(text))
    raise ValueError(f"PipelineTrainer needs TrainingArguments(deepspeed=...) to be a DeepSpeed config dict or the "
                     f"path of a JSON file with a \"pipeline\": {{\"schedule\": ...}} section; got {value!r}")


def _number(config: dict, key: str):
    value = config.get(key)
    return None if value is None or value == AUTO else value


# TrainingArguments the pipeline loop would otherwise ignore: (attribute, value it must have, what to do instead)
IGNORED_ARGUMENTS = [
    ("label_smoothing_factor", 0.0, "the loss is ds_chimera.hf's causal-LM loss without smoothing"),
    ("gradient_checkpointing", False, "use PipelineTrainer(..., activation_checkpoint_interval=K)"),
    ("load_best_model_at_end", False, "pick the checkpoint from state.log_history yourself"),
    ("average_tokens_across_devices", True, "the loss is always the mean over the global batch's tokens"),
]


def _refuse_ignored_arguments(args) -> None:
    for attr, allowed, instead in IGNORED_ARGUMENTS:
        value = getattr(args, attr, allowed)
        if value != allowed:
            raise ValueError(f"PipelineTrainer does not support TrainingArguments({attr}={value!r}); {instead}")


def resolve(raw, args, world_size: int) -> PipelineSetup:
    """Check ``raw`` (args.deepspeed) against ``args`` and the world size; return what to run."""
    from ..runtime.plan import check_precision_and_zero, schedule_options
    from ..schedules import registry
    config = load_config(raw)
    section = config.get("pipeline")
    if not isinstance(section, dict) or "schedule" not in section:
        raise ValueError(f"PipelineTrainer needs a \"pipeline\": {{\"schedule\": NAME}} section in the DeepSpeed "
                         f"config; available schedules: {', '.join(sorted(registry.available()))}")
    name, options, _ = schedule_options(section)        # unknown schedule or option: a clear error
    _refuse_ignored_arguments(args)
    if getattr(args, "fp16", False):
        raise ValueError("fp16 training (loss scaling) is not supported by ds_chimera schedules yet; use bf16 or fp32")
    check_precision_and_zero(config)                     # fp16 / ZeRO in the config, as deepspeed.initialize would
    stages = section.get("stages", AUTO)
    stages = world_size if stages == AUTO else stages
    if not isinstance(stages, int) or stages < 1 or world_size % stages:
        raise ValueError(f"\"pipeline\": {{\"stages\": {stages!r}}} must divide the world size {world_size}")
    dp = world_size // stages
    micro = args.per_device_train_batch_size
    cfg_micro = _number(config, "train_micro_batch_size_per_gpu")
    if cfg_micro is not None and cfg_micro != micro:
        raise ValueError(f"the DeepSpeed config's train_micro_batch_size_per_gpu={cfg_micro} disagrees with "
                         f"per_device_train_batch_size={micro}; set one of them to match (or the config's to \"auto\")")
    gas, tbs = _number(config, "gradient_accumulation_steps"), _number(config, "train_batch_size")
    if gas is not None:
        n = int(gas)
        if tbs is not None and tbs != micro * n * dp:
            raise ValueError(f"train_batch_size {tbs} != per_device_train_batch_size {micro} x "
                             f"gradient_accumulation_steps {n} x data-parallel size {dp}")
    elif tbs is not None:
        if tbs % (micro * dp):
            raise ValueError(f"train_batch_size {tbs} is not divisible by per_device_train_batch_size {micro} x "
                             f"data-parallel size {dp} (world size {world_size} / {stages} stages)")
        n = tbs // (micro * dp)
    else:
        n = args.gradient_accumulation_steps
    if args.gradient_accumulation_steps not in (1, n):
        raise ValueError(f"gradient_accumulation_steps={args.gradient_accumulation_steps} disagrees with the DeepSpeed "
                         f"config's {n} micro-batches per step; leave it at 1 or make them equal")
    schedule = registry.get(name)(stages, n, **options)  # the schedule's own limits (e.g. N vs D), now
    check_precision_and_zero(config, schedule)           # and ZeRO-1 with replicated stages (Chimera)
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=n,
                  train_batch_size=micro * n * dp)
    clip = config.get("gradient_clipping")
    config["gradient_clipping"] = float(args.max_grad_norm or 0.0) if clip in (None, AUTO) else clip
    if args.bf16:
        config["bf16"] = {**(config.get("bf16") or {}), "enabled": True}
    _fill_optimizer(config, args)
    return PipelineSetup(config, name, stages, dp, micro, n)


def _fill_optimizer(config: dict, args) -> None:
    params = (config.get("optimizer") or {}).get("params")
    if not isinstance(params, dict):
        return
    fills = {"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
             "weight_decay": args.weight_decay}
    for key, value in fills.items():
        if params.get(key) == AUTO:
            params[key] = value


def fill_scheduler(config: dict, args, max_steps: int) -> None:
    """Fill a config scheduler's "auto" values once the number of steps is known."""
    params = (config.get("scheduler") or {}).get("params")
    if not isinstance(params, dict):
        return
    fills = {"total_num_steps": max_steps, "warmup_num_steps": max(1, args.get_warmup_steps(max_steps)),
             "warmup_max_lr": args.learning_rate, "warmup_min_lr": 0}
    for key, value in fills.items():
        if params.get(key) == AUTO:
            params[key] = value
