"""The optimizer step of one stage's worth of weights: what every synchronous step ends with.

It is not the same for every candidate: a rank steps the weights it holds, and Chimera's ranks hold 2f stage
copies (two with one pipeline per direction, four with two), an interleaved or looped rank its chunks' share.
The simulator prices it as ``Costs.step`` (a chunk pays it times its size); :func:`measure_step` times it here.

Timed on the profiling rank with the job's optimizer kind (the instance's class and settings, else the config's
``"optimizer"`` type, else Adam), over one tensor per layer of a mean stage's parameters (the model's parameters
over the pipeline's stages), gradients set. A stage with more than ``cap`` elements is timed on ``cap`` of them
and scaled: the step of a big stage is bound by its bytes. On CPU each timed step follows an idle of
``idle_s``, as the step follows the wait for the last gradient sync (the first code after a wait runs on a cold
core: docs/investigations/zero-bubble-host-time.md, part 4). ``zero_grad`` is timed with it: the engine clears
the gradients in the same call.
"""
from __future__ import annotations

import inspect
import math
import statistics
import time

import torch

from ..logs import get_logger
from .profile import _Clock

TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
                    "adagrad": torch.optim.Adagrad}
CAP_ELEMENTS = 1 << 25          # 128 MiB of fp32 weights (and as much per moment) at most, timed
IDLE_S = 0.005                  # the wait before the step on CPU: the last gradient sync's


def optimizer_maker(config: dict, optimizer=None) -> tuple:
    """(``make(params) -> torch.optim.Optimizer``, a description): the optimizer the job steps with, or the
    torch optimizer closest to it. An instance (or the ``template`` a callable rebuilds, the HF Trainer's) is
    rebuilt with its own class and first group's settings; a config ``"optimizer"`` section names a type (SGD,
    Adam, AdamW, Adagrad; any other, such as Lamb or a 1-bit optimizer, is timed as Adam, whose state and work
    per parameter it shares); neither: Adam, DeepSpeed's usual pick."""
    optimizer = getattr(optimizer, "template", optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        return (lambda params: _build(cls, params, settings)), cls.__name__
    section = (config or {}).get("optimizer") or {}
    name = str(section.get("type", "adam")).lower()
    cls = TORCH_OPTIMIZERS.get(name, torch.optim.Adam)
    settings = dict(section.get("params") or {})
    described = cls.__name__ if name in TORCH_OPTIMIZERS else f"{cls.__name__} (for {section.get('type', 'adam')})"
    return (lambda params: _build(cls, params, settings)), described


def _build(cls, params, settings: dict):
    """``cls(params, **settings)`` with the settings its constructor takes (DeepSpeed's sections carry others)."""
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        settings = {k: v for k, v in settings.items() if k in accepted}
    if "betas" in settings:
        settings["betas"] = tuple(settings["betas"])
    return cls(params, **settings)


def stage_tensors(param_counts: list, stages: int, cap: int = CAP_ELEMENTS) -> tuple:
    """(element counts of a mean stage's tensors, the scale from them to the stage): one tensor per layer with
    parameters, the mean stage holding ``1/stages`` of the layers and of their parameters."""
    counts = [n for n in param_counts if n > 0]
    if not counts:
        return [], 0.0
    per_stage = max(1, round(len(counts) / stages))
    total = sum(counts) / stages
    size = max(1, int(total // per_stage))
    tensors = [size] * per_stage
    timed = sum(tensors)
    if timed > cap:
        tensors = [max(1, size * cap // timed)] * per_stage
    return tensors, total / sum(tensors)


def measure_step(make_optimizer, param_counts: list, stages: int, device, rounds: int = 9,
                 idle_s: float = IDLE_S, cap: int = CAP_ELEMENTS) -> float:
    """Seconds of one optimizer step (with its ``zero_grad``) over a mean stage's weights; 0 without parameters.

    ``param_counts``: the trainable parameters of each layer, in order. The median of ``rounds`` steps after two
    that create the optimizer's state."""
    tensors, scale = stage_tensors(param_counts, stages, cap)
    if not tensors:
        return 0.0
    device = torch.device(device)
    cuda = device.type == "cuda"
    clock = _Clock(device)           # device events on GPU, the host clock on CPU: as the layers are timed
    params = [torch.zeros(n, device=device, requires_grad=True) for n in tensors]
    grads = [torch.full((n,), 1e-3, device=device) for n in tensors]      # no random draw: training's stream intact
    times = []
    try:
        opt = make_optimizer(params)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)
        for i in range(rounds + 2):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            if not cuda:
                time.sleep(idle_s)
            seconds = clock.time(step)
            if i >= 2:
                times.append(seconds)
    finally:
        # the timing's weights, gradients and optimizer state leave the device's cache: the memory budget the
        # planner reads next (mem_get_info) is then what training has
        opt = params = grads = None
        if cuda:
            torch.cuda.empty_cache()
    return statistics.median(times) * scale


def measured_step_s(config: dict, optimizer, param_counts: list, stages: int, device) -> float:
    """:func:`measure_step` for the job's optimizer, or 0 (logged) where it cannot be rebuilt apart from the job:
    the step is then not priced, as before it was measured. Under ZeRO-Offload the optimizer steps on the CPU,
    and is timed there."""
    make, described = optimizer_maker(config, optimizer)
    offload = (((config or {}).get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
    if offload in ("cpu", "nvme"):
        device = "cpu"
    try:
        seconds = measure_step(make, param_counts, stages, device)
    except Exception as exc:            # noqa: BLE001  (an optimizer this cannot rebuild: price no step, say so)
        get_logger().warning("schedule auto: the optimizer step could not be timed with %s (%s: %s); the "
                             "planner prices no optimizer step", described, type(exc).__name__, exc)
        return 0.0
    if not math.isfinite(seconds):
        return 0.0
    get_logger().info("schedule auto: optimizer step of one stage's weights (%s): %.3g ms", described,
                      seconds * 1e3)
    return seconds
