"""The runtime on one CUDA device, in under 45 s: step 6 of benchmarks/gpu_check.sh.

    python3 benchmarks/gpu_runtime_check.py --out DIR              # one GPU: NCCL, fp32 and bf16
    python3 benchmarks/gpu_runtime_check.py --out DIR --dry-run    # this CPU: gloo, DS_ACCELERATOR=cpu

Checks, all in one process of one rank (torchrun, so the engine sees a real process group):

  a. every synchronous schedule at D = 1 (one rank holds every chunk) on the DeepSpeed engine,
     against one-process training of the same layers: the scenarios ``equiv-1x1-<schedule>`` (fp32)
     and, on the GPU, ``bf16-1x1-<schedule>`` of tests/distributed/worker.py. A schedule with no
     such scenario runs the same ``train_and_compare`` call, marked "added here"; one that cannot
     be built at D = 1 (chimera needs an even D) is reported with the schedule's own error;
  b. LocalPipeline (ds_chimera/runtime/local.py) training the DynamicConv LM of ds_chimera.nn on
     the device, against plain training of the same layers on the same device;
  c. one engine step with ``"trace_dir"``: which clock timed it (device events on CUDA, the host
     clock on CPU) and one trace event per compute action of the rank's program.

Writes DIR/runtime.json (every number) and DIR/summary.txt (printed too). Exit status: 0 when every
check this mode runs passed, 1 when one failed, 3 when none failed but one could not run (each
says why). Nothing is inferred for a check that did not run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests", "distributed")
HOOK_LIMIT_S = 45.0              # gpu_check.sh's `timeout` on this step
MARGIN_S = 4.0                   # left for reading the results and writing the summary
FP32_TOL = 1e-5                  # the multi-rank tests' bound for fp32 against one process
BF16_TOL = 5e-3                  # the bf16 tests' absolute bound (DeepSpeed's BF16_Optimizer)
LM_STEPS, LM_MICRO_BATCHES = 3, 4


# ---- shared by both GPU hooks (gpu_wavelet_check.py imports these) -------------------------------

def free_port() -> int:
    """A loopback port free now: the rendezvous must not collide with the other steps' runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_until(cmd: list, env: dict, deadline: float, log_path: str) -> tuple:
    """Run ``cmd`` in its own process group until ``deadline`` (time.monotonic()).

    Returns (exit status or None when it was stopped at the deadline, seconds). Stopping it
    ourselves leaves time to report what finished before the hook's own `timeout` kills us.
    """
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
    return rc, time.monotonic() - start


def _stop_group(proc) -> None:
    """End the process group we started (torchrun and its workers), politely first."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: str, lines: int = 12) -> str:
    """The end of a worker's own output, for a failure's reason in the summary (torchrun's report
    of the failure, which follows it and names no cause, is cut off)."""
    try:
        with open(path, errors="replace") as fh:
            text = fh.readlines()
    except OSError as exc:
        return f"(no log: {exc})"
    cut = next((i for i, line in enumerate(text) if "elastic/multiprocessing/api.py" in line), len(text))
    return "".join(text[max(0, cut - lines):cut]).rstrip()


def write_json_atomic(path: str, data) -> None:
    """Readers (the parent at its deadline) never see half a file."""
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    os.replace(path + ".tmp", path)


def read_json(path: str):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def child_env(dry_run: bool, backend_var: str | None = None) -> dict:
    """The workers' environment: the checkout importable; on a dry run the CPU accelerator and one thread."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if dry_run:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    else:
        env["DS_ACCELERATOR"] = "cuda"
    if backend_var:
        env[backend_var] = "gloo" if dry_run else "nccl"
    return env


def finish(out_dir: str, name: str, data: dict, lines: list) -> int:
    """Write DIR/<name>.json and DIR/summary.txt, print the summary; the exit status from the verdicts."""
    verdicts = [c["verdict"] for c in data["checks"]]
    status = 1 if "FAIL" in verdicts else 3 if "NOT RUN" in verdicts else 0
    data["exit_status"] = status
    counts = {v: verdicts.count(v) for v in ("pass", "FAIL", "NOT RUN", "skipped")}
    lines.append(f"result: {counts['pass']} pass, {counts['FAIL']} FAIL, {counts['NOT RUN']} NOT RUN, "
                 f"{counts['skipped']} skipped (by design in this mode); exit {status}")
    write_json_atomic(os.path.join(out_dir, f"{name}.json"), data)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(text)
    print(text, end="")
    return status


