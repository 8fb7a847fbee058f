"""The Triton kernels under the interpreter (TRITON_INTERPRET=1), against the fp64 reference's
error bound: the tap-loop and decoding-step kernels, and the window kernels.

On a CPU the interpreter checks what the kernels compute, not their speed; each check runs in a
subprocess because the interpreter is chosen when Triton is imported. A file of its own: the two
checks are the suite's longest, and pytest-xdist spreads files over its workers.
"""
import os
import subprocess
import sys
import textwrap

import pytest


TRITON_CHECK = textwrap.dedent('''
    import itertools, os, sys, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    FULL = os.environ.get("DS_CHIMERA_KERNEL_GRID") == "full"
    from ds_chimera.ops import error_bounds, lightconv, dynamicconv, triton_kernels
    from ds_chimera.ops.reference import lightconv_step, dynamicconv_step
    failures, cases = [], 0
    def tbc(t):
        return t.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    for dynamic, dtype in itertools.product((False, True), dtypes):
        u = error_bounds.accumulation_roundoff(dtype, tensor_cores=True)
        # the interpreter converts fp32 to bf16 by truncation (a GPU rounds to nearest)
        rounding = "truncate" if dtype == torch.bfloat16 else "nearest"
        shapes = [(1, 1, 1, 4), (2, 2, 5, 4), (3, 4, 9, 4), (4, 1, 17, 4), (7, 2, 6, 4), (31, 2, 40, 4),
                  (70, 2, 72, 2)]
        if dtype in (torch.float16, torch.bfloat16):     # the same tap loop as fp32 here (see _use_window)
            shapes = [(3, 4, 9, 4), (7, 2, 6, 4)]
        elif dtype == torch.float64 and not FULL:        # fp64 shares fp32's code but for its accumulator
            shapes = [(1, 1, 1, 4), (7, 2, 6, 4)]
        elif not FULL:                                   # CI: fp32 without two of the middle shapes
            shapes = [shape for shape in shapes if shape[0] not in (2, 4)]
        for kernel, heads, time, channels in shapes:
            if not FULL and dynamic and kernel == 31:    # CI: the dynamic kernel's long reach is K = 70's
                continue
            # K = 70: a causal reach over 64 (the tap loop on a GPU too), and P = 0
            paddings = {0, kernel - 1} if kernel == 70 else {0, kernel // 2, kernel - 1}
            if not FULL and dtype in (torch.float16, torch.bfloat16) and kernel == 7:
                paddings = {kernel // 2}                 # CI: K = 3 runs every padding in 16 bits
            for padding_l in sorted(paddings):
                g = torch.Generator().manual_seed(kernel + time)
                x = torch.randn(1, channels, time, generator=g).to(dtype)
                shape = (1, heads, kernel, time) if dynamic else (heads, kernel)
                w = torch.randn(*shape, generator=g).to(dtype)
                grad = torch.randn(1, channels, time, generator=g).to(dtype)
                fn = dynamicconv if dynamic else lightconv
                refs = error_bounds.references(dynamic, x, w, padding_l, grad)
                for layout in ((lambda t: t), tbc) if kernel in (7, 70) else ((lambda t: t),):
                    xs, ws = layout(x).requires_grad_(True), w.clone().requires_grad_(True)
                    y = fn(xs, ws, padding_l, "triton")
                    got = dict(zip(("y", "grad_x", "grad_w"), [y, *torch.autograd.grad(y, (xs, ws), layout(grad))]))
                    if kernel == 7:                     # the single-gradient op (the weight does not need one)
                        got["grad_x only"] = torch.autograd.grad(fn(xs, ws.detach(), padding_l, "triton"), xs,
                                                                 layout(grad))[0]
                        refs["grad_x only"] = refs["grad_x"]
                    cases += 1
                    if any(t.dtype != dtype for t in got.values()) or y.stride() != torch.empty_like(xs).stride():
                        failures.append(f"dtype or layout {dynamic} {dtype} {kernel} {padding_l}")
                    path = triton_kernels.kernel_path("dynamicconv_forward" if dynamic else "lightconv_forward", x,
                                                      kernel, padding_l, channels // heads)
                    failures += error_bounds.check(got, refs, u, f"dyn={dynamic} {dtype} K={kernel} H={heads} "
                                                   f"T={time} P={padding_l} {xs.stride()} [{path}]", rounding)
    for dynamic, dtype, kernel in itertools.product((False, True), dtypes, (1, 2, 6, 31)):
        g = torch.Generator().manual_seed(kernel)
        buf = torch.randn(kernel - 1, 3, 16, generator=g).to(dtype)
        x = torch.randn(3, 16, generator=g).to(dtype)
        w = torch.randn(*((3, 4, kernel) if dynamic else (4, kernel)), generator=g).to(dtype)
        for position in range(max(1, kernel - 1)) if FULL else sorted({0, max(0, kernel - 2) // 2, max(0, kernel - 2)}):
            got = (triton_kernels.dynamicconv_step if dynamic else triton_kernels.lightconv_step)(buf, x, w, position)
            step = dynamicconv_step if dynamic else lightconv_step
            want = step(buf.double(), x.double(), w.double(), position)
            magnitude = step(buf.double().abs(), x.double().abs(), w.double().abs(), position)
            cases += 1
            ratio, where = error_bounds.excess(got, want, magnitude, kernel, error_bounds.accumulation_roundoff(dtype),
                                               "truncate" if dtype == torch.bfloat16 else "nearest")
            if not ratio <= 1:
                failures.append(f"step dyn={dynamic} {dtype} K={kernel} position={position}: {ratio:.3g}x")
    print("\\n".join(failures[:20]))
    print(f"triton-interpret: {cases} checks, {len(failures)} failures")
    sys.exit(1 if failures else 0)
''')


