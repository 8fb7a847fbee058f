"""Let Megatron-Core's models run on CPU (tests, examples, laptops).

Megatron-Core 0.16 allocates two things on ``torch.cuda.current_device()`` unconditionally:
the attention's scratch buffer (``GlobalMemoryBuffer``) and the dropout RNG states
(``CudaRNGStatesTracker``), and its distributed-checkpoint writer calls
``torch.cuda.synchronize()`` and allocates on ``torch.cuda.current_device()``. Where no CUDA
device exists, :func:`enable_cpu` makes the buffer follow the CPU, the tracker's ``fork``
use torch's default generator, ``torch.cuda.synchronize`` do nothing (there is no device to
wait for) and ``torch.cuda.current_device`` name the CPU. Nothing changes where CUDA is
available. Models must also be given an explicit attention mask: Megatron's
default causal mask is built on CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import operator

import torch

_ENABLED = False


def enable_cpu() -> bool:
    """Install the CPU fallbacks once; returns True when they are active (no CUDA here)."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    from megatron.core import utils
    from megatron.core.tensor_parallel import random as tp_random

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        needed = functools.reduce(operator.mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < needed:
            buffer = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype)
        return buffer[:needed].view(*tensor_shape)

    def fork(self, name=None):
        # one generator on CPU: dropout inside "model-parallel" regions draws from torch's default
        return contextlib.nullcontext()

    utils.GlobalMemoryBuffer.get_tensor = get_tensor
    tp_random.CudaRNGStatesTracker.fork = fork
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    _ENABLED = True
    return True


def causal_mask(seq_length: int, device=None) -> torch.Tensor:
    """Megatron's attention mask convention: True where a query must not see a key."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]