def check(name: str, verdict: str, detail: str, **numbers) -> dict:
    """One line of the report: verdict is pass, FAIL, NOT RUN (could not run: why), skipped (by design
    in this mode) or info (a figure reported, not judged)."""
    return {"check": name, "verdict": verdict, "detail": detail, **numbers}


# ---- the worker: one rank under torchrun ----------------------------------------------------------

def _timed(results: dict, path: str, name: str, meta: dict, fn) -> None:
    """Run one scenario, record its result or its error, rewrite the file (a deadline keeps what finished)."""
    start = time.perf_counter()
    try:
        out = {"status": "ok", "result": fn()}
    except Exception as exc:                       # reported per scenario; the next one still runs
        out = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-3000:]}
    out.update(meta, seconds=round(time.perf_counter() - start, 3))
    results["scenarios"][name] = out
    write_json_atomic(path, results)


def _layers_on(specs, device):
    """The LM's layers seeded as the engine seeds them (tests/distributed/models.py), on ``device``."""
    from models import build_reference
    return [layer.to(device) for layer in build_reference(specs)]


def _cut(layers: list, parts: int) -> list:
    """``layers`` in ``parts`` contiguous stages of near-equal length (one module each)."""
    import torch
    bounds = [round(i * len(layers) / parts) for i in range(parts + 1)]
    return [torch.nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def local_lm(schedule: str, ranks: int, device: str, **options) -> dict:
    """LocalPipeline on the device against plain training of the same layers on the same device.

    SGD with momentum, clipping on (the global-norm CLIP across stages is part of what runs);
    the torch reference kernels, so that no Triton compile spends the 45 s (the kernels are
    step 3's subject).
    """
    import torch

    from ds_chimera.nn import counting_batches, lm_layer_specs, lm_loss
    from ds_chimera.runtime.local import LocalPipeline
    from ds_chimera.schedules import registry
    specs = lm_layer_specs(vocab_size=32, d_model=32, num_layers=6, kernel_sizes=(3, 7, 15, 31), num_heads=4,
                           max_len=16, backend="torch")
    sched = registry.build(schedule, ranks, LM_MICRO_BATCHES, **options)
    stages = _cut(_layers_on(specs, device), sched.placement.num_stages)
    make_opt = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    pipe = LocalPipeline(sched, stages, [make_opt(m.parameters()) for m in stages], lm_loss, clip=1.0)
    ref = torch.nn.Sequential(*_layers_on(specs, device))
    ref_opt = make_opt(ref.parameters())
    data = counting_batches(2, seq_len=16, vocab_size=32, seed=7)
    losses, ref_losses = [], []
    for _ in range(LM_STEPS):
        batches = [tuple(t.to(device) for t in next(data)) for _ in range(LM_MICRO_BATCHES)]
        losses.append(pipe.train_batch(batches))
        ref_opt.zero_grad()
        total = 0.0
        for x, y in batches:
            loss = lm_loss(ref(x), y) / len(batches)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_losses.append(total)
    mine = [p for stage in stages for p in stage.parameters()]
    theirs = list(ref.parameters())
    if len(mine) != len(theirs) or not mine:
        raise AssertionError(f"compared {len(mine)} pipeline tensors with {len(theirs)} reference tensors")
    diff = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(mine, theirs))
    return {"max_param_diff": diff, "compared_tensors": len(mine), "losses": losses, "ref_losses": ref_losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "stages": sched.placement.num_stages, "ranks": ranks, "device": str(mine[0].device),
            "param_dtype": str(mine[0].dtype)}


