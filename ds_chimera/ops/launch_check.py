"""The Triton launches the dispatcher makes, compiled for a Hopper GPU that is not here.

``capture(fn)`` runs ``fn`` (calls of triton_kernels' ops on CPU tensors) under a stand-in
CUDA driver whose target is sm_90: each kernel launch is recorded, with the signature,
specialisations (which integers are 1 or multiples of 16, pointer alignment), constants and
options that Triton's own launcher derives from the arguments, and neither compiled nor run.
``shared_memory(launch)`` compiles a recorded launch through Triton's front end and its
shared-memory allocation pass (seconds, no LLVM or ptxas) and returns the bytes per block;
``compile_full(launch)`` makes the cubin and reads registers and spills with cuobjdump.

``grid()`` lists the dispatcher's whole (K, padding, dtype, direction, head width, layout)
grid as calls; ``launches(grid())`` the distinct launches behind it. tests/test_ops_sm90.py
checks every one against Hopper's limits; ``python -m ds_chimera.ops.launch_check`` prints
them. Tied to Triton's internals (pinned in the Makefile); a Triton without them fails loudly.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

HOPPER = (90, 32)                  # capability, warp size
HOPPER_SHARED = 227 * 1024         # bytes of shared memory one block may use (sm_90)
HOPPER_REGISTERS = 65536           # 32-bit registers per block
MAX_THREAD_REGISTERS = 255


@dataclass(frozen=True)
class Launch:
    """One kernel specialisation as Triton's launcher would compile it."""

    kernel: str                    # the JITFunction's qualified name
    signature: tuple               # ((argument, type), ...)
    constants: tuple               # ((path, value), ...)
    attrs: tuple                   # ((path, attributes), ...)
    num_warps: int
    num_stages: int
    fp_fusion: bool                # fused multiply-adds: as asked, else Triton's default
    fn: object = field(compare=False, hash=False, repr=False)
    raw_constants: tuple = field(compare=False, hash=False, repr=False, default=())   # as Triton gave them

    def describe(self) -> str:
        consts = {k[0] if len(k) == 1 else k: v for k, v in self.constants}
        names = [name for name, _ in self.signature]
        shown = {names[k] if isinstance(k, int) else k: v for k, v in consts.items()}
        return f"{self.kernel.split('.')[-1]} warps={self.num_warps} stages={self.num_stages} {shown}"


class _HopperDriver:
    """Just enough of a driver for Triton's launcher: a current device, stream and target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", *HOPPER)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _value(value):
    """Constants made hashable and printable (Triton dtypes become their names)."""
    return str(value) if value.__class__.__name__ == "dtype" else value


@contextlib.contextmanager
def _recording(store: dict):
    from triton import knobs
    from triton.runtime.driver import driver
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("launch capture needs compiled (not interpreted) Triton: unset TRITON_INTERPRET")

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        jit = fn.jit_function
        options = json.loads(compile["specialization_data"])["options"]
        launch = Launch(kernel=f"{jit.module}.{jit.fn.__qualname__}",
                        signature=tuple(compile["signature"].items()),
                        constants=tuple((k, _value(v)) for k, v in compile["constants"].items()),
                        attrs=tuple((k, json.dumps(v)) for k, v in compile["configs"][0].items()),
                        num_warps=options["num_warps"], num_stages=options["num_stages"],
                        fp_fusion=options["enable_fp_fusion"], fn=jit,
                        raw_constants=tuple(compile["constants"].items()))
        store.setdefault(launch, launch)
        return True                                     # skip the compile and the launch

    saved_hook, saved_driver = knobs.runtime.jit_cache_hook, driver._active
    knobs.runtime.jit_cache_hook = hook
    driver.set_active(_HopperDriver())
    try:
        yield store
    finally:
        knobs.runtime.jit_cache_hook = saved_hook
        driver._active = saved_driver


def capture(fn) -> list:
    """The distinct launches ``fn()`` makes, in first-seen order."""
    store: dict = {}
    with _recording(store):
        fn()
    return list(store)


# ---- the dispatcher's grid ---------------------------------------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OPS = ("lightconv_forward", "lightconv_backward_input", "lightconv_backward_weight", "lightconv_backward",
       "dynamicconv_forward", "dynamicconv_backward_input", "dynamicconv_backward_weight", "dynamicconv_backward",
       "lightconv_step", "dynamicconv_step")
# channels per head: one channel block of 16, 32 or 64, and a head wider than one block
HEAD_WIDTHS = (16, 32, 64, 96)
# (T, layout): T a multiple of 16 and not, many tiles per program and one; B x C x T and T x B x C
SHAPES = ((2048, "bct"), (2048, "tbc"), (1000, "tbc"), (40, "bct"))


@dataclass(frozen=True)
class Call:
    op: str
    dtype: torch.dtype
    kernel: int
    padding_l: int
    head_width: int
    time: int
    layout: str


def grid(max_kernel: int = 130, dtypes=DTYPES, ops=OPS, head_widths=HEAD_WIDTHS, shapes=SHAPES):
    """Every (op, dtype, K, padding, head width, T, layout) for K in 1..max_kernel, all paddings.
    K = 130 is past the window kernels' limit (129), where only the tap loop serves."""
    for op in ops:
        paddings = (lambda k: [k - 1]) if op.endswith("step") else (lambda k: range(k))
        for dtype in dtypes:
            for kernel in range(1, max_kernel + 1):
                for padding_l in paddings(kernel):
                    for width in head_widths:
                        for time, layout in shapes:
                            yield Call(op, dtype, kernel, padding_l, width, time, layout)


