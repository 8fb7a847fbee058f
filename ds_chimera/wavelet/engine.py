"""Tick-tock data-parallel training on DeepSpeed (Wavelet, Wang et al., MLSys 2021).

Two tasks per device: the tick wave and, launched half a cycle later, the tock wave. Each
task is a full DeepSpeed data-parallel replica training on its own samples.

Synchronisation (exact semantics). Updates alternate between the waves. An update averages
the gradients of one wave's tasks (an all-reduce over that wave). Every task then applies
every update of both waves, in the same order, so there is one model. The tasks of a device
pass each other their wave's averaged gradient. Number the updates in time order, U1 = tick
step 0, U2 = tock step 0, U3 = tick step 1 and so on. Update n is computed on the weights
after update n-2 and applied to the weights after update n-1:

    W(n) = W(n-1) - opt(g(W(n-2)))        (W(-1) = W(0))

So each wave's step sees the other wave's latest update but one, which is still being
computed: a staleness of exactly one update, as in PipeDream-2BW. A ``step()`` call applies
two updates (the partner's, then its own), and ``global_steps`` counts both.

The launch offset: the tock wave's first forward waits until the tick wave has finished its
first step (and passed its gradient), then waits half of that step's duration more. After
that the exchange keeps the waves interleaved: each needs the other's previous gradient at
the end of its step.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from deepspeed.runtime.engine import DeepSpeedEngine

from ..runtime.p2p import PeerTimeout
from .layout import TICK, WaveLayout

log = logging.getLogger("ds_chimera")
DEFAULT_TIMEOUT_S = 300.0


def wavelet_options(config: dict) -> dict:
    """The validated ``"wavelet"`` section: enabled, offset (fraction of a cycle), timeout (s)."""
    section = dict(config.get("wavelet") or {})
    unknown = sorted(set(section) - {"enabled", "offset", "timeout"})
    if unknown:
        raise ValueError(f'"wavelet" option {unknown[0]!r} is not understood; allowed: enabled, offset, timeout')
    offset = section.get("offset", 0.5)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not 0 <= offset < 1:
        raise ValueError(f'"wavelet": {{"offset": ...}} must be a fraction of a cycle in [0, 1), got {offset!r}')
    timeout = section.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f'"wavelet": {{"timeout": ...}} must be a number of seconds > 0, got {timeout!r}')
    for key, what in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        if (config.get(key) or {}).get("enabled"):
            raise ValueError(f"wavelet with {what}: the waves exchange fp32 gradients and apply them with the "
                             f"fp32 optimizer; use fp32")
    zero = (config.get("zero_optimization") or {}).get("stage", 0)
    if zero:
        raise ValueError(f"wavelet with ZeRO stage {zero}: every task applies every update, so it needs the "
                         f"whole optimizer state; use ZeRO stage 0")
    return {"offset": float(offset), "timeout": float(timeout)}


class WaveletEngine(DeepSpeedEngine):
    """A DeepSpeedEngine whose step() is a Wavelet update pair: the partner wave's, then its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wavelet = wavelet = wavelet_options(self._config._param_dict)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", dist.get_world_size())))
        self.layout = WaveLayout(dist.get_rank(), dist.get_world_size(), local_world)
        self.timeout = timedelta(seconds=wavelet["timeout"])
        groups = {w: dist.new_group(self.layout.wave_ranks(w)) for w in (0, 1)}   # collective: every rank, same order
        self.wave_group = groups[self.layout.wave]
        self.wave_size = len(self.layout.wave_ranks(self.layout.wave))
        self.enable_backward_allreduce = False    # the wave's all-reduce happens in the update instead
        # DeepSpeed's fp32 clipping all-reduces the norm over every rank, but a wave updates alone;
        # every task holds the same averaged gradient, so each clips locally to the same result.
        self.clip = float(self.gradient_clipping() or 0.0)
        self._config.gradient_clipping = 0.0
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.own_steps = 0
        self.partner_grad = None
        self.pending_send = None
        self.step_starts: list = []               # wall-clock start of each step (first forward after a step)
        self._step_open = False
        if dist.get_rank() == 0:
            print(f"[ds_chimera] wavelet: {self.layout.world // 2} devices x 2 waves, offset "
                  f"{wavelet['offset']:g} cycle, one update per wave step (staleness 1)", flush=True)

    @property
    def wave_name(self) -> str:
        return "tick" if self.layout.wave == TICK else "tock"

    # ---- timing of the waves -----------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if not self._step_open:
            self._step_open = True
            if self.layout.wave != TICK and self.own_steps == 0 and self.module.training:
                self._launch_offset()
            self.step_starts.append(time.time())
        return super().forward(*inputs, **kwargs)

    def _launch_offset(self) -> None:
        """Tock's first step: start ``offset`` of a cycle after the tick wave's second step starts."""
        self.partner_grad, cycle = self._recv_partner()
        if self.wavelet["offset"] > 0:
            time.sleep(self.wavelet["offset"] * cycle)

    # ---- the update pair -----------------------------------------------------------------------
    def _take_model_step(self, lr_kwargs):
        own = self._wave_average()
        if self.layout.wave == TICK and self.own_steps == 0:
            partner = None                          # U1: nothing from the tock wave yet
        elif self.partner_grad is not None:
            partner, self.partner_grad = self.partner_grad, None
        else:
            partner, _ = self._recv_partner()
        if partner is not None:
            self._load_grads(partner)
            super()._take_model_step(lr_kwargs)
        self._load_grads(own)
        super()._take_model_step(lr_kwargs)
        cycle = time.time() - self.step_starts[-1] if self.step_starts else 0.0
        self._send_partner(own, cycle)
        self.own_steps += 1
        self._step_open = False

    def _wave_average(self) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flatten_dense_tensors([g.float() for g in grads])
        if self.wave_size > 1:
            self._wait(dist.all_reduce(flat, group=self.wave_group, async_op=True),
                       f"the {self.wave_name} wave's gradient all-reduce")
            flat.div_(self.wave_size)
        return flat

    def _load_grads(self, flat: torch.Tensor) -> None:
        for p, g in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
            if p.grad is None:
                p.grad = g.to(p.dtype).clone()
            else:
                p.grad.copy_(g)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)

    def _send_partner(self, flat: torch.Tensor, cycle: float) -> None:
        if self.pending_send is not None:
            self._wait(self.pending_send, f"the previous gradient send to task {self.layout.partner}")
        payload = torch.cat([flat, torch.tensor([cycle], dtype=flat.dtype, device=flat.device)])
        self._send_buffer = payload                # keep it alive until the send completes
        self.pending_send = dist.isend(payload, self.layout.partner)

    def _recv_partner(self) -> tuple:
        numel = sum(p.numel() for p in self.params)
        buf = torch.empty(numel + 1, dtype=torch.float32, device=self.device)
        other = "tock" if self.layout.wave == TICK else "tick"
        self._wait(dist.irecv(buf, self.layout.partner),
                   f"the {other} wave's gradient from task {self.layout.partner} (same device)")
        return buf[:numel], float(buf[numel])

    def _wait(self, work, what: str) -> None:
        start = time.monotonic()
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise PeerTimeout(f"ds_chimera wavelet: {what} did not arrive after {time.monotonic() - start:.1f}s "
                              f"(timeout {self.wavelet['timeout']:g}s): a task died or is stuck. Cause: {exc}") from exc

    def drain(self) -> None:
        """Apply the tock wave's last update on the tick wave too: afterwards every task holds
        the same weights (all updates so far). Call it on every task before evaluating, saving
        or stopping; ``save_checkpoint`` does."""
        if self.own_steps == 0:
            return
        if self.layout.wave == TICK:
            partner, _ = self._recv_partner()
            self._load_grads(partner)
            super()._take_model_step(None)
        if self.pending_send is not None:
            self._wait(self.pending_send, f"the last gradient send to task {self.layout.partner}")
            self.pending_send = None
        self.own_steps = 0          # the next step starts a new tick-tock sequence, launch offset included
        self.step_starts.clear()

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint of the drained model (every task then holds the same weights)."""
        self.drain()
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)