def traced_step(W, schedule: str, n: int = 4, **options) -> dict:
    """One engine step at D = 1 with trace_dir; the clock the executor built is observed, not assumed."""
    import shutil
    import tempfile

    import ds_chimera.runtime.executor as executor
    from ds_chimera.schedules.actions import Action
    clocks = []
    original = executor.StepTrace

    class ObservedTrace(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            clocks.append(type(self.clock).__name__)
    folder = tempfile.mkdtemp(prefix="dsc_gpu_trace_")
    executor.StepTrace = ObservedTrace
    try:
        cfg = W.config(schedule, n, 1, **options)
        cfg["pipeline"]["trace_dir"] = folder
        engine = W.make_engine(1, cfg, W.mlp_specs(16))
        engine.train_batch(iter(W.make_global_batches(n)(0)))
        files = sorted(os.listdir(folder))
        events = []
        for name in files:
            with open(os.path.join(folder, name)) as fh:
                events += [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    finally:
        executor.StepTrace = original
        shutil.rmtree(folder, ignore_errors=True)
    actions = [op for op in engine.plan.program.ops[0] if type(op) is Action]
    want = sorted(f"{op[0]}{op[1]}:{op[2]}" for op in actions)
    got = sorted(f"{e['name'][0]}{e['args']['chunk']}:{e['args']['micro_batch']}" for e in events)
    return {"clocks": clocks, "files": files, "events": len(events), "actions": len(actions),
            "same_actions": want == got, "engine_device": str(engine.device),
            "durations_us": [round(e["dur"], 3) for e in events],
            "span_us": max((e["ts"] + e["dur"] for e in events), default=0.0)}


def plan(W, dry_run: bool) -> list:
    """(name, meta, callable) in priority order: fp32 equivalence, trace, LocalPipeline, then bf16."""
    from ds_chimera.schedules import registry
    sync = [name for name, cls in registry.available().items() if cls.synchronous]
    device = "cpu" if dry_run else "cuda"
    runs, bf16 = [], []
    for schedule in sync:
        for prefix, kwargs, into in (("equiv", {}, runs), ("bf16", {"bf16": True}, bf16)):
            name = f"{prefix}-1x1-{schedule}"
            meta = {"kind": prefix, "schedule": schedule}
            if name in W.SCENARIOS:
                into.append((name, dict(meta, source="tests/distributed/worker.py"), W.SCENARIOS[name]))
                continue
            try:
                registry.build(schedule, 1, 4)
            except ValueError as exc:
                into.append((name, dict(meta, source="none", not_runnable=str(exc)), None))
                continue
            into.append((name, dict(meta, source="added here: worker.train_and_compare(schedule, 1, 1, 4)"),
                         lambda s=schedule, kw=kwargs: W.train_and_compare(s, 1, 1, 4, **kw)))
    runs.append(("trace-1x1-zbv", {"kind": "trace", "schedule": "zbv", "source": "this script"},
                 lambda: traced_step(W, "zbv")))
    for schedule, ranks in (("1f1b", 4), ("zbv", 2), ("chimera", 4)):
        runs.append((f"local-lm-{schedule}", {"kind": "local", "schedule": schedule, "source": "this script"},
                     lambda s=schedule, r=ranks: local_lm(s, r, device)))
    return runs + ([] if dry_run else bf16)


def worker_main(out_path: str, dry_run: bool) -> int:
    """Inside torchrun: run the planned scenarios one by one, writing ``out_path`` after each."""
    import torch
    results = {"scenarios": {}, "meta": {"dry_run": dry_run, "torch": torch.__version__}}
    if not dry_run and not torch.cuda.is_available():
        results["fatal"] = "no CUDA device visible to torch (torch.cuda.is_available() is False)"
        write_json_atomic(out_path, results)
        return 2
    if not dry_run:      # fp32 means fp32: the comparisons must not run on TF32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        results["meta"].update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, tf32=False)
    sys.path.insert(0, TESTS)
    start = time.perf_counter()
    import deepspeed
    import worker as W                             # tests/distributed/worker.py: its scenarios and helpers
    deepspeed.init_distributed(dist_backend=os.environ.get("DS_CHIMERA_TEST_BACKEND", "gloo"))
    import torch.distributed as tdist
    results["meta"].update(backend=tdist.get_backend(), world=tdist.get_world_size(),
                           import_and_init_s=round(time.perf_counter() - start, 3))
    planned = plan(W, dry_run)
    results["planned"] = [name for name, _, _ in planned]
    write_json_atomic(out_path, results)
    for name, meta, fn in planned:
        if fn is None:
            results["scenarios"][name] = dict(meta, status="not runnable", error=meta["not_runnable"])
            write_json_atomic(out_path, results)
            continue
        _timed(results, out_path, name, meta, fn)
    results["complete"] = True
    write_json_atomic(out_path, results)
    tdist.destroy_process_group()
    return 0


# ---- the parent: launch, read back, judge ---------------------------------------------------------

def judge_equiv(name: str, s: dict, tol: float) -> dict:
    """A schedule's engine against one-process training: every tensor compared, within ``tol``."""
    r = s["result"]
    diff, compared, wanted = r["max_param_diff"], r["compared_tensors"], r["reference_tensors"]
    ok = diff <= tol and compared == wanted
    return check(name, "pass" if ok else "FAIL",
                 f"max param diff {diff:.3g} (tol {tol:g}), {compared}/{wanted} tensors, max loss diff "
                 f"{r['max_loss_diff']:.3g}, {s['seconds']:.1f}s [{s['source']}]",
                 max_param_diff=diff, max_loss_diff=r["max_loss_diff"], seconds=s["seconds"])


def judge_local(name: str, s: dict) -> dict:
    r = s["result"]
    ok = r["max_param_diff"] <= FP32_TOL and r["max_loss_diff"] <= FP32_TOL
    return check(name, "pass" if ok else "FAIL",
                 f"{r['stages']} stages on {r['ranks']} ranks, {r['device']} {r['param_dtype']}: max weight diff "
                 f"{r['max_param_diff']:.3g}, max loss diff {r['max_loss_diff']:.3g} (tol {FP32_TOL:g}), "
                 f"losses {', '.join(f'{x:.4f}' for x in r['losses'])}, {s['seconds']:.1f}s",
                 max_param_diff=r["max_param_diff"], max_loss_diff=r["max_loss_diff"])


def judge_trace(name: str, s: dict, dry_run: bool) -> dict:
    """Device events on CUDA, the host clock on CPU; one event per compute action, none missing."""
    r = s["result"]
    want = "HostClock" if dry_run else "DeviceClock"
    ok = (r["clocks"] == [want] and len(r["files"]) == 1 and r["same_actions"] and r["events"] == r["actions"]
          and all(d >= 0 for d in r["durations_us"]))
    return check(name, "pass" if ok else "FAIL",
                 f"clock {'/'.join(r['clocks']) or 'none'} (want {want}) on {r['engine_device']}; "
                 f"{r['events']} events for {r['actions']} compute actions, same actions: {r['same_actions']}; "
                 f"files {r['files']}; step span {r['span_us'] / 1000:.2f} ms",
                 clocks=r["clocks"], events=r["events"], actions=r["actions"])


def judge(name: str, s: dict, dry_run: bool) -> dict:
    """The verdict of one scenario's record (None: it never started)."""
    if s is None:
        return check(name, "NOT RUN", "did not start before the deadline (see runtime.log)")
    if s["status"] == "not runnable":           # the schedule's own refusal at D = 1, by design
        return check(name, "skipped", f"cannot run at D = 1: {s['error']}")
    if s["status"] == "error":
        if s["kind"] == "local" and "single-route" in s["error"]:
            return check(name, "skipped", f"LocalPipeline refuses it by design: {s['error']}")
        return check(name, "FAIL", f"{s['error']} (traceback in runtime.json)")
    if s["kind"] == "equiv":
        return judge_equiv(name, s, FP32_TOL)
    if s["kind"] == "bf16":
        return judge_equiv(name, s, BF16_TOL)
    if s["kind"] == "local":
        return judge_local(name, s)
    return judge_trace(name, s, dry_run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for runtime.json, runtime.log and summary.txt (required)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, DS_ACCELERATOR=cpu")
    parser.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.dry_run)
    if not args.out:
        parser.error("--out DIR is required")
    t0 = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    result_path, log_path = os.path.join(args.out, "runtime.json"), os.path.join(args.out, "runtime.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           os.path.abspath(__file__), "--worker", result_path] + (["--dry-run"] if args.dry_run else [])
    env = child_env(args.dry_run, "DS_CHIMERA_TEST_BACKEND")
    rc, seconds = run_until(cmd, env, t0 + HOOK_LIMIT_S - MARGIN_S, log_path)
    raw = read_json(result_path) or {"scenarios": {}, "meta": {}}
    mode = "dry run (CPU, gloo, DS_ACCELERATOR=cpu)" if args.dry_run else "GPU (CUDA, NCCL)"
    lines = [f"gpu_runtime_check: {mode}; worker {'exit ' + str(rc) if rc is not None else 'STOPPED at the deadline'}"
             f" after {seconds:.1f}s; meta {json.dumps(raw.get('meta', {}))}"]
    checks = []
    if raw.get("fatal"):
        checks.append(check("runtime", "NOT RUN", raw["fatal"]))
    elif "planned" not in raw:
        checks.append(check("runtime", "NOT RUN", f"the worker stopped before planning; log tail:\n"
                                                   f"{log_tail(log_path)}"))
    else:
        for name in raw["planned"]:
            checks.append(judge(name, raw["scenarios"].get(name), args.dry_run))
        if args.dry_run:
            checks.append(check("bf16-1x1-*", "skipped", "bf16 at D = 1 runs on the GPU only"))
    if rc not in (0, None) and "planned" in raw:
        checks.append(check("worker", "FAIL", f"exit {rc}; log tail:\n{log_tail(log_path)}"))
    lines += [f"  {c['verdict']:8s} {c['check']:26s} {c['detail']}" for c in checks]
    lines.append(f"total {time.monotonic() - t0:.1f}s (limit {HOOK_LIMIT_S:g}s); log {log_path}")
    return finish(args.out, "runtime", {"mode": mode, "worker_exit": rc, "worker": raw, "checks": checks}, lines)


if __name__ == "__main__":
    sys.exit(main())