def _tensor(shape, dtype, layout):
    """An uninitialised (B, C, T) tensor, contiguous or as the T x B x C view the layers pass."""
    if layout == "tbc":
        b, c, t = shape
        return torch.empty(t, b, c, dtype=dtype).permute(1, 2, 0)
    return torch.empty(shape, dtype=dtype)


BATCH, HEADS = 2, 2


def run_call(call: Call):
    """Invoke the Triton op of ``call`` on small uninitialised CPU tensors (BATCH x HEADS)."""
    from . import triton_kernels as tk
    heads, batch = HEADS, BATCH
    channels = heads * call.head_width
    x = _tensor((batch, channels, call.time), call.dtype, call.layout)
    dynamic = call.op.startswith("dynamic")
    if call.op.endswith("step"):
        buffer = torch.empty(call.kernel - 1, batch, channels, dtype=call.dtype)
        weight = torch.empty((batch, heads, call.kernel) if dynamic else (heads, call.kernel), dtype=call.dtype)
        return getattr(tk, call.op)(buffer, x[:, :, 0], weight, 0)
    if dynamic:
        w = torch.empty(call.time, batch, heads, call.kernel, dtype=call.dtype).permute(1, 2, 3, 0) \
            if call.layout == "tbc" else torch.empty(batch, heads, call.kernel, call.time, dtype=call.dtype)
    else:
        w = torch.empty(heads, call.kernel, dtype=call.dtype)
    fn = getattr(tk, call.op)
    p = call.padding_l
    if call.op.endswith("forward") or call.op.endswith("input"):
        return fn(x, w, p)
    if call.op.endswith("weight"):
        return fn(x, x, p, heads, call.kernel)
    return fn(x, x, w, p)


def launches(calls) -> list:
    """The distinct launches behind ``calls``."""
    calls = list(calls)
    return capture(lambda: [run_call(c) for c in calls])


def _spec(value: int) -> str:
    """How Triton specialises an integer argument: 1 is a constant, multiples of 16 are marked."""
    return "one" if value == 1 else "16n" if value % 16 == 0 else ""


_FUSED = {"lightconv_forward": "lightconv_forward", "lightconv_backward_input": "lightconv_forward",
          "lightconv_backward_weight": "lightconv_backward", "lightconv_backward": "lightconv_backward",
          "dynamicconv_forward": "dynamicconv_forward", "dynamicconv_backward_input": "dynamicconv_backward",
          "dynamicconv_backward_weight": "dynamicconv_backward", "dynamicconv_backward": "dynamicconv_backward"}


