"""The runtime's own host time per compute action: what a step adds to the layers' profiled costs.

The layer profile times each layer's forward, input-grad and weight-grad alone. In a step, the runtime
also works around every compute action: the executor's bookkeeping, the chunk's call, the input's leaf and
copy, a split backward's block capture and its deferred weight-grad, each backward call's entry. That is
the simulator's ``Costs.dispatch``; without it predictions run short by a few percent on CPU ranks, most for
the schedules with the most actions per rank (docs/investigations/zero-bubble-host-time.md).

Measured here apart from any step: the runtime's own executor runs a one-rank program of every compute kind
(forward, full backward, input-grad, weight-grad; zbv's on one rank, two chunks) over chunks of one
layer, near-free by default; the per-action time less that layer's own forward, input-grad and weight-grad,
timed as the profiler times layers, is the host time per action.

What the runtime's code costs depends on what ran on the core before it. Between compute-bound layers it runs
on a warm core: the near-free default measures that. After a layer that leaves the core idle (a wait on a
device, or the benchmarks' timed layers, which sleep) a virtual CPU resumes with cold caches, and the first
code after the wait runs several times slower: on this project's CI host a 1 us tensor op takes 5 us after
0.1 ms idle and 100 us after 10 ms (docs/investigations/zero-bubble-host-time.md). ``layer`` measures the
host time per action around such layers; ``idle_s`` and ``busy_s`` around a :class:`ShapedLayer` that waits,
then computes, as the model's mean layer does (the planner passes its profile's; the layers' waits are read
as they happen and left out, so their wake-ups, which vary from call to call, are not taken for the
runtime's). The planner's links take it (``measure_links``'s
``host_cost``; the entry points pass this function in, the planner does not import the runtime): every rank
of a job measures at once, so ranks that share a host's cores are measured sharing them, as in a step.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
from torch import nn

from .. import autograd_calls
from ..schedules import registry
from ..schedules.actions import FORWARD, Action, split_chunks
from .chunks import ChunkModule
from .executor import StepExecutor
from .local import LocalTransport

PROGRAM = ("zbv", 1, 8)          # schedule, ranks, micro-batches: F, I and W of two chunks, hand-offs local


class _NearFree(nn.Module):
    """One multiply by a one-element weight: a layer with a weight and an input gradient, costing next to
    nothing, so what is timed around it is the runtime's."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.weight


class Shape:
    """How a shaped layer uses the core: idle ``idle_s``, then busy ``busy_s``, per op; ``inside`` adds up the
    seconds spent so (the ``clock`` of :func:`layer_costs` and :func:`time_per_action`)."""

    def __init__(self, idle_s: float, busy_s: float):
        self.idle_s, self.busy_s, self.inside = idle_s, busy_s, 0.0

    def wait_then_work(self) -> None:
        start = time.perf_counter()
        if self.idle_s > 0:
            time.sleep(self.idle_s)
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            pass
        self.inside += time.perf_counter() - start


class _ShapedPath(torch.autograd.Function):
    """The identity whose backward waits, then computes (``Shape.wait_then_work``)."""

    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = shape
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.shape.wait_then_work()
        return grad, None


