"""Wavelet (tick-tock data parallel) against gang scheduling and plain data parallelism.

    python benchmarks/wavelet.py            # 12 measured steps per run
    python benchmarks/wavelet.py --quick    # 6 steps; last line: JSON ("counted_offset", "peak_offset" (RSS), ...)

Two simulated devices. A *task* trains a timed model: 16 layers whose forward sleeps 2.5 ms
per layer and saves a 2 MiB activation for its backward (written, so it is resident), which
sleeps 5 ms. Costs and activations scale with the batch. (16 steps of 1/16 of the peak each:
the memory model's ramps are straight lines, and 8 steps of 1/8 could not be compared with
it within 10%.)

Memory, two ways, per device (ds_chimera.wavelet.meter): the bytes each task holds for the
backward, counted by saved-tensor hooks, plus Wavelet's own buffers; and each task's RSS
above its size before training. The tick task of each device samples both tasks' counts and
both processes' RSS every millisecond, so the two tasks are read on one clock. The peak per
device is compared for two tasks launched half a cycle apart (Wavelet) and in lock-step (gang
scheduling), next to ds_chimera.sim.memory's prediction from one task's counted peak and its
measured forward and backward times.

Throughput: Wavelet (4 tasks, batch b each) against plain DeepSpeed data parallelism with the
same global batch (2 tasks, one per device, batch 2b each). Sleeping tasks do not compete, so
two tasks on one device would run at full speed each. That is the paper's premise of an
under-used device, and it is an upper bound. A second run puts a lock around every layer's
compute per device, so a device computes one thing at a time.
"""
import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from harness import free_port  # noqa: E402
LAYERS, FWD_S, BWD_S, ACT_MB, WIDTH = 16, 0.0025, 0.005, 2, 16
MIB = 2 ** 20


class TaskSampler(threading.Thread):
    """Plain DP (one task a device): this process's counted bytes and RSS every ``period`` seconds."""

    def __init__(self, counted, period=0.001):
        super().__init__(daemon=True)
        self.counted, self.period, self.rows, self.running = counted, period, [], True

    def run(self):
        from ds_chimera.wavelet.meter import rss_bytes
        while self.running:
            self.rows.append((time.time(), self.counted.held, rss_bytes(os.getpid())))
            time.sleep(self.period)

    def stop(self) -> list:
        self.running = False
        self.join()
        return self.rows


def make_model(scale: int, device: int, exclusive: bool):
    import torch

    lock_path = f"/tmp/ds_chimera_wavelet_device{device}.lock"

    class DeviceLock:
        """A device that runs one compute at a time (across processes), when ``exclusive``."""

        def __enter__(self):
            if exclusive:
                self.fh = open(lock_path, "w")
                fcntl.flock(self.fh, fcntl.LOCK_EX)

        def __exit__(self, *exc):
            if exclusive:
                fcntl.flock(self.fh, fcntl.LOCK_UN)
                self.fh.close()

    class Activation(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            with DeviceLock():
                time.sleep(FWD_S * scale)
            held = torch.empty(ACT_MB * scale * MIB // 4)
            held[::1024] = 1.0              # touch every 4 KiB page: resident, without writing all of it
            ctx.save_for_backward(held)     # autograd releases it after this node's backward
            return x * weight

        @staticmethod
        def backward(ctx, grad):
            with DeviceLock():
                time.sleep(BWD_S * scale)
            return grad, grad.sum().reshape(1)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return Activation.apply(x, self.weight)

    return torch.nn.Sequential(*[Layer() for _ in range(LAYERS)])


def worker(args):
    import torch
    import torch.distributed as dist

    import deepspeed
    import ds_chimera  # noqa: F401
    from ds_chimera.wavelet.meter import Meter, SavedBytes, rss_bytes

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wavelet = args.mode == "wavelet"
    devices = world // 2 if wavelet else world
    device = rank % devices
    scale = 1 if wavelet else 2                       # plain DP runs the doubled batch per device
    model = make_model(scale, device, args.exclusive)
    cfg = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 6,
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-6}}}
    if wavelet:
        cfg["wavelet"] = {"enabled": True, "offset": args.offset, "timeout": 120}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.ones(1, WIDTH)
    meter = Meter(engine) if wavelet else None
    counted = meter.saved if wavelet else SavedBytes(exclude=model.parameters())

    phases = {"F": [], "B": [], "held": []}           # held: counted bytes right after each backward

    def step():
        t0 = time.perf_counter()
        with counted.hooks():
            loss = engine(x).sum()
        t1 = time.perf_counter()
        engine.backward(loss)
        phases["F"].append(t1 - t0 - getattr(engine, "last_wait", 0.0))     # not the wait for the offset
        phases["B"].append(time.perf_counter() - t1)
        phases["held"].append(counted.held)
        engine.step()

    for _ in range(2):                                # warm-up: allocator, groups, launch offset
        step()
    base = rss_bytes(os.getpid())
    dist.barrier() if not wavelet else None
    sampler = meter if wavelet else TaskSampler(counted)
    sampler.start()
    start = time.time()
    for _ in range(args.steps):
        step()
    end = time.time()
    record = {"rank": rank, "device": device, "wave": engine.layout.wave if wavelet else 0, "start": start,
              "end": end, "base": base, "rows": sampler.stop(),
              "step_starts": engine.step_starts[-args.steps:] if wavelet else [],
              "fwd_s": statistics.median(phases["F"][2:]), "bwd_s": statistics.median(phases["B"][2:]),
              "held_after_backward": max(phases["held"])}
    if wavelet:
        engine.drain()
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(gathered, fh)
    dist.barrier()
    dist.destroy_process_group()


