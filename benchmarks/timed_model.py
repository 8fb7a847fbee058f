"""A model whose layers sleep for their cost: schedules, not the 2 CPU cores, are measured.

Forward sleeps F; the input-grad path sleeps I; the weight-grad path sleeps W. They are
separate autograd functions, so a fused backward pays I + W and a split backward pays
each once, where the schedule puts it. Sleeping frees the cores, so 4 ranks on 2 cores
measure the schedule and the runtime's own overhead.

The model (``model_specs``) starts with a cost-free layer that has a parameter, as a real
model starts with its embedding. Without it, the first stage's input-grad work would be
free (nothing below its first timed layer needs a gradient), so every runtime would run
stage 0 one I per micro-batch cheaper than the "ideal" and the simulator assume.

Each cost is held to a deadline, so a layer takes its nominal cost and not more: a plain
``time.sleep`` overshoots by its wake-up latency (0.15-0.5 ms per 10 ms on this VM,
depending on the host's load), and the first Python code after a sleep runs slowly on a
vCPU that went idle. The forward's deadline counts from the layer's entry, so its own
autograd bookkeeping is inside F; each backward path's deadline counts from its entry.

The spun tail is short (0.5 ms) and yields the core at every turn. Four ranks share two
cores, so spinning ranks compete for them: with a 1 ms spin that did not yield, one hold
in ten came back 0.4-0.5 ms late inside a pipeline step, and the timed layers, not the
schedule or the runtime, cost the step 2-3% (``tools/step_breakdown.py``, chimera zero-bubble
with two pipelines at N = 8: 1.095-1.099x ideal with that spin, 1.066-1.076x with this one).
"""
import os
import time

import torch
from torch import nn

WIDTH = 16
SPIN_S = 0.0005    # the last part of each cost is spun, not slept: 9 wake-ups in 10 come sooner than this


def hold_until(deadline: float, spin_s: float = SPIN_S) -> None:
    """Return at ``deadline`` (a perf_counter time): sleep most of the wait (freeing the core),
    spin the last ``spin_s``, yielding the core to any other runnable rank at each turn."""
    rest = deadline - time.perf_counter()
    if rest > spin_s:
        time.sleep(rest - spin_s)
    while time.perf_counter() < deadline:
        os.sched_yield()


def hold(seconds: float, spin_s: float = SPIN_S) -> None:
    """Take ``seconds`` of wall time, accurately."""
    hold_until(time.perf_counter() + seconds, spin_s)


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, igrad_s, spin_s):
        ctx.igrad_s, ctx.spin_s = igrad_s, spin_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        hold(ctx.igrad_s, ctx.spin_s)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, like, wgrad_s, spin_s):
        ctx.wgrad_s, ctx.spin_s = wgrad_s, spin_s
        return weight.expand_as(like).clone()

    @staticmethod
    def backward(ctx, grad):
        hold(ctx.wgrad_s, ctx.spin_s)
        return grad.sum().reshape(1), None, None, None


class TimedLayer(nn.Module):
    spin_s = SPIN_S     # 0: plain sleeps, every core left free (for benchmarks whose communication needs CPU)

    def __init__(self, fwd_s: float, igrad_s: float, wgrad_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.costs = (fwd_s, igrad_s, wgrad_s)

    def forward(self, x):
        start = time.perf_counter()
        fwd_s, igrad_s, wgrad_s = self.costs
        out = _InputPath.apply(x, igrad_s, self.spin_s) + _WeightPath.apply(self.weight, x.detach(), wgrad_s,
                                                                           self.spin_s)
        hold_until(start + fwd_s, self.spin_s)
        return out


class EntryLayer(nn.Module):
    """The model's cost-free first layer, with a parameter (an embedding's place): the first
    timed layer's input-grad path is then needed, and paid, like every other stage's."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.weight


def model_specs(layer_spec, layer_s: float, layers: int) -> list:
    """The timed model as DeepSpeed layer specs: the entry layer, then ``layers`` timed layers
    of ``layer_s`` each for F, I and W. Cut it with ``partition_method="uniform"``: the entry
    layer then joins the first stage."""
    return [layer_spec(EntryLayer)] + [layer_spec(TimedLayer, layer_s, layer_s, layer_s) for _ in range(layers)]


def stage_layers(specs: list, stage: int, num_stages: int) -> list:
    """Built layers of ``stage``, cut as DeepSpeed's uniform partition cuts ``specs``."""
    from deepspeed.runtime.utils import partition_uniform
    bounds = partition_uniform(len(specs), num_stages)
    return [spec.build() for spec in specs[bounds[stage]:bounds[stage + 1]]]
