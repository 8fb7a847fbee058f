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
waits for the tick's start signal. Each later step starts no earlier than a fraction of a cycle
after the partner's step it follows (tock m after tick m, tick m+1 after tock m), read from the
partner's board (see .channel), so every step keeps the offset, not only their average. The
cycle is the slower task's: each task's is the median of its last few step-to-step times, each
less what it waited for (the partner, the offset, another device's task in the all-reduce).
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
from ..runtime.p2p import wait_or_fail
from ..validation import check_fraction, check_seconds
from .channel import PairChannel, poll_until
from .layout import TICK

log = get_logger()
DEFAULT_TIMEOUT_S = 300.0
HISTORY = 64          # step starts kept per task
CYCLES = 5            # the cycle is the median of this task's last CYCLES


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
        self.own_steps = 0                        # steps since the tick-tock sequence (re)started
        self.openings = 0                         # steps ever opened: the count the partner waits on
        self.faults = faults.monitor(wavelet["timeout"])     # one task's failure ends every task, naming it
        self.store = self._channel_store(wavelet["timeout"])
        if dist.get_rank() == 0:                  # the launch signal's times: float32 seconds since this epoch
            self.store.set("epoch", repr(time.time()))
        numel = sum(p.numel() for p in self.params)
        self.channel = PairChannel(self.store, self.layout.rank, self.layout.partner, max(numel, 2),
                                   wavelet["timeout"])
        self._post_buffers()
        self.epoch = float(self.store.get("epoch"))   # set: rank 0 sets it before the channel's id, awaited above
        self._same_start()
        self.step_starts: list = []               # wall-clock start of each step (first forward after a step)
        self.cycles: list = []                    # each step's start to the next, less its waits (see _open_step)
        self.reduce_times: list = []              # the last steps' all-reduce times
        self._waited_at_start = 0.0               # the channel's waiting total when the last step started
        self.last_wait = 0.0                      # seconds the last step's start waited (partner, offset)
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
            self._open_step()
        out = super().forward(*inputs, **kwargs)
        if opening and self.layout.wave == TICK and self.own_steps == 0:
            # tell the tock task when this first step started and how long its forward took
            signal = torch.tensor([self.step_starts[-1] - self.epoch, time.time() - self.step_starts[-1]],
                                  dtype=torch.float32, device=self.device)
            self._send(signal)
        return out

    def _open_step(self) -> None:
        """A step starts: measure the last cycle, wait for the offset, post the start on the board.

        A cycle runs from a step's start to the next step's opening, less what the task waited for
        in between: its partner (the channel counts it) and the other devices' tasks in the wave's
        all-reduce (what it took beyond the quickest of the last ones). The offset waits come
        before a start."""
        self._step_open = True
        now = time.time()
        if self.step_starts:
            waited = self.channel.waited - self._waited_at_start
            if self.reduce_times:
                waited += self.reduce_times[-1] - min(self.reduce_times)
            self.cycles.append(now - self.step_starts[-1] - waited)
            del self.cycles[:-CYCLES]
            self.channel.post("cycle", statistics.median(self.cycles))
        if self.own_steps > 0:
            self._keep_offset()
        elif self.layout.wave != TICK:
            self._launch_offset()
        self.step_starts.append(time.time())
        del self.step_starts[:-HISTORY]
        self.last_wait = self.step_starts[-1] - now
        self._waited_at_start = self.channel.waited
        self.openings += 1
        self.channel.post("start", self.step_starts[-1])
        self.channel.post("opened", self.openings)       # after the start: a partner that sees it reads that start

    def _launch_offset(self) -> None:
        """Tock's first step starts ``offset`` of a cycle after the tick wave's first step.

        The cycle is not measured yet: it is taken as 3x the tick's first forward (a backward
        of about 2F). From then on :meth:`_keep_offset` holds the measured offset.
        """
        signal = self.channel.recv(2, self.device,
                                   f"the tick wave's start signal from task {self.layout.partner} (same device)")
        tick_start, tick_fwd = float(signal[0]) + self.epoch, float(signal[1])
        self._sleep_until(tick_start + self.wavelet["offset"] * 3 * tick_fwd)

    def _keep_offset(self) -> None:
        """Start no earlier than the offset after the partner's step this one follows.

        Tock step m follows tick step m by ``offset`` of a cycle P; tick step m+1 follows tock
        step m by the rest, ``1 - offset``. The partner's start comes from its board, exactly, so
        an error in P moves this step by a fraction of it only. P is the longer of the two tasks'
        cycles (a shorter one would leave the slower task's start late, and the lag short of the
        offset). A task's cycle is the median of its last ones (see ``_open_step``), which leave out
        the waits, since a P with those in it feeds the next waits (docs/investigations/
        wavelet-memory.md).
        """
        offset = self.wavelet["offset"]
        follows, fraction = (self.openings, 1 - offset) if self.layout.wave == TICK else \
            (self.openings + 1, offset)
        other = "tock" if self.layout.wave == TICK else "tick"
        self.channel.wait_post("opened", follows, f"the start of the {other} wave's step {follows} from task "
                                                  f"{self.layout.partner} (same device)")
        period = max(statistics.median(self.cycles), self.channel.peek("cycle"))
        self._sleep_until(self.channel.peek("start") + fraction * period, limit=period)

    @staticmethod
    def _sleep_until(target: float, limit: float | None = None) -> None:
        """Sleep until ``target`` (wall clock), for at most ``limit`` seconds."""
        delay = target - time.time()
        if delay > 0:
            time.sleep(delay if limit is None else min(delay, limit))

    # ---- the update pair -----------------------------------------------------------------------
    def _take_model_step(self, lr_kwargs):
        own = self._wave_average()
        self._post_buffers(own)
        if self.layout.wave == TICK and self.own_steps == 0:
            partner = None                          # U1: nothing from the tock wave yet
        else:
            partner = self._recv_partner()
            self._post_buffers(own, partner)
            self._load_grads(partner)
            super()._take_model_step(lr_kwargs)
        self._load_grads(own)
        super()._take_model_step(lr_kwargs)
        self._send(own)
        self._post_buffers()
        self.own_steps += 1
        self._step_open = False

    def _post_buffers(self, *flats) -> None:
        """Post the bytes of Wavelet's own buffers on the board (read by .meter): the channel's
        mapped buffers, and the flat gradients an update holds."""
        self.channel.post("buffers", self.channel.nbytes + sum(f.numel() * f.element_size() for f in flats))

    def _wave_average(self) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flatten_dense_tensors([g.float() for g in grads])
        if self.wave_size > 1:
            start = time.time()
            self._wait(lambda: dist.all_reduce(flat, group=self.wave_group, async_op=True),
                       f"the {self.wave_name} wave's gradient all-reduce")
            self.reduce_times.append(time.time() - start)
            del self.reduce_times[:-CYCLES]
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

    def _recv_partner(self) -> torch.Tensor:
        """The partner wave's averaged gradient (flat)."""
        numel = sum(p.numel() for p in self.params)
        other = "tock" if self.layout.wave == TICK else "tick"
        return self.channel.recv(numel, self.device,
                                 f"the {other} wave's gradient from task {self.layout.partner} (same device)")

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
            self._load_grads(self._recv_partner())
            super()._take_model_step(None)
        self.channel.flush(f"the last gradient's read by task {self.layout.partner}")
        self.own_steps = 0          # the next step starts a new tick-tock sequence, launch offset included
        self.step_starts.clear()
        self.cycles.clear()
        self.reduce_times.clear()

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
            poll_until(lambda: int(self.store.add(key, 0)) >= world, self.wavelet["timeout"],
                       f"ds_chimera wavelet: rank {rank} waited {self.wavelet['timeout']:g}s at a checkpoint "
                       f"barrier: a task died or is stuck", poll_s=0.001)
        ds_comm.barrier = barrier
        try:
            yield
        finally:
            ds_comm.barrier = original
