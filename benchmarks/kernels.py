"""LightConv / DynamicConv kernel speed: C++ against pure torch on CPU; Triton against the roofline on GPU.

    python benchmarks/kernels.py            # CPU part; the GPU part too when CUDA is present
    python benchmarks/kernels.py --quick    # fewer repeats

CPU: forward + backward (input and weight gradient) at K=31, C=512, T=512, B=8, H=8, fp32,
for the cpp backend and the pure-torch ``unfold`` and ``band`` algorithms, through autograd.
GPU: each Triton kernel's achieved bandwidth as a fraction of the HBM roofline (a
device-to-device copy measured in the same run, and the nominal peak), counting bytes per
element as: LightConv forward 2 values, backward 3; DynamicConv forward 2 + K*H/C, backward
3 + 2*K*H/C (the backward is the fused kernel that gives both gradients); and its speed
against the torch paths. Centred padding (P = K//2), and causal padding (P = K-1) at K = 31. The last line is one JSON object.
"""
import argparse
import json
import statistics
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


def check_gpu_kernels(dev):
    """Compiled Triton kernels against the fp64 reference (forward and both grads) before timing them."""
    worst = 0.0
    for dyn in (False, True):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for kernel, heads, time_ in ((1, 1, 1), (3, 4, 257), (8, 2, 100), (31, 8, 1025), (64, 4, 300)):
                for padding_l in sorted({0, kernel // 2, kernel - 1}):
                    g = torch.Generator(device="cpu").manual_seed(kernel * 7 + time_)
                    x = torch.randn(2, 64, time_, generator=g).to(dev, dtype).requires_grad_(True)
                    shape = (2, heads, kernel, time_) if dyn else (heads, kernel)
                    w = torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_(True)
                    fn, ref = (dynamicconv, dynamicconv_unfold) if dyn else (lightconv, lightconv_unfold)
                    y = fn(x, w, padding_l, "triton")
                    grad = torch.randn_like(y)
                    got = [y, *torch.autograd.grad(y, (x, w), grad)]
                    x64 = x.detach().double().requires_grad_(True)
                    w64 = w.detach().double().requires_grad_(True)
                    y64 = ref(x64, w64, padding_l)
                    want = [y64, *torch.autograd.grad(y64, (x64, w64), grad.double())]
                    for a, b in zip(got, want):
                        err = ((a.double() - b).abs().max() / b.abs().max().clamp_min(1.0)).item()
                        limit = 1e-5 if dtype == torch.float32 else 2e-2
                        if err > limit:
                            raise AssertionError(f"triton mismatch dyn={dyn} {dtype} K={kernel} H={heads} T={time_} "
                                                 f"P={padding_l}: {err:.2e}")
                        if dtype == torch.float32:
                            worst = max(worst, err)
    print(f"GPU correctness: all Triton kernels match the fp64 reference (worst fp32 relative error {worst:.1e})",
          flush=True)
    return worst


def gpu_part(repeats):
    import triton
    from ds_chimera.ops import triton_kernels as tk
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    nominal = next((v for k, v in NOMINAL_HBM_TBS.items() if k in name), None)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100 if repeats > 3 else 40) * 1e-3   # seconds
    big = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    copy_s = bench(lambda: big.clone())
    copy_tbs = 2 * big.numel() / copy_s / 1e12
    print(f"GPU {name}: device-to-device copy {copy_tbs:.2f} TB/s (read + write); nominal HBM {nominal} TB/s", flush=True)
    results = {"device": name, "copy_TBps": round(copy_tbs, 3), "nominal_TBps": nominal, "rows": [],
               "max_rel_error": check_gpu_kernels(dev)}
    batch, channels, time_, heads = 16, 1024, 2048, 16
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(batch, channels, time_, device=dev, dtype=dtype)
        gy = torch.randn_like(x)
        esize = x.element_size()
        n = x.numel()
        for kernel in (3, 15, 31, 64):
            w = torch.softmax(torch.randn(heads, kernel, device=dev), -1).to(dtype)
            wd = torch.softmax(torch.randn(batch, heads, kernel, time_, device=dev), 2).to(dtype)
            p = kernel // 2
            ratio = kernel * heads / channels
            cases = [
                ("lightconv fwd", lambda: tk.lightconv_forward(x, w, p), 2, lambda: lightconv_unfold(x, w, p)),
                ("lightconv bwd", lambda: tk.lightconv_backward(gy, x, w, p), 3, None),
                ("dynamicconv fwd", lambda: tk.dynamicconv_forward(x, wd, p), 2 + ratio,
                 lambda: dynamicconv_unfold(x, wd, p)),
                ("dynamicconv bwd", lambda: tk.dynamicconv_backward(gy, x, wd, p), 3 + 2 * ratio, None),
            ]
            if kernel == 31:
                # the decoder's causal padding: one window before the tile, none after
                cases += [("lightconv fwd causal", lambda: tk.lightconv_forward(x, w, kernel - 1), 2, None),
                          ("lightconv bwd causal", lambda: tk.lightconv_backward(gy, x, w, kernel - 1), 3, None),
                          ("dynamicconv fwd causal", lambda: tk.dynamicconv_forward(x, wd, kernel - 1), 2 + ratio,
                           None),
                          ("dynamicconv bwd causal", lambda: tk.dynamicconv_backward(gy, x, wd, kernel - 1),
                           3 + 2 * ratio, None)]
            for label, fn, values, torch_fn in cases:
                seconds = bench(fn)
                tbs = values * n * esize / seconds / 1e12
                op = ("dynamicconv" if label.startswith("dynamic") else "lightconv") + \
                    ("_forward" if " fwd" in label else "_backward")
                pad = kernel - 1 if label.endswith("causal") else p
                row = {"kernel": label, "dtype": str(dtype).split(".")[-1], "K": kernel, "us": round(seconds * 1e6, 1),
                       "path": tk.kernel_path(op, x, kernel, pad, channels // heads),
                       "TBps": round(tbs, 3), "of_copy": round(tbs / copy_tbs, 3),
                       "of_nominal": round(tbs / nominal, 3) if nominal else None}
                if torch_fn is not None and dtype == torch.float32 and kernel <= 31:
                    try:
                        row["torch_unfold_us"] = round(bench(torch_fn) * 1e6, 1)
                        row["speedup_vs_unfold"] = round(row["torch_unfold_us"] / row["us"], 2)
                    except torch.OutOfMemoryError:
                        row["torch_unfold_us"] = "OOM"
                results["rows"].append(row)
                print(f"  {label:<22} {row['dtype']:<9} K={kernel:<3} {row['us']:9.1f} us  {tbs:6.2f} TB/s  "
                      f"{row['of_copy'] * 100:5.1f}% of copy  "
                      f"{(row['of_nominal'] or 0) * 100:5.1f}% of nominal"
                      + (f"  x{row['speedup_vs_unfold']} vs torch unfold" if "speedup_vs_unfold" in row else "")
                      + f"  [{row['path']}]",
                      flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu-only", action="store_true")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    out = {}
    if not args.gpu_only:
        out["cpu"] = cpu_part(repeats)
    if torch.cuda.is_available():
        out["gpu"] = gpu_part(repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
