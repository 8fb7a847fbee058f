"""Launch configurations of the window-band Triton kernels, timed side by side on one GPU.

    python tools/kernel_sweep.py [--json out.json]

For the shape of benchmarks/kernels.py (B=16, C=1024, T=2048, H=16), each kernel (LightConv
and DynamicConv forward, and their fused backward) at K = 3, 15, 31, 64 in bf16 and fp32 is
timed under every configuration: warps per program, tile width (the smallest that covers the
kernel, and twice that), software-pipeline stages (3, 1), and tiles per program (the default
heuristic, 16). The tap-loop
kernel is timed too where it still serves (K <= 4). Before timing, every kernel variant is
checked against the fp64 reference on small shapes (within ops/error_bounds.py's bound). Prints percent of the nominal HBM
bandwidth, counting bytes as kernels.py does; the defaults in triton_window.py come from here.
"""
import argparse
import itertools
import json

import torch

from ds_chimera.ops import error_bounds
from ds_chimera.ops import triton_kernels as tk
from ds_chimera.ops import triton_window as tw

NOMINAL_HBM_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}
# (warps, twice the smallest tile width, tiles per program (None: the heuristic), pipeline stages)
CONFIGS = [(4, False, None, 3), (8, False, None, 3), (4, True, None, 3), (8, True, None, 3), (4, False, None, 1),
           (4, False, 16, 3)]


def _check_within_bounds(got, refs, dtype, context):
    """Raise if any of ``got`` (name -> tensor on the GPU) is beyond its error bound."""
    u = error_bounds.accumulation_roundoff(dtype, tensor_cores=True)
    failures = error_bounds.check({k: v.cpu() for k, v in got.items()}, refs, u, context)
    if failures:
        raise AssertionError("; ".join(failures[:3]))


def check(dev):
    """The window kernels (forward and fused backward, every config) against the fp64 direct
    reference, elementwise within ops/error_bounds.py's bound."""
    for dyn, dtype, (kernel, padding_l), (nw, wide) in itertools.product(
            (False, True), (torch.float32, torch.bfloat16), ((3, 1), (31, 30), (31, 0), (64, 32)),
            ((4, False), (8, True))):
        g = torch.Generator().manual_seed(kernel)
        heads, time_ = 4, 301
        x = torch.randn(2, 128, time_, generator=g).to(dtype)
        w = torch.randn(*((2, heads, kernel, time_) if dyn else (heads, kernel)), generator=g).to(dtype)
        gy = torch.randn(x.shape, generator=g).to(dtype)
        refs = error_bounds.references(dyn, x, w, padding_l, gy)
        width = tw.window_width(kernel, padding_l) * (2 if wide else 1)
        xd, wdv, gyd = (t.to(dev) for t in (x, w, gy))
        got = dict(zip(("y", "grad_x", "grad_w"),
                       [tw.window_forward(xd, wdv, padding_l, dyn, num_warps=nw, width=width, tiles=3),
                        *tw.window_backward(gyd, xd, wdv, padding_l, heads, kernel, dyn, num_warps=nw, width=width,
                                            tiles=3)]))
        _check_within_bounds(got, refs, dtype, f"dyn={dyn} {dtype} K={kernel} P={padding_l} warps={nw} W={width}")
    print("window kernels within the error bound of the fp64 reference", flush=True)
    return True


