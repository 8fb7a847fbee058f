"""The ``Trainer`` methods a pipelined Trainer replaces, and the refusal of subclasses that override them.

Shared by the routing (:mod:`.routing`, before it turns a ``Trainer`` into a pipelined one)
and by :class:`~ds_chimera.hf.trainer.PipelineTrainer`'s constructor; neither depends on the
other for it.
"""
from __future__ import annotations

# methods whose override a pipelined Trainer cannot honour -> why
REPLACED = {
    "compute_loss": "the loss is computed on the last pipeline stage (HF's causal-LM loss)",
    "training_step": "a step runs all its micro-batches through the schedule at once",
    "_inner_training_loop": "the pipeline hooks into HF's own training loop",
    "_run_epoch": "the pipeline hooks into HF's own training loop",
    "_prepare_for_training": "the pipeline engine replaces accelerate's model preparation",
    "prediction_step": "evaluation runs micro-batches through the pipeline's forward passes",
    "evaluation_loop": "the pipeline preprocesses logits on its last stages inside HF's loop",
    "save_model": "the trained weights live in the pipeline stages, not in trainer.model",
    "_save": "the trained weights live in the pipeline stages, not in trainer.model",
    "_save_checkpoint": "checkpoints add the pipeline engine's state",
    "_save_optimizer_and_scheduler": "the optimizer state lives in the pipeline stages",
    "_load_optimizer_and_scheduler": "the optimizer state lives in the pipeline stages",
    "create_accelerator_and_postprocess": "the pipeline needs its own view of the accelerator",
}


def refuse_overrides(cls, pipeline_trainer) -> None:
    """Refuse a Trainer subclass ``cls`` whose overrides the pipeline would silently skip: every class
    of its MRO before ``pipeline_trainer`` (the PipelineTrainer class) or ``Trainer`` is looked at."""
    from transformers import Trainer
    for klass in cls.__mro__:
        if klass in (pipeline_trainer, Trainer):
            break
        for name, why in REPLACED.items():
            if name in vars(klass):
                raise ValueError(f"{klass.__name__} overrides {name}(), which a pipelined Trainer cannot run: {why}. "
                                 f"Remove the override, or train without the DeepSpeed config's \"pipeline\" section")
