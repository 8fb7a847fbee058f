"""Wavelet (tick-tock data parallel) against gang scheduling and plain data parallelism.

    python benchmarks/wavelet.py            # 12 measured steps per run
    python benchmarks/wavelet.py --quick    # 6 steps; last line: {"peak_offset", "peak_gang", "throughput_ratio"}

Two simulated devices. A *task* trains a timed model: 8 layers whose forward sleeps 5 ms
per layer and holds a 4 MiB activation (written, so it is resident) until its backward,
which sleeps 10 ms. Costs and activations scale with the batch.

Memory: every process samples its own RSS every millisecond. A device's curve is the sum
of its two tasks' curves minus their resident size before training, so it counts activations.
The peak per device is compared for two tasks launched half a cycle apart (Wavelet) and in
lock-step (gang scheduling), next to ds_chimera.sim.memory's prediction from one task's
measured peak.

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
LAYERS, FWD_S, BWD_S, ACT_MB, WIDTH = 8, 0.005, 0.010, 4, 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler(threading.Thread):
    """Samples this process's resident size every ``period`` seconds (wall clock, for alignment)."""

    def __init__(self, period=0.001):
        super().__init__(daemon=True)
        self.period, self.samples, self.running = period, [], True

    def run(self):
        while self.running:
            self.samples.append((time.time(), rss_bytes()))
            time.sleep(self.period)


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
            held = torch.empty(ACT_MB * scale * 2 ** 20 // 4)
            held[::1024] = 1.0              # touch every 4 KiB page: resident, without writing all of it
            ctx.held = held                 # kept until the backward
            return x * weight

        @staticmethod
        def backward(ctx, grad):
            with DeviceLock():
                time.sleep(BWD_S * scale)
            del ctx.held
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

    phases = {"F": [], "B": []}

    def step():
        t0 = time.perf_counter()
        loss = engine(x).sum()
        t1 = time.perf_counter()
        engine.backward(loss)
        phases["F"].append(t1 - t0 - getattr(engine, "last_wait", 0.0))     # not the wait for the offset
        phases["B"].append(time.perf_counter() - t1)
        engine.step()

    for _ in range(2):                                # warm-up: allocator, groups, launch offset
        step()
    base = rss_bytes()
    sampler = RssSampler()
    sampler.start()
    dist.barrier() if not wavelet else None
    start = time.time()
    for _ in range(args.steps):
        step()
    end = time.time()
    sampler.running = False
    sampler.join()
    record = {"rank": rank, "device": device, "wave": engine.layout.wave if wavelet else 0, "start": start,
              "end": end, "base": base, "samples": sampler.samples,
              "step_starts": engine.step_starts[-args.steps:] if wavelet else [],
              "fwd_s": statistics.median(phases["F"][2:]), "bwd_s": statistics.median(phases["B"][2:])}
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
    """Per device: the peak of the summed activation memory of its tasks (bytes), on a common clock."""
    by_device = {}
    for r in records:
        by_device.setdefault(r["device"], []).append(r)
    peaks = {}
    for device, tasks in by_device.items():
        lo = max(t["start"] for t in tasks)
        hi = min(t["end"] for t in tasks)
        grid = [lo + i * 0.001 for i in range(int((hi - lo) / 0.001))]
        total = [0.0] * len(grid)
        for t in tasks:
            samples, j = t["samples"], 0
            for i, when in enumerate(grid):
                while j + 1 < len(samples) and samples[j + 1][0] <= when:
                    j += 1
                total[i] += max(0, samples[j][1] - t["base"])
        peaks[device] = max(total) if total else 0.0
    return peaks


def run(mode, steps, out, offset=0.5, exclusive=False):
    nproc = 4 if mode == "wavelet" else 2
    # A fixed mmap threshold: glibc otherwise raises it after the first free, keeps 16 MiB blocks
    # on its heap, and RSS would stop showing activations being freed.
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), __file__, "--worker",
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
    mib = 2 ** 20
    print(f"2 devices; a task: {LAYERS} layers, F = {LAYERS * FWD_S * 1e3:.0f} ms, B = {LAYERS * BWD_S * 1e3:.0f} ms, "
          f"activations {LAYERS * ACT_MB} MiB at its peak; {args.steps} measured steps per run", flush=True)
    offset_records, offset_tput = run("wavelet", args.steps, args.out, offset=0.5)
    gang_records, gang_tput = run("wavelet", args.steps, args.out, offset=0.0)
    dp_records, dp_tput = run("dp", args.steps, args.out)
    ex_records, ex_tput = run("wavelet", args.steps, args.out, offset=0.5, exclusive=True)
    dpx_records, dpx_tput = run("dp", args.steps, args.out, exclusive=True)

    one_task = statistics.median(max(v - r["base"] for _, v in r["samples"]) for r in offset_records)
    fwd_s = statistics.median(r["fwd_s"] for r in offset_records)     # measured: allocation adds to the sleeps
    bwd_s = statistics.median(r["bwd_s"] for r in offset_records)
    model = wavelet_memory(TaskMemory(static=0.0, activations=one_task, fwd=fwd_s, bwd=bwd_s))
    peak_offset = max(device_peaks(offset_records).values())
    peak_gang = max(device_peaks(gang_records).values())
    peak_dp = max(device_peaks(dp_records).values())
    starts = {}
    for r in offset_records:
        starts.setdefault(r["device"], {})[r["wave"]] = r["step_starts"]
    lags = [((tock[i] - tick[i]) / (tick[i + 1] - tick[i])) % 1.0 for d in starts.values()
            for tick, tock in [(d[0], d[1])] for i in range(len(tick) - 1)]
    print("peak activation memory per device (MiB), measured from RSS, and the memory model's prediction")
    print(f"  one task alone (measured per task)     {one_task / mib:8.1f}")
    print(f"  Wavelet, waves offset by half a cycle  {peak_offset / mib:8.1f}   model {model['offset_waves'] / mib:8.1f}")
    print(f"  two tasks gang-scheduled               {peak_gang / mib:8.1f}   model {model['gang'] / mib:8.1f}")
    print(f"  plain DP, one task with doubled batch  {peak_dp / mib:8.1f}   model {model['doubled_batch'] / mib:8.1f}")
    lag = statistics.fmean(lags)
    at_lag = TaskMemory(static=0.0, activations=one_task, fwd=fwd_s, bwd=bwd_s).two_tasks_peak(lag)
    print(f"  (model from one task's measured peak and its measured F = {fwd_s * 1e3:.0f} ms, B = {bwd_s * 1e3:.0f} ms)")
    print(f"  tock wave's lag behind tick, measured: {lag:.2f} of a cycle (target 0.5); model at that lag "
          f"{at_lag / mib:.1f}")
    print("throughput, samples/s (same global batch per cycle)")
    print(f"  device free to overlap:   Wavelet {offset_tput:6.2f}  gang {gang_tput:6.2f}  plain DP {dp_tput:6.2f}"
          f"   Wavelet / plain DP {offset_tput / dp_tput:5.2f}")
    print(f"  device one compute a time: Wavelet {ex_tput:6.2f}  plain DP {dpx_tput:6.2f}"
          f"   Wavelet / plain DP {ex_tput / dpx_tput:5.2f}")
    print(json.dumps({"peak_offset": peak_offset, "peak_gang": peak_gang, "throughput_ratio": ex_tput / dpx_tput,
                      "throughput_ratio_free_device": offset_tput / dp_tput, "peak_plain_dp": peak_dp,
                      "model_offset": model["offset_waves"], "model_gang": model["gang"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
