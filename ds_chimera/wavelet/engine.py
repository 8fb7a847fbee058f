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

Timing: the tock wave's step m starts ``offset`` (default half) of a cycle after the tick
wave's step m. That is the only feasible relation, because tock step m ends by applying tick
step m's gradient and tick step m+1 ends by applying tock step m's. The first tock step
waits for the tick's start signal. Each later step waits, if it would start early, for the
target computed from the partner's reported step starts, which keeps the offset where
timing noise would let it drift.
"""
from __future__ import annotations

import atexit
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.model_checkpointing.constants import CHECKPOINT_TAG_VALIDATION, ValidationMode

from ..logs import get_logger
from ..runtime import faults
from ..runtime.bounded_store import BoundedStore
from ..runtime.clipping import clip_by_norm
from ..runtime.p2p import PeerTimeout, wait_or_fail
from ..validation import check_fraction, check_seconds
from .channel import PairChannel
from .layout import TICK

log = get_logger()
DEFAULT_TIMEOUT_S = 300.0
HISTORY = 64          # step times kept per task (the controller reads the last few)


def wavelet_options(config: dict) -> dict:
    """The validated ``"wavelet"`` section: enabled, offset (fraction of a cycle), timeout (s)."""
    section = dict(config.get("wavelet") or {})
    unknown = sorted(set(section) - {"enabled", "offset", "timeout"})
    if unknown:
        raise ValueError(f'"wavelet" option {unknown[0]!r} is not understood; allowed: enabled, offset, timeout')
    offset = check_fraction('"wavelet"', "offset (a fraction of a cycle)", section.get("offset", 0.5))
    timeout = check_seconds('"wavelet"', "timeout", section.get("timeout", DEFAULT_TIMEOUT_S))
    for key, what in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        if (config.get(key) or {}).get("enabled"):
            raise ValueError(f"wavelet with {what}: the waves exchange fp32 gradients and apply them with the "
                             f"fp32 optimizer; use fp32")
    zero = (config.get("zero_optimization") or {}).get("stage", 0)
    if zero:
        raise ValueError(f"wavelet with ZeRO stage {zero}: every task applies every update, so it needs the "
                         f"whole optimizer state; use ZeRO stage 0")
    return {"offset": offset, "timeout": timeout}


class WaveletEngine(DeepSpeedEngine):
    """A DeepSpeedEngine whose step() is a Wavelet update pair: the partner wave's, then its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wavelet = wavelet = wavelet_options(self._config._param_dict)
        # every collective stays within a wave (one task per device, so NCCL can run it); the two tasks of
        # a device talk through shared memory (see .channel), and DeepSpeed's checkpoint barriers go
        # through the store (see _store_barriers)
        self.layout = self.mpu.layout
        self.wave_group = self.mpu.get_data_parallel_group()
        self.wave_size = self.mpu.get_data_parallel_world_size()
        self._config.checkpoint_config[CHECKPOINT_TAG_VALIDATION] = ValidationMode.IGNORE   # a world all-reduce
        self.save_non_zero_checkpoint = dist.get_rank() == 0         # one writer: both waves hold one model
        self.enable_backward_allreduce = False    # the wave's all-reduce happens in the update instead
        # DeepSpeed's fp32 clipping all-reduces the norm over every rank, but a wave updates alone;
        # every task holds the same averaged gradient, so each clips locally to the same result.
        self.clip = float(self.gradient_clipping() or 0.0)
        self._config.gradient_clipping = 0.0
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.own_steps = 0
        self.partner_starts: list = []            # starts of the partner's steps, from its messages
        self.faults = faults.monitor(wavelet["timeout"])     # one task's failure ends every task, naming it
        self.store = self._channel_store(wavelet["timeout"])
        if dist.get_rank() == 0:                  # step times travel as float32 seconds since this shared epoch
            self.store.set("epoch", repr(time.time()))
        numel = sum(p.numel() for p in self.params)
        self.channel = PairChannel(self.store, self.layout.rank, self.layout.partner, numel + 3, wavelet["timeout"])
        self.epoch = float(self.store.get("epoch"))   # set: rank 0 sets it before the channel's id, awaited above
        self._same_start()
        self.step_starts: list = []               # wall-clock start of each step (first forward after a step)
        self.work_times: list = []                # each step's duration from its start to its update
        self.last_wait = 0.0                      # seconds the last step waited to keep the offset
        self._step_open = False
        if dist.get_rank() == 0:
            log.info("wavelet: %d devices x 2 waves, offset %g cycle, one update per wave step (staleness 1)",
                     self.layout.world // 2, wavelet["offset"])

    def _channel_store(self, timeout_s: float):
        """The store the partner channel polls.

        Direct calls, while the fault monitor runs: a call through BoundedStore's helper thread
        costs two thread wake-ups, which a loaded host turns into milliseconds per poll, and a
        store whose host froze (rank 0 stopped, under env://) is the monitor's to catch. Without
        the monitor (DS_CHIMERA_FAULT_MONITOR=0) nothing would: torch's store calls to a frozen
        host never return, whatever the store's timeout, so each call is bounded here instead.
        """
        store = dist.PrefixStore("ds_chimera/wavelet/", dist.distributed_c10d._get_default_store().clone())
        if self.faults is not None:
            return store
        bounded = BoundedStore(store, deadline_s=timeout_s, name="wavelet-store")
        atexit.register(bounded.close)      # before the interpreter finalizes (see BoundedStore.close)
        return bounded

    @property
    def wave_name(self) -> str:
        return "tick" if self.layout.wave == TICK else "tock"

    # ---- the engine's calls, each guarded: one task's failure ends every task ----------------------
    def forward(self, *inputs, **kwargs):
        with faults.guard(f"wavelet forward ({self.wave_name} step {self.own_steps})", self.wavelet["timeout"]):
            return self._forward(*inputs, **kwargs)

    def backward(self, *args, **kwargs):
        with faults.guard(f"wavelet backward ({self.wave_name} step {self.own_steps})", self.wavelet["timeout"]):
            return super().backward(*args, **kwargs)

    def step(self, *args, **kwargs):
        with faults.guard(f"wavelet step ({self.wave_name} step {self.own_steps})", self.wavelet["timeout"]):
            return super().step(*args, **kwargs)

    # ---- timing of the waves -----------------------------------------------------------------
    def _forward(self, *inputs, **kwargs):
        opening = not self._step_open and self.module.training
        if opening:
            self._step_open = True
            self.last_wait = 0.0
            if self.layout.wave != TICK and self.own_steps == 0:
                self._launch_offset()
            else:
                self._keep_offset()
            self.step_starts.append(time.time())
            del self.step_starts[:-HISTORY]
            del self.partner_starts[:-HISTORY]
            del self.work_times[:-HISTORY]
        out = super().forward(*inputs, **kwargs)
        if opening and self.layout.wave == TICK and self.own_steps == 0:
            # tell the tock task when this first step started and how long its forward took
            signal = torch.tensor([self.step_starts[-1] - self.epoch, time.time() - self.step_starts[-1]],
                                  dtype=torch.float32, device=self.device)
            self._send(signal)
        return out

    def _launch_offset(self) -> None:
        """Tock's first step starts ``offset`` of a cycle after the tick wave's first step.

        The cycle is not measured yet: it is taken as 3x the tick's first forward (a backward
        of about 2F). From then on :meth:`_keep_offset` holds the measured offset.
        """
        signal = self.channel.recv(2, self.device,
                                   f"the tick wave's start signal from task {self.layout.partner} (same device)")
        tick_start, tick_fwd = float(signal[0]) + self.epoch, float(signal[1])
        self.last_wait = max(0.0, tick_start + self.wavelet["offset"] * 3 * tick_fwd - time.time())
        if self.last_wait > 0:
            time.sleep(self.last_wait)

    def _keep_offset(self) -> None:
        """Delay this step if it would start early for the offset, measured from the partner's steps.

        The target is s_tock(m) = s_tick(m) + offset * P, P the cycle. That is the only feasible
        relation: tock step m ends by applying tick step m's gradient and tick step m+1 ends by
        applying tock step m's. At its step j+1, the tick task knows s_tock(j-1) from its last message
        and aims at s_tock(j-1) + (2 - offset) * P. The tock task knows s_tick(j) and aims at
        s_tick(j) + (1 + offset) * P. Only the early wave waits, so the waves drift back to the
        offset. P is the median of the partner's last periods, so one wait does not feed back into
        the next target.
        """
        starts = self.partner_starts[-5:]
        if len(starts) < 2:
            return
        period = statistics.median(b - a for a, b in zip(starts, starts[1:]))
        offset = self.wavelet["offset"]
        ahead = (2 - offset) if self.layout.wave == TICK else (1 + offset)
        delay = starts[-1] + ahead * period - time.time()
        if delay > 0:
            delay = min(delay, period)
            time.sleep(delay)
            self.last_wait = delay

    # ---- the update pair -----------------------------------------------------------------------
    def _take_model_step(self, lr_kwargs):
        own = self._wave_average()
        if self.layout.wave == TICK and self.own_steps == 0:
            partner = None                          # U1: nothing from the tock wave yet
        else:
            partner, _, start = self._recv_partner()
            self.partner_starts.append(start)
        if partner is not None:
            self._load_grads(partner)
            super()._take_model_step(lr_kwargs)
        self._load_grads(own)
        super()._take_model_step(lr_kwargs)
        start = self.step_starts[-1] if self.step_starts else time.time()
        self.work_times.append(time.time() - start)
        self._send_partner(own, self.work_times[-1], start)
        self.own_steps += 1
        self._step_open = False

    def _wave_average(self) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flatten_dense_tensors([g.float() for g in grads])
        if self.wave_size > 1:
            self._wait(lambda: dist.all_reduce(flat, group=self.wave_group, async_op=True),
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
            grads = [p.grad for p in self.params]
            clip_by_norm(grads, grads, self.clip)

    def _send_partner(self, flat: torch.Tensor, cycle: float, start: float) -> None:
        """The wave's averaged gradient, plus this step's duration and start (for the offset)."""
        since = start - self.epoch           # float64 seconds as two float32s: no drift over long runs
        high = float(torch.tensor(since, dtype=torch.float32))
        self._send(torch.cat([flat, torch.tensor([cycle, high, since - high], dtype=flat.dtype, device=flat.device)]))

    def _same_start(self) -> None:
        """Both waves start from one model: each tock task takes its tick partner's weights (DeepSpeed's
        initial broadcast covers one wave)."""
        flat = _flatten_dense_tensors([p.detach().float() for p in self.params])
        if self.layout.wave == TICK:
            self._send(flat)
            self.channel.flush(f"the initial weights' read by task {self.layout.partner}")
        else:
            start = self.channel.recv(flat.numel(), self.device, f"task {self.layout.partner}'s initial weights")
            with torch.no_grad():
                for p, q in zip(self.params, _unflatten_dense_tensors(start, self.params)):
                    p.copy_(q)

    def _send(self, payload: torch.Tensor) -> None:
        """Write a message for the partner (it must have read the previous one: one buffer in flight)."""
        self.channel.send(payload, f"a message to task {self.layout.partner}")

    def _recv_partner(self) -> tuple:
        numel = sum(p.numel() for p in self.params)
        other = "tock" if self.layout.wave == TICK else "tick"
        buf = self.channel.recv(numel + 3, self.device,
                                f"the {other} wave's gradient from task {self.layout.partner} (same device)")
        return buf[:numel], float(buf[numel]), float(buf[numel + 1]) + float(buf[numel + 2]) + self.epoch

    def _wait(self, work, what: str) -> None:
        wait_or_fail(work, self.wavelet["timeout"], what, source="ds_chimera wavelet", peer="a task")

    def drain(self) -> None:
        """Apply the tock wave's last update on the tick wave too: afterwards every task holds
        the same weights (all updates so far). Call it on every task before evaluating, saving
        or stopping; ``save_checkpoint`` does."""
        if self.own_steps == 0:
            return
        with faults.guard("wavelet drain", self.wavelet["timeout"]):
            self._drain()

    def _drain(self) -> None:
        if self.layout.wave == TICK:
            partner, _, _ = self._recv_partner()
            self._load_grads(partner)
            super()._take_model_step(None)
        self.channel.flush(f"the last gradient's read by task {self.layout.partner}")
        self.own_steps = 0          # the next step starts a new tick-tock sequence, launch offset included
        self.step_starts.clear()
        self.work_times.clear()
        self.partner_starts.clear()

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint of the drained model (every task then holds the same weights)."""
        self.drain()
        with faults.guard(f"wavelet save_checkpoint {save_dir}", self.wavelet["timeout"]), self._store_barriers():
            return super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                           exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, *args, **kwargs):
        with faults.guard("wavelet load_checkpoint", self.wavelet["timeout"]), self._store_barriers():
            return super().load_checkpoint(*args, **kwargs)

    @contextlib.contextmanager
    def _store_barriers(self):
        """DeepSpeed's checkpoint code waits on barriers of the whole world, a group that holds both
        tasks of a device; during a save or load they are barriers of the rendezvous store instead."""
        import deepspeed.comm as ds_comm
        original = ds_comm.barrier
        world, rank = dist.get_world_size(), dist.get_rank()

        def barrier(*args, **kwargs):
            self._barriers = getattr(self, "_barriers", 0) + 1
            key = f"barrier/{self._barriers}"
            self.store.add(key, 1)
            deadline = time.monotonic() + self.wavelet["timeout"]
            while int(self.store.add(key, 0)) < world:
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"ds_chimera wavelet: rank {rank} waited {self.wavelet['timeout']:g}s at a "
                                      f"checkpoint barrier: a task died or is stuck")
                time.sleep(0.001)
        ds_comm.barrier = barrier
        try:
            yield
        finally:
            ds_comm.barrier = original
