"""An LR-scheduler instance bound to the script's optimizer drives the optimizer ds_chimera rebuilt.

Each case builds two identical (optimizer, scheduler) pairs, rebuilds the second optimizer as
``deepspeed.initialize`` does under a schedule (same class, same groups' options, new tensors) and
re-points the scheduler at it; both then step side by side and their learning rates (and weight decay)
must agree at every step."""
import warnings

import pytest
import torch

from ds_chimera.runtime.param_groups import rebuild_optimizer
from ds_chimera.runtime.schedulers import repoint_scheduler


def _groups(count=2):
    torch.manual_seed(0)
    return [{"params": [torch.nn.Parameter(torch.randn(3))], "weight_decay": 0.1 * i, "lr": 0.01 * (i + 1)}
            for i in range(count)]


def _rebuilt(optimizer, kept):
    groups = [{**{k: v for k, v in optimizer.param_groups[i].items() if k != "params"},
               "params": [torch.nn.Parameter(p.detach().clone()) for p in optimizer.param_groups[i]["params"]]}
              for i in kept]
    return rebuild_optimizer(optimizer, groups)


def _trajectory(optimizer, scheduler, steps, step_args=()):
    out = []
    for _ in range(steps):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step(*step_args)
        out.append([(g["lr"], g["weight_decay"]) for g in optimizer.param_groups])
    return out


def _megatron_scheduler(optimizer):
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=0.02, min_lr=0.001, lr_warmup_steps=3,
                                   lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.2,
                                   wd_incr_steps=10, wd_incr_style="linear")


def _deepspeed_warmup(optimizer):
    from deepspeed.runtime.lr_schedules import WarmupLR
    return WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.02, warmup_num_steps=4)


SCHEDULERS = {
    "LambdaLR": (lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1.0 / (1 + s)]), ()),
    "OneCycleLR": (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.1], total_steps=12), ()),
    "SequentialLR": (lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.8)], milestones=[3]), ()),
    "WarmupLR (DeepSpeed)": (_deepspeed_warmup, ()),
    "OptimizerParamScheduler (Megatron)": (_megatron_scheduler, (1,)),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_scheduler_instance_drives_the_rebuilt_optimizer_step_for_step(name):
    build, step_args = SCHEDULERS[name]
    stock_opt = torch.optim.SGD(_groups(), lr=0.01, momentum=0.9)
    stock = build(stock_opt)
    moved_opt = torch.optim.SGD(_groups(), lr=0.01, momentum=0.9)
    moved = build(moved_opt)
    # the script steps once before initialize: the state (step count, last LR) must carry over
    _trajectory(stock_opt, stock, 1, step_args)
    _trajectory(moved_opt, moved, 1, step_args)
    moved_opt.state.clear()
    rebuilt = _rebuilt(moved_opt, [0, 1])
    repoint_scheduler(moved, moved_opt, rebuilt, [0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # torch's "scheduler.step() before optimizer.step()" must not fire
        expected = _trajectory(stock_opt, stock, 8, step_args)
        got = _trajectory(rebuilt, moved, 8, step_args)
    assert got == expected
    assert len({lr for step in expected for lr, _ in step}) > 2     # the trajectory moves: a real comparison
    assert all(g["lr"] == moved_opt.param_groups[i]["lr"] for i, g in enumerate(moved_opt.param_groups))


def test_a_group_empty_on_this_rank_drops_its_per_group_entries():
    stock_opt = torch.optim.SGD(_groups(3), lr=0.01)
    stock = torch.optim.lr_scheduler.LambdaLR(stock_opt, [lambda s: 1.0, lambda s: 0.5 ** s, lambda s: 0.9 ** s])
    moved_opt = torch.optim.SGD(_groups(3), lr=0.01)
    moved = torch.optim.lr_scheduler.LambdaLR(moved_opt, [lambda s: 1.0, lambda s: 0.5 ** s, lambda s: 0.9 ** s])
    rebuilt = _rebuilt(moved_opt, [0, 2])           # group 1 holds nothing of this rank's chunks
    repoint_scheduler(moved, moved_opt, rebuilt, [0, 2])
    expected = _trajectory(stock_opt, stock, 5)
    got = _trajectory(rebuilt, moved, 5)
    assert got == [[step[0], step[2]] for step in expected]
    assert len(moved.base_lrs) == 2 and len(moved.lr_lambdas) == 2


def test_a_scheduler_it_cannot_move_is_refused_naming_its_class():
    class ClosureScheduler:
        def __init__(self, optimizer):
            self.set_lr = lambda lr: [g.__setitem__("lr", lr) for g in optimizer.param_groups]

        def step(self):
            self.set_lr(0.5)

    opt = torch.optim.SGD(_groups(), lr=0.01)
    with pytest.raises(ValueError, match="ClosureScheduler.*callable"):
        repoint_scheduler(ClosureScheduler(opt), opt, _rebuilt(opt, [0, 1]), [0, 1])

    class PerGroupScheduler:
        def __init__(self, optimizer):
            self.optimizer, self.factors = optimizer, [1.0, 2.0, 3.0]

        def step(self):
            pass

    opt = torch.optim.SGD(_groups(3), lr=0.01)
    with pytest.raises(ValueError, match="PerGroupScheduler.*'factors'.*groups \\[1\\]"):
        repoint_scheduler(PerGroupScheduler(opt), opt, _rebuilt(opt, [0, 2]), [0, 2])
