"""Native CPU LightConv / DynamicConv kernels (csrc/lightconv_cpu.cpp) against the fp64 reference.

Every output is compared elementwise with the direct fp64 reference on the same (already
rounded) inputs, within the error bound of ds_chimera/ops/error_bounds.py: forward, both
single-gradient kernels and the fused backward, in both loop orders (time-contiguous rows
and the layers' channels-contiguous T x B x C), and the decoding step.
"""
import pytest
import torch

from ds_chimera.ops import cpp_backend, error_bounds
from ds_chimera.ops import reference as ref_ops

if not cpp_backend.compiler_found():
    pytest.skip("no C++ compiler on PATH: the native CPU kernels cannot be built", allow_module_level=True)


@pytest.fixture(scope="module")
def ext():
    assert cpp_backend.available(), "native kernels failed to build although a compiler exists"
    return cpp_backend.load()


def tbc(x):
    """(B, C, T) as the view of a T x B x C tensor (channels contiguous)."""
    return x.permute(2, 0, 1).contiguous().permute(1, 2, 0)


def dyn_tbc(w):
    """(B, H, K, T) as the view of a T x B x H x K tensor, as DynamicConv1dTBC passes it."""
    return w.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)


def check_all(ext, dynamic, x, w, padding_l, grad_y, dtype, tag):
    """Every kernel of one op on one input; returns the number of tensors compared."""
    heads, kernel = (w.shape[1], w.shape[2]) if dynamic else w.shape
    refs = error_bounds.references(dynamic, x, w, padding_l, grad_y)
    name = "dynamicconv" if dynamic else "lightconv"
    got = {"y": getattr(ext, f"{name}_forward")(x, w, padding_l),
           "grad_x": getattr(ext, f"{name}_backward_input")(grad_y, w, padding_l),
           "grad_w": getattr(ext, f"{name}_backward_weight")(grad_y, x, padding_l, heads, kernel)}
    got["grad_x fused"], got["grad_w fused"] = getattr(ext, f"{name}_backward")(grad_y, x, w, padding_l)
    for key, tensor in got.items():
        assert tensor.dtype == dtype, f"{tag} {key}: dtype {tensor.dtype} != {dtype}"
    # outputs take the input's layout (the layers view them back as T x B x C for free)
    assert got["y"].stride() == torch.empty_like(x).stride(), tag
    assert got["grad_x fused"].stride() == torch.empty_like(x).stride(), tag
    if dynamic:
        assert got["grad_w fused"].stride() == torch.empty_like(w).stride(), tag
    u = error_bounds.accumulation_roundoff(dtype)
    failures = error_bounds.check(got, {k: refs[k.split(" ")[0]] for k in got}, u, tag)
    assert not failures, failures[:5]
    return len(got)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("kernel", [1, 2, 3, 4, 7, 31])
