"""LightConv / DynamicConv kernel speed: C++ against pure torch on CPU; Triton against the roofline on GPU.

    python benchmarks/kernels.py            # CPU part; the GPU part too when CUDA is present
    python benchmarks/kernels.py --quick    # fewer repeats
    python benchmarks/kernels.py --cpu-only --layers    # only the layer / decoding rows

CPU: forward + backward (input and weight gradient) at K=31, C=512, T=512, B=8, H=8, fp32,
for the cpp backend and the pure-torch ``unfold`` and ``band`` algorithms, through autograd.
Layers: each layer (T x B x C in and out) against its op on the layer's own (T x B x C)
tensors, forward + backward; DynamicConv's kernel prediction (Linear, softmax) is timed
alone and added to its op; the op on contiguous B x C x T tensors for scale. Decoding: one token per call through ``incremental_state``
(beam B=8), against fairseq's incremental step as tests/test_ops_fairseq.py re-derives it
(keep the last K-1 inputs, unfold one step, bmm).
GPU: each Triton kernel's achieved bandwidth as a fraction of the HBM roofline (a
device-to-device copy measured in the same run, and the nominal peak), counting bytes per
element as: LightConv forward 2 values, backward 3; DynamicConv forward 2 + K*H/C, backward
3 + 2*K*H/C (the backward is the fused kernel that gives both gradients); and its speed
against the torch paths. Centred padding (P = K//2), and causal padding (P = K-1) at K = 31. The last line is one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from ds_chimera.ops import dynamicconv, lightconv
from ds_chimera.ops.reference import dynamicconv_band, dynamicconv_unfold, lightconv_band, lightconv_unfold

NOMINAL_HBM_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


def cpu_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(runs: dict, repeats: int) -> dict:
    """Median seconds of each of ``runs``, timed in turn, in a shuffled order each round (on a
    shared machine a drift in load then hits all of them alike, and no run always follows the
    same one)."""
    import random
    order = random.Random(0)
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        names = list(runs)
        order.shuffle(names)
        for name, fn in ((n, runs[n]) for n in names):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def fwd_bwd(op, x, w, padding_l):
    def run():
        xx = x.detach().requires_grad_(True)
        ww = w.detach().requires_grad_(True)
        y = op(xx, ww, padding_l)
        torch.autograd.grad(y, (xx, ww), torch.ones_like(y))
    return run


def cpu_part(repeats):
    torch.manual_seed(0)
    batch, channels, time_, heads, kernel = 8, 512, 512, 8, 31
    x = torch.randn(batch, channels, time_)
    rows = {}
    for name, dyn in (("lightconv", False), ("dynamicconv", True)):
        w = torch.softmax(torch.randn(*((batch, heads, kernel, time_) if dyn else (heads, kernel))), dim=-2 if dyn else -1)
        ops = {"cpp": (lambda a, b, p, d=dyn: (dynamicconv if d else lightconv)(a, b, p, "cpp")),
               "unfold": dynamicconv_unfold if dyn else lightconv_unfold,
               "band": dynamicconv_band if dyn else lightconv_band}
        times = {k: cpu_time(fwd_bwd(op, x, w, kernel // 2), repeats) for k, op in ops.items()}
        rows[name] = {k: round(v * 1e3, 2) for k, v in times.items()}
        rows[name]["speedup_vs_unfold"] = round(times["unfold"] / times["cpp"], 2)
        rows[name]["speedup_vs_band"] = round(times["band"] / times["cpp"], 2)
        print(f"CPU {name:<12} fwd+bwd ms: cpp {times['cpp'] * 1e3:8.2f}  unfold {times['unfold'] * 1e3:8.2f}  "
              f"band {times['band'] * 1e3:8.2f}   cpp speedup x{rows[name]['speedup_vs_unfold']} vs unfold, "
              f"x{rows[name]['speedup_vs_band']} vs band", flush=True)
    return {"shape": "B=8 C=512 T=512 H=8 K=31 fp32", "threads": torch.get_num_threads(), **rows}


def _fairseq_math():
    """tests/test_ops_fairseq.py's re-derivation of fairseq's modules (fairseq is not installed)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "tests" / "test_ops_fairseq.py"
    spec = importlib.util.spec_from_file_location("fairseq_math", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_layers(repeats):
    """Layer (T x B x C) against its op on the same tensors, forward + backward."""
    import torch.nn.functional as F
    from ds_chimera.nn import DynamicConv1dTBC, LightweightConv1dTBC
    torch.manual_seed(0)
    time_, batch, channels, heads, kernel = 512, 8, 512, 8, 31
    x = torch.randn(time_, batch, channels)
    grad = torch.randn(time_, batch, channels)
    rows = {}
    for name, dyn in (("lightconv", False), ("dynamicconv", True)):
        cls = DynamicConv1dTBC if dyn else LightweightConv1dTBC
        layer = cls(channels, kernel, padding_l=kernel // 2, num_heads=heads, weight_softmax=True, backend="cpp")

        def run_layer():
            xx = x.detach().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            layer(xx).backward(grad)

        xv, gv = x.permute(1, 2, 0), grad.permute(1, 2, 0)     # the (B, C, T) views the layer passes
        if dyn:
            logits = torch.randn(time_, batch, heads, kernel)
            w = torch.softmax(logits, -1).permute(1, 2, 3, 0)
        else:
            w = torch.softmax(torch.randn(heads, kernel), -1)

        def run_op():
            xx, ww = xv.detach().requires_grad_(True), w.detach().requires_grad_(True)
            y = (dynamicconv if dyn else lightconv)(xx, ww, kernel // 2, "cpp")
            torch.autograd.grad(y, (xx, ww), gv)

        xc, gc, wc = xv.contiguous(), gv.contiguous(), w.contiguous()

        def run_op_bct():                                        # the op on contiguous B x C x T, for scale
            xx, ww = xc.detach().requires_grad_(True), wc.detach().requires_grad_(True)
            y = (dynamicconv if dyn else lightconv)(xx, ww, kernel // 2, "cpp")
            torch.autograd.grad(y, (xx, ww), gc)

        runs = {"layer": run_layer, "op": run_op, "op_bct": run_op_bct}
        if dyn:
            linear = torch.nn.Linear(channels, heads * kernel, bias=False)

            def run_predict():                                   # the kernel prediction alone
                xx = x.detach().requires_grad_(True)
                linear.zero_grad(set_to_none=True)
                w = F.softmax(linear(xx).view(time_, batch, heads, kernel), dim=-1)
                w.backward(torch.ones_like(w))
            runs["predict"] = run_predict
        times = interleaved(runs, 3 * repeats)
        base = times["op"] + times.get("predict", 0.0)
        rows[name] = {k: round(v * 1e3, 2) for k, v in times.items()}
        rows[name]["layer_over_op"] = round(times["layer"] / base, 3)
        extra = f" + predict {times['predict'] * 1e3:7.2f}" if dyn else ""
        print(f"CPU {name:<12} layer {times['layer'] * 1e3:8.2f} ms   op {times['op'] * 1e3:8.2f}{extra} ms   "
              f"layer / (op{' + predict' if dyn else ''}) = {rows[name]['layer_over_op']:.3f}   "
              f"(op on contiguous B x C x T {times['op_bct'] * 1e3:.2f} ms)", flush=True)
    return {"shape": f"T={time_} B={batch} C={channels} H={heads} K={kernel} fp32, padding K//2, fwd+bwd",
            "threads": torch.get_num_threads(), **rows}


def cpu_decoding(repeats, steps=64):
    """One token per call through incremental_state, ours against fairseq's step (median ms
    per token over ``steps`` tokens, decoding from an empty state)."""
    from ds_chimera.nn import DynamicConv1dTBC, LightweightConv1dTBC
    fairseq = _fairseq_math()
    torch.manual_seed(0)
    batch, channels, heads, kernel = 8, 512, 8, 31
    tokens = torch.randn(steps, batch, channels)
    rows = {}
    for name, dyn in (("lightconv", False), ("dynamicconv", True)):
        config = dict(kernel_size=kernel, padding_l=kernel - 1, num_heads=heads, weight_softmax=True)
        theirs = (fairseq.FairseqDynamicConv if dyn else fairseq.FairseqLightConv)(channels, **config).eval()
        ours = (DynamicConv1dTBC if dyn else LightweightConv1dTBC)(channels, **config, backend="cpp").eval()
        ours.load_state_dict(theirs.state_dict())

        def decode(module):
            state = {}
            with torch.no_grad():
                for t in range(steps):
                    module(tokens[t:t + 1], incremental_state=state)

        times = {name: t / steps for name, t in
                 interleaved({"ours": lambda: decode(ours), "fairseq": lambda: decode(theirs)}, repeats).items()}
        rows[name] = {k: round(v * 1e3, 4) for k, v in times.items()}
        rows[name]["speedup"] = round(times["fairseq"] / times["ours"], 2)
        print(f"CPU {name:<12} decoding step: ours {times['ours'] * 1e6:7.1f} us   fairseq {times['fairseq'] * 1e6:7.1f} us"
              f"   x{rows[name]['speedup']}", flush=True)
    return {"shape": f"B={batch} C={channels} H={heads} K={kernel} fp32, {steps} tokens from an empty state",
            "threads": torch.get_num_threads(), **rows}


# ---- GPU: correctness and the roofline table (benchmarks/gpu_check.sh runs these) ----------------

def _layout(x, layout):
    """A (B, C, T) tensor as itself ("bct") or as the (B, C, T) view of T x B x C ("tbc")."""
    return x if layout == "bct" else x.permute(2, 0, 1).contiguous().permute(1, 2, 0)


def _dyn_layout(w, layout):
    return w if layout == "bct" else w.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)


def correctness_cases(dry_run=False):
    """(dynamic, dtype, K, padding, channels per head, T, layout): every kind of launch the
    dispatcher makes (tap loop below 5 taps, window tiles of 16-64 steps with one- and
    two-sided reach, the tap loop past a reach of 64 or K of 129, fp64), heads of 16, 64, 96
    and 128 channels (one and several 64-channel blocks) and both layouts, taken in turn so
    that each compiles only a few dozen kernels per shard."""
    if dry_run:   # the interpreter runs every program in Python: a few small cases
        kernels, dtypes, extra, extra_kernels = (3, 7, 70), (torch.float32,), (torch.float64,), (7,)
        widths, time_ = (4, 8), 24
    else:
        kernels, dtypes, extra = (3, 7, 31, 64, 100, 130), (torch.float32, torch.bfloat16), (torch.float16, torch.float64)
        extra_kernels, widths, time_ = (31, 100), (16, 64, 96, 128), 300
    cases = []
    for dyn in (False, True):
        for dtype in dtypes + extra:
            for kernel in kernels:
                if dtype in extra and kernel not in extra_kernels:
                    continue
                for padding_l in sorted({0, kernel // 2, kernel - 1}):
                    turn = len(cases)
                    cases.append((dyn, dtype, kernel, padding_l, widths[turn % len(widths)], time_,
                                  ("tbc", "bct")[(turn // len(widths)) % 2]))
    return cases


def check_case(case, dev):
    """Failures (strings) of one case: forward, the fused backward and the single-gradient
    ops, and the decoding step for causal cases, each within ops/error_bounds.py's bound of
    the fp64 direct reference."""
    from ds_chimera.ops import error_bounds
    from ds_chimera.ops import triton_kernels as tk
    from ds_chimera.ops.reference import dynamicconv_step, lightconv_step
    dyn, dtype, kernel, padding_l, width, time_, layout = case
    heads, batch = 2, 2
    g = torch.Generator().manual_seed(kernel * 131 + padding_l * 7 + width)
    x = torch.randn(batch, heads * width, time_, generator=g).to(dtype)
    w = torch.randn(*((batch, heads, kernel, time_) if dyn else (heads, kernel)), generator=g).to(dtype)
    grad = torch.randn(x.shape, generator=g).to(dtype)
    refs = error_bounds.references(dyn, x, w, padding_l, grad)
    xd, gd = _layout(x.to(dev), layout), _layout(grad.to(dev), layout)
    wd = _dyn_layout(w.to(dev), layout) if dyn else w.to(dev)
    name = "dynamicconv" if dyn else "lightconv"
    got = {"y": getattr(tk, f"{name}_forward")(xd, wd, padding_l)}
    got["grad_x"], got["grad_w"] = getattr(tk, f"{name}_backward")(gd, xd, wd, padding_l)
    got["grad_x only"] = getattr(tk, f"{name}_backward_input")(gd, wd, padding_l)
    got["grad_w only"] = getattr(tk, f"{name}_backward_weight")(gd, xd, padding_l, heads, kernel)
    u = error_bounds.accumulation_roundoff(dtype, tensor_cores=True)
    path = tk.kernel_path(f"{name}_forward", x, kernel, padding_l, width)
    context = f"{name} {str(dtype)[6:]} K={kernel} P={padding_l} C/H={width} T={time_} {layout} [{path}]"
    failures = error_bounds.check({k: v.cpu() for k, v in got.items()},
                                  {k: refs[k.split(" ")[0]] for k in got}, u, context)
    if got["y"].stride() != xd.stride():
        failures.append(f"{context}: y strides {got['y'].stride()} != x strides {xd.stride()}")
    if padding_l == kernel - 1:                   # the decoding step on the last step's window
        buffer = torch.randn(kernel - 1, batch, heads * width, generator=g).to(dtype)
        step_w = torch.randn(*((batch, heads, kernel) if dyn else (heads, kernel)), generator=g).to(dtype)
        position = (kernel // 3) % max(1, kernel - 1)
        out = getattr(tk, f"{name}_step")(buffer.to(dev), x[:, :, 0].to(dev), step_w.to(dev), position).cpu()
        step = dynamicconv_step if dyn else lightconv_step
        want = step(buffer.double(), x[:, :, 0].double(), step_w.double(), position)
        magnitude = step(buffer.double().abs(), x[:, :, 0].double().abs(), step_w.double().abs(), position)
        ratio, where = error_bounds.excess(out, want, magnitude, kernel, error_bounds.accumulation_roundoff(dtype))
        if not ratio <= 1:
            failures.append(f"{context} step: error {ratio:.3g}x its bound at {where}")
    return failures


def correctness(dev, shard=(0, 1), dry_run=False, out=None):
    cases = correctness_cases(dry_run)[shard[0]::shard[1]]
    failures = []
    start = time.perf_counter()
    for case in cases:
        try:
            failures += check_case(case, dev)
        except Exception as exc:                 # a launch that fails is a failure, reported
            failures.append(f"{case}: {type(exc).__name__}: {str(exc)[:300]}")
    summary = {"cases": len(cases), "failures": failures, "seconds": round(time.perf_counter() - start, 1)}
    print(f"correctness shard {shard[0]}/{shard[1]}: {len(cases)} cases, {len(failures)} failures "
          f"({summary['seconds']} s)", flush=True)
    for line in failures[:20]:
        print("  FAIL", line, flush=True)
    if out:
        with open(out, "w") as fh:
            json.dump(summary, fh, indent=1)
    return summary


ROOFLINE_KERNELS = (3, 7, 15, 31, 64, 127)


def roofline_cells(dry_run=False):
    """(op, direction, dtype, K, padding name, layout): the issue's table in the layers' layout
    (T x B x C), and K=31 in B x C x T too (the layout of the earlier H200 tables)."""
    dtypes = (torch.float32,) if dry_run else (torch.float32, torch.bfloat16)
    kernels = (3, 7) if dry_run else ROOFLINE_KERNELS
    return [(op, direction, dtype, kernel, pad, layout)
            for layout in ("tbc", "bct") for dtype in dtypes for op in ("lightconv", "dynamicconv")
            for direction in ("fwd", "bwd") for kernel in kernels for pad in ("centred", "causal")
            if layout == "tbc" or kernel in (7, 31)]


def roofline(dev, shard=(0, 1), dry_run=False, warm_only=False, out=None):
    """Each cell's time and bandwidth as a share of the nominal HBM peak and of a measured
    device-to-device copy; bytes per element: LightConv forward 2 values, backward 3;
    DynamicConv forward 2 + K*H/C, backward 3 + 2*K*H/C (the fused backward). ``warm_only``
    runs each cell once (compiles it into Triton's cache) and times nothing."""
    from ds_chimera.ops import triton_kernels as tk
    cells = roofline_cells(dry_run)[shard[0]::shard[1]]
    batch, channels, time_, heads = (2, 32, 64, 2) if dry_run else (16, 1024, 2048, 16)
    if dev.type == "cuda":
        import triton
        bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-3
        name = torch.cuda.get_device_name()
    else:
        bench = lambda fn: cpu_time(fn, 1)
        name = "cpu (TRITON_INTERPRET=1, dry run)"
    nominal = next((v for k, v in NOMINAL_HBM_TBS.items() if k in name), None)
    result = {"device": name, "nominal_TBps": nominal, "shape": f"B={batch} C={channels} T={time_} H={heads}",
              "rows": []}
    if not warm_only:
        big = torch.empty((1 << 28) if dev.type == "cuda" else 1 << 16, dtype=torch.uint8, device=dev)
        copy_tbs = 2 * big.numel() / bench(lambda: big.clone()) / 1e12
        result["copy_TBps"] = round(copy_tbs, 3)
        print(f"{name}: device-to-device copy {result['copy_TBps']} TB/s; nominal {nominal} TB/s", flush=True)
    tensors = {}
    for op, direction, dtype, kernel, pad_name, layout in cells:
        key = (dtype, layout)
        if key not in tensors:
            x = _layout(torch.randn(batch, channels, time_, device=dev, dtype=dtype), layout)
            tensors[key] = (x, _layout(torch.randn(batch, channels, time_, device=dev, dtype=dtype), layout))
        x, gy = tensors[key]
        padding_l = kernel // 2 if pad_name == "centred" else kernel - 1
        dyn = op == "dynamicconv"
        if dyn:
            w = _dyn_layout(torch.softmax(torch.randn(batch, heads, kernel, time_, device=dev), 2).to(dtype), layout)
        else:
            w = torch.softmax(torch.randn(heads, kernel, device=dev), -1).to(dtype)
        if direction == "fwd":
            fn = (lambda: tk.dynamicconv_forward(x, w, padding_l)) if dyn else (lambda: tk.lightconv_forward(x, w, padding_l))
            values = 2 + (kernel * heads / channels if dyn else 0)
        else:
            fn = (lambda: tk.dynamicconv_backward(gy, x, w, padding_l)) if dyn else \
                (lambda: tk.lightconv_backward(gy, x, w, padding_l))
            values = 3 + (2 * kernel * heads / channels if dyn else 0)
        path = tk.kernel_path(f"{op}_{'forward' if direction == 'fwd' else 'backward'}", x, kernel, padding_l,
                              channels // heads)
        if warm_only:
            fn()
            continue
        seconds = bench(fn)
        tbs = values * x.numel() * x.element_size() / seconds / 1e12
        row = {"op": op, "dir": direction, "dtype": str(dtype)[6:], "K": kernel, "padding": pad_name,
               "layout": layout, "us": round(seconds * 1e6, 1), "TBps": round(tbs, 3),
               "of_copy": round(tbs / copy_tbs, 3),
               "of_nominal": round(tbs / nominal, 3) if nominal else None, "path": path}
        result["rows"].append(row)
        print(f"  {op:<11} {direction} {row['dtype']:<8} K={kernel:<3} {pad_name:<7} {layout} {row['us']:9.1f} us "
              f"{tbs:6.2f} TB/s {100 * (row['of_nominal'] or 0):5.1f}% of nominal  [{path}]", flush=True)
        if out:                                   # after every row: a timeout keeps what was measured
            with open(out, "w") as fh:
                json.dump(result, fh, indent=1)
    return result


def roofline_table(path):
    """A markdown table (percent of nominal HBM, time in us) from a roofline JSON."""
    with open(path) as fh:
        result = json.load(fh)
    lines = []
    for layout in ("tbc", "bct"):
        rows = [r for r in result["rows"] if r["layout"] == layout]
        if not rows:
            continue
        heads = [f"K={k} {p}" for k in ROOFLINE_KERNELS for p in ("centred", "causal")]
        lines += [f"\nLayout {layout} ({result['device']}, {result['shape']}), percent of nominal (us):\n",
                  "| kernel | dtype | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
        for op in ("lightconv", "dynamicconv"):
            for direction in ("fwd", "bwd"):
                for dtype in ("float32", "bfloat16"):
                    cells = {(r["K"], r["padding"]): r for r in rows
                             if (r["op"], r["dir"], r["dtype"]) == (op, direction, dtype)}
                    if not cells:
                        continue
                    text = [("-" if (k, p) not in cells else
                             f"{100 * cells[(k, p)]['of_nominal']:.0f}% ({cells[(k, p)]['us']:.0f})"
                             if cells[(k, p)]["of_nominal"] else f"({cells[(k, p)]['us']:.0f})")
                            for k in ROOFLINE_KERNELS for p in ("centred", "causal")]
                    lines.append(f"| {op} {direction} | {dtype} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--layers", action="store_true", help="only the layer and decoding rows on CPU")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU rows")
    parser.add_argument("--correctness", action="store_true", help="only the Triton correctness grid")
    parser.add_argument("--roofline", action="store_true", help="only the roofline table")
    parser.add_argument("--warm", action="store_true", help="with --roofline: run each cell once, time nothing")
    parser.add_argument("--table", default=None, help="print the markdown table of a roofline JSON and exit")
    parser.add_argument("--summary", nargs="*", default=None, help="count the failures in correctness JSONs")
    parser.add_argument("--shard", default="0/1", help="i/n: this process's share of the cases")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script, not the GPU)")
    args = parser.parse_args()
    if args.table:
        print(roofline_table(args.table))
        return
    if args.summary is not None:
        docs = [json.load(open(path)) for path in args.summary]
        print(f"{sum(len(d['failures']) for d in docs)} failures in {sum(d['cases'] for d in docs)} cases "
              f"({len(docs)} shards reported)")
        return
    shard = tuple(int(v) for v in args.shard.split("/"))
    if args.correctness or args.roofline:
        if args.dry_run:
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise SystemExit("--dry-run needs TRITON_INTERPRET=1 (the Triton interpreter on CPU)")
            dev = torch.device("cpu")
        elif not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-run (and TRITON_INTERPRET=1) on CPU")
        else:
            dev = torch.device("cuda")
        if args.correctness:
            summary = correctness(dev, shard, args.dry_run, args.out)
            sys.exit(1 if summary["failures"] else 0)
        roofline(dev, shard, args.dry_run, args.warm, args.out)
        return
    repeats = 3 if args.quick else 7
    out = {}
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.gpu_only:
        if not args.layers:
            out["cpu"] = cpu_part(repeats)
        out["cpu_layers"] = cpu_layers(repeats)
        out["cpu_decoding"] = cpu_decoding(repeats)
    if torch.cuda.is_available() and not args.cpu_only:
        out["gpu_correctness"] = correctness(torch.device("cuda"))
        out["gpu_roofline"] = roofline(torch.device("cuda"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
