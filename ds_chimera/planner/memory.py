"""Memory per rank of a planned pipeline: model states by precision and ZeRO stage, activations at
the schedule's peak, the gathered weights of ZeRO-3, and the communication buffers.

Model states per parameter (bytes), as DeepSpeed's optimizers keep them:

- fp32: weight 4, gradient 4, optimizer state ``k`` (Adam's two moments: 8; SGD with momentum: 4);
- bf16: weight 2, gradient 2, fp32 master 4, fp32 gradient accumulator 4, optimizer state ``k``;
- fp16: weight 2, gradient 2, fp32 master 4, the master's fp32 gradient 4 (the unscaled copy the step and the
  clip read), optimizer state ``k``.

ZeRO divides what it shards by the data-parallel size: stage 1 the master weights and optimizer
state, stage 2 the gradients too, stage 3 the weights too (and then holds gathered chunks).

The activations are counted along each rank's order (a forward adds its stage's saved bytes, a
full backward or a weight-grad frees them): the peak does not depend on timing, so it is the
simulator's and the runtime's (measured equal on the DeepSpeed runtime: tests/test_runtime_deepspeed*.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedules.actions import activation_peaks

GIB = 1024 ** 3


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak bytes, by what holds them."""

    model_states: float
    activations: float
    gathered: float
    buffers: float

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.gathered + self.buffers


def state_bytes_per_param(precision: str, zero: int, data_parallel: int, optimizer_bytes: int) -> float:
    """Bytes of model states one parameter costs a rank (see the module docstring)."""
    dp = max(1, data_parallel)
    if precision in ("bf16", "fp16"):
        weight, grad, master = 2.0, 2.0 + 4.0, 4.0 + optimizer_bytes
    else:
        weight, grad, master = 4.0, 4.0, float(optimizer_bytes)
    if zero >= 1:
        master /= dp
    if zero >= 2:
        grad /= dp
    if zero >= 3:
        weight /= dp
    return weight + grad + master


def rank_params(placement, stage_params: list) -> list:
    """Each rank's parameters: the sum over its chunks of their stages' (replicas count once per chunk)."""
    held = [0] * placement.num_ranks
    for c in placement.chunks:
        held[c.rank] += stage_params[c.stage]
    return held


def rank_memory(schedule, program, stage_params: list, stage_act: list, stage_out: list, *, precision: str,
                zero: int, data_parallel: int, optimizer_bytes: int) -> list:
    """RankMemory of every pipeline rank for ``schedule`` (its lowered ``program``) on a cut whose stages
    hold ``stage_params`` parameters, save ``stage_act`` bytes and send ``stage_out`` bytes per micro-batch."""
    placement = schedule.placement
    per_param = state_bytes_per_param(precision, zero, data_parallel, optimizer_bytes)
    chunk_stage = [c.stage for c in placement.chunks]
    acts = activation_peaks(schedule.orders, [stage_act[s] for s in chunk_stage])
    plain = placement.weights_per_rank()
    versions = program.weights or plain         # asynchronous schedules: weight versions beyond the placement's
    weight_bytes = 2.0 if precision == "bf16" else 4.0
    out = []
    held = rank_params(placement, stage_params)
    for r in range(placement.num_ranks):
        chunks = placement.chunks_on(r)
        params = held[r]
        extra_versions = (versions[r] / plain[r] - 1.0) if plain[r] else 0.0
        states = params * per_param + max(0.0, extra_versions) * params * weight_bytes
        gathered = 0.0
        if zero >= 3:       # the chunks gathered at once: at most two (one computing, the next prefetched)
            biggest = sorted((stage_params[chunk_stage[c]] for c in chunks), reverse=True)[:2]
            gathered = sum(biggest) * weight_bytes
        # a received activation and a received gradient per chunk edge, in flight at once
        buffers = 2.0 * sum(stage_out[chunk_stage[c]] for c in chunks)
        out.append(RankMemory(states, acts[r], gathered, buffers))
    return out