def test_grid(ext, dynamic, dtype, kernel):
    """Heads of 2 to 64 channels (the channels-last loops have fixed-width paths for 16, 32 and
    64 channels and a general one), both layouts, every padding reach."""
    gen = torch.Generator().manual_seed(kernel)
    batch, compared, expected = 2, 0, 0
    for channels, heads in ((8, 4), (32, 2), (64, 2), (64, 1), (80, 2)):
        for padding_l in sorted({0, kernel // 2, kernel - 1}):
            for time in (1, 5, 33):
                x = torch.randn(batch, channels, time, generator=gen).to(dtype)
                wshape = (batch, heads, kernel, time) if dynamic else (heads, kernel)
                w = torch.randn(wshape, generator=gen).to(dtype)
                grad_y = torch.randn(batch, channels, time, generator=gen).to(dtype)
                for layout in ("bct", "tbc"):
                    xs, gs = (x, grad_y) if layout == "bct" else (tbc(x), tbc(grad_y))
                    ws = dyn_tbc(w) if dynamic and layout == "tbc" else w
                    tag = f"C={channels} H={heads} K={kernel} P={padding_l} T={time} {layout}"
                    compared += check_all(ext, dynamic, xs, ws, padding_l, gs, dtype, tag)
                    expected += 5
    assert compared == expected > 0


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
def test_other_strides(ext, dynamic):
    """Layouts that are neither (strided rows, channels-last with a batch stride, a kernel
    transposed in place): read through the strides, gradients in x's layout."""
    torch.manual_seed(1)
    batch, channels, time, heads, kernel = 2, 8, 19, 2, 5
    x = torch.randn(batch, time, channels).transpose(1, 2)             # (B, C, T), strided
    grad_y = torch.randn(channels, batch, time).permute(1, 0, 2)
    if dynamic:
        w = torch.randn(batch, heads, time, kernel).transpose(2, 3)    # (B, H, K, T), strided
    else:
        w = torch.randn(kernel, heads).t()                             # (H, K), strided
    assert not (x.is_contiguous() or w.is_contiguous() or grad_y.is_contiguous())
    sliced = torch.randn(batch, channels, 2 * time)[:, :, ::2]                 # rows with a stride of 2
    for padding_l in (0, 2, 4):
        check_all(ext, dynamic, x, w, padding_l, grad_y, torch.float32, f"strided P={padding_l}")
        ws = torch.randn(batch, heads, kernel, time) if dynamic else w
        check_all(ext, dynamic, sliced, ws, padding_l, grad_y, torch.float32, f"sliced P={padding_l}")


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
def test_long_sequence(ext, dynamic):
    torch.manual_seed(2)
    batch, channels, time, heads, kernel = 1, 4, 16384, 2, 31
    x = torch.randn(batch, channels, time)
    w = torch.randn(batch, heads, kernel, time) if dynamic else torch.randn(heads, kernel)
    grad_y = torch.randn(batch, channels, time)
    for padding_l in (15, 30):
        check_all(ext, dynamic, x, w, padding_l, grad_y, torch.float32, f"T={time} P={padding_l}")
        check_all(ext, dynamic, tbc(x), dyn_tbc(w) if dynamic else w, padding_l, tbc(grad_y), torch.float32,
                  f"T x B x C, T={time} P={padding_l}")


def test_result_independent_of_thread_count(ext):
    torch.manual_seed(3)
    x, gy = torch.randn(2, 16, 300), torch.randn(2, 16, 300)
    w, wd = torch.randn(4, 7), torch.randn(2, 4, 7, 300)
    xt, gt = tbc(torch.randn(2, 128, 300)), tbc(torch.randn(2, 128, 300))
    calls = [lambda: ext.lightconv_forward(x, w, 3), lambda: ext.lightconv_backward_weight(gy, x, 3, 4, 7),
             lambda: ext.dynamicconv_backward_input(gy, wd, 6), lambda: ext.dynamicconv_backward_weight(gy, x, 0, 4, 7),
             lambda: ext.lightconv_backward(gt, xt, w, 3)[1], lambda: ext.dynamicconv_backward(gt, xt, wd, 2)[1],
             lambda: ext.lightconv_backward(gy, x, w, 3)[1], lambda: ext.dynamicconv_backward(gy, x, wd, 2)[1]]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)              # the suite runs single-threaded (conftest)
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


@pytest.mark.parametrize("dynamic", [False, True], ids=["lightconv", "dynamicconv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_decoding_step(ext, dynamic, dtype):
    """One output per channel from the ring buffer, at every position, within the bound of the
    fp64 step (which tests/test_nn.py ties to full-sequence decoding)."""
    gen = torch.Generator().manual_seed(7)
    compared = 0
    for kernel, channels, heads in ((1, 8, 2), (2, 8, 1), (5, 64, 2), (31, 80, 2)):
        buf = torch.randn(kernel - 1, 3, channels, generator=gen).to(dtype)
        x = torch.randn(3, channels, generator=gen).to(dtype)
        w = torch.randn(*((3, heads, kernel) if dynamic else (heads, kernel)), generator=gen).to(dtype)
        step = ref_ops.dynamicconv_step if dynamic else ref_ops.lightconv_step
        for position in range(max(1, kernel - 1)):
            got = (ext.dynamicconv_step if dynamic else ext.lightconv_step)(buf, x, w, position)
            want = step(buf.double(), x.double(), w.double(), position)
            magnitude = step(buf.double().abs(), x.double().abs(), w.double().abs(), position)
            ratio, where = error_bounds.excess(got, want, magnitude, kernel, error_bounds.accumulation_roundoff(dtype))
            assert got.dtype == dtype and ratio <= 1, (kernel, position, ratio, where)
            compared += 1
    assert compared == 1 + 1 + 4 + 30
    with pytest.raises(ValueError, match=r"position must be in \[0, K-2\] = \[0, 3\], got 4"):
        (ext.dynamicconv_step if dynamic else ext.lightconv_step)(
            torch.zeros(4, 1, 8), torch.zeros(1, 8), torch.zeros(*((1, 2, 5) if dynamic else (2, 5))), 4)


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


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    """torch waits forever on its build lock file; one left by a killed build must not hang load()."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not cpp_backend.remove_stale_build_lock(tmp_path) and lock.exists()   # a build in progress
    old = lock.stat().st_mtime
    with pytest.warns(RuntimeWarning, match="stale C\\+\\+ build lock"):
        assert cpp_backend.remove_stale_build_lock(tmp_path, now=old + cpp_backend.STALE_BUILD_LOCK_S + 1)
    assert not lock.exists() and not cpp_backend.remove_stale_build_lock(tmp_path)
