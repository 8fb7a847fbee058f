"""A profile of the user's own model on its own device: what the planner prices schedules with.

Per layer: forward, full backward and weight-grad times of one micro-batch, the bytes it leaves
saved for the backward, the bytes of its output (what crosses a stage boundary after it) and of
its trainable parameters. Timed with device events on GPU and the clock on CPU, repeated until
the median is stable. The links (point-to-point latency, bandwidth and the runtime's host time
per message; the data-parallel all-reduce) are measured by :mod:`.links`.

A layer is timed alone, on the real activations of the layers before it: the first micro-batch
runs forward through the whole model once, one layer at a time, so at most one layer built
from a ``LayerSpec`` is alive at once.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import autograd_calls
from ..tensor_tree import map_tensors

PROFILE_VERSION = 1


@dataclass(frozen=True)
class LayerCost:
    """One layer's measured costs for one micro-batch (seconds and bytes)."""

    name: str
    fwd: float
    bwd: float                  # full backward: input-grad and weight-grad together
    wgrad: float                # the weight-grad part of a split backward (0 without parameters)
    activation_bytes: int       # saved for the backward (parameters not counted)
    output_bytes: int           # the layer's output: a message if a stage ends after it
    param_bytes: int            # trainable parameters
    params: int = 0
    fwd_idle: float = 0.0       # of ``fwd``, the time the process used no CPU (a layer that waits); 0 on GPU


@dataclass(frozen=True)
class Links:
    """What messages and collectives cost on this job's devices (seconds, bytes per second)."""

    p2p_latency_s: float = 0.0          # one small message, one way
    p2p_bytes_per_s: float = 0.0        # 0: unmeasured, sizes not priced
    send_s: float = 0.0                 # the sender's own host time per message
    recv_s: float = 0.0                 # the receiver's own host time per message
    allreduce_latency_s: float = 0.0    # one all-reduce of a small tensor over a stage's replicas
    allreduce_bytes_per_s: float = 0.0  # ... and its bandwidth (0: sizes not priced)
    wide_allreduce_latency_s: float = 0.0    # the same over every pipeline rank (stages with > 2 replicas)
    wide_allreduce_bytes_per_s: float = 0.0
    sync_post_s: float = 0.0                 # a rank's own time to post one stage's gradient sync
    dispatch_s: float = 0.0                  # the runtime's host time per compute action (runtime/host_cost.py)

    def message_s(self, nbytes: float) -> float:
        return self.p2p_latency_s + (nbytes / self.p2p_bytes_per_s if self.p2p_bytes_per_s else 0.0)

    def allreduce_s(self, nbytes: float, members: int = 2) -> float:
        """One all-reduce of ``nbytes`` over ``members`` ranks: the pair (or data-parallel) figure up to two
        members, the whole pipeline's beyond."""
        if members > 2 and self.wide_allreduce_latency_s:
            latency, rate = self.wide_allreduce_latency_s, self.wide_allreduce_bytes_per_s
        else:
            latency, rate = self.allreduce_latency_s, self.allreduce_bytes_per_s
        return latency + (nbytes / rate if rate else 0.0)


@dataclass(frozen=True)
class Profile:
    """The measured model: its layers in order, the links, and where they were measured."""

    layers: tuple
    links: Links = Links()
    micro_batch_size: int = 1
    device: str = "cpu"
    optimizer_state_bytes_per_param: int = 8     # Adam's two fp32 moments; SGD with momentum 4, plain SGD 0
    meta: dict = field(default_factory=dict)
    optimizer_step_s: float = 0.0                # one stage's worth of weights stepped (optimizer_cost.py); 0: unpriced

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, "layers": [asdict(layer) for layer in self.layers],
                "links": asdict(self.links), "micro_batch_size": self.micro_batch_size, "device": self.device,
                "optimizer_state_bytes_per_param": self.optimizer_state_bytes_per_param, "meta": self.meta,
                "optimizer_step_s": self.optimizer_step_s}

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION or "layers" not in data:
            raise ValueError(f"not a ds_chimera profile (version {PROFILE_VERSION}): expected a JSON object with "
                             f'"version": {PROFILE_VERSION} and "layers"')
        layers = tuple(LayerCost(**_known(LayerCost, layer)) for layer in data["layers"])
        if not layers:
            raise ValueError("the profile has no layers")
        return cls(layers, Links(**_known(Links, data.get("links", {}))), int(data.get("micro_batch_size", 1)),
                   str(data.get("device", "cpu")), int(data.get("optimizer_state_bytes_per_param", 8)),
                   dict(data.get("meta", {})), float(data.get("optimizer_step_s", 0.0)))

    def save(self, path: str) -> None:
        from ..atomic import write_json_atomic
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as fh:
            return cls.from_json(json.load(fh))


