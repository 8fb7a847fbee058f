"""Wavelet's two tasks on one device, in under 45 s: step 7 of benchmarks/gpu_check.sh.

    python3 benchmarks/gpu_wavelet_check.py --out DIR              # one GPU: NCCL wave groups
    python3 benchmarks/gpu_wavelet_check.py --out DIR --dry-run    # this CPU: gloo, DS_ACCELERATOR=cpu

One launch, ``ds-chimera launch --torchrun --wavelet --nproc_per_node 1``: two processes for one
device (the tick task and the tock task; the launcher maps both onto device 0). In them:

  1. the gang baseline: the model as two gang-scheduled tasks on the device, plain data parallelism
     of the two processes with the same micro-batch, the gradients averaged every step (through a
     gloo group, staged in host memory: NCCL refuses two ranks of one communicator on one device).
     Plain torch, no DeepSpeed engine: its static memory is at most Wavelet's, so the comparison errs
     against Wavelet. It runs first because it frees all it held; each run is also measured above
     what its process held when it started;
  2. Wavelet trains the same activation-heavy MLP (each task its own micro-batch per step);
  3. after ``drain()``: both tasks hold the same weights, equal to the staleness-1 recurrence
     ``ds_chimera.wavelet.wavelet_reference`` on the same batches (as tests/test_wavelet.py checks).

Memory. Each process samples its allocator after every layer's forward and every layer's
backward, on the host clock: the peak since the previous sample (torch.cuda.max_memory_allocated,
then reset) and the device's used memory (cudaMemGetInfo). The per-device peak of two tasks is the
largest sum of their peaks over overlapping sample intervals (an upper bound of the true peak of
the summed curves; the same estimate for both runs). Checked on the GPU: Wavelet's per-device peak
/ the gang's <= 0.8. Reported, not checked: the device's used memory, which counts what each
process's caching allocator keeps, and each process's max_memory_allocated / max_memory_reserved.
On a dry run there is no device memory: each process's maximum RSS is reported, labelled, and no
ratio is computed.

Writes DIR/wavelet.json, DIR/wavelet.log, DIR/summary.txt (printed too). Exit status: 0 when every
check of this mode passed, 1 when one failed, 3 when none failed but one could not run.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_runtime_check import (HOOK_LIMIT_S, MARGIN_S, check, child_env, finish, free_port, log_tail,  # noqa: E402
                               read_json, run_until, write_json_atomic)

RATIO_TARGET = 0.8
WARMUP, MEASURED = 2, 6                  # steps per run: allocator, groups and the launch offset, then measured
LR = 0.05
# GPU: activations (rows x width x 4 B = 64 MiB, two per block, 8 blocks: 1 GiB) dominate the static
# memory (weights, gradients, momentum, Wavelet's flat buffers: about 5 x 8 MiB); a step is ~0.4 TFLOP.
# Few weights also keep the partner channel small: two 8 MiB buffers in /dev/shm (64 MiB in a default
# container)
SHAPES = {"gpu": {"width": 512, "layers": 8, "rows": 32768}, "dry": {"width": 32, "layers": 4, "rows": 64}}
REF_TOL = {"gpu": 1e-5, "dry": 1e-6}     # the test's 1e-6 on CPU; cuBLAS on the device leaves more room


# ---- the worker: one of the two tasks ----------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shm_free() -> int | None:
    """Room in /dev/shm, where Wavelet's partner channel maps its buffers (for a failure's diagnosis)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


