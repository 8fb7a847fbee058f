"""The Trainer's accelerator as a pipelined run needs it: one process that holds the global batch.

In a pipelined run every rank reads the same global batches (each stage takes what it needs),
so the Trainer's data and metrics code must behave as in a single process: dataloaders are not
sharded across ranks, and gathering or padding "across processes" changes nothing. Everything
else (device, gradient state, unwrapping) is the real accelerator's. Rank identity for logging
and saving stays with the TrainingArguments (``should_log``, ``should_save``).
"""
from __future__ import annotations

import contextlib
import functools


class OneProcessView:
    """Wraps an ``accelerate.Accelerator``; see the module docstring."""

    num_processes = 1
    process_index = 0
    local_process_index = 0

    def __init__(self, accelerator, step_skipped=lambda: False):
        """``step_skipped``: whether the engine skipped its last step (an fp16 overflow on some rank)."""
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_step_skipped", step_skipped)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """HF's loop leaves its LR scheduler alone after a skipped step, as DeepSpeed's engine leaves its own."""
        return self._step_skipped()

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def __setattr__(self, name, value):
        setattr(self._accelerator, name, value)

    # ---- data: every rank reads everything, in the order one process would -------------------
    def prepare(self, *objects, **kwargs):
        from torch.utils.data import DataLoader
        out = []
        for obj in objects:
            if not isinstance(obj, DataLoader):
                raise RuntimeError(f"ds_chimera: a pipelined Trainer never prepares a {type(obj).__name__} with "
                                   f"accelerate (the pipeline engine owns the model and optimizer)")
            out.append(self.prepare_data_loader(obj))
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        fn = data_loader.worker_init_fn
        if isinstance(fn, functools.partial) and "rank" in fn.keywords:
            # workers are seeded by rank; here every rank must collate the same batches
            data_loader.worker_init_fn = functools.partial(fn.func, *fn.args, **{**fn.keywords, "rank": 0})
        # accelerate's own preparation, with this object's view of the processes
        return type(self._accelerator).prepare_data_loader(self, data_loader, device_placement=device_placement,
                                                           slice_fn_for_dispatch=slice_fn_for_dispatch)

    def prepare_model(self, model, *args, **kwargs):
        """Evaluation asks for the model once: it stays where it is (the engine holds the stages)."""
        if model not in self._accelerator._models:
            self._accelerator._models.append(model)
        return model

    # ---- collectives: nothing to combine ------------------------------------------------------
    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """accelerate's own, with nothing gathered: it still drops the padding of a short last batch
        (as one process does), which weights that batch by its true size in eval_loss."""
        with _no_object_gathering():
            return type(self._accelerator).gather_for_metrics(self, input_data, use_gather_object=use_gather_object)

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        return tensor

    def reduce(self, tensor, reduction="sum", scale=1.0):
        return tensor * scale if scale != 1.0 else tensor


@contextlib.contextmanager
def _no_object_gathering():
    """accelerate's gather_object as in one process (it would all-gather across the real ranks)."""
    import accelerate.accelerator as module
    saved = module.gather_object
    module.gather_object = lambda obj: obj
    try:
        yield
    finally:
        module.gather_object = saved