@functools.lru_cache(maxsize=None)
def _probe(dtype):
    return torch.empty(0, dtype=dtype)


def decision(op: str, dtype: torch.dtype, kernel: int, padding_l: int, specialise: bool = True) -> tuple:
    """What of (K, padding) reaches a launch of ``op``: the dispatcher's own choices (window or
    tap loop, tile width, stages, sliding, tap rows, tap blocks) and, with ``specialise``, how
    Triton specialises the integers K, P and K-1-P (1 is a constant, multiples of 16 are
    marked). Calls with equal decisions make equal launches for equal head widths and shapes
    (tests/test_ops_sm90.py checks samples); without ``specialise`` they make launches that
    differ only in those integer attributes."""
    from . import triton_kernels as tk
    from . import triton_window as tw
    # K, P, K-1-P, and DynamicConv's kernel strides, which are multiples of K: H*K, B*H*K in the
    # T x B x H x K layout, T*K and H*T*K in B x H x K x T (run_call's batch and heads)
    multiples = (HEADS, BATCH * HEADS) + tuple(m * t for t in sorted({t for t, _ in SHAPES}) for m in (1, HEADS))
    spec = ((_spec(kernel), _spec(padding_l), _spec(kernel - 1 - padding_l))
            + tuple(_spec(kernel * m) for m in multiples)) if specialise else ()
    if op.endswith("step"):
        return ("step",) + spec
    fused = _FUSED[op]
    pad = kernel - 1 - padding_l if op == "lightconv_backward_input" else padding_l
    if tk._use_window(_probe(dtype), kernel, pad, fused if fused == "lightconv_backward" else ""):
        width, stages, sliding = tw.launch_config(fused, dtype, kernel, pad)
        return ("window", width, stages, sliding, tw.tap_rows(kernel, width), pad > 0, kernel - 1 - pad > 0) + spec
    blocks = []
    for time in sorted({t for t, _ in SHAPES}):
        for cap in (256, 1024):
            taps, block = tk._tap_block(kernel, time, cap)
            blocks.append((taps, block, _spec(-(-kernel // taps) * taps) if specialise else ""))
    return ("tap", tuple(blocks)) + spec


def classes(max_kernel: int = 130, dtypes=DTYPES, ops=OPS, specialise: bool = True) -> dict:
    """(op, dtype, decision) -> the first (K, padding) with it, over the whole (K, padding) grid."""
    found = {}
    for op in ops:
        for dtype in dtypes:
            for kernel in range(1, max_kernel + 1):
                for padding_l in ([kernel - 1] if op.endswith("step") else range(kernel)):
                    key = (op, dtype, decision(op, dtype, kernel, padding_l, specialise))
                    if key not in found:
                        found[key] = (kernel, padding_l)
    return found


def class_calls(representatives: dict, head_widths=HEAD_WIDTHS, shapes=SHAPES):
    """The calls of every class representative at every head width and shape."""
    for (op, dtype, _), (kernel, padding_l) in representatives.items():
        for width in head_widths:
            for time, layout in shapes:
                yield Call(op, dtype, kernel, padding_l, width, time, layout)


# ---- compiling a launch for sm_90 ---------------------------------------------------------------

def _source(launch: Launch):
    from triton.compiler import ASTSource
    return ASTSource(fn=launch.fn, signature=dict(launch.signature), constexprs=dict(launch.raw_constants),
                     attrs={k: json.loads(v) for k, v in launch.attrs})


def _options(launch: Launch) -> dict:
    return {"num_warps": launch.num_warps, "num_stages": launch.num_stages, "enable_fp_fusion": launch.fp_fusion}


def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    return make_backend(GPUTarget("cuda", *HOPPER))


def cache_key(launch: Launch) -> str:
    """Triton's own cache key of the launch (source, options, compiler), for memoising."""
    from triton.compiler.compiler import get_cache_key
    backend = _backend()
    options = backend.parse_options(_options(launch))
    return hashlib.sha256(get_cache_key(_source(launch), backend, options, {}).encode()).hexdigest()


def _cache_file() -> Path:
    root = os.environ.get("DS_CHIMERA_SM90_CACHE") or Path.home() / ".cache" / "ds_chimera" / "sm90_shared.json"
    return Path(root)


def shared_memory(launch: Launch, cache: dict | None = None) -> int:
    """Bytes of shared memory per block of ``launch`` on sm_90: Triton's front end (TTIR,
    TTGIR) and its shared-memory allocation pass, the same passes a full compile runs first."""
    key = cache_key(launch)
    if cache is not None and key in cache:
        return cache[key]
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    backend = _backend()
    options = backend.parse_options(_options(launch))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module_map = backend.get_module_map()
    module = _source(launch).make_ir(backend.target, options, codegen, module_map, context)
    stages: dict = {}
    backend.add_stages(stages, options, _source(launch).language)
    metadata: dict = {}
    for name in ("ttir", "ttgir"):
        module = stages[name](module, metadata)
    capability = HOPPER[0]
    pm = ir.pass_manager(module.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm, False)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, get_ptx_version_from_options(options, capability))
    pm.run(module, "shared_memory")
    shared = module.get_int_attr("ttg.shared") or 0
    if cache is not None:
        cache[key] = shared
    return shared


def load_cache() -> dict:
    path = _cache_file()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_cache(cache: dict):
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, sort_keys=True))
    tmp.replace(path)


def compile_full(launch: Launch) -> dict:
    """A full sm_90 compile: shared bytes, whether the PTX uses tensor cores, registers per
    thread and stack / local (spill) bytes from cuobjdump."""
    import triton
    compiled = triton.compile(_source(launch), target=_backend().target, options=_options(launch))
    usage = _resource_usage(compiled.asm["cubin"])
    return {"shared": compiled.metadata.shared, "tensor_cores": "mma" in compiled.asm["ptx"], **usage}


def _resource_usage(cubin: bytes) -> dict:
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", fh.name], capture_output=True, text=True,
                             check=True).stdout
    fields = dict(part.split(":", 1) for part in out.split() if ":" in part and part.split(":", 1)[1].isdigit())
    return {"registers": int(fields["REG"]), "stack": int(fields.get("STACK", 0)), "local": int(fields.get("LOCAL", 0))}


