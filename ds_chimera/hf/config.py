"""The DeepSpeed config a pipelined Trainer runs, reconciled with its TrainingArguments.

The TrainingArguments are the source of truth, as in HF's own DeepSpeed integration: a
config value of ``"auto"`` (or a missing key) takes the argument's value, and a concrete value
that disagrees is an error naming both and the fix. HF's reconciliation assumes pure data
parallelism (train_batch_size = world x micro x accumulation), which is wrong for a pipeline,
so it is redone here:

- micro-batch size = ``per_device_train_batch_size``;
- micro-batches per step N = ``gradient_accumulation_steps``;
- stages D = ``"pipeline": {"stages": D}``, else the world size; data parallel = world / D;
- ``train_batch_size`` = micro x N x data parallel;
- clipping = ``max_grad_norm``; the optimizer / scheduler sections' ``"auto"`` values come
  from the arguments (the scheduler's step counts once training starts).

Everything here runs in the Trainer's constructor, before any model or data work.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from ..config import PipelineConfig
from ..config_reader import read_config
from ..named_files import read_named_file

AUTO = "auto"


@dataclass
class PipelineSetup:
    config: dict           # what goes to deepspeed.initialize (batch keys resolved)
    pipeline: PipelineConfig   # the same, parsed and checked once
    stages: int            # D, ranks per pipeline
    data_parallel: int
    micro_batch: int
    micro_batches: int     # N per step

    @property
    def schedule(self) -> str:
        return self.pipeline.schedule

    @property
    def options(self) -> dict:
        """The schedule's own options from the "pipeline" section."""
        return dict(self.pipeline.options)

    @property
    def max_grad_norm(self) -> float:
        """The Trainer's; the engine always computes the norm (see engine_clip)."""
        return self.pipeline.clip

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.data_parallel

    @property
    def engine_clip(self) -> float:
        """The engine clips at this norm; with clipping off, at infinity, so it still reports the norm."""
        return self.max_grad_norm if self.max_grad_norm > 0 else float("inf")


