"""The convolution ops: gradients, backends against the reference, registration, compile."""
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_chimera.ops import backends, dynamicconv, error_bounds, lightconv
from ds_chimera.ops.reference import (dynamicconv_band, dynamicconv_direct, dynamicconv_unfold, lightconv_band,
                                      lightconv_direct, lightconv_unfold)

CPU = torch.device("cpu")
CPU_BACKENDS = [name for name in ("torch", "cpp") if backends.available_backends()[name].available(CPU)[0]]


def make(batch, channels, time, heads, kernel, dtype, dynamic, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, time, generator=g, dtype=torch.float64)
    shape = (batch, heads, kernel, time) if dynamic else (heads, kernel)
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype)


def tbc(x):
    """The (B, C, T) view of a T x B x C tensor, as the layers pass their activations."""
    return x.permute(2, 0, 1).contiguous().permute(1, 2, 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_gradcheck_fp64(backend, dynamic):
    fn = dynamicconv if dynamic else lightconv
    for kernel, padding_l, heads in [(1, 0, 1), (4, 3, 2), (5, 2, 4), (6, 0, 2)]:
        x, w = make(2, 8, 7, heads, kernel, torch.float64, dynamic)
        for layout in (lambda t: t, tbc):
            xs = layout(x).requires_grad_(True)
            ws = w.clone().requires_grad_(True)
            assert torch.autograd.gradcheck(lambda a, b: fn(a, b, padding_l, backend), (xs, ws))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dynamic", [False, True])
def test_backend_within_the_error_bound_of_the_fp64_reference(backend, dtype, dynamic):
    """Forward and both gradients (the fused backward) against the direct fp64 reference,
    elementwise within the bound of ops/error_bounds.py: a dropped tap or a 1% scale fails
    in bf16 and fp32. Contiguous and T x B x C inputs; the output keeps the input's layout."""
    fn = dynamicconv if dynamic else lightconv
    u = error_bounds.accumulation_roundoff(dtype)
    failures, compared = [], 0
    for kernel, heads, time in itertools.product((1, 2, 3, 4, 7, 31), (1, 2, 4), (1, 5, 33)):
        for padding_l in sorted({0, kernel // 2, kernel - 1}):
            x, w = make(2, 8, time, heads, kernel, dtype, dynamic, seed=kernel * 100 + time)
            for layout in ((lambda t: t), tbc) if time == 33 else ((lambda t: t),):
                xs = layout(x).requires_grad_(True)
                ws = w.clone().requires_grad_(True)
                y = fn(xs, ws, padding_l, backend)
                assert y.dtype == dtype and y.stride() == torch.empty_like(xs).stride()
                grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(time)).to(dtype)
                gx, gw = torch.autograd.grad(y, (xs, ws), grad)
                refs = error_bounds.references(dynamic, x, w, padding_l, grad)
                failures += error_bounds.check({"y": y, "grad_x": gx, "grad_w": gw}, refs, u,
                                               f"K={kernel} H={heads} T={time} P={padding_l} stride={xs.stride()}")
                compared += 1
    cases_per_row = sum(len({0, k // 2, k - 1}) for k in (1, 2, 3, 4, 7, 31))
    assert compared == cases_per_row * 3 * (1 + 1 + 2), compared          # T=33 twice: two layouts
    assert not failures, failures[:10]


def test_the_bounds_fail_a_dropped_tap_and_a_one_percent_scale():
    """The bound's own power, on the torch backend's outputs: an output scaled by 1.01, or
    computed without one tap, is beyond it in fp32 and in bf16 (at most elements)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w = make(2, 8, 33, 2, 31, dtype, False, seed=5)
        grad = torch.randn(2, 8, 33).to(dtype)
        refs = error_bounds.references(False, x, w, 15, grad)
        y = lightconv(x, w, 15, "torch")
        u = error_bounds.accumulation_roundoff(dtype)
        assert not error_bounds.check({"y": y}, refs, u)
        dropped = w.clone()
        dropped[:, 7] = 0
        for bad in ((y.double() * 1.01).to(dtype), lightconv(x, dropped, 15, "torch")):
            reference, magnitude, terms = refs["y"]
            limit = error_bounds.bound(reference, magnitude, terms, dtype, u)
            beyond = ((bad.double() - reference).abs() > limit).double().mean().item()
            assert beyond > 0.5, (dtype, beyond)


@pytest.mark.parametrize("dynamic", [False, True])
def test_band_unfold_and_direct_references_agree(dynamic):
    x, w = make(2, 8, 19, 2, 6, torch.float64, dynamic)
    for padding_l in range(6):
        a = (dynamicconv_unfold if dynamic else lightconv_unfold)(x, w, padding_l)
        b = (dynamicconv_band if dynamic else lightconv_band)(x, w, padding_l)
        c = (dynamicconv_direct if dynamic else lightconv_direct)(x, w, padding_l)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


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
    # the layers' layout: T x B x C activations and T x B x H x K kernels as (B, C, T) / (B, H, K, T) views
    ("lightconv_forward", lambda: (tbc(torch.randn(2, 8, 9, dtype=torch.float64)).requires_grad_(True),
                                   torch.randn(2, 5, dtype=torch.float64, requires_grad=True), 4)),
    ("dynamicconv_forward", lambda: (tbc(torch.randn(2, 8, 9, dtype=torch.float64)).requires_grad_(True),
                                     torch.randn(9, 2, 4, 3, dtype=torch.float64).permute(1, 2, 3, 0)
                                     .detach().requires_grad_(True), 2)),
    ("dynamicconv_backward", lambda: (tbc(torch.randn(2, 8, 9)), tbc(torch.randn(2, 8, 9)),
                                      torch.randn(9, 2, 2, 3).permute(1, 2, 3, 0), 1)),
    ("lightconv_step", lambda: (torch.randn(4, 2, 8), torch.randn(2, 8), torch.randn(2, 5), 3)),
    ("dynamicconv_step", lambda: (torch.randn(2, 2, 8), torch.randn(2, 8), torch.randn(2, 4, 3), 1)),
])
def test_opcheck(op, args):
    result = torch.library.opcheck(getattr(torch.ops.ds_chimera, op).default, args())
    assert set(result.values()) == {"SUCCESS"}, result


def test_torch_compile_of_a_model_using_the_layers():
    from ds_chimera.nn import ConvLM
    torch.manual_seed(0)
    model = ConvLM(vocab_size=16, d_model=16, num_layers=2, kernel_sizes=(3, 5), num_heads=2, max_len=8)
    ids = torch.randint(0, 16, (2, 8))
    model.eval()                                              # no dropout: both runs see one function
    target = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    eager = model(ids)
    (eager.float() * target).sum().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(ids)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    (out.float() * target).sum().backward()
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and len(got) == len(list(model.parameters()))
    for name in want:                                         # the compiled backward, gradient by gradient
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


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