def _known(cls, fields: dict) -> dict:
    """The entries of ``fields`` that ``cls`` has: a profile a later version wrote, with more, still loads."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in fields.items() if k in names}


def rng_devices(device) -> list:
    """What ``torch.random.fork_rng`` must save besides the CPU generator: ``device`` where it is a GPU."""
    device = torch.device(device)
    return [device] if device.type == "cuda" else []


# ---- timing ------------------------------------------------------------------------------------

class _Clock:
    """Elapsed seconds of a piece of work: device events on GPU, the clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, work) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            work()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        work()
        return time.perf_counter() - begin


def stable_median(measure, min_reps: int = 3, max_reps: int = 25, rel_spread: float = 0.05,
                  budget_s: float = 2.0, agree=None) -> float:
    """The median of ``measure()`` once the middle half of the samples lies within ``rel_spread`` of it,
    or after ``max_reps`` samples or ``budget_s`` seconds (a slow layer is measured fewer times).

    ``agree(done) -> done``: where ``measure`` is a collective (a tensor-parallel layer, timed by its whole
    tensor group), every member must stop at the same sample: ``agree`` turns this rank's decision into the
    group's."""
    samples, begin = [], time.perf_counter()
    while True:
        samples.append(measure())
        done, median = False, None
        if len(samples) >= min_reps:
            ordered = sorted(samples)
            median = statistics.median(ordered)
            quarter = len(ordered) // 4
            spread = ordered[-1 - quarter] - ordered[quarter]
            done = median <= 0 or spread <= rel_spread * median or len(samples) >= max_reps or \
                time.perf_counter() - begin > budget_s
        if agree is not None:
            done = agree(done)
        if done:
            return median if median is not None else statistics.median(samples)


# ---- one layer ---------------------------------------------------------------------------------

def _tensors(value) -> list:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _detached(value):
    """The layer's output as the next layer's input: detached, floating tensors requiring grad."""
    return map_tensors(value, lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t.detach())


def _as_given(value):
    """``value`` detached, each tensor requiring grad only where it did."""
    return map_tensors(value, lambda t: t.detach().requires_grad_(t.requires_grad))


def _trainable_params(func) -> list:
    """The trainable parameters of a layer: a module, or a tied module's ``partial(forward_fn, module)``."""
    module = func.args[0] if hasattr(func, "args") and func.args and isinstance(func.args[0], torch.nn.Module) \
        else func
    return [p for p in module.parameters() if p.requires_grad] if isinstance(module, torch.nn.Module) else []


def _fresh(value):
    """``value`` with each tensor that requires grad replaced by a non-leaf copy (the leaf's gradient still
    flows): what a layer's in-place first operation may modify."""
    return map_tensors(value, lambda t: t.clone() if t.requires_grad else t)


def _saved_bytes(run, params: set) -> tuple:
    """(output, bytes saved for the backward by ``run()``): each storage once, parameters left out."""
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.device.type)
        if id(t) not in params and t.untyped_storage().data_ptr() not in params and key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, total[0]


def profile_layer(func, x, name: str, device: torch.device, loss=None, **reps) -> tuple:
    """Time ``func`` on input ``x`` (and ``loss(output)`` after it, for the last layer).

    Returns (LayerCost, the output as the next layer's input).
    """
    params = _trainable_params(func)
    param_ids = {id(p) for p in params} | {p.untyped_storage().data_ptr() for p in params}
    inputs = [t for t in _tensors(x) if t.requires_grad]
    clock = _Clock(device)

    def forward():
        # each call gets its own non-leaf copy of the input: an in-place first op (ReLU(inplace=True)) may
        # then modify it, as it does a received activation in training, and ``x`` stays intact for the next call
        out = func(_fresh(x))
        return loss(out) if loss is not None else out

    def seeds(out):
        outs = [t for t in _tensors(out) if t.requires_grad]
        return outs, [torch.ones_like(t) for t in outs]

    out, saved = _saved_bytes(forward, param_ids)
    with torch.no_grad():
        result = func(_fresh(x))
    fwd = stable_median(lambda: clock.time(forward), **reps)
    idle = _idle_time(forward) if device.type == "cpu" else 0.0
    trainable = bool(params) or bool(inputs)

    def full_backward():
        out = forward()
        outs, grads = seeds(out)
        if outs:
            clock_s = clock.time(lambda: autograd_calls.backward(outs, grads))
            for p in params:
                p.grad = None
            return clock_s
        return 0.0

    bwd = stable_median(full_backward, **reps) if trainable else 0.0

    def weight_grad():
        out = forward()
        outs, grads = seeds(out)
        if not outs:
            return 0.0
        if inputs:
            autograd_calls.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
        return clock.time(lambda: autograd_calls.grad(outs, params, grads, allow_unused=True))

    wgrad = min(bwd, stable_median(weight_grad, **reps)) if params and inputs else (bwd if params else 0.0)
    cost = LayerCost(name=name, fwd=fwd, bwd=bwd, wgrad=wgrad, activation_bytes=int(saved),
                     output_bytes=_nbytes(result), param_bytes=sum(p.numel() * p.element_size() for p in params),
                     params=sum(p.numel() for p in params), fwd_idle=min(idle, fwd))
    del out
    return cost, _detached(result)


