"""DeepSpeed's BF16_Optimizer seen per module parameter, so that predictors can read it.

BF16_Optimizer keeps fp32 master weights, gradients and optimizer state in flat partitions;
the module's bf16 parameters are linked to their fragments (``lp._hp_mapping``). This view
gives a predictor what a plain torch optimizer would: ``param_groups`` whose ``params`` are the
module's parameters (hyperparameters read live from the real groups, so LR schedules apply),
``state[p]`` with the fragments of the moment and the step count, and the fp32 master value
and gradient of each parameter. It needs whole parameters on this rank: data-parallel size 1.
"""
from __future__ import annotations

from collections.abc import Mapping


class _GroupView(Mapping):
    def __init__(self, group: dict, params: list):
        self.group, self.params = group, params

    def __getitem__(self, key):
        return self.params if key == "params" else self.group[key]

    def __iter__(self):
        return iter(self.group)

    def __len__(self):
        return len(self.group)


class _StateView(Mapping):
    def __init__(self, view):
        self.view = view

    def __getitem__(self, p):
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None or not mapping.optim_fragment:
            raise KeyError(p)
        flat = self.view.wrapper.fp32_groups_flat_partition[mapping.param_group_index]
        state = {key: frag.view(p.shape) for key, frag in mapping.optim_fragment.items()}
        if "step" in self.view.inner.state.get(flat, {}):
            state["step"] = self.view.inner.state[flat]["step"]
        return state

    def __iter__(self):
        return iter(p for group in self.view.param_groups for p in group["params"])

    def __len__(self):
        return sum(len(group["params"]) for group in self.view.param_groups)


class BF16MasterView:
    """``param_groups``, ``state``, ``master_value(p)`` and ``master_grad(p)`` over a BF16_Optimizer."""

    def __init__(self, bf16_optimizer, hp_grads: dict):
        self.wrapper = bf16_optimizer
        self.inner = bf16_optimizer.optimizer
        self.hp_grads = hp_grads
        self.param_groups = [_GroupView(group, list(params))
                             for group, params in zip(self.inner.param_groups, bf16_optimizer.bf16_groups)]
        self.state = _StateView(self)

    def master_value(self, p):
        return p._hp_mapping.hp_fragment.view(p.shape)

    def master_grad(self, p):
        grad = self.hp_grads.get(id(p))
        return None if grad is None else grad.view(p.shape)