class ShapedLayer(nn.Module):
    """A layer whose forward, input-grad and weight-grad each leave the core idle, then compute, as ``shape``
    says: the model's layers as the core sees them (the profile's ``fwd_idle`` and the rest of ``fwd``), for
    the host time per action around them."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.shape = shape

    def forward(self, x):
        self.shape.wait_then_work()
        return _ShapedPath.apply(x, self.shape) + _ShapedPath.apply(self.weight, self.shape) * 0.0


class _OneRank:
    """The execution context of the one-rank program: the runtime's chunk class, a sum as the loss, no syncs, and
    the in-process transport (a one-rank program has no messages). The input needs a gradient, as a
    later stage's does: every input-grad action then computes one, as the layer costs' I does."""

    def __init__(self, schedule, width: int, device, make_layer):
        self.placement, self.pipe_rank, self.transport = schedule.placement, 0, LocalTransport({})
        self.split_chunks = split_chunks(schedule.orders[0])
        self.chunks = {}
        for chunk in schedule.placement.chunks:
            layer = make_layer().to(device)
            self.chunks[chunk.index] = ChunkModule(chunk.index, chunk.stage, 0, [layer], [layer])
        self.x = torch.randn(1, width, device=device, requires_grad=True)

    def load_input(self, chunk, mb):
        return self.x

    def forward(self, chunk, mb, x, capture, train):
        return self.chunks[chunk](x, capture)

    def loss(self, output, chunk, mb):
        return output.sum()

    def backward_done(self, chunk, mb):
        pass

    def start_grad_sync(self, stage):
        pass

    def wait_grad_syncs(self, stages):
        pass

    def clip_gradients(self, scope, stage):
        pass

    def optimizer_step(self, chunks):
        for module in self.chunks.values():
            for p in module.parameters():
                p.grad = None


def _outside_waits(work, clock=None) -> tuple:
    """(seconds ``work()`` took, less the shaped layers' waits in it where ``clock`` is their :class:`Shape`;
    its result)."""
    waited = clock.inside if clock is not None else 0.0
    start = time.perf_counter()
    out = work()
    return time.perf_counter() - start - ((clock.inside - waited) if clock is not None else 0.0), out


def layer_costs(make_layer, width: int, device, rounds: int, clock=None) -> dict:
    """The layer's own forward, input-grad and weight-grad (median seconds), timed as the profiler times a
    layer, and the loss. ``clock`` (a :class:`Shape`): the time the layer spends in its waits, read as it goes,
    is left out of each (:func:`time_per_action` leaves it out of the program's runs too)."""
    layer = make_layer().to(device)
    params = [p for p in layer.parameters() if p.requires_grad]
    times = {"F": [], "I": [], "W": [], "loss": []}

    def timed(kind, work):
        seconds, out = _outside_waits(work, clock)
        times[kind].append(seconds)
        return out
    for _ in range(rounds):
        x = torch.randn(1, width, device=device, requires_grad=True)
        y = timed("F", lambda: layer(x))
        loss = timed("loss", y.sum)
        grads = [torch.ones_like(y)]
        timed("I", lambda: autograd_calls.grad([y], [x], grads, retain_graph=True))
        timed("W", lambda: autograd_calls.grad([y], params, grads))
        del loss
    return {kind: statistics.median(values) for kind, values in times.items()}


def measure_dispatch(device="cpu", rounds: int = 30, width: int = 16, layer=None, idle_s: float = 0.0,
                     busy_s: float = 0.0) -> float:
    """Seconds of the runtime's host time per compute action on this process (see the module docstring):
    the median over ``rounds`` runs of the one-rank program, each less the layer's own costs timed beside it,
    per action (:func:`time_per_action`).

    ``layer``: a function making the layer each chunk holds (a module mapping a (1, ``width``) tensor to one of
    the same shape, with a parameter and an input gradient); near-free by default. ``idle_s`` (> 0, no
    ``layer``): around :class:`ShapedLayer` ``(idle_s, busy_s)`` instead, a layer that waits as the model's do
    (the planner passes the profile's mean layer: ``fwd_idle`` and the rest of ``fwd``).
    The random state is left as it was: training after planning starts as it would have."""
    clock = None
    if layer is None and idle_s > 0:
        clock = Shape(idle_s, busy_s)

        def layer():
            return ShapedLayer(clock)
    with torch.random.fork_rng(devices=[]):
        return _measure(device, rounds, width, layer or _NearFree, clock)


def _measure(device, rounds: int, width: int, make_layer, clock=None) -> float:
    schedule, ops = one_rank_program()
    executor = StepExecutor(_OneRank(schedule, width, device, make_layer))
    scale = 1.0 / PROGRAM[2]
    return time_per_action(lambda: executor.run(ops, train=True, scale=scale), make_layer, width, device, rounds,
                           clock)


@functools.lru_cache(maxsize=1)
def one_rank_program() -> tuple:
    """(schedule, its one rank's lowered ops) of :data:`PROGRAM`."""
    name, ranks, n = PROGRAM
    schedule = registry.get(name)(ranks, n)
    return schedule, schedule.lower().ops[0]


PAIRED_REPS = 7       # the layers' own costs timed this many times in each round, beside that round's run


def time_per_action(run, make_layer, width: int, device, rounds: int, clock=None) -> float:
    """Seconds per compute action of ``run()``, a call that runs :data:`PROGRAM` once over chunks of one
    ``make_layer()`` layer each, less the layers' own costs and the loss: the host time per action of whatever
    runs the program (the runtime's executor here; the Megatron contract in ``benchmarks/schedules.py``).
    Each of ``rounds`` rounds, after three calls to warm up (allocations, the engine's first calls), times one
    call and then the layers' own costs (:data:`PAIRED_REPS` times each), and takes the difference: the host's
    speed drifts (other ranks, other work), and a difference of two timings taken apart from each other carries
    the drift between them (eight measurements around waiting layers: 0.005-0.145 ms per action timed apart,
    0.061-0.098 paired: docs/investigations/zero-bubble-host-time.md, part 7). The median over the
    rounds. ``clock`` (the layers' :class:`Shape`): their waits, read in each run, are left out of it and of the
    layers' costs, so a wait's wake-up, which varies from call to call, is not taken for the runtime's."""
    schedule, ops = one_rank_program()
    kinds = [str(op.kind) for op in ops if type(op) is Action]
    last = {c.index for c in schedule.placement.chunks if schedule.placement.next_chunk(c.index) is None}
    losses = sum(1 for op in ops if type(op) is Action and op.kind == FORWARD and op.chunk in last)
    for _ in range(3):
        run()
    per_action = []
    for _ in range(rounds):
        seconds = _outside_waits(run, clock)[0]
        own = layer_costs(make_layer, width, device, PAIRED_REPS, clock)
        layers = sum(own.get(kind, own["I"] + own["W"] if kind == "B" else 0.0) for kind in kinds)
        per_action.append((seconds - layers - losses * own["loss"]) / len(kinds))
    return max(0.0, statistics.median(per_action))