def sliding_comparison(bench, nominal, out, dev, shape=(16, 1024, 2048, 16), check_time=320,
                       dtypes=(torch.bfloat16, torch.float32)):
    """Windows reloaded per tile (each read three times through L2) against windows that slide
    through registers (each read once), under the launch rules, after a correctness check."""
    batch, channels, time_, heads = shape
    cases = [(15, 7), (31, 15), (64, 32), (31, 30)]
    for dtype in dtypes:
        g = torch.Generator().manual_seed(0)
        for kernel, p in cases:       # the timed specialisations, on a short sequence, against fp64
            for dyn in (False, True):
                x = torch.randn(1, channels, check_time, generator=g).to(dtype)
                shape_w = (1, heads, kernel, check_time) if dyn else (heads, kernel)
                w = torch.randn(*shape_w, generator=g).to(dtype)
                gy = torch.randn(x.shape, generator=g).to(dtype)
                refs = error_bounds.references(dyn, x, w, p, gy)
                xd, wdv, gyd = (t.to(dev) for t in (x, w, gy))
                # two tiles per program: the timed runs' specialisation (Triton compiles 1 apart)
                got = dict(zip(("y", "grad_x", "grad_w"),
                               [tw.window_forward(xd, wdv, p, dyn, sliding=True, tiles=2),
                                *tw.window_backward(gyd, xd, wdv, p, heads, kernel, dyn, sliding=True, tiles=2)]))
                _check_within_bounds(got, refs, dtype, f"sliding dyn={dyn} {dtype} K={kernel} P={p}")
        print(f"sliding kernels match the fp64 reference ({dtype})", flush=True)
    for dtype in dtypes:
        x = torch.randn(batch, channels, time_, device=dev, dtype=dtype)
        gy = torch.randn_like(x)
        n, esize = x.numel(), x.element_size()
        for kernel, p in cases:
            w = torch.softmax(torch.randn(heads, kernel, device=dev), -1).to(dtype)
            wd = torch.softmax(torch.randn(batch, heads, kernel, time_, device=dev), 2).to(dtype)
            ratio = kernel * heads / channels
            for label, values, dyn in (("lightconv fwd", 2, False), ("dynamicconv fwd", 2 + ratio, True),
                                       ("lightconv bwd", 3, False), ("dynamicconv bwd", 3 + 2 * ratio, True)):
                wt = wd if dyn else w
                times = {}
                for sliding in (False, True):
                    if label.endswith("fwd"):
                        fn = lambda: tw.window_forward(x, wt, p, dyn, sliding=sliding)
                    else:
                        fn = lambda: tw.window_backward(gy, x, wt, p, heads, kernel, dyn, sliding=sliding)
                    times[sliding] = bench(fn)
                row = {"kernel": label, "dtype": str(dtype).split(".")[-1], "K": kernel, "P": p,
                       "reloaded_us": round(times[False] * 1e6, 1), "sliding_us": round(times[True] * 1e6, 1),
                       "reloaded_of_nominal": round(values * n * esize / times[False] / 1e12 / nominal, 3),
                       "sliding_of_nominal": round(values * n * esize / times[True] / 1e12 / nominal, 3)}
                out["sliding"].append(row)
                print(f"  {label:<16} {row['dtype']:<9} K={kernel:<3} P={p:<3} reloaded {row['reloaded_us']:8.1f} us "
                      f"({row['reloaded_of_nominal'] * 100:4.1f}%)  sliding {row['sliding_us']:8.1f} us "
                      f"({row['sliding_of_nominal'] * 100:4.1f}%)  x{times[False] / times[True]:.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sliding", action="store_true", help="only compare reloaded against sliding windows")
    args = parser.parse_args()
    import triton
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    nominal = next((v for k, v in NOMINAL_HBM_TBS.items() if k in name), None) or 1.0
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=30) * 1e-3
    if args.sliding:
        out = {"device": name, "sliding": []}
        sliding_comparison(bench, nominal, out, dev)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh)
        return
    out = {"device": name, "check": check(dev), "rows": []}
    batch, channels, time_, heads = 16, 1024, 2048, 16
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(batch, channels, time_, device=dev, dtype=dtype)
        gy = torch.randn_like(x)
        n, esize = x.numel(), x.element_size()
        for kernel in (3, 15, 31, 64):
            p = kernel // 2
            w = torch.softmax(torch.randn(heads, kernel, device=dev), -1).to(dtype)
            wd = torch.softmax(torch.randn(batch, heads, kernel, time_, device=dev), 2).to(dtype)
            ratio = kernel * heads / channels
            base = tw.window_width(kernel, p)
            for (label, values), (nw, wide, tiles, stages) in itertools.product(
                    (("lightconv fwd", 2), ("dynamicconv fwd", 2 + ratio), ("lightconv bwd", 3),
                     ("dynamicconv bwd", 3 + 2 * ratio)), CONFIGS):
                width = base * (2 if wide else 1)
                dyn = label.startswith("dynamic")
                wt = wd if dyn else w
                if label.endswith("fwd"):
                    fn = lambda: tw.window_forward(x, wt, p, dyn, tiles=tiles, num_warps=nw, width=width,
                                                   num_stages=stages)
                else:
                    fn = lambda: tw.window_backward(gy, x, wt, p, heads, kernel, dyn, tiles=tiles, num_warps=nw,
                                                    width=width, num_stages=stages)
                row = {"kernel": label, "dtype": str(dtype).split(".")[-1], "K": kernel, "warps": nw, "width": width,
                       "tiles": tiles or "auto", "stages": stages}
                try:
                    seconds = bench(fn)
                except Exception as exc:      # a config that fails to compile is reported, not fatal
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    print(f"  {row}", flush=True)
                    out["rows"].append(row)
                    continue
                row["us"] = round(seconds * 1e6, 1)
                row["of_nominal"] = round(values * n * esize / seconds / 1e12 / nominal, 3)
                out["rows"].append(row)
                print(f"  {label:<16} {row['dtype']:<9} K={kernel:<3} warps={nw} width={width:<3} "
                      f"tiles={str(row['tiles']):<5} stages={stages} {row['us']:8.1f} us  "
                      f"{row['of_nominal'] * 100:5.1f}% of nominal", flush=True)
            if kernel <= 4:
                for label, values, fn in (
                        ("lightconv fwd tap", 2, lambda: tk._tap_lightconv_forward(x, w, p)),
                        ("dynamicconv fwd tap", 2 + ratio, lambda: tk._tap_dynamicconv_forward(x, wd, p))):
                    seconds = bench(fn)
                    share = values * n * esize / seconds / 1e12 / nominal
                    out["rows"].append({"kernel": label, "dtype": str(dtype).split(".")[-1], "K": kernel,
                                        "us": round(seconds * 1e6, 1), "of_nominal": round(share, 3)})
                    print(f"  {label:<20} {str(dtype):<14} K={kernel:<3} {seconds * 1e6:8.1f} us  "
                          f"{share * 100:5.1f}% of nominal", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main()
