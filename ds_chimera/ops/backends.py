"""Kernel backends for the convolution ops, found through the ``ds_chimera.kernels`` entry points.

A backend provides the six primitive functions (forward, input grad, weight grad for
LightConv and DynamicConv) on some devices, and may provide ``lightconv_backward`` /
``dynamicconv_backward`` (grad, x, weight, padding_l) -> (grad_x, grad_w), which compute
both gradients in one pass, and ``lightconv_step`` / ``dynamicconv_step`` (buffer, x,
weight, position) -> y, one decoding step. Inputs come with any strides. Built in: ``torch`` (the reference, anywhere),
``cpp`` (csrc/, CPU) and ``triton`` (CUDA; CPU under TRITON_INTERPRET=1). The choice is,
in order: an explicit ``backend=`` argument, ``DS_CHIMERA_KERNEL``, then the fastest
available for the tensor's device. Falling back from the preferred backend warns once.
A third-party package adds one with
``entry_points={"ds_chimera.kernels": ["mine = mypkg.kernels:MyBackend"]}``.
"""
from __future__ import annotations

import functools
import logging
import os
import warnings
from importlib import metadata

import torch

from . import reference

ENTRY_POINT_GROUP = "ds_chimera.kernels"
ENV_VAR = "DS_CHIMERA_KERNEL"
FUNCTIONS = ("lightconv_forward", "lightconv_backward_input", "lightconv_backward_weight",
             "dynamicconv_forward", "dynamicconv_backward_input", "dynamicconv_backward_weight")
# optional: both gradients in one pass; the ops fall back to the two gradient functions
FUSED_FUNCTIONS = ("lightconv_backward", "dynamicconv_backward")
# optional: one causal decoding step (buffer, x, weight, position); the fallback is the reference
STEP_FUNCTIONS = ("lightconv_step", "dynamicconv_step")
log = logging.getLogger(__name__)


class TorchBackend:
    """Pure PyTorch: the unfold reference and its exact gradients, on any device."""

    name = "torch"
    description = "pure PyTorch (unfold), any device; the reference"

    def available(self, device: torch.device):
        return True, ""

    lightconv_forward = staticmethod(reference.lightconv_unfold)
    dynamicconv_forward = staticmethod(reference.dynamicconv_unfold)
    lightconv_step = staticmethod(reference.lightconv_step)
    dynamicconv_step = staticmethod(reference.dynamicconv_step)

    @staticmethod
    def lightconv_backward_input(grad, weight, padding_l):
        # gx[s] = sum_k w[k] gy[s - k + P]: the forward with the kernel reversed, padding K-1-P
        return reference.lightconv_unfold(grad, weight.flip(-1), weight.shape[1] - 1 - padding_l)

    @staticmethod
    def lightconv_backward_weight(grad, x, padding_l, heads, kernel):
        batch, channels, time = x.shape
        acc = reference.accum_dtype(x)
        win = reference._windows(x.to(acc), kernel, padding_l)               # (B, C, T, K)
        gw = torch.einsum("bct,bctk->ck", grad.to(acc), win)
        return gw.view(heads, channels // heads, kernel).sum(1).to(x.dtype)

    @staticmethod
    def dynamicconv_backward_input(grad, weight, padding_l):
        # gx[s] = sum_k w[k, t] gy[t] with t = s - k + P: each tap's product shifted by k - P
        batch, channels, time = grad.shape
        heads, kernel = weight.shape[1], weight.shape[2]
        acc = reference.accum_dtype(grad)
        gy = grad.to(acc).reshape(batch, heads, channels // heads, time)
        out = torch.zeros_like(gy)
        for k in range(kernel):
            z = gy * weight[:, :, k, :].to(acc).unsqueeze(2)
            shift = k - padding_l
            if shift >= 0:
                out[..., shift:] += z[..., :time - shift] if shift < time else 0
            elif -shift < time:
                out[..., :time + shift] += z[..., -shift:]
        return out.reshape(batch, channels, time).to(grad.dtype)

    @staticmethod
    def dynamicconv_backward_weight(grad, x, padding_l, heads, kernel):
        batch, channels, time = x.shape
        acc = reference.accum_dtype(x)
        win = reference._windows(x.to(acc), kernel, padding_l).reshape(batch, heads, channels // heads, time, kernel)
        gw = torch.einsum("bhgt,bhgtk->bhkt", grad.to(acc).reshape(batch, heads, channels // heads, time), win)
        return gw.to(x.dtype)


class CppBackend:
    """csrc/lightconv_cpu.cpp, JIT-compiled on first use (CPU)."""

    name = "cpp"
    description = "native C++ (csrc/), CPU, built on first use"

    def available(self, device: torch.device):
        if device.type != "cpu":
            return False, f"the cpp backend runs on CPU tensors, got {device.type}"
        from . import cpp_backend
        if not cpp_backend.available():
            return False, "the C++ extension could not be built (see the warning above)"
        return True, ""

    def __getattr__(self, name):
        if name in FUNCTIONS or name in FUSED_FUNCTIONS or name in STEP_FUNCTIONS:
            from . import cpp_backend
            return getattr(cpp_backend.load(), name)
        raise AttributeError(name)


class TritonBackend:
    """ds_chimera/ops/triton_kernels.py: CUDA, or CPU under TRITON_INTERPRET=1 (slow, for tests)."""

    name = "triton"
    description = "Triton kernels, CUDA (CPU only with TRITON_INTERPRET=1)"

    def available(self, device: torch.device):
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "triton is not installed"
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return True, ""
        return False, f"triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device.type}"

    def __getattr__(self, name):
        if name in FUNCTIONS or name in FUSED_FUNCTIONS or name in STEP_FUNCTIONS:
            from . import triton_kernels
            return getattr(triton_kernels, name)
        raise AttributeError(name)


def step_function(backend, name: str):
    """The backend's decoding step ``name``, or the reference's where it has none."""
    return getattr(backend, name, None) or getattr(reference, name)


PREFERENCE = {"cuda": ("triton", "torch"), "cpu": ("cpp", "torch")}


@functools.lru_cache(maxsize=None)
def available_backends() -> dict:
    """name -> backend instance: built-ins, then entry-point plugins."""
    found = {b.name: b for b in (TorchBackend(), CppBackend(), TritonBackend())}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and ep.value.startswith("ds_chimera."):
            continue
        try:
            obj = ep.load()
            found[ep.name] = obj() if isinstance(obj, type) else obj
        except Exception as exc:
            log.warning("kernel backend plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)
    return found


_warned: set = set()


def select(device: torch.device, name: str | None = None):
    """The backend to use for tensors on ``device``; a named one must exist and be usable."""
    backends = available_backends()
    name = name or os.environ.get(ENV_VAR) or None
    if name:
        if name not in backends:
            raise ValueError(f"unknown kernel backend {name!r}; available: {', '.join(sorted(backends))}")
        ok, why = backends[name].available(device)
        if not ok:
            raise ValueError(f"kernel backend {name!r} cannot run here: {why}")
        return backends[name]
    order = PREFERENCE.get(device.type, ("torch",))
    for candidate in order:
        ok, why = backends[candidate].available(device)
        if ok:
            if candidate != order[0] and (device.type, order[0]) not in _warned:
                _warned.add((device.type, order[0]))
                reason = backends[order[0]].available(device)[1]
                warnings.warn(f"ds_chimera: the {order[0]} kernels are unavailable on {device.type} ({reason}); "
                              f"using the {candidate} backend", RuntimeWarning, stacklevel=3)
            return backends[candidate]
    return backends["torch"]
