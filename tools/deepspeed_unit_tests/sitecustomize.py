"""Harness for running DeepSpeed's own pipeline unit tests, unchanged, under ds_chimera.

Put this directory first on PYTHONPATH (``run.sh`` does). Every Python process then runs this file,
including the workers DeepSpeed's ``DistributedTest`` starts through multiprocessing's forkserver, so
nothing in the tests is edited. ``DSU_MODE`` picks what it does:

- ``stock``: nothing but the torchvision shim below (DeepSpeed alone);
- ``import``: ``import ds_chimera`` (the switch installed; configs as the tests build them);
- ``schedule``: ``import ds_chimera`` and wrap ``deepspeed.initialize`` so that the config of every
  ``PipelineModule`` gets ``"pipeline": {..., "schedule": $DSU_SCHEDULE}`` (the tests' own pipeline keys kept).

In ``import`` and ``schedule`` modes each ``deepspeed.initialize`` appends one line to ``$DSU_LOG``: the
process, the schedule injected, the engine class returned (or the exception raised).

torchvision shim: the only torchvision wheels on this host (0.28.0 for torch 2.13.0) are CUDA builds whose
``_C.so`` cannot load against the CPU torch; torchvision 0.28 then fails at import because
``_meta_registrations`` registers fake kernels for ``torchvision::nms`` / ``qnms`` unguarded. Defining those
two operator schemas first lets ``import torchvision`` (datasets, transforms) work; no detection op is used.
"""
import copy
import os
import sys


def _torchvision_shim():
    if os.environ.get("DSU_TORCHVISION_SHIM", "1") != "1":
        return
    try:
        import torch
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in ("nms", "qnms"):
            try:
                lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:
                pass          # already defined (a working torchvision _C)
        globals()["_TV_LIB"] = lib   # keep the fragment alive
    except Exception as exc:       # never break interpreter start-up
        print(f"ds_unit sitecustomize: torchvision shim failed: {exc}", file=sys.stderr)


def _log(line):
    path = os.environ.get("DSU_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def _install(mode, schedule):
    import deepspeed
    import ds_chimera  # noqa: F401  (installs ds_chimera.initialize as deepspeed.initialize)
    from deepspeed.runtime.pipe.module import PipelineModule
    inner = deepspeed.initialize

    def initialize(*args, **kwargs):
        model = kwargs.get("model", args[1] if len(args) > 1 else None)
        injected = None
        if mode == "schedule" and isinstance(model, PipelineModule):
            key = "config" if kwargs.get("config") is not None else "config_params"
            config = kwargs.get(key)
            if isinstance(config, dict):
                config = copy.deepcopy(config)
                section = dict(config.get("pipeline") or {})
                section["schedule"] = schedule
                config["pipeline"] = section
                kwargs[key] = config
                injected = section
            else:
                injected = f"not injected: config is {type(config).__name__}"
        tag = f"pid={os.getpid()} rank={os.environ.get('RANK')} mode={mode} model={type(model).__name__} " \
              f"pipeline={injected}"
        try:
            out = inner(*args, **kwargs)
        except BaseException as exc:
            _log(f"{tag} RAISED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise
        _log(f"{tag} engine={type(out[0]).__name__}")
        return out

    initialize._ds_chimera = True    # ds_chimera's install() stays idempotent
    deepspeed.initialize = initialize


def _fake_cifar_no_md5():
    """DSU_FAKE_CIFAR_NO_MD5=1: CIFAR10 accepts the synthetic files of make_fake_cifar.py (md5 not checked)."""
    if os.environ.get("DSU_FAKE_CIFAR_NO_MD5") != "1":
        return
    import torchvision.datasets.cifar as cifar
    cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)


def _sparse_names_compat():
    """DSU_SPARSE_NAMES_COMPAT=1: DeepSpeed 0.19.8's engine no longer has ``sparse_tensor_module_names``, which
    tests/unit/checkpoint/common.py (edaa722) compares first; an empty class attribute lets the rest of the
    comparison (weights, optimizer, scheduler) run. Off by default: the plain runs report the skew as is."""
    if os.environ.get("DSU_SPARSE_NAMES_COMPAT") != "1":
        return
    from deepspeed.runtime.engine import DeepSpeedEngine
    if not hasattr(DeepSpeedEngine, "sparse_tensor_module_names"):
        DeepSpeedEngine.sparse_tensor_module_names = frozenset()


def _cpu_fork_rng():
    """DSU_CPU_FORK_RNG=1: tests/unit/alexnet_model.py's train_cifar (edaa722) enters
    ``torch.random.fork_rng(devices=['cpu'], device_type='cpu')``, which calls ``torch.cpu.get_rng_state``; torch
    2.13's ``torch.cpu`` has none, so every TestPipeCifar10 case fails at its first line on the CPU accelerator.
    The shim maps the per-device pair to the CPU generator's (which fork_rng saves and restores anyway)."""
    if os.environ.get("DSU_CPU_FORK_RNG") != "1":
        return
    import torch
    if not hasattr(torch.cpu, "get_rng_state"):
        torch.cpu.get_rng_state = lambda device="cpu": torch.get_rng_state()
        torch.cpu.set_rng_state = lambda new_state, device="cpu": torch.set_rng_state(new_state)


def _seed():
    """DSU_SEED=N: ``torch.manual_seed(N)`` at start-up. torch's CPU generator starts from a random seed in each
    process here, and the DistributedTest workers inherit the forkserver's state, so a model built before the
    test seeds (TestPipeCifar10's AlexNet) is the same within a pytest session but differs between sessions,
    i.e. between modes. Seeded, every mode starts from the same weights and their losses compare across
    columns (importing deepspeed or ds_chimera draws nothing from the generator)."""
    seed = os.environ.get("DSU_SEED")
    if seed:
        import torch
        torch.manual_seed(int(seed))


_torchvision_shim()
_seed()
_cpu_fork_rng()
_fake_cifar_no_md5()
_sparse_names_compat()
_MODE = os.environ.get("DSU_MODE", "stock")
if _MODE in ("import", "schedule"):
    try:
        _install(_MODE, os.environ.get("DSU_SCHEDULE", "1f1b"))
    except Exception as exc:
        print(f"ds_unit sitecustomize: could not install mode {_MODE}: {exc}", file=sys.stderr)
        raise