def test_triton_kernels_under_the_interpreter():
    """Tap-loop and decoding-step kernels against the fp64 reference's error bound, every dtype and
    layout. CI checks a subset of shapes, paddings and step positions (fp64 and 16-bit share fp32's
    code but for the accumulator and the rounding); DS_CHIMERA_KERNEL_GRID=full all."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 failures" in proc.stdout


WINDOW_CHECK = textwrap.dedent('''
    import os, sys, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from ds_chimera.ops import error_bounds
    from ds_chimera.ops import triton_window as tw
    failures, cases = [], 0
    u = error_bounds.accumulation_roundoff(torch.float32, tensor_cores=True)
    def tbc(t):
        return t.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    def dyn_tbc(w):
        return w.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    FULL = os.environ.get("DS_CHIMERA_KERNEL_GRID") == "full"
    shapes = [(1, 1, 1, 8), (3, 4, 9, 8), (4, 1, 17, 8), (7, 2, 40, 8), (31, 2, 70, 64), (33, 1, 50, 16),
              (64, 2, 100, 8), (5, 1, 33, 130)]
    for dynamic in (False, True):
        # CI: no 64-channel head (K = 5 has a 130-channel one), no K = 64, fewer paddings at K = 33
        for kernel, heads, time, channels in shapes if FULL else [s for s in shapes if s[0] not in (4, 31, 64)]:
            if not FULL and dynamic and kernel in (5, 33):   # CI: dynamic weights at K = 1, 3, 7
                continue
            paddings = {0, kernel // 2, kernel - 1}
            if not FULL and kernel in (7, 33):          # CI: K = 3 runs every padding; K = 7 adds the
                paddings = {kernel - 1}                 # T x B x C layout, K = 33 the reach over 32
            elif not FULL and kernel == 5:              # CI: the 130-channel head, centred
                paddings = {kernel // 2}
            for padding_l in sorted(paddings):
                g = torch.Generator().manual_seed(kernel + time)
                x = torch.randn(2, channels, time, generator=g).float()
                shape = (2, heads, kernel, time) if dynamic else (heads, kernel)
                w = torch.randn(*shape, generator=g).float()
                gy = torch.randn(2, channels, time, generator=g).float()
                refs = error_bounds.references(dynamic, x, w, padding_l, gy)
                wide = 2 * tw.window_width(kernel, padding_l)
                layouts = [(x, w, gy, "bct")]
                if kernel == 7:                          # the layers' T x B x C views
                    layouts.append((tbc(x), dyn_tbc(w) if dynamic else w, tbc(gy), "tbc"))
                for (xf, wf, gf, layout), slide in [(l, s) for l in layouts for s in (False, True)]:
                    args = (padding_l, heads, kernel, dynamic)
                    got = {"y": tw.window_forward(xf, wf, padding_l, dynamic, tiles=2, sliding=slide),
                           "y wide": tw.window_forward(xf, wf, padding_l, dynamic, width=wide, sliding=slide)}
                    got["grad_x"], got["grad_w"] = tw.window_backward(gf, xf, wf, *args, tiles=2, sliding=slide)
                    got["grad_x wide"], got["grad_w wide"] = tw.window_backward(gf, xf, wf, *args, width=wide,
                                                                                tiles=1, sliding=slide)
                    got["grad_x only"] = tw.window_backward(gf, None, wf, *args, need_weight=False, sliding=slide)[0]
                    got["grad_w only"] = tw.window_backward(gf, xf, None, *args, need_input=False, sliding=slide)[1]
                    named = {name: refs[name.split(" ")[0]] for name in got}
                    cases += len(got)
                    if got["y"].stride() != xf.stride() or got["grad_x"].stride() != xf.stride():
                        failures.append(f"layout {layout} {kernel} {padding_l}")
                    failures += error_bounds.check(got, named, u, f"slide={slide} dyn={dynamic} K={kernel} "
                                                   f"H={heads} T={time} C={channels} P={padding_l} {layout}")
    print("\\n".join(failures[:20]))
    print(f"window kernels: {cases} checks, {len(failures)} failures")
    sys.exit(1 if failures else 0)
''')


def test_window_kernels_under_the_interpreter():
    """Forward, fused backward and the single-gradient variants, windows reloaded and sliding,
    tile widths from the smallest to twice it, one and several tiles per program, every padding
    reach, heads wider than one channel block (fp32: the interpreter's 16-bit dot is wrong).
    CI drops three shapes, runs one padding at K = 5, 7 and 33 (K = 3 runs all three) and dynamic
    weights at K = 1, 3, 7; DS_CHIMERA_KERNEL_GRID=full runs them all."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", WINDOW_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " 0 failures" in proc.stdout
