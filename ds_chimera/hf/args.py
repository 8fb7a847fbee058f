"""Let ``TrainingArguments(deepspeed=...)`` take a ds_chimera pipeline config as it is.

accelerate's DeepSpeed plugin insists on a ``zero_optimization`` section, which pipeline
configs usually leave out (pipelines run ZeRO stage 0 or 1). For a config with
``"pipeline": {"schedule": ...}`` and no such section, stage 0 is filled in, which is what
DeepSpeed assumes anyway. Nothing else of HF's DeepSpeed handling changes: the
:class:`~ds_chimera.hf.PipelineTrainer` reads the config itself.
"""
from __future__ import annotations

_PATCHED = "_ds_chimera_pipeline_ok"


def is_pipeline_config(config) -> bool:
    return isinstance(config, dict) and isinstance(config.get("pipeline"), dict) and "schedule" in config["pipeline"]


def install() -> None:
    """Wrap HfTrainerDeepSpeedConfig.__init__ once (idempotent)."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:        # transformers without DeepSpeed support: nothing to adapt
        return
    cls = hf_deepspeed.HfTrainerDeepSpeedConfig
    if getattr(cls.__init__, _PATCHED, False):
        return
    original = cls.__init__

    def __init__(self, config_file_or_dict, *args, **kwargs):
        original(self, config_file_or_dict, *args, **kwargs)
        if is_pipeline_config(self.config) and "zero_optimization" not in self.config:
            self.config["zero_optimization"] = {"stage": 0}

    setattr(__init__, _PATCHED, True)
    cls.__init__ = __init__