def _idle_time(forward, reps: int = 3) -> float:
    """Median seconds of ``forward()`` in which this process used no CPU (wall time less CPU time): a layer that
    leaves the core idle (it waits) makes the runtime's code after it run on a cold core, which the host time
    per action is then measured around (``runtime.host_cost``). Compute on several threads counts once per
    thread, so a parallel layer is not idle; OpenMP workers that spin after a parallel op count as busy too
    (``OMP_WAIT_POLICY=passive`` stops them)."""
    samples = []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        forward()
        samples.append(max(0.0, (time.perf_counter() - wall) - (time.process_time() - cpu)))
    return statistics.median(samples)


def profile_layers(factories: list, first_input, device, loss=None, **reps) -> list:
    """Profile a sequence of layers: ``factories`` holds (name, build) pairs, ``build()`` returning the layer's
    callable; each is built just before it is timed and dropped after, so one built layer is alive at a time.
    ``loss(output)`` closes the last layer. Returns a LayerCost per layer, in order.

    ``first_input`` is taken as given: the runtime computes no gradient for the data a first stage loads, so
    the first layer's input-grad is timed only where the input requires one (each later layer's input does)."""
    costs, x = [], _as_given(first_input)
    for index, (name, build) in enumerate(factories):
        last = index == len(factories) - 1
        layer = build()
        try:
            cost, x = profile_layer(layer, x, name, device, loss if last else None, **reps)
        except Exception as exc:        # noqa: BLE001  (any layer a model has: price it, never stop the run)
            cost, x = _priced_from_forward(layer, x, name, device, exc, **reps)
        costs.append(cost)
    return costs


def _priced_from_forward(func, x, name: str, device, error: Exception, **reps) -> tuple:
    """A layer whose backward could not be timed alone (it needs state only training sets up, say) is priced
    from its forward, with the usual ratios: backward = 2 x forward, weight-grad = forward (0 without
    parameters). Logged; a layer whose forward fails too cannot train either, and that is raised."""
    from ..logs import get_logger
    clock = _Clock(device)
    try:
        with torch.no_grad():
            result = func(_fresh(x))
            fwd = stable_median(lambda: clock.time(lambda: func(_fresh(x))), **reps)
    except Exception as exc:            # noqa: BLE001
        raise ValueError(f'"schedule": "auto": layer {name} fails when the profiler runs it alone on the first '
                         f"micro-batch ({type(exc).__name__}: {exc}), so it cannot be timed; name a schedule instead "
                         f"of auto, or a profile_file measured elsewhere") from exc
    params = _trainable_params(func)
    get_logger().warning("schedule auto: layer %s could not be timed in the backward (%s: %s); priced from its "
                         "forward (%.3g ms): backward = 2 x forward, weight-grad = forward", name,
                         type(error).__name__, error, fwd * 1e3)
    cost = LayerCost(name=name, fwd=fwd, bwd=2 * fwd, wgrad=fwd if params else 0.0, activation_bytes=_nbytes(result),
                     output_bytes=_nbytes(result), param_bytes=sum(p.numel() * p.element_size() for p in params),
                     params=sum(p.numel() for p in params))
    return cost, _detached(result)


def profile_sequential(layers: list, inputs, loss=None, device=None, micro_batch_size: int = 1,
                       optimizer_state_bytes_per_param: int = 8) -> Profile:
    """A Profile of a model given as a list of layers (modules or callables) on one micro-batch ``inputs``;
    ``loss(output)`` closes the last layer. For ``ds-chimera plan`` outside a training run."""
    device = torch.device(device or "cpu")
    factories = [(f"{i}:{type(layer).__name__}", (lambda layer=layer: layer)) for i, layer in enumerate(layers)]
    with torch.random.fork_rng(devices=rng_devices(device)):
        costs = profile_layers(factories, inputs, device, loss)
    return Profile(tuple(costs), micro_batch_size=micro_batch_size, device=str(device),
                   optimizer_state_bytes_per_param=optimizer_state_bytes_per_param)
