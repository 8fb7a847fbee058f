"""The Triton kernels the dispatcher can launch fit Hopper (sm_90), checked without a GPU.

The launches are captured from the real launchers (ds_chimera/ops/launch_check.py) and
compiled for sm_90 by the installed Triton. In CI: the launch rules over the whole
(op, dtype, K <= 130, padding) grid, and shared memory for each launch structure at its
largest tiles (about 100 compiles of a few tenths of a second: Triton's front end and its
shared-memory allocation, no LLVM or ptxas). ``DS_CHIMERA_SM90_GRID=full``: every distinct launch of the whole grid (all
head widths, shapes, layouts and integer specialisations), about an hour of compiling the
first time; results are cached per Triton cache key in ~/.cache/ds_chimera/sm90_shared.json.
Shared memory grows with the tiles, so the largest of a structure bounds the others; the full
grid checks that claim too.
"""
import os
import random

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiling for sm_90 needs Triton's compiler, not its interpreter", allow_module_level=True)

from ds_chimera.ops import launch_check as lc  # noqa: E402
from ds_chimera.ops import triton_kernels as tk  # noqa: E402
from ds_chimera.ops import triton_window as tw  # noqa: E402

FULL = os.environ.get("DS_CHIMERA_SM90_GRID") == "full"


@pytest.fixture(scope="module")
def shared_cache():
    cache = lc.load_cache()
    yield cache
    lc.save_cache(cache)


@pytest.fixture(scope="module")
def families():
    """(op, dtype, dispatcher decision) -> first (K, padding) with it, over the whole grid."""
    return lc.classes(specialise=False)


