"""Route ``transformers.Trainer`` to the pipeline when its DeepSpeed config has a ``"pipeline"`` section.

``Trainer.__init__`` is wrapped: built with such a config, the instance's class becomes
:class:`~ds_chimera.hf.trainer.PipelineTrainer` (for a subclass ``MyTrainer``: a class deriving from
both, ``MyTrainer`` first, so its overrides that call ``super()`` still run). A subclass that
overrides what the pipeline replaces (the loss, the training or prediction step, the loop,
saving) is refused by name, since its override would silently not run. HF's own DeepSpeed
initialisation refuses pipeline configs too, as a last guard: once ds_chimera is imported, a
pipeline config is never trained unpipelined. A Trainer that is not pipelined warns when it
resumes from a pipelined checkpoint whose optimizer state it cannot read (:mod:`.plain_resume`).
"""
from __future__ import annotations

import functools
import inspect

from .args import pipeline_config_of
from .overrides import refuse_overrides

_PATCHED = "_ds_chimera_routed"


def check_overrides(cls) -> None:
    """Refuse a Trainer subclass whose overrides the pipeline would silently skip."""
    from .trainer import PipelineTrainer
    refuse_overrides(cls, PipelineTrainer)


@functools.lru_cache(maxsize=None)
def pipelined_class(cls):
    """PipelineTrainer for Trainer itself; for a subclass, one deriving from it and then PipelineTrainer."""
    from transformers import Trainer

    from .trainer import PipelineTrainer
    if issubclass(cls, PipelineTrainer):
        return cls
    if cls is Trainer:
        return PipelineTrainer
    return type(cls.__name__, (cls, PipelineTrainer), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                        "__doc__": cls.__doc__})


def install_routing(trainer_module) -> None:
    """Wrap ``Trainer.__init__`` and guard HF's ``deepspeed_init`` (idempotent)."""
    trainer_cls = trainer_module.Trainer
    if getattr(trainer_cls.__init__, _PATCHED, False):
        return
    original = trainer_cls.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from .trainer import PipelineTrainer
        if not isinstance(self, PipelineTrainer):
            bound = signature.bind(self, *args, **kwargs)      # a wrong call fails as Trainer's would
            training_args = bound.arguments.get("args")
            if training_args is not None and pipeline_config_of(getattr(training_args, "deepspeed", None)) is not None:
                check_overrides(type(self))
                self.__class__ = pipelined_class(type(self))
                named = {k: v for k, v in bound.arguments.items() if k != "self"}
                PipelineTrainer.__init__(self, **named)
                return
        original(self, *args, **kwargs)

    setattr(__init__, _PATCHED, True)
    trainer_cls.__init__ = __init__
    _guard_deepspeed_init(trainer_module)
    _warn_plain_resume(trainer_cls)


def _warn_plain_resume(trainer_cls) -> None:
    """A Trainer that is not pipelined, resuming from a pipelined checkpoint it cannot take the optimizer of:
    warn (HF would start a fresh optimizer and schedule without a word). PipelineTrainer overrides the load."""
    original = trainer_cls._load_optimizer_and_scheduler
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def _load_optimizer_and_scheduler(self, checkpoint):
        from .plain_resume import warn_plain_resume
        warn_plain_resume(self, checkpoint)
        return original(self, checkpoint)

    setattr(_load_optimizer_and_scheduler, _PATCHED, True)
    trainer_cls._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


def _guard_deepspeed_init(trainer_module) -> None:
    """HF's DeepSpeed set-up would train the whole model on every rank: refuse pipeline configs there."""
    original = getattr(trainer_module, "deepspeed_init", None)
    if original is None or getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def deepspeed_init(trainer, *args, **kwargs):
        if pipeline_config_of(getattr(trainer.args, "deepspeed", None)) is not None:
            raise RuntimeError(f"ds_chimera: {type(trainer).__name__} reached HF's own DeepSpeed initialisation with a "
                               f"\"pipeline\" config, which would train the whole model unpipelined on every rank; "
                               f"build the Trainer after importing ds_chimera (or use ds_chimera.hf.PipelineTrainer)")
        return original(trainer, *args, **kwargs)

    setattr(deepspeed_init, _PATCHED, True)
    trainer_module.deepspeed_init = deepspeed_init