def load_config(value) -> dict:
    """args.deepspeed as a dict: a dict, or a path to a JSON/HJSON file."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        # as DeepSpeed reads it (JSON or HJSON, a key given twice refused), and as the DeepSpeed path does
        return read_named_file("TrainingArguments(deepspeed=...)", value, read_config,
                               "pass a DeepSpeed config file that DeepSpeed itself can read")
    raise ValueError(f"TrainingArguments(deepspeed=...) must be a DeepSpeed config dict or the path of a JSON "
                     f"file with a \"pipeline\": {{\"schedule\": ...}} section; got {value!r}")


def _concrete(config: dict, key: str):
    value = config.get(key)
    return None if value is None or value == AUTO else value


def _agree(config: dict, key: str, expected, argument: str, fix: str) -> None:
    """Fill an "auto" / missing key; refuse a concrete value that disagrees with the arguments."""
    value = _concrete(config, key)
    if value is not None and value != expected:
        raise ValueError(f"the DeepSpeed config's {key}={value!r} disagrees with {argument}; {fix}")
    config[key] = expected


def _batch_keys(config: dict, micro: int, n: int, dp: int, stages: int, world: int) -> None:
    auto = 'set it to "auto"'
    _agree(config, "train_micro_batch_size_per_gpu", micro, f"per_device_train_batch_size={micro}",
           f"{auto} or pass --per_device_train_batch_size {_concrete(config, 'train_micro_batch_size_per_gpu')}")
    _agree(config, "gradient_accumulation_steps", n, f"gradient_accumulation_steps={n} (the micro-batches of "
           f"one pipeline step)", f"{auto} or pass --gradient_accumulation_steps "
           f"{_concrete(config, 'gradient_accumulation_steps')}")
    tbs = _concrete(config, "train_batch_size")
    if tbs is not None and tbs != micro * n * dp:
        hint = f"{auto}"
        if isinstance(tbs, int) and tbs % (micro * dp) == 0:
            hint += f" or pass --gradient_accumulation_steps {tbs // (micro * dp)}"
        raise ValueError(f"the DeepSpeed config's train_batch_size={tbs} disagrees with per_device_train_batch_size "
                         f"{micro} x gradient_accumulation_steps {n} x data-parallel size {dp} (world size {world} / "
                         f"{stages} pipeline stages) = {micro * n * dp}; {hint}")
    config["train_batch_size"] = micro * n * dp


# TrainingArguments a pipeline cannot honour: (attribute, value it must have, why / what to do instead)
IGNORED_ARGUMENTS = [
    ("label_smoothing_factor", 0.0, "the loss is ds_chimera.hf's causal-LM loss without smoothing"),
    ("load_best_model_at_end", False, "pick the checkpoint from state.log_history yourself"),
    ("fp16_full_eval", False, "evaluation runs in the training precision"),
    ("bf16_full_eval", False, "evaluation runs in the training precision"),
    ("torch_compile", False, "the pipeline stages are not compiled"),
    ("auto_find_batch_size", False, "the schedule is built for one batch size; set per_device_train_batch_size"),
    ("neftune_noise_alpha", None, "the embedding runs inside the pipeline, without NEFTune's hook"),
    ("use_liger_kernel", False, "the pipeline layers are HF's own modules"),
    ("push_to_hub", False, "push the saved folder yourself after training"),
]
SAMPLING = ("random", "sequential")


def checkpoint_interval(args, given: int) -> int:
    """The pipeline's activation_checkpoint_interval for HF's ``--activation_checkpointing`` (and its
    older name ``--gradient_checkpointing``): 1, every pipeline layer recomputed in the backward,
    which gives the gradients HF's per-decoder-layer checkpointing gives. ``given``:
    PipelineTrainer's own keyword (0: none), which must agree."""
    if not (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)):
        return given
    options = dict(getattr(args, "activation_checkpointing_kwargs", None) or
                   getattr(args, "gradient_checkpointing_kwargs", None) or {})
    options.pop("use_reentrant", None)      # how autograd recomputes: the same gradients either way
    every = options.pop("every_n_layers", 1)
    if every != 1 or options.pop("offload", False) or options:
        raise ValueError(f"a pipelined Trainer takes activation_checkpointing_kwargs "
                         f"{getattr(args, 'activation_checkpointing_kwargs', None)!r} only as every_n_layers=1 "
                         f"(and use_reentrant): the pipeline checkpoints segments of K whole layers; use "
                         f"PipelineTrainer(..., activation_checkpoint_interval=K) instead")
    if given not in (0, 1):
        raise ValueError(f"activation_checkpointing=True (every layer) disagrees with PipelineTrainer's "
                         f"activation_checkpoint_interval={given}; pass one of them")
    return 1


def refuse_ignored_arguments(args) -> None:
    for attr, allowed, instead in IGNORED_ARGUMENTS:
        value = getattr(args, attr, None)
        ok = value in allowed if isinstance(allowed, tuple) else (value == allowed or value is None)
        if not ok:
            raise ValueError(f"a pipelined Trainer does not support TrainingArguments({attr}={value!r}); {instead}")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in SAMPLING:
        raise ValueError(f"a pipelined Trainer does not support train_sampling_strategy={strategy!r}: every rank "
                         f"must draw the same global batches; use one of {', '.join(SAMPLING)}")
    seedable = getattr(getattr(args, "accelerator_config", None), "use_seedable_sampler", True)
    if seedable is False:
        raise ValueError("a pipelined Trainer needs accelerator_config.use_seedable_sampler=True: every rank must "
                         "draw the same shuffled order, whatever else its random generator did")