class MemoryProbe:
    """Samples (host time, peak since the last sample, allocated now, device used) at layer boundaries.

    Interval peaks, not instantaneous values: a sample cannot miss the high-water mark between two
    samples, so the per-device estimate can only err upwards. On CPU the figures are RSS (labelled so).
    """

    def __init__(self, device):
        """Made before the run builds anything: ``base`` is what the process held already."""
        import torch
        self.torch, self.cuda, self.active, self.samples = torch, device.type == "cuda", False, []
        self.base = torch.cuda.memory_allocated() if self.cuda else rss_bytes()

    def attach(self, model) -> None:
        for module in model.modules():
            if not list(module.children()):
                module.register_forward_hook(self._after_forward)

    def _after_forward(self, module, inputs, output) -> None:
        if self.active:
            self.sample()
            if getattr(output, "requires_grad", False):
                output.register_hook(self._on_grad)

    def _on_grad(self, grad) -> None:
        if self.active:
            self.sample()

    def sample(self) -> None:
        cuda = self.torch.cuda
        if self.cuda:
            peak = cuda.max_memory_allocated()
            cuda.reset_peak_memory_stats()
            free, total = cuda.mem_get_info()
            self.samples.append((time.time(), peak, cuda.memory_allocated(), total - free, cuda.memory_reserved()))
        else:
            rss = rss_bytes()
            self.samples.append((time.time(), rss, rss, None, None))

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        self.samples, self.active = [], True
        self.sample()

    def stop(self) -> dict:
        self.sample()
        self.active = False
        return {"kind": "cuda_allocated" if self.cuda else "rss", "samples": self.samples, "base": self.base,
                "max_allocated": max(s[1] for s in self.samples),
                "max_reserved": max((s[4] for s in self.samples if s[4] is not None), default=None),
                "max_device_used": max((s[3] for s in self.samples if s[3] is not None), default=None)}


