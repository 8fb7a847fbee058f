"""Refuse a model family the pipeline cannot train as soon as both the config and the model are known.

A run_clm-style script parses its ``TrainingArguments`` first, builds the model next, then
tokenizes its data and builds the ``Trainer`` last. The Trainer refuses an unsupported model
when it is built, which there comes after the data work; so the model's family (its class and
config: :func:`~ds_chimera.hf.layout.check_family`) is also checked

- when the script creates a language model (a class that ``AutoModelForCausalLM`` or
  ``AutoModelForSeq2SeqLM`` builds) with ``from_config`` / ``from_pretrained`` while
  ``TrainingArguments`` with a ``"pipeline"`` config exist: from the class and config,
  before any weight is built or loaded (``from_pretrained`` without a ``config=`` object:
  once it returns);
- when ``TrainingArguments`` with a ``"pipeline"`` config are built after the script
  created such a model (still alive).

Models that transformers builds for itself (a ``pipeline()``, the parts of a composite model)
are not checked, nor are models built by calling the class (the Trainer still checks the model
it is given). ``DS_CHIMERA_EARLY_MODEL_CHECK=0`` turns these early checks off, for a script
that builds an unsupported model for some other use than training it pipelined.
"""
from __future__ import annotations

import functools
import os
import sys
import weakref

ENV = "DS_CHIMERA_EARLY_MODEL_CHECK"
_PATCHED = "_ds_chimera_family_checked"
# frames between the script and the check: transformers' model factories and this module
_FACTORIES = ("transformers.modeling_utils", "transformers.models.auto.auto_factory", __name__)

_pipeline_args: list = []          # weak references to TrainingArguments with a "pipeline" config
_last_model = None                 # weak reference to the last language model the script created


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=1)
def _language_models() -> frozenset:
    """Class names that AutoModelForCausalLM and AutoModelForSeq2SeqLM build."""
    from transformers.models.auto import modeling_auto as auto
    names = set()
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"):
        for value in getattr(auto, mapping, {}).values():
            names.update([value] if isinstance(value, str) else value)
    return frozenset(names)


def _is_language_model(cls) -> bool:
    return cls.__name__ in _language_models()


def _created_by_script() -> bool:
    """Whether the model is being created by user code, not by transformers (or ds_chimera) for itself."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _FACTORIES:
        frame = frame.f_back
    caller = frame.f_globals.get("__name__", "") if frame is not None else ""
    return not caller.startswith(("transformers.", "ds_chimera."))


def _pipeline_args_alive() -> bool:
    _pipeline_args[:] = [ref for ref in _pipeline_args if ref() is not None]
    return bool(_pipeline_args)


def _refuse(cls, config, when: str) -> None:
    from .layout import check_family
    try:
        check_family(cls, config)
    except ValueError as exc:
        raise ValueError(f"ds_chimera: {exc}. The \"pipeline\" config of the TrainingArguments cannot train it: "
                         f"refused {when}, before any data work (a model built for another use than training: "
                         f"set {ENV}=0)") from None


def model_created(cls, config, when: str) -> None:
    """Check a language model the script is creating, if a pipeline config is in force."""
    if enabled() and _is_language_model(cls) and _pipeline_args_alive():
        _refuse(cls, config, when)


def remember(model) -> None:
    """Remember the last language model the script created (weakly), for arguments built after it."""
    global _last_model
    try:
        _last_model = weakref.ref(model)
    except TypeError:
        _last_model = None


def arguments_built(args) -> None:
    """TrainingArguments with a pipeline config were built: check the model created before them, if any."""
    model = _last_model() if _last_model is not None else None
    if model is not None and enabled():
        _refuse(type(model), getattr(model, "config", None),
                f"as the TrainingArguments are built (the model {type(model).__name__} was created before them)")
    _pipeline_args.append(weakref.ref(args))


def install(pretrained_model_cls) -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` and ``_from_config`` once (``AutoModel*`` call them).

    A transformers whose ``PreTrainedModel`` has them otherwise is left as it is: the Trainer still checks."""
    methods = [pretrained_model_cls.__dict__.get(name) for name in ("_from_config", "from_pretrained")]
    if not all(isinstance(m, classmethod) for m in methods) or getattr(methods[0].__func__, _PATCHED, False):
        return
    from_config, from_pretrained = (m.__func__ for m in methods)

    @functools.wraps(from_config)
    def _from_config(cls, config, **kwargs):
        script = _created_by_script() and _is_language_model(cls)
        if script:
            model_created(cls, config, f"when {cls.__name__} is created from its config")
        model = from_config(cls, config, **kwargs)
        if script:
            remember(model)
        return model

    @functools.wraps(from_pretrained)
    def _from_pretrained(cls, *args, **kwargs):
        from transformers import PretrainedConfig
        script = _created_by_script() and _is_language_model(cls)
        config = kwargs.get("config")
        checked = script and isinstance(config, PretrainedConfig)
        if checked:
            model_created(cls, config, f"when {cls.__name__}.from_pretrained is called, before its weights load")
        result = from_pretrained(cls, *args, **kwargs)
        if script:
            model = result[0] if isinstance(result, tuple) else result
            if not checked:
                model_created(type(model), model.config, f"when {type(model).__name__}.from_pretrained returns")
            remember(model)
        return result

    for func in (_from_config, _from_pretrained):
        setattr(func, _PATCHED, True)
    pretrained_model_cls._from_config = classmethod(_from_config)
    pretrained_model_cls.from_pretrained = classmethod(_from_pretrained)
