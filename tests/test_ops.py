"""The convolution ops: gradients, backends against the reference, registration, compile."""
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_chimera.ops import backends, dynamicconv, lightconv
from ds_chimera.ops.reference import (dynamicconv_band, dynamicconv_unfold, lightconv_band, lightconv_unfold)

CPU = torch.device("cpu")
CPU_BACKENDS = [name for name in ("torch", "cpp") if backends.available_backends()[name].available(CPU)[0]]


def make(batch, channels, time, heads, kernel, dtype, dynamic, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, time, generator=g, dtype=torch.float64)
    shape = (batch, heads, kernel, time) if dynamic else (heads, kernel)
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype)


def reference_grads(x, w, padding_l, dynamic, grad):
    """Forward and both gradients of the unfold reference, in fp64 on the (rounded) inputs."""
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    fn = dynamicconv_unfold if dynamic else lightconv_unfold
    y = fn(x64, w64, padding_l)
    gx, gw = torch.autograd.grad(y, (x64, w64), grad.double())
    return y.detach(), gx, gw


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_gradcheck_fp64(backend, dynamic):
    fn = dynamicconv if dynamic else lightconv
    for kernel, padding_l, heads in [(1, 0, 1), (4, 3, 2), (5, 2, 4), (6, 0, 2)]:
        x, w = make(2, 8, 7, heads, kernel, torch.float64, dynamic)
        x.requires_grad_(True)
        w.requires_grad_(True)
        assert torch.autograd.gradcheck(lambda a, b: fn(a, b, padding_l, backend), (x, w))


TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 5e-2)}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dynamic", [False, True])
def test_backend_matches_reference(backend, dtype, dynamic):
    fn = dynamicconv if dynamic else lightconv
    rtol, atol = TOL[dtype]
    for kernel, heads, time in itertools.product((1, 2, 3, 4, 7, 31), (1, 2, 4), (1, 5, 33)):
        for padding_l in sorted({0, kernel // 2, kernel - 1}):
            x, w = make(2, 8, time, heads, kernel, dtype, dynamic, seed=kernel * 100 + time)
            x.requires_grad_(True)
            w.requires_grad_(True)
            y = fn(x, w, padding_l, backend)
            grad = torch.randn_like(y)
            gx, gw = torch.autograd.grad(y, (x, w), grad)
            ry, rgx, rgw = reference_grads(x.detach(), w.detach(), padding_l, dynamic, grad)
            scale = max(1.0, ry.abs().max().item())
            for got, want in ((y, ry), (gx, rgx), (gw, rgw)):
                assert got.dtype == dtype
                torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * scale * kernel ** 0.5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_band_and_unfold_references_agree(dynamic):
    x, w = make(2, 8, 19, 2, 6, torch.float64, dynamic)
    for padding_l in range(6):
        a = (dynamicconv_unfold if dynamic else lightconv_unfold)(x, w, padding_l)
        b = (dynamicconv_band if dynamic else lightconv_band)(x, w, padding_l)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_long_sequences_and_non_contiguous_inputs(backend):
    x = torch.randn(1, 16384, 4).transpose(1, 2)                 # (B, C, T) view, not contiguous
    w = torch.softmax(torch.randn(2, 31), dim=1)
    y = lightconv(x, w, 30, backend)
    torch.testing.assert_close(y, lightconv_unfold(x.contiguous(), w, 30), rtol=1e-5, atol=1e-5)
    wd = torch.softmax(torch.randn(1, 2, 31, 16384), dim=2).transpose(2, 3).contiguous().transpose(2, 3)
    torch.testing.assert_close(dynamicconv(x, wd, 15, backend), dynamicconv_unfold(x.contiguous(), wd.contiguous(), 15),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,args", [
    ("lightconv_forward", lambda: (torch.randn(2, 8, 9, dtype=torch.float64, requires_grad=True),
                                   torch.randn(2, 5, dtype=torch.float64, requires_grad=True), 2)),
    ("dynamicconv_forward", lambda: (torch.randn(2, 8, 9, dtype=torch.float64, requires_grad=True),
                                     torch.randn(2, 4, 3, 9, dtype=torch.float64, requires_grad=True), 2)),
    ("lightconv_backward_input", lambda: (torch.randn(2, 8, 9), torch.randn(2, 5), 4)),
    ("lightconv_backward_weight", lambda: (torch.randn(2, 8, 9), torch.randn(2, 8, 9), 1, 2, 3)),
    ("dynamicconv_backward_input", lambda: (torch.randn(2, 8, 9), torch.randn(2, 2, 3, 9), 0)),
    ("dynamicconv_backward_weight", lambda: (torch.randn(2, 8, 9), torch.randn(2, 8, 9), 1, 2, 3)),
    ("lightconv_backward", lambda: (torch.randn(2, 8, 9), torch.randn(2, 8, 9), torch.randn(2, 5), 3)),
    ("dynamicconv_backward", lambda: (torch.randn(2, 8, 9), torch.randn(2, 8, 9), torch.randn(2, 2, 3, 9), 1)),
])
def test_opcheck(op, args):
    result = torch.library.opcheck(getattr(torch.ops.ds_chimera, op).default, args())
    assert set(result.values()) == {"SUCCESS"}, result


def test_torch_compile_of_a_model_using_the_layers():
    from ds_chimera.nn import ConvLM
    torch.manual_seed(0)
    model = ConvLM(vocab_size=16, d_model=16, num_layers=2, kernel_sizes=(3, 5), num_heads=2, max_len=8)
    ids = torch.randint(0, 16, (2, 8))
    eager = model(ids)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(ids)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("message,call", [
    ("padding_l must be in [0, K-1] = [0, 2], got 3", lambda: lightconv(torch.randn(1, 4, 5), torch.randn(2, 3), 3)),
    ("the number of heads must divide the channels: H=3, C=4",
     lambda: lightconv(torch.randn(1, 4, 5), torch.randn(3, 3), 1)),
    ("dynamic weight must be (B=1, H, K, T=5)", lambda: dynamicconv(torch.randn(1, 4, 5), torch.randn(1, 2, 3, 4), 1)),
    ("unknown kernel backend 'cuda-fast'; available:", lambda: lightconv(torch.randn(1, 4, 5), torch.randn(2, 3), 1,
                                                                         "cuda-fast")),
    ("kernel backend 'triton' cannot run here", lambda: lightconv(torch.randn(1, 4, 5), torch.randn(2, 3), 1, "triton")),
])
def test_errors_name_the_bad_value(message, call):
    if "triton" in message and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 makes triton runnable on CPU")
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


def test_environment_variable_forces_a_backend():
    code = ("import torch; from ds_chimera.ops import backends; "
            "print(backends.select(torch.device('cpu')).name)")
    env = dict(os.environ, DS_CHIMERA_KERNEL="torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "torch", out.stderr


def test_third_party_kernel_backend_through_entry_points(tmp_path):
    (tmp_path / "mykernels.py").write_text(textwrap.dedent('''
        from ds_chimera.ops.backends import TorchBackend

        class Doubled(TorchBackend):
            name = "doubled"
            description = "a plugin: the reference, doubled"

            @staticmethod
            def lightconv_forward(x, w, padding_l):
                return 2 * TorchBackend.lightconv_forward(x, w, padding_l)
    '''))
    dist = tmp_path / "mykernels-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mykernels\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ds_chimera.kernels]\ndoubled = mykernels:Doubled\n")
    code = ("import torch\nfrom ds_chimera.ops import lightconv\nfrom ds_chimera.ops.reference import lightconv_unfold\n"
            "x, w = torch.randn(1, 4, 6), torch.randn(2, 3)\n"
            "print(torch.allclose(lightconv(x, w, 1, 'doubled'), 2 * lightconv_unfold(x, w, 1)))\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.getcwd()}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    listing = subprocess.run([sys.executable, "-m", "ds_chimera.cli", "kernels"], env=env, capture_output=True,
                             text=True)
    assert "doubled" in listing.stdout and "[mykernels]" in listing.stdout


TRITON_CHECK = textwrap.dedent('''
    import itertools, os, sys, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from ds_chimera.ops import lightconv, dynamicconv
    from ds_chimera.ops.reference import lightconv_unfold, dynamicconv_unfold
    failures = 0
    cases = 0
    for dynamic, dtype in itertools.product((False, True), (torch.float32, torch.float16, torch.bfloat16)):
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for kernel, heads, time in [(1, 1, 1), (2, 2, 5), (3, 4, 9), (4, 1, 17), (7, 2, 6), (31, 2, 40)]:
            for padding_l in sorted({0, kernel // 2, kernel - 1}):
                g = torch.Generator().manual_seed(kernel + time)
                x = torch.randn(2, 8, time, generator=g).to(dtype).requires_grad_(True)
                shape = (2, heads, kernel, time) if dynamic else (heads, kernel)
                w = torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)
                fn, ref = (dynamicconv, dynamicconv_unfold) if dynamic else (lightconv, lightconv_unfold)
                y = fn(x, w, padding_l, "triton")
                grad = torch.randn_like(y)
                got = [y] + list(torch.autograd.grad(y, (x, w), grad))
                x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
                y64 = ref(x64, w64, padding_l)
                want = [y64] + list(torch.autograd.grad(y64, (x64, w64), grad.double()))
                for a, b in zip(got, want):
                    cases += 1
                    err = (a.double() - b).abs().max().item() / max(1.0, b.abs().max().item())
                    if a.dtype != dtype or err > tol * max(1.0, kernel ** 0.5):
                        failures += 1
                        print("MISMATCH", dynamic, dtype, kernel, heads, time, padding_l, err)
    print(f"triton-interpret: {cases} checks, {failures} failures")
    sys.exit(1 if failures else 0)
''')


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 failures" in proc.stdout


WINDOW_CHECK = textwrap.dedent('''
    import os, sys, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from ds_chimera.ops import triton_window as tw
    from ds_chimera.ops.reference import lightconv_unfold, dynamicconv_unfold
    failures = cases = 0
    for dynamic in (False, True):
        for kernel, heads, time, channels in [(1, 1, 1, 8), (3, 4, 9, 8), (4, 1, 17, 8), (7, 2, 40, 8),
                                              (31, 2, 70, 64), (33, 1, 50, 16), (64, 2, 100, 8), (5, 1, 33, 130)]:
            for padding_l in sorted({0, kernel // 2, kernel - 1}):
                g = torch.Generator().manual_seed(kernel + time)
                x = torch.randn(2, channels, time, generator=g, dtype=torch.float64)
                shape = (2, heads, kernel, time) if dynamic else (heads, kernel)
                w = torch.randn(*shape, generator=g, dtype=torch.float64)
                gy = torch.randn(2, channels, time, generator=g, dtype=torch.float64)
                xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                ref = (dynamicconv_unfold if dynamic else lightconv_unfold)(xr, wr, padding_l)
                ref_gx, ref_gw = torch.autograd.grad(ref, (xr, wr), gy)
                xf, wf, gf = x.float(), w.float(), gy.float()
                wide = 2 * tw.window_width(kernel, padding_l)
                for slide in (False, True):
                    args = (padding_l, heads, kernel, dynamic)
                    got = {
                        "y": (tw.window_forward(xf, wf, padding_l, dynamic, tiles=2, sliding=slide), ref),
                        "y wide": (tw.window_forward(xf, wf, padding_l, dynamic, width=wide, sliding=slide), ref),
                    }
                    gx, gw = tw.window_backward(gf, xf, wf, *args, tiles=2, sliding=slide)
                    got.update({"gx": (gx, ref_gx), "gw": (gw, ref_gw)})
                    gx, gw = tw.window_backward(gf, xf, wf, *args, width=wide, tiles=1, sliding=slide)
                    got.update({"gx wide": (gx, ref_gx), "gw wide": (gw, ref_gw)})
                    got["gx only"] = (tw.window_backward(gf, None, wf, *args, need_weight=False, sliding=slide)[0],
                                      ref_gx)
                    got["gw only"] = (tw.window_backward(gf, xf, None, *args, need_input=False, sliding=slide)[1],
                                      ref_gw)
                    for name, (a, b) in got.items():
                        cases += 1
                        err = (a.double() - b).abs().max().item() / max(1.0, b.abs().max().item())
                        if a.shape != b.shape or err > 1e-5:
                            failures += 1
                            print("MISMATCH", name, slide, dynamic, kernel, heads, time, channels, padding_l, err)
    print(f"window kernels: {cases} checks, {failures} failures")
    sys.exit(1 if failures else 0)
''')


def test_window_kernels_under_the_interpreter():
    """Forward, fused backward and the single-gradient variants, windows reloaded and sliding,
    tile widths from the smallest to twice it, one and several tiles per program, every padding
    reach, heads wider than one channel block (fp32: the interpreter's 16-bit dot is wrong)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", WINDOW_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " 0 failures" in proc.stdout


@pytest.mark.parametrize("op", ["lightconv_forward", "dynamicconv_forward", "lightconv_backward",
                                "dynamicconv_backward"])
def test_window_launch_configs_cover_the_kernel_reach(op):
    """Every measured launch config keeps a tile at least as wide as the kernel reaches either side."""
    pytest.importorskip("triton")
    from ds_chimera.ops import triton_window as tw
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for kernel in range(1, 130):
            for padding_l in {0, kernel // 2, kernel - 1}:
                width, stages, _ = tw.launch_config(op, dtype, kernel, padding_l)
                assert width >= max(padding_l, kernel - 1 - padding_l, 16) and width & (width - 1) == 0
                assert tw.tap_rows(kernel, width) >= max(kernel, width)
                assert stages in (1, 3)


def _compile_for_hopper(fn, pointer_types: dict, constants: dict, stages: int):
    """A window kernel compiled to sm_90 code (no GPU needed), pointers 16-byte aligned."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = dict(pointer_types)
    signature.update({name: "i32" for name in ("C", "T", "K", "P", "CPH", "H", "TILES")})
    signature.update({name: "constexpr" for name in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointer_types))}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})