def make_model(shape: dict):
    """Linear + Tanh blocks, seeded: every task and the reference start from the same weights."""
    import torch
    torch.manual_seed(7)
    blocks = []
    for _ in range(shape["layers"]):
        blocks += [torch.nn.Linear(shape["width"], shape["width"]), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def batch(seed: int, shape: dict, device):
    """A deterministic (x, y) made on the device (host-made batches of 64 MiB would cost seconds)."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape["rows"], shape["width"], generator=g, device=device)
    return x, torch.randn(shape["rows"], shape["width"], generator=g, device=device)


def wave_seed(wave: int, step: int) -> int:
    return 1000 * (wave + 1) + step


def flat_weights(model):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def wavelet_run(shape: dict, device, rank: int, gloo) -> dict:
    """Train with Wavelet, measure, drain; compare with the staleness-1 recurrence and across the tasks."""
    import deepspeed
    import torch
    import torch.distributed as dist
    probe = MemoryProbe(device)
    model = make_model(shape).to(device)
    probe.attach(model)
    rows = shape["rows"]
    cfg = {"train_batch_size": rows * dist.get_world_size(), "train_micro_batch_size_per_gpu": rows,
           "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
           "wavelet": {"enabled": True, "offset": 0.5, "timeout": 30}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))
    wave = engine.layout.wave
    losses = []
    for step in range(WARMUP + MEASURED):
        if step == WARMUP:
            probe.start()
        x, y = batch(wave_seed(wave, step), shape, device)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    memory = probe.stop()
    starts = engine.step_starts[-MEASURED:]         # drain() clears them
    engine.drain()
    out = {"wave": wave, "partner": engine.layout.partner, "device": str(engine.device),
           "losses": [float(v) for v in losses], "step_starts": starts,
           "global_steps": engine.global_steps, "memory": memory}
    mine = flat_weights(engine.module).cpu()
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine, group=gloo)           # gloo: a group holding both tasks of a device
    out["max_diff_between_tasks"] = (both[0] - both[1]).abs().max().item()
    if rank == 0:
        out.update(reference(shape, device, mine))
    del engine, model
    return out


def reference(shape: dict, device, weights) -> dict:
    """The documented recurrence on the same device and batches: W(n) = W(n-1) - opt(g(W(n-2)))."""
    import torch

    from ds_chimera.wavelet import wavelet_reference
    ref = make_model(shape).to(device)
    wavelet_reference(ref, lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9), torch.nn.functional.mse_loss,
                      lambda wave, step: [batch(wave_seed(wave, step), shape, device)], WARMUP + MEASURED)
    diff = (flat_weights(ref).cpu() - weights).abs().max().item()
    moved = (flat_weights(make_model(shape)) - weights).abs().max().item()
    return {"max_diff_reference": diff, "moved_from_init": moved, "updates": 2 * (WARMUP + MEASURED)}


def gang_run(shape: dict, device, rank: int, gloo) -> dict:
    """Plain data parallelism of the two processes on the device, in lock-step: the gang baseline."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    probe = MemoryProbe(device)
    model = make_model(shape).to(device)
    probe.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    params = list(model.parameters())
    dist.barrier(group=gloo)
    for step in range(WARMUP + MEASURED):
        if step == WARMUP:
            probe.start()
        x, y = batch(500 + 10 * rank + step, shape, device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        flat = _flatten_dense_tensors([p.grad for p in params])
        host = flat.cpu()
        dist.all_reduce(host, group=gloo)              # the gang's step boundary: both tasks wait here
        flat.copy_(host.div_(2))
        for p, g in zip(params, _unflatten_dense_tensors(flat, params)):
            p.grad.copy_(g)
        del flat, host
        opt.step()
    return {"memory": probe.stop()}


def worker_main(prefix: str, dry_run: bool, init: str) -> int:
    """One task: the gang baseline, then Wavelet, each result written as soon as it exists."""
    if not dry_run:        # two tasks per device: local ranks 0 and 1 both on device 0 (the launcher's mapping)
        devices = int(os.environ.get("DS_CHIMERA_DEVICES_PER_NODE", "1"))
        os.environ["LOCAL_RANK"] = str(int(os.environ.get("LOCAL_RANK", "0")) % devices)
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    path = f"{prefix}.rank{rank}.json"
    out = {"rank": rank, "init": init, "torch": torch.__version__, "shm_free_bytes": shm_free()}
    if not dry_run and not torch.cuda.is_available():
        out["fatal"] = "no CUDA device visible to torch (torch.cuda.is_available() is False)"
        write_json_atomic(path, out)
        return 2
    backend = "gloo" if dry_run else "nccl"
    device = torch.device("cpu") if dry_run else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        out.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    start = time.perf_counter()
    if init == "deepspeed":                       # the product's default path (binds device_id for NCCL)
        import deepspeed
        deepspeed.init_distributed(dist_backend=backend)
    else:                                         # no device_id: NCCL builds communicators per group, lazily
        dist.init_process_group(backend)
    gloo = dist.new_group([0, 1], backend="gloo")
    out.update(backend=dist.get_backend(), world=dist.get_world_size(), init_s=round(time.perf_counter() - start, 3))
    shape = SHAPES["dry" if dry_run else "gpu"]
    out["shape"] = shape
    # the gang first: plain torch frees all it held, while a leftover of the DeepSpeed engine would
    # count against the run after it (each run's figures are also taken above its own starting point)
    for name, fn in (("gang", gang_run), ("wavelet", wavelet_run)):
        begin = time.perf_counter()
        try:
            out[name] = fn(shape, device, rank, gloo)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        out[name]["seconds"] = round(time.perf_counter() - begin, 3)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()                  # the next run starts from an empty cache
        write_json_atomic(path, out)
        if "error" in out[name]:
            return 1
    import resource
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write_json_atomic(path, out)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 0


# ---- the parent: launch, combine the two tasks, judge -------------------------------------------

def window(tasks: list) -> tuple:
    """The span every task was measuring: from the last start to the first stop."""
    return max(t["samples"][0][0] for t in tasks), min(t["samples"][-1][0] for t in tasks)


def pair_peak(a: list, b: list, lo: float, hi: float) -> float:
    """The largest peak_a + peak_b over sample intervals of the two tasks that overlap within [lo, hi].

    Sample i of a task covers (t[i-1], t[i]] and carries the peak of that interval; two
    intervals overlap when each starts before the other ends. A two-pointer sweep.
    """
    def intervals(samples):
        return [(max(s0[0], lo), min(s1[0], hi), s1[1]) for s0, s1 in zip(samples, samples[1:])
                if s1[0] > lo and s0[0] < hi]
    ia, ib = intervals(a), intervals(b)
    best, j = 0.0, 0
    for start, end, peak in ia:
        while j < len(ib) and ib[j][1] <= start:
            j += 1
        k = j
        while k < len(ib) and ib[k][0] < end:
            best = max(best, peak + ib[k][2])
            k += 1
    return best


def check_pair_peak() -> None:
    """The sweep on a case worked by hand: offset spikes never add, aligned ones do."""
    a = [(0.0, 0, 0, None, None), (1.0, 10, 0, None, None), (2.0, 1, 0, None, None), (3.0, 1, 0, None, None)]
    b = [(0.0, 0, 0, None, None), (1.0, 1, 0, None, None), (2.0, 1, 0, None, None), (3.0, 10, 0, None, None)]
    if pair_peak(a, b, 0.0, 3.0) != 11 or pair_peak(a, a, 0.0, 3.0) != 20:
        raise AssertionError("pair_peak: wrong on the worked case")


def above_base(memory: dict) -> list:
    """A task's samples with the peaks counted from what it held before the run (a run's own memory)."""
    return [(s[0], s[1] - memory["base"]) + tuple(s[2:]) for s in memory["samples"]]


def device_peak(run: str, tasks: list) -> dict:
    """Per-device figures of one run from both tasks' samples (bytes; allocated figures above each
    task's starting point, which the summary shows)."""
    mems = [t[run]["memory"] for t in tasks]
    lo, hi = window(mems)
    used = [s[3] for m in mems for s in m["samples"] if s[3] is not None and lo <= s[0] <= hi]
    return {"per_device_peak": pair_peak(above_base(mems[0]), above_base(mems[1]), lo, hi),
            "task_base": [m["base"] for m in mems],
            "sum_of_task_peaks": sum(m["max_allocated"] - m["base"] for m in mems),
            "task_max_allocated": [m["max_allocated"] for m in mems],
            "task_max_reserved": [m["max_reserved"] for m in mems],
            "device_used_peak": max(used) if used else None, "window_s": hi - lo,
            "samples": [len(m["samples"]) for m in mems]}


def measured_lag(tasks: list) -> float | None:
    """How far the tock wave's steps start after the tick wave's, as a fraction of the tick's period."""
    by_wave = {t["wavelet"]["wave"]: t["wavelet"]["step_starts"] for t in tasks}
    tick, tock = by_wave.get(0), by_wave.get(1)
    if not tick or not tock or len(tick) < 2:
        return None
    period = statistics.median(b - a for a, b in zip(tick, tick[1:]))
    return statistics.median(b - a for a, b in zip(tick, tock)) / period if period > 0 else None


def mib(value) -> str:
    return "n/a" if value is None else f"{value / 2 ** 20:.1f} MiB"


def judge_training(tasks: list, dry_run: bool) -> list:
    """Both tasks trained and hold one model, the staleness-1 recurrence's."""
    w = [t["wavelet"] for t in tasks]
    rank0 = next(x for t, x in zip(tasks, w) if t["rank"] == 0)
    tol = REF_TOL["dry" if dry_run else "gpu"]
    finite = all(math.isfinite(v) for x in w for v in x["losses"])
    updates = rank0["updates"]
    trained = finite and all(x["global_steps"] == updates for x in w)
    out = [check("wavelet-train", "pass" if trained else "FAIL",
                 f"tick and tock on {w[0]['device']}: {updates} updates each (global_steps "
                 f"{[x['global_steps'] for x in w]}), losses finite: {finite}; tock lag "
                 f"{measured_lag(tasks) or float('nan'):.2f} of a cycle (target 0.5)")]
    same = rank0["max_diff_between_tasks"] == 0.0
    ok = same and rank0["max_diff_reference"] <= tol and rank0["moved_from_init"] > 10 * tol
    out.append(check("wavelet-reference", "pass" if ok else "FAIL",
                     f"after drain(): tasks differ by {rank0['max_diff_between_tasks']:.3g} (want 0); staleness-1 "
                     f"recurrence max diff {rank0['max_diff_reference']:.3g} (tol {tol:g}); weights moved "
                     f"{rank0['moved_from_init']:.3g} from init",
                     max_diff_reference=rank0["max_diff_reference"],
                     max_diff_between_tasks=rank0["max_diff_between_tasks"]))
    return out


def judge_memory(tasks: list, dry_run: bool) -> tuple:
    """GPU: the per-device peak ratio against the target. Dry run: RSS per task, labelled, no ratio."""
    if dry_run:
        rss = [t.get("max_rss_bytes") for t in tasks]
        exercise = {run: device_peak(run, tasks) for run in ("wavelet", "gang")}   # the code path, not a figure
        return [check("memory-per-device", "skipped",
                      "no device memory on CPU; NOT a device figure: process max RSS per task "
                      f"{', '.join(mib(r) for r in rss)} (interpreter and libraries included; no ratio computed)",
                      max_rss_bytes=rss, rss_exercise_not_a_device_figure=exercise)], {}
    figures = {run: device_peak(run, tasks) for run in ("wavelet", "gang")}
    w, g = figures["wavelet"], figures["gang"]
    ratio = w["per_device_peak"] / g["per_device_peak"] if g["per_device_peak"] else None
    ok = ratio is not None and ratio <= RATIO_TARGET
    out = [check("memory-per-device", "pass" if ok else "FAIL",
                 f"allocated per device, two tasks summed on one clock: Wavelet {mib(w['per_device_peak'])}, gang "
                 f"{mib(g['per_device_peak'])}, ratio {ratio if ratio is None else round(ratio, 3)} (target <= "
                 f"{RATIO_TARGET}); per task max_memory_allocated Wavelet "
                 f"{', '.join(map(mib, w['task_max_allocated']))}, gang {', '.join(map(mib, g['task_max_allocated']))}"
                 f" (held before each run: Wavelet {', '.join(map(mib, w['task_base']))}, gang "
                 f"{', '.join(map(mib, g['task_base']))})",
                 ratio=ratio, wavelet=w, gang=g)]
    used = (w["device_used_peak"] / g["device_used_peak"]) if w["device_used_peak"] and g["device_used_peak"] else None
    out.append(check("memory-held", "info",
                     f"what the device held (cudaMemGetInfo, contexts and each process's allocator cache included): "
                     f"Wavelet {mib(w['device_used_peak'])}, gang {mib(g['device_used_peak'])}, ratio "
                     f"{used if used is None else round(used, 3)}; max_memory_reserved per task Wavelet "
                     f"{', '.join(map(mib, w['task_max_reserved']))}, gang "
                     f"{', '.join(map(mib, g['task_max_reserved']))}"
                     " (a process's cache keeps its own peak: the saving reaches the device only as far as the "
                     "allocators return memory)", ratio=used))
    return out, figures


def run_problem(tasks: list, run: str) -> tuple:
    """(verdict, reason) when a run failed on a task or never finished; None when both tasks have it."""
    errors = [f"rank {t['rank']}: {t[run]['error']}" for t in tasks if "error" in t.get(run, {})]
    if errors:
        return "FAIL", "; ".join(errors) + " (traceback in the task's file)"
    missing = [t["rank"] for t in tasks if run not in t]
    if missing:
        return "NOT RUN", f"ranks {missing} did not finish it before the deadline (see wavelet.log)"
    return None


def judge(tasks: list, dry_run: bool) -> list:
    """Every check's verdict from the two tasks' files (missing parts: not run, with the reason)."""
    fatal = [t["fatal"] for t in tasks if t and t.get("fatal")]
    if fatal:
        return [check("wavelet", "NOT RUN", fatal[0])]
    if any(t is None for t in tasks):
        return [check("wavelet", "NOT RUN", "a task wrote no result (see wavelet.log)")]
    gang = run_problem(tasks, "gang")                 # the first run: a task stops at its failure
    if gang and gang[0] == "FAIL":
        return [check("gang-baseline", *gang),
                check("wavelet-train", "NOT RUN", "the tasks stop after a failed gang baseline")]
    problem = run_problem(tasks, "wavelet")
    if problem:
        return [check("wavelet-train", *problem)]
    return judge_training(tasks, dry_run) + judge_memory(tasks, dry_run)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for wavelet.json, wavelet.log and summary.txt (required)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, DS_ACCELERATOR=cpu")
    parser.add_argument("--init", choices=("torch", "deepspeed"), default="torch",
                        help="how the workers start torch.distributed: torch (no device_id; default) or "
                             "deepspeed.init_distributed (binds device_id: NCCL then connects the whole world at "
                             "once, which may refuse two ranks on one device)")
    parser.add_argument("--worker", metavar="PREFIX", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.dry_run, args.init)
    if not args.out:
        parser.error("--out DIR is required")
    t0 = time.monotonic()
    check_pair_peak()
    os.makedirs(args.out, exist_ok=True)
    prefix, log_path = os.path.join(args.out, "wavelet_task"), os.path.join(args.out, "wavelet.log")
    for rank in (0, 1):
        if os.path.exists(f"{prefix}.rank{rank}.json"):
            os.remove(f"{prefix}.rank{rank}.json")
    cmd = [sys.executable, "-m", "ds_chimera.cli", "launch", "--torchrun", "--wavelet", "--nproc_per_node", "1",
           "--master_port", str(free_port()), os.path.abspath(__file__), "--worker", prefix, "--init", args.init]
    cmd += ["--dry-run"] if args.dry_run else []
    rc, seconds = run_until(cmd, child_env(args.dry_run), t0 + HOOK_LIMIT_S - MARGIN_S, log_path)
    tasks = [read_json(f"{prefix}.rank{rank}.json") for rank in (0, 1)]
    mode = "dry run (CPU, gloo, DS_ACCELERATOR=cpu)" if args.dry_run else "GPU (one device, NCCL wave groups)"
    first = next((t for t in tasks if t), {})
    lines = [f"gpu_wavelet_check: {mode}; 2 tasks on 1 device; launcher "
             f"{'exit ' + str(rc) if rc is not None else 'STOPPED at the deadline'} after {seconds:.1f}s; "
             f"backend {first.get('backend')}, init {args.init}, shape {first.get('shape')}, gpu {first.get('gpu')}, "
             f"/dev/shm free {mib(first.get('shm_free_bytes'))}"]
    checks = judge(tasks, args.dry_run)
    if rc not in (0, None) and all(c["verdict"] not in ("FAIL", "NOT RUN") for c in checks):
        checks.append(check("launch", "FAIL", f"exit {rc}; log tail:\n{log_tail(log_path)}"))
    lines += [f"  {c['verdict']:8s} {c['check']:20s} {c['detail']}" for c in checks]
    lines.append(f"total {time.monotonic() - t0:.1f}s (limit {HOOK_LIMIT_S:g}s); log {log_path}")
    data = {"mode": mode, "launcher_exit": rc, "checks": checks,
            "tasks": [{k: v for k, v in (t or {}).items() if k not in ("wavelet", "gang")} for t in tasks],
            "runs": {run: [{k: v for k, v in (t or {}).get(run, {}).items() if k != "memory"} for t in tasks]
                     for run in ("wavelet", "gang")}}
    return finish(args.out, "wavelet", data, lines)


if __name__ == "__main__":
    sys.exit(main())
