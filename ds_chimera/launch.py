"""``ds-chimera launch``: run an unchanged DeepSpeed script with the schedule switch enabled.

    ds-chimera launch [--torchrun] [--wavelet] LAUNCHER_ARGS... script.py SCRIPT_ARGS...

Wraps the ``deepspeed`` launcher (or ``torchrun`` with ``--torchrun``). Every worker
process starts with ``ds_chimera`` imported through a ``sitecustomize`` hook, so the
script's own ``deepspeed.initialize`` honours ``"pipeline": {"schedule": ...}``.

``--wavelet`` starts two processes per device (``--num_gpus N`` or ``--nproc_per_node N``
become 2N) and turns Wavelet's tick-tock data parallelism on for non-pipelined models;
``LOCAL_RANK`` is mapped back onto the N devices.
"""
from __future__ import annotations

import os
import subprocess
import sys

AUTOLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autoload")


def launch_env(env=None) -> dict:
    env = dict(os.environ if env is None else env)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [AUTOLOAD, package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


PROCESS_FLAGS = ("--num_gpus", "--num-gpus", "--nproc_per_node", "--nproc-per-node")


def double_processes(argv: list) -> tuple:
    """Wavelet: two tasks per device. Returns (argv with the process count doubled, devices per node)."""
    out, devices = list(argv), None
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag not in PROCESS_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(out):
                break
            value = out[i + 1]
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"ds-chimera launch --wavelet: {flag} must be a positive integer, got {value!r}")
        devices = int(value)
        if eq:
            out[i] = f"{flag}={2 * devices}"
        else:
            out[i + 1] = str(2 * devices)
        break
    if devices is None:
        raise ValueError("ds-chimera launch --wavelet needs the number of devices per node: pass --num_gpus N "
                         "(deepspeed launcher) or --nproc_per_node N (with --torchrun); it starts 2N processes")
    return out, devices


def main(argv) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    torchrun = wavelet = False
    while argv and argv[0] in ("--torchrun", "--wavelet"):
        torchrun |= argv[0] == "--torchrun"
        wavelet |= argv[0] == "--wavelet"
        argv = argv[1:]
    env = launch_env()
    if wavelet:
        try:
            argv, devices = double_processes(argv)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        env.update(DS_CHIMERA_WAVELET="1", DS_CHIMERA_DEVICES_PER_NODE=str(devices))
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *argv]
    return subprocess.call(cmd, env=env)