def test_launch_rules_over_the_whole_grid(families):
    """Every (op, dtype, K in 1..130, padding): a window tile covers the reach, is at most 64
    steps and has tap rows for every tap; a tap-loop weight gradient holds at most TAP_TILE
    values per program. ``families`` enumerated every point; here each family is checked."""
    assert len(families) > 100
    seen_windows = 0
    for (op, dtype, decision), (kernel, padding_l) in families.items():
        if decision[0] == "window":
            width, stages, sliding, rows, left, right = decision[1:7]
            pad = kernel - 1 - padding_l if op == "lightconv_backward_input" else padding_l
            assert tw.reach(kernel, pad) <= width <= 64 and width & (width - 1) == 0, (op, dtype, kernel, pad)
            assert rows >= max(kernel, width) and stages in (1, 3)
            seen_windows += 1
        elif decision[0] == "tap":
            for taps, block, _ in decision[1]:
                assert taps * block <= tk.TAP_TILE and taps * -(-kernel // taps) >= kernel
    assert seen_windows > 50


def test_a_one_sided_reach_over_64_takes_the_tap_loop():
    """The 128-step tiles that overflowed Hopper's shared memory are no longer chosen."""
    x = torch.empty(1, 8, 4096)
    for kernel in (66, 100, 129):
        for padding_l in (0, kernel - 1):
            assert tk.kernel_path("lightconv_forward", x, kernel, padding_l, 8) == "tap loop"
    assert tk.kernel_path("lightconv_forward", x, 129, 64, 8).startswith("window")


def test_equal_decisions_make_equal_launches():
    """``decision`` is what the grid is grouped by: sampled points of one decision capture
    exactly the launches of their family's first point."""
    rng = random.Random(0)
    by_decision = {}
    for op in ("lightconv_backward", "dynamicconv_forward", "lightconv_backward_input", "dynamicconv_backward_weight"):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for kernel in rng.sample(range(1, 131), 12):
                padding_l = rng.randrange(kernel)
                key = (op, dtype, lc.decision(op, dtype, kernel, padding_l))
                by_decision.setdefault(key, []).append((kernel, padding_l))
    pairs = [(key, points) for key, points in by_decision.items() if len(points) > 1]
    assert len(pairs) >= 5
    for (op, dtype, _), points in pairs:
        captured = [lc.launches([lc.Call(op, dtype, k, p, 64, 2048, "tbc")]) for k, p in points[:2]]
        assert captured[0] == captured[1] and captured[0], (op, dtype, points[:2])


def test_every_launch_asks_for_fused_multiply_adds(monkeypatch):
    """Triton 3.10 turns its fusion default off; with the default off here, only a launch that asks
    for fusion compiles with it."""
    monkeypatch.setattr(triton.knobs.language, "default_fp_fusion", False)
    calls = [lc.Call(op, dtype, kernel, kernel // 2, 64, 2048, "tbc")
             for op in lc.OPS for dtype in (torch.float32, torch.bfloat16) for kernel in (3, 31, 127)]
    captured = lc.launches(calls)
    assert len({launch.kernel for launch in captured}) >= 6
    assert [launch.describe() for launch in captured if not launch.fp_fusion] == []


def _arguments(launch):
    """{argument name: constant value} of a launch (Triton keys constants by argument index)."""
    names = [name for name, _ in launch.signature]
    return {names[path[0]]: value for path, value in launch.constants}


SIZES = ("W", "KP", "BG", "BLOCK_T", "KB")


def _largest_per_structure(launches):
    """One launch per structure (kernel, stages, dtypes, layout constants, which windows and
    gradients, precision): the one with the largest tiles, where shared memory peaks (tile
    width, then tap rows, channel block, steps, taps; two-sided before one-sided)."""
    best = {}
    for launch in launches:
        args = _arguments(launch)
        structure = (launch.kernel, launch.num_warps, launch.num_stages,
                     tuple((name, kind) for name, kind in launch.signature if kind.startswith("*")),
                     tuple(sorted((k, str(v)) for k, v in args.items()
                                  if k not in SIZES + ("LEFT", "RIGHT", "K", "P"))))
        size = tuple(args.get(name, 0) for name in SIZES[:1]) + (bool(args.get("LEFT")) + bool(args.get("RIGHT")),) \
            + tuple(args.get(name, 0) for name in SIZES[1:])
        if structure not in best or size > best[structure][0]:
            best[structure] = (size, launch)
    return [launch for _, launch in best.values()]


def test_every_launch_fits_hopper_shared_memory(families, shared_cache):
    """Shared memory per block within 227 KB for the launches behind the grid: in CI, of the
    launches of every family at the widest channel block (64, one block and several) in both
    layouts, the largest tiles of each structure; with DS_CHIMERA_SM90_GRID=full every
    distinct launch of every head width, shape and integer specialisation."""
    if FULL:
        calls = list(lc.class_calls(lc.classes(specialise=True)))
    else:
        calls = list(lc.class_calls(families, head_widths=(64, 96), shapes=((2048, "bct"), (2048, "tbc"))))
    launches = lc.launches(calls)
    checked = launches if FULL else _largest_per_structure(launches)
    assert len(checked) >= 20
    over = []
    worst = 0
    for launch in checked:
        shared = lc.shared_memory(launch, shared_cache)
        worst = max(worst, shared)
        problem = lc.limits_problem(launch, shared)
        if problem:
            over.append(f"{launch.describe()}: {problem}")
    print(f"{len(checked)} launches of {len(calls)} calls, largest {worst} B of shared memory")
    assert worst > 0 and not over, over


def test_window_kernels_compile_to_tensor_core_code_within_the_register_file():
    """Two full sm_90 compiles (bf16 and fp32 window backward, the heaviest kernels): the PTX
    has tensor-core instructions and ptxas fits each thread in at most 255 registers; the
    shared memory of the full compile equals what the shortcut in shared_memory() reports."""
    for dtype in (torch.bfloat16, torch.float32):
        launch = lc.launches([lc.Call("lightconv_backward", dtype, 31, 15, 64, 2048, "tbc")])[0]
        assert launch.kernel.endswith("_win_backward_sliding") or launch.kernel.endswith("_win_backward")
        result = lc.compile_full(launch)
        assert result["tensor_cores"] and 0 < result["registers"] <= lc.MAX_THREAD_REGISTERS
        assert result["shared"] == lc.shared_memory(launch)