def limits_problem(launch: Launch, shared: int) -> str | None:
    """Why ``launch`` cannot run on Hopper, or None: shared memory per block, and registers at
    the most a thread can hold (ptxas never assigns more than 255, spilling instead)."""
    if shared > HOPPER_SHARED:
        return f"{shared} bytes of shared memory > {HOPPER_SHARED}"
    if launch.num_warps * 32 * MAX_THREAD_REGISTERS > HOPPER_REGISTERS:
        return f"{launch.num_warps} warps x 32 threads x {MAX_THREAD_REGISTERS} registers > {HOPPER_REGISTERS}"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-kernel", type=int, default=130)
    parser.add_argument("--full", action="store_true", help="also compile each launch to a cubin (slow)")
    args = parser.parse_args(argv)
    representatives = classes(args.max_kernel)
    print(f"{len(representatives)} classes of (op, dtype, K, padding)", flush=True)
    found = launches(class_calls(representatives))
    cache = load_cache()
    worst = 0
    print(f"{len(found)} distinct launches", flush=True)
    try:
        for launch in found:
            shared = shared_memory(launch, cache)
            worst = max(worst, shared)
            line = f"{shared:7d} B  {launch.describe()}"
            if args.full:
                line += f"  {compile_full(launch)}"
            problem = limits_problem(launch, shared)
            print(line + (f"  OVER: {problem}" if problem else ""), flush=True)
    finally:
        save_cache(cache)
    print(f"largest shared memory {worst} B (limit {HOPPER_SHARED})")


if __name__ == "__main__":
    sys.exit(main())
