"""Hugging Face integration: HF causal LMs on ds_chimera's pipeline schedules.

- an unchanged ``transformers.Trainer`` script whose DeepSpeed config has a ``"pipeline"``
  section trains pipelined once ``ds_chimera`` is imported (see :mod:`.hook`);
- :class:`PipelineTrainer`: the same trainer, named explicitly;
- :func:`to_pipeline`: a GPT-2 / Llama / pp_plan model as LayerSpecs for a PipelineModule;
- :func:`causal_lm_loss`: the matching next-token loss (HF's ForCausalLMLoss);
- :func:`export_pretrained`: layer checkpoints or a live engine back to a ``save_pretrained`` folder.

Everything is imported lazily: ``import ds_chimera`` must not pull in transformers or DeepSpeed.
"""
from importlib import import_module

_EXPORTS = {"to_pipeline": ".convert", "export_pretrained": ".export", "causal_lm_loss": ".loss",
            "PipelineTrainer": ".trainer"}


def __getattr__(name):
    if name in _EXPORTS:
        from .hook import install
        install()                     # the explicit path gets the same TrainingArguments handling
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'ds_chimera.hf' has no attribute {name!r}")


__all__ = list(_EXPORTS)