def device_peaks(records) -> dict:
    """Per device: peaks (bytes) over the window both its tasks measured, counted and RSS (see meter.pair_peaks).

    Wavelet: the tick task's rows hold both tasks on one clock. Plain DP: one task a device."""
    from ds_chimera.wavelet.meter import pair_peaks
    by_device = {}
    for r in records:
        by_device.setdefault(r["device"], {})[r["wave"]] = r
    peaks = {}
    for device, tasks in by_device.items():
        lo = max(t["start"] for t in tasks.values())
        hi = min(t["end"] for t in tasks.values())
        rows = [row for row in tasks[0]["rows"] if lo <= row[0] <= hi]
        if len(tasks) == 2:
            peaks[device] = pair_peaks(rows, (tasks[0]["base"], tasks[1]["base"]))
        else:
            peaks[device] = {"saved_sum": max(r[1] for r in rows),
                             "rss_sum": max(max(0, r[2] - tasks[0]["base"]) for r in rows)}
    return peaks


def worst(peaks: dict, key: str) -> float:
    return max(p[key] for p in peaks.values())


def lags(records) -> list:
    """Per step and device: how far the tock wave's step starts after the tick's, as a fraction of the tick's period."""
    starts = {}
    for r in records:
        starts.setdefault(r["device"], {})[r["wave"]] = r["step_starts"]
    return [((tock[i] - tick[i]) / (tick[i + 1] - tick[i])) % 1.0 for d in starts.values()
            for tick, tock in [(d[0], d[1])] for i in range(len(tick) - 1)]


