"""Hugging Face integration: HF causal LMs on ds_chimera's pipeline schedules.

- :func:`to_pipeline`: a GPT-2 / Llama / pp_plan model as LayerSpecs for a PipelineModule;
- :func:`causal_lm_loss`: the matching next-token loss (HF's ForCausalLMLoss);
- :func:`export_pretrained`: layer checkpoints or a live engine back to a ``save_pretrained`` folder;
- :class:`PipelineTrainer`: a ``transformers.Trainer`` that trains with the configured schedule.

Importing this package also lets ``TrainingArguments(deepspeed=...)`` accept a ds_chimera
pipeline config without a ``zero_optimization`` section (see :mod:`.args`).
"""
from .args import install as _install_args
from .convert import to_pipeline
from .export import export_pretrained
from .loss import causal_lm_loss

_install_args()


def __getattr__(name):
    if name == "PipelineTrainer":      # transformers.Trainer pulls in accelerate: only when asked for
        from .trainer import PipelineTrainer
        return PipelineTrainer
    raise AttributeError(f"module 'ds_chimera.hf' has no attribute {name!r}")


__all__ = ["to_pipeline", "causal_lm_loss", "export_pretrained", "PipelineTrainer"]
