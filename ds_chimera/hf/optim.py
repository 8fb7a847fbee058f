"""The Trainer's own optimizer and scheduler, on the pipeline's parameters.

The Trainer builds its optimizer (``create_optimizer``: ``optim``, its weight-decay groups,
``optimizer_cls_and_kwargs``, a subclass override or an ``optimizers=`` instance) over the HF
model. The pipeline trains other tensors (each rank's chunks), so the same class is rebuilt
with the same groups and options over them, parameter by parameter through the HF names.
The engine steps it inside ``train_batch``; the Trainer's loop then only steps its scheduler,
which reads and sets the learning rate of these groups, as in a plain run.
"""
from __future__ import annotations

import torch

from ..runtime.param_groups import rebuild_optimizer


def torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` inside DeepSpeed's wrappers (what an LR scheduler must drive)."""
    seen = optimizer
    while seen is not None and not isinstance(seen, torch.optim.Optimizer):
        seen = getattr(seen, "optimizer", None)
    if seen is None:
        raise TypeError(f"ds_chimera: cannot find the torch optimizer inside {type(optimizer).__name__}")
    return seen


def chunk_optimizer_factory(hf_optimizer, hf_model, names_of):
    """``make(params)`` for deepspeed.initialize: ``hf_optimizer``'s class and groups over the chunks' parameters.

    ``names_of()`` maps id(chunk parameter) -> HF parameter name (known once the chunks exist).
    """
    hf_names = {id(p): n for n, p in hf_model.named_parameters()}
    group_of = {}
    for index, group in enumerate(hf_optimizer.param_groups):
        for p in group["params"]:
            group_of[hf_names.get(id(p))] = index
    group_of.pop(None, None)
    cls = type(hf_optimizer)

    def make(params):
        names = names_of()
        buckets = [[] for _ in hf_optimizer.param_groups]
        for p in params:
            name = names.get(id(p))
            if name not in group_of:
                raise ValueError(f"the pipeline parameter {name or '?'} is in none of the Trainer optimizer's "
                                 f"parameter groups ({cls.__name__}); every trained HF parameter must be in one")
            buckets[group_of[name]].append(p)
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": bucket}
                  for group, bucket in zip(hf_optimizer.param_groups, buckets) if bucket]
        return rebuild_optimizer(hf_optimizer, groups)
    make.template = hf_optimizer        # what it rebuilds (the planner prices its state per parameter)
    return make


class EngineStepped:
    """The Trainer's handle on the optimizer: the engine already stepped and zeroed it in ``train_batch``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None

    @property
    def param_groups(self):
        return torch_optimizer(self.optimizer).param_groups

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


class EngineScheduler:
    """A scheduler from the DeepSpeed config's ``"scheduler"`` section, which the engine steps itself."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, *args, **kwargs):
        return None

    def get_last_lr(self):
        return list(self.engine.get_lr())

    def state_dict(self):
        return self.engine.lr_scheduler.state_dict()

    def load_state_dict(self, state):
        self.engine.lr_scheduler.load_state_dict(state)
