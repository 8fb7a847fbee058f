"""Native CPU LightConv / DynamicConv kernels (csrc/lightconv_cpu.cpp) against ops/reference.py.

Forward is compared with the unfold reference, the two backward kernels with autograd through
it, always computed in float64 from the same (already rounded) inputs.
"""
import pytest
import torch

from ds_chimera.ops import cpp_backend
from ds_chimera.ops.reference import dynamicconv_unfold, lightconv_unfold

if not cpp_backend.compiler_found():
    pytest.skip("no C++ compiler on PATH: the native CPU kernels cannot be built", allow_module_level=True)


@pytest.fixture(scope="module")
def ext():
    assert cpp_backend.available(), "native kernels failed to build although a compiler exists"
    return cpp_backend.load()


# (rtol, atol as a fraction of the reference's largest magnitude)
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


def assert_close(got, ref, dtype, what):
    assert got.dtype == dtype, f"{what}: dtype {got.dtype} != {dtype}"
    assert got.is_contiguous(), f"{what}: output not contiguous"
    rtol, atol = TOL[dtype]
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def reference(dynamic, x, w, padding_l, grad_y):
    """(y, grad_x, grad_w) in float64 from the unfold reference and autograd."""
    fn = dynamicconv_unfold if dynamic else lightconv_unfold
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = fn(x64, w64, padding_l)
    gx, gw = torch.autograd.grad(y, (x64, w64), grad_y.double())
    return y.detach(), gx, gw