FORWARD_POINTERS = ("x_ptr", "w_ptr", "y_ptr")
BACKWARD_POINTERS = ("gy_ptr", "x_ptr", "w_ptr", "gx_ptr", "gw_ptr")


def test_window_kernels_compile_for_hopper():
    """Each window kernel (reloaded and sliding, LightConv and DynamicConv) compiles to sm_90
    code with the installed Triton. No GPU is needed to compile, and an earlier version's
    tl.gather failed to lower on the GPU machine's Triton: this catches that class of error."""
    pytest.importorskip("triton")
    from ds_chimera.ops import triton_window as tw
    kernel, padding_l = 31, 15
    both = {"NEED_GX": True, "NEED_GW": True}
    for dtype, dynamic, (fn, ptrs, extra) in itertools.product(
            ("bf16", "fp32"), (False, True),
            ((tw._win_forward, FORWARD_POINTERS, {}), (tw._win_forward_sliding, FORWARD_POINTERS, {}),
             (tw._win_backward, BACKWARD_POINTERS, both), (tw._win_backward_sliding, BACKWARD_POINTERS, both))):
        if dtype == "fp32" and not dynamic:
            continue
        width = tw.window_width(kernel, padding_l)
        constants = {"DYNAMIC": dynamic, "LEFT": True, "RIGHT": True, "BG": 64, "W": width,
                     "KP": tw.tap_rows(kernel, width), "PREC": "tf32x3" if dtype == "fp32" else "ieee", **extra}
        types = {name: ("*fp32" if name == "gw_ptr" and not dynamic else f"*{dtype}") for name in ptrs}
        compiled = _compile_for_hopper(fn, types, constants, stages=3)
        assert "mma" in compiled.asm["ptx"], (fn.__name__, dtype, dynamic)


def test_widest_window_kernels_fit_in_shared_memory():
    """At 129 taps (64-step tiles), the fp32 kernels under their launch rules stay within
    Hopper's 227 KB of shared memory per block (three-pass TF32 tiles are the largest)."""
    pytest.importorskip("triton")
    from ds_chimera.ops import triton_window as tw
    kernel, padding_l = 129, 64
    for op, fn, ptrs, extra in (("lightconv_forward", tw._win_forward, FORWARD_POINTERS, {}),
                                ("lightconv_backward", tw._win_backward, BACKWARD_POINTERS,
                                 {"NEED_GX": True, "NEED_GW": True})):
        width, stages, _ = tw.launch_config(op, torch.float32, kernel, padding_l)
        constants = {"DYNAMIC": False, "LEFT": True, "RIGHT": True, "BG": 64, "W": width,
                     "KP": tw.tap_rows(kernel, width), "PREC": "tf32x3", **extra}
        compiled = _compile_for_hopper(fn, {name: "*fp32" for name in ptrs}, constants, stages)
        assert compiled.metadata.shared <= 227 * 1024, (op, compiled.metadata.shared)