def resolve(raw, args, world_size: int) -> PipelineSetup:
    """Check ``raw`` (args.deepspeed) against ``args`` and the world size; return what to run."""
    from ..config import split_pipeline_section
    from ..schedules import registry
    config = load_config(raw)
    section = config.get("pipeline")
    if not isinstance(section, dict) or "schedule" not in section:
        raise ValueError(f"the DeepSpeed config's \"pipeline\" section needs a schedule: \"pipeline\": {{\"schedule\": "
                         f"NAME}} with NAME one of {', '.join(sorted(registry.available()))}; got {section!r}")
    split_pipeline_section(section)     # unknown schedule or option: a clear error, before the arguments' checks
    refuse_ignored_arguments(args)
    stages = section.get("stages", AUTO)
    stages = world_size if stages == AUTO else stages
    if not isinstance(stages, int) or stages < 1 or world_size % stages:
        raise ValueError(f"\"pipeline\": {{\"stages\": {stages!r}}} must divide the world size {world_size}")
    dp = world_size // stages
    micro, n = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if dp > 1 and not getattr(args, "average_tokens_across_devices", True):
        raise ValueError("average_tokens_across_devices=False with data parallelism: the pipeline averages the loss "
                         "over the tokens of the whole global batch; leave it True")
    _batch_keys(config, micro, n, dp, stages, world_size)
    clip = float(args.max_grad_norm or 0.0)
    if _concrete(config, "gradient_clipping") is not None and float(config["gradient_clipping"]) != clip:
        raise ValueError(f"the DeepSpeed config's gradient_clipping={config['gradient_clipping']!r} disagrees with "
                         f"max_grad_norm={args.max_grad_norm}; set it to \"auto\" or pass --max_grad_norm "
                         f"{config['gradient_clipping']}")
    config["gradient_clipping"] = clip
    _agree_precision(config, args)
    _fill_optimizer(config, args)
    # the reconciled config is what runs: parsed once (fp16 / ZeRO, as deepspeed.initialize would refuse them)
    pipeline = PipelineConfig.from_deepspeed(config, sharding=False)
    from ..runtime.setup import check_fp16_zero1_device
    check_fp16_zero1_device(pipeline)
    if not pipeline.planned:    # "auto": the planner only picks schedules that build, and the engine re-checks
        pipeline.build_schedule(stages, n)      # the schedule's own limits (N vs D, ZeRO-1 with replicas), now
    return PipelineSetup(config, pipeline, stages, dp, micro, n)


def _agree_precision(config: dict, args) -> None:
    """The config's "bf16" and "fp16" sections against ``--bf16`` / ``--fp16``: "auto" takes the argument, a
    concrete value must agree with it (HF's rule for its DeepSpeed configs)."""
    for key, aliases, given in (("bf16", ("bf16", "bfloat16"), bool(args.bf16)), ("fp16", ("fp16",), bool(args.fp16))):
        section = next((config[name] for name in aliases if config.get(name) is not None), None)
        enabled = (section or {}).get("enabled", AUTO)
        if enabled == AUTO:
            if given:
                config[key] = {**(section or {}), "enabled": True}
            elif section is not None:
                section["enabled"] = False
        elif bool(enabled) != given:
            raise ValueError(f"the DeepSpeed config's {key}.enabled={enabled!r} disagrees with {key}={given}; set it "
                             f"to \"auto\" or pass --{key} {bool(enabled)}")


def _fill_optimizer(config: dict, args) -> None:
    """The config optimizer's "auto" values from the arguments; concrete ones must agree (HF's rule)."""
    for section, fills in (("optimizer", {"lr": ("learning_rate", args.learning_rate),
                                          "betas": ("adam_beta1/adam_beta2", [args.adam_beta1, args.adam_beta2]),
                                          "eps": ("adam_epsilon", args.adam_epsilon),
                                          "weight_decay": ("weight_decay", args.weight_decay)}),
                           ("scheduler", {"warmup_max_lr": ("learning_rate", args.learning_rate),
                                          "warmup_min_lr": (None, 0)})):
        params = (config.get(section) or {}).get("params")
        if not isinstance(params, dict):
            continue
        for key, (argument, value) in fills.items():
            current = params.get(key)
            if current == AUTO:
                params[key] = value
            elif argument is not None and current is not None and not _same(current, value):
                raise ValueError(f"the DeepSpeed config's {section}.params.{key}={current} disagrees with "
                                 f"{argument}={value}; set it to \"auto\" or pass the same value")


def _same(config_value, value) -> bool:
    if isinstance(value, list):
        return isinstance(config_value, (list, tuple)) and [float(v) for v in config_value] == [float(v) for v in value]
    return float(config_value) == float(value)


def fill_scheduler(config: dict, args, max_steps: int) -> None:
    """Fill a config scheduler's "auto" step counts once the number of steps is known."""
    params = (config.get("scheduler") or {}).get("params")
    if not isinstance(params, dict):
        return
    fills = {"total_num_steps": max_steps, "warmup_num_steps": max(1, args.get_warmup_steps(max_steps))}
    for key, value in fills.items():
        if params.get(key) == AUTO:
            params[key] = value
