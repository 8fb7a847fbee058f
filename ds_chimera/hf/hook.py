"""The zero-code path: ``import ds_chimera`` makes the HF Trainer honour ``"pipeline"`` configs.

Nothing is imported here. Each patch is applied the moment the user's script imports the
transformers module it concerns (or now, if it already has): importing transformers costs
seconds, and the CLI and simulator must stay light.

- ``transformers.training_args``: pipeline configs need no ``zero_optimization`` section, are
  checked as the arguments are built, and every rank knows its true rank (HF's ``should_log``
  rules); see :mod:`.args`.
- ``transformers.trainer``: ``Trainer`` (and subclasses that keep its training loop) built
  with a pipeline config becomes a :class:`~ds_chimera.hf.trainer.PipelineTrainer`, or
  refuses clearly; it is never trained unpipelined. See :mod:`.routing`.
- ``transformers.modeling_utils``: a language model the script creates (``from_config`` /
  ``from_pretrained``) while a pipeline config is in force has its family checked then, before
  the script's data work, not only when the Trainer is built; see :mod:`.early`.
"""
from __future__ import annotations


def install() -> None:
    """Install the patches when (or now, if) transformers' modules are imported. Idempotent."""
    from .._import_hooks import call_after_import
    call_after_import("transformers.training_args", _patch_args)
    call_after_import("transformers.integrations.deepspeed", _patch_deepspeed_config)
    call_after_import("transformers.trainer", _patch_trainer)
    call_after_import("transformers.modeling_utils", _patch_models)


def _patch_args(module) -> None:
    from .args import install_early_checks, install_true_ranks
    install_true_ranks(module.TrainingArguments)
    install_early_checks(module.TrainingArguments)


def _patch_deepspeed_config(module) -> None:
    from .args import install_zero_default
    install_zero_default(module.HfTrainerDeepSpeedConfig)


def _patch_trainer(module) -> None:
    from .routing import install_routing
    install_routing(module)


def _patch_models(module) -> None:
    from .early import install
    install(module.PreTrainedModel)