def run(mode, steps, out, offset=0.5, exclusive=False):
    nproc = 4 if mode == "wavelet" else 2
    # A fixed mmap threshold: glibc otherwise raises it after the first free, keeps 16 MiB blocks
    # on its heap, and RSS would stop showing activations being freed.
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), __file__, "--worker",
           "--mode", mode, "--steps", str(steps), "--offset", str(offset), "--out", out]
    if exclusive:
        cmd.append("--exclusive")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    records = json.load(open(out))
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    samples = steps * len(records) * (1 if mode == "wavelet" else 2)
    return records, samples / wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="wavelet")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--offset", type=float, default=0.5)
    parser.add_argument("--exclusive", action="store_true")
    parser.add_argument("--out", default="/tmp/ds_chimera_wavelet.json")
    args = parser.parse_args()
    args.steps = args.steps or (6 if args.quick else 12)
    if args.worker:
        return worker(args)
    from ds_chimera.sim.memory import TaskMemory, wavelet_memory
    print(f"2 devices; a task: {LAYERS} layers, F = {LAYERS * FWD_S * 1e3:.0f} ms, B = {LAYERS * BWD_S * 1e3:.0f} ms, "
          f"activations {LAYERS * ACT_MB} MiB at its peak; {args.steps} measured steps per run", flush=True)
    offset_records, offset_tput = run("wavelet", args.steps, args.out, offset=0.5)
    gang_records, gang_tput = run("wavelet", args.steps, args.out, offset=0.0)
    dp_records, dp_tput = run("dp", args.steps, args.out)
    ex_records, ex_tput = run("wavelet", args.steps, args.out, offset=0.5, exclusive=True)
    dpx_records, dpx_tput = run("dp", args.steps, args.out, exclusive=True)

    offset, gang, dp = device_peaks(offset_records), device_peaks(gang_records), device_peaks(dp_records)
    one_task = statistics.median(p[k] for p in offset.values() for k in ("saved_tick", "saved_tock"))
    one_task_rss = statistics.median(p[k] for p in offset.values() for k in ("rss_tick", "rss_tock"))
    fwd_s = statistics.median(r["fwd_s"] for r in offset_records)     # measured: allocation adds to the sleeps
    bwd_s = statistics.median(r["bwd_s"] for r in offset_records)
    task = TaskMemory(static=0.0, activations=one_task, fwd=fwd_s, bwd=bwd_s)
    model = wavelet_memory(task)
    figures = {"offset": [worst(offset, "saved_sum"), worst(offset, "rss_sum"), model["offset_waves"]],
               "gang": [worst(gang, "saved_sum"), worst(gang, "rss_sum"), model["gang"]],
               "dp": [worst(dp, "saved_sum"), worst(dp, "rss_sum"), model["doubled_batch"]]}
    buffers = max(worst(offset, "buffers"), worst(gang, "buffers"))
    print("peak memory per device (MiB): held for the backward, counted by saved-tensor hooks; RSS above the size")
    print("before training (both tasks of a device read on one clock); the memory model from one task's counted peak")
    print("                                          counted      RSS    model")
    print(f"  one task alone (per task)              {one_task / MIB:8.1f} {one_task_rss / MIB:8.1f}")
    for key, name in (("offset", "Wavelet, waves offset by half a cycle"), ("gang", "two tasks gang-scheduled"),
                      ("dp", "plain DP, one task with doubled batch")):
        print(f"  {name:38s} " + " ".join(f"{v / MIB:8.1f}" for v in figures[key]))
    after = max(r["held_after_backward"] for r in offset_records + gang_records + dp_records)
    print(f"  held for the backward once a backward ended, at most: {after} bytes; Wavelet's own buffers per task, "
          f"at most: {buffers / 1024:.1f} KiB (channel buffers, an update's gradients)")
    ratio = {k: figures["offset"][k] / figures["gang"][k] for k in (0, 1)}
    vs_model = {k: figures["offset"][k] / model["offset_waves"] for k in (0, 1)}
    print(f"  offset / gang: counted {ratio[0]:.2f}, RSS {ratio[1]:.2f}; offset measured / model: counted "
          f"{vs_model[0]:.2f}, RSS {vs_model[1]:.2f}")
    lag = lags(offset_records)
    mean_lag = statistics.fmean(lag)
    print(f"  (model from one task's counted peak and its measured F = {fwd_s * 1e3:.0f} ms, B = {bwd_s * 1e3:.0f} ms)")
    # the measured peak is the worst step's: the model at each step's measured lag, worst step
    at_lags = max(task.two_tasks_peak(x) for x in lag)
    print(f"  tock wave's lag behind tick, per step: mean {mean_lag:.2f}, {min(lag):.2f} to {max(lag):.2f} of a "
          f"cycle (target 0.5); model at the mean {task.two_tasks_peak(mean_lag) / MIB:.1f}, at each step's lag "
          f"(worst step) {at_lags / MIB:.1f}: offset counted / that {figures['offset'][0] / at_lags:.2f}")
    print("throughput, samples/s (same global batch per cycle)")
    print(f"  device free to overlap:   Wavelet {offset_tput:6.2f}  gang {gang_tput:6.2f}  plain DP {dp_tput:6.2f}"
          f"   Wavelet / plain DP {offset_tput / dp_tput:5.2f}")
    print(f"  device one compute a time: Wavelet {ex_tput:6.2f}  plain DP {dpx_tput:6.2f}"
          f"   Wavelet / plain DP {ex_tput / dpx_tput:5.2f}")
    print(json.dumps({"peak_offset": figures["offset"][1], "peak_gang": figures["gang"][1],
                      "counted_offset": figures["offset"][0], "counted_gang": figures["gang"][0],
                      "model_offset": model["offset_waves"], "model_gang": model["gang"], "buffers": buffers,
                      "held_after_backward": after,
                      "lag_mean": mean_lag, "lag_min": min(lag), "lag_max": max(lag), "model_at_lags": at_lags,
                      "throughput_ratio": ex_tput / dpx_tput, "throughput_ratio_free_device": offset_tput / dp_tput,
                      "peak_plain_dp": figures["dp"][1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
