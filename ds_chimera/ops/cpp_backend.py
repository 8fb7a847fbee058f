"""JIT-built native CPU kernels for LightConv / DynamicConv (csrc/lightconv_cpu.cpp).

Built once per process with torch.utils.cpp_extension into a cached build directory, so only
the first use on a machine pays the compile (~1 min); later processes just load the .so.
Without a working compiler ``available()`` is False and callers keep the pure-torch path.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

_NAME = "ds_chimera_lightconv_cpu"
_SOURCE = "lightconv_cpu.cpp"

# torch's build lock is a bare file; a build killed mid-way leaves it behind and every later
# load() would wait on it forever. A build takes about a minute, so an older lock is stale.
STALE_BUILD_LOCK_S = 600.0

_lock = threading.Lock()
_module = None
_error: Optional[str] = None   # why the build failed, once it has
_warned = False


def source_path() -> Path:
    """The C++ source: ``<repo>/csrc`` in a checkout, else a copy installed as ``ds_chimera/csrc``."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package.parent / "csrc", package / "csrc"):
        if (folder / _SOURCE).is_file():
            return folder / _SOURCE
    raise FileNotFoundError(f"{_SOURCE} not found in {package.parent / 'csrc'} or {package / 'csrc'}")


def build_dir() -> Path:
    """$DS_CHIMERA_BUILD_DIR, else a per torch/python version cache (the .so is ABI-specific)."""
    env = os.environ.get("DS_CHIMERA_BUILD_DIR")
    if env:
        return Path(env)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Path.home() / ".cache" / "ds_chimera" / f"build-{torch.__version__}-{py}"


def compiler_found() -> bool:
    """Whether the C++ compiler cpp_extension will call ($CXX, default c++) is on PATH."""
    cxx = shlex.split(os.environ.get("CXX", "c++")) or ["c++"]
    return shutil.which(cxx[0]) is not None


def remove_stale_build_lock(directory: Path, now: float | None = None) -> bool:
    """Delete ``directory``/lock if no build has touched it for STALE_BUILD_LOCK_S; True if removed."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_BUILD_LOCK_S:
        return False
    warnings.warn(f"ds_chimera: removing the stale C++ build lock {lock} ({age:.0f} s old, left by a killed "
                  "build)", RuntimeWarning, stacklevel=3)
    lock.unlink(missing_ok=True)
    return True


def load():
    """The compiled module (built on first call, then cached); raises RuntimeError if it cannot be built."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(_error)
        try:
            if not compiler_found():
                raise RuntimeError(f"no C++ compiler found ({os.environ.get('CXX', 'c++')!r} is not on PATH)")
            from torch.utils.cpp_extension import load as _cpp_load

            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            remove_stale_build_lock(directory)
            # -fopenmp: at::parallel_for is an inline OpenMP loop in the headers; without it the
            # kernels would run on one thread. No -ffast-math: it would change the results.
            openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
            _module = _cpp_load(name=_NAME, sources=[str(source_path())], extra_cflags=["-O3", *openmp],
                                extra_ldflags=openmp, build_directory=str(directory), verbose=False)
        except Exception as exc:  # compiler, ninja or build failure: remember and report once
            _error = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(_error) from exc
        return _module


def available() -> bool:
    """True if the native kernels load; otherwise warn once and report False (pure-torch path)."""
    global _warned
    try:
        load()
        return True
    except RuntimeError:
        if not _warned:
            _warned = True
            warnings.warn(f"ds_chimera: native CPU LightConv/DynamicConv kernels unavailable ({_error}); "
                          "using the pure-torch path.", RuntimeWarning, stacklevel=2)
        return False
