"""``ds-chimera launch``: run an unchanged DeepSpeed script with the schedule switch enabled.

    ds-chimera launch [--torchrun] LAUNCHER_ARGS... script.py SCRIPT_ARGS...

Wraps the ``deepspeed`` launcher (or ``torchrun`` with ``--torchrun``). Every worker
process starts with ``ds_chimera`` imported through a ``sitecustomize`` hook, so the
script's own ``deepspeed.initialize`` honours ``"pipeline": {"schedule": ...}``.
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


def main(argv) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *argv]
    return subprocess.call(cmd, env=launch_env())
