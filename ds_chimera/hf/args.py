"""``TrainingArguments(deepspeed=...)`` with a ds_chimera pipeline config, as HF would treat any other.

Three adaptations, only for configs with a ``"pipeline"`` section:

- accelerate's DeepSpeed plugin insists on a ``zero_optimization`` section, which pipeline
  configs usually leave out; stage 0 is filled in, which is what DeepSpeed assumes anyway.
- On CPU, accelerate's DeepSpeed state reports one process of rank 0 on every rank (it finds no
  device backend), so every rank would log as the main process and HF's ``should_log`` /
  ``should_save`` rules would not hold. The true ranks of the initialised process group are
  put back, as accelerate reports them on GPUs.
- Everything the arguments, the config and the world size decide (schedule, batch keys,
  ZeRO, precision) is checked as the arguments are built: a script that prepares its data
  before building the Trainer learns of a bad config before that work, not after. So is the
  family of a language model the script created before them (:mod:`.early`).
"""
from __future__ import annotations

import functools
import os

_PATCHED = "_ds_chimera_pipeline_ok"


def is_pipeline_config(config) -> bool:
    """True for a DeepSpeed config dict with a ``"pipeline"`` section (a schedule or not: never run it unpipelined)."""
    return isinstance(config, dict) and "pipeline" in config


def pipeline_config_of(value):
    """The config dict of ``args.deepspeed`` if it has a ``"pipeline"`` section, else None.

    A file that exists but does not parse raises (as DeepSpeed would): guessing "no pipeline"
    there could train unpipelined.
    """
    from .config import load_config
    if isinstance(value, dict) or (isinstance(value, (str, os.PathLike)) and os.path.isfile(value)):
        config = load_config(value)
        return config if is_pipeline_config(config) else None
    return None


def install_zero_default(cls) -> None:
    """Wrap HfTrainerDeepSpeedConfig.__init__ once: a pipeline config without ZeRO section gets stage 0."""
    if getattr(cls.__init__, _PATCHED, False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, config_file_or_dict, *args, **kwargs):
        original(self, config_file_or_dict, *args, **kwargs)
        if is_pipeline_config(self.config) and "zero_optimization" not in self.config:
            self.config["zero_optimization"] = {"stage": 0}

    setattr(__init__, _PATCHED, True)
    cls.__init__ = __init__


def true_ranks(distributed_state) -> None:
    """Make accelerate's shared state report the process group's ranks when it reports one process."""
    import torch.distributed as dist
    if distributed_state is None or not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if world <= 1 or distributed_state.num_processes == world:
        return
    from accelerate.state import PartialState
    ranks = {"num_processes": world, "process_index": dist.get_rank(),
             "local_process_index": int(os.environ.get("LOCAL_RANK", dist.get_rank()))}
    PartialState._shared_state.update(ranks)
    distributed_state.__dict__.update(ranks)


def install_true_ranks(args_cls) -> None:
    """Wrap TrainingArguments._setup_devices once (a cached_property) to apply :func:`true_ranks`."""
    prop = args_cls.__dict__.get("_setup_devices")
    if prop is None or getattr(prop.func, _PATCHED, False):
        return
    original = prop.func

    @functools.wraps(original)
    def _setup_devices(self):
        device = original(self)
        if pipeline_config_of(getattr(self, "deepspeed", None)) is not None:
            true_ranks(getattr(self, "distributed_state", None))
        return device

    setattr(_setup_devices, _PATCHED, True)
    patched = functools.cached_property(_setup_devices)
    patched.__set_name__(args_cls, "_setup_devices")
    args_cls._setup_devices = patched


def world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def install_early_checks(args_cls) -> None:
    """Wrap TrainingArguments.__post_init__ once: a pipeline config is checked against the arguments now."""
    original = args_cls.__post_init__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = pipeline_config_of(getattr(self, "deepspeed", None))
        if config is not None:
            from .config import resolve
            from .early import arguments_built
            resolve(config, self, world_size())
            arguments_built(self)          # a model the script created before: its family is checked now

    setattr(__post_init__, _PATCHED, True)
    args_cls.__post_init__ = __post_init__