def check_all(ext, dynamic, x, w, padding_l, grad_y, dtype, tag):
    heads, kernel = (w.shape[1], w.shape[2]) if dynamic else w.shape
    y_ref, gx_ref, gw_ref = reference(dynamic, x, w, padding_l, grad_y)
    if dynamic:
        y = ext.dynamicconv_forward(x, w, padding_l)
        gx = ext.dynamicconv_backward_input(grad_y, w, padding_l)
        gw = ext.dynamicconv_backward_weight(grad_y, x, padding_l, heads, kernel)
    else:
        y = ext.lightconv_forward(x, w, padding_l)
        gx = ext.lightconv_backward_input(grad_y, w, padding_l)
        gw = ext.lightconv_backward_weight(grad_y, x, padding_l, heads, kernel)
    assert_close(y, y_ref, dtype, f"{tag} forward")
    assert_close(gx, gx_ref, dtype, f"{tag} backward_input")
    assert_close(gw, gw_ref, dtype, f"{tag} backward_weight")


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("kernel", [1, 2, 3, 4, 7, 31])
def test_grid(ext, dynamic, dtype, kernel):
    gen = torch.Generator().manual_seed(kernel)
    batch, channels = 2, 8
    for heads in (1, 2, 4):
        for padding_l in sorted({0, kernel // 2, kernel - 1}):
            for time in (1, 5, 33):
                x = torch.randn(batch, channels, time, generator=gen).to(dtype)
                wshape = (batch, heads, kernel, time) if dynamic else (heads, kernel)
                w = torch.randn(wshape, generator=gen).to(dtype)
                grad_y = torch.randn(batch, channels, time, generator=gen).to(dtype)
                tag = f"H={heads} K={kernel} P={padding_l} T={time}"
                check_all(ext, dynamic, x, w, padding_l, grad_y, dtype, tag)


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
def test_non_contiguous_inputs(ext, dynamic):
    torch.manual_seed(1)
    batch, channels, time, heads, kernel = 2, 8, 19, 2, 5
    x = torch.randn(batch, time, channels).transpose(1, 2)             # (B, C, T), strided
    grad_y = torch.randn(channels, batch, time).permute(1, 0, 2)
    if dynamic:
        w = torch.randn(batch, heads, time, kernel).transpose(2, 3)    # (B, H, K, T), strided
    else:
        w = torch.randn(kernel, heads).t()                             # (H, K), strided
    assert not (x.is_contiguous() or w.is_contiguous() or grad_y.is_contiguous())
    for padding_l in (0, 2, 4):
        check_all(ext, dynamic, x, w, padding_l, grad_y, torch.float32, f"strided P={padding_l}")


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
def test_long_sequence(ext, dynamic):
    torch.manual_seed(2)
    batch, channels, time, heads, kernel = 1, 4, 16384, 2, 31
    x = torch.randn(batch, channels, time)
    w = torch.randn(batch, heads, kernel, time) if dynamic else torch.randn(heads, kernel)
    grad_y = torch.randn(batch, channels, time)
    for padding_l in (15, 30):
        check_all(ext, dynamic, x, w, padding_l, grad_y, torch.float32, f"T={time} P={padding_l}")


def test_result_independent_of_thread_count(ext):
    torch.manual_seed(3)
    x, gy = torch.randn(2, 16, 300), torch.randn(2, 16, 300)
    w, wd = torch.randn(4, 7), torch.randn(2, 4, 7, 300)
    calls = [lambda: ext.lightconv_forward(x, w, 3), lambda: ext.lightconv_backward_weight(gy, x, 3, 4, 7),
             lambda: ext.dynamicconv_backward_input(gy, wd, 6), lambda: ext.dynamicconv_backward_weight(gy, x, 0, 4, 7)]
    threads = torch.get_num_threads()
    try:
        many = [f() for f in calls]
        torch.set_num_threads(1)
        one = [f() for f in calls]
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(many, one):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
def test_errors(ext, dynamic):
    x = torch.randn(2, 8, 5)
    w = torch.randn(2, 2, 3, 5) if dynamic else torch.randn(2, 3)
    fwd = ext.dynamicconv_forward if dynamic else ext.lightconv_forward
    bwd_in = ext.dynamicconv_backward_input if dynamic else ext.lightconv_backward_input
    bwd_w = ext.dynamicconv_backward_weight if dynamic else ext.lightconv_backward_weight

    for bad in (3, -1):
        with pytest.raises(ValueError, match=r"padding_l must be in \[0, K-1\] = \[0, 2\], got " + str(bad)):
            fwd(x, w, bad)
        with pytest.raises(ValueError, match=r"padding_l must be in \[0, K-1\]"):
            bwd_in(x, w, bad)
        with pytest.raises(ValueError, match=r"padding_l must be in \[0, K-1\]"):
            bwd_w(x, x, bad, 2, 3)

    w3 = torch.randn(2, 3, 3, 5) if dynamic else torch.randn(3, 3)
    with pytest.raises(ValueError, match="the number of heads must divide the channels: H=3, C=8"):
        fwd(x, w3, 1)
    with pytest.raises(ValueError, match="the number of heads must divide the channels: H=3, C=8"):
        bwd_w(x, x, 1, 3, 3)

    with pytest.raises(TypeError, match="must have the same dtype, got Float and Double"):
        fwd(x, w.double(), 1)
    with pytest.raises(TypeError, match="must have the same dtype"):
        bwd_w(x, x.double(), 1, 2, 3)
    with pytest.raises(TypeError, match="must be float32, float64, float16 or bfloat16"):
        fwd(x.long(), w.long(), 1)

    with pytest.raises(ValueError, match=r"must be \(B, C, T\)"):
        fwd(x[0], w, 1)
    with pytest.raises(ValueError, match="dynamic weight must be" if dynamic else r"lightconv weight must be \(H, K\)"):
        fwd(x, w[..., :4] if dynamic else w[None], 1)
    with pytest.raises(ValueError, match="grad_y must have the shape of x"):
        bwd_w(x[:, :, :4], x, 1, 2, 3)
    with pytest.raises(RuntimeError, match="must be a CPU tensor"):
        fwd(x.to("meta"), w.to("meta"), 1)


def test_unavailable_warns_once(monkeypatch):
    monkeypatch.setattr(cpp_backend, "_module", None)
    monkeypatch.setattr(cpp_backend, "_error", "RuntimeError: simulated build failure")
    monkeypatch.setattr(cpp_backend, "_warned", False)
    with pytest.warns(RuntimeWarning, match="simulated build failure.*pure-torch path"):
        assert cpp_backend.available() is False
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpp_backend.available() is False
