"""``ds-chimera launch``: run an unchanged DeepSpeed script with the schedule switch enabled.

    ds-chimera launch [--torchrun] [--wavelet] [--pipeline-schedule NAME [--pipeline-schedule-options JSON]]
                      LAUNCHER_ARGS... script.py SCRIPT_ARGS...

Wraps the ``deepspeed`` launcher (or ``torchrun`` with ``--torchrun``). Every worker
process starts with ``ds_chimera`` imported through a ``sitecustomize`` hook, so the
script's own ``deepspeed.initialize`` honours ``"pipeline": {"schedule": ...}``.

``--wavelet`` starts two processes per device (``--num_gpus N`` or ``--nproc_per_node N``
become 2N) and turns Wavelet's tick-tock data parallelism on for non-pipelined models;
``LOCAL_RANK`` is mapped back onto the N devices.

When the job ends, the launcher removes the ~70 MB shared-memory buffer per rank that DeepSpeed's CPU
accelerator makes in this node's ``/dev/shm`` and never removes (only this job's: its master port, made since it
started); other nodes of a multi-node launch keep theirs.

``--pipeline-schedule NAME`` is for Megatron launches: Megatron-Core's
``get_forward_backward_func()`` then returns ds_chimera's NAME schedule in every worker
(see :mod:`ds_chimera.megatron.install`).

Multi-node: with ``--torchrun`` run ``ds-chimera launch`` on every node (``--nnodes``,
``--node_rank``, ``--master_addr``), so each node's workers get this environment directly.
The deepspeed launcher with a hostfile starts the other nodes' processes through pdsh (ssh) or
an MPI launcher, which pass on only the variables whose names start with one of its
``EXPORT_ENVS`` prefixes (``PYTHON``: so ``PYTHONPATH``, and with it the ``sitecustomize``
hook, gets there) and those listed in ``.deepspeed_env``; the runner is started here with the
``DS_CHIMERA_`` variables (``--wavelet``, ``--pipeline-schedule``) added to that list.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

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


EXPORTED_PREFIX = "DS_CHIMERA"
DEEPSPEED_RUNNER = "from ds_chimera.launch import deepspeed_runner; deepspeed_runner()"


def deepspeed_runner() -> None:
    """``python -m deepspeed.launcher.runner`` (arguments from ``sys.argv``), exporting every ``DS_CHIMERA_*``
    variable to the nodes of a multi-node launch, as the runner itself does for ``PYTHON*``, ``NCCL*``, ..."""
    import shlex

    from deepspeed.launcher import multinode_runner, runner
    runner.EXPORT_ENVS = [*runner.EXPORT_ENVS, EXPORTED_PREFIX]
    add_export = multinode_runner.PDSHRunner.add_export

    def add_export_for_a_shell(self, key, var):
        # pdsh hands "export KEY=VALUE; ..." to each node's shell; DeepSpeed wraps a value with special
        # characters in double quotes without escaping the ones inside, so JSON options would lose theirs
        if key.strip().startswith(EXPORTED_PREFIX):
            self.exports[key.strip()] = shlex.quote(var.strip())
        else:
            add_export(self, key, var)

    multinode_runner.PDSHRunner.add_export = add_export_for_a_shell
    sys.argv[0] = "deepspeed"          # its usage and error messages, instead of "-c"
    runner.main()


def _check_megatron_schedule(name: str, options) -> str | None:
    """A bad --pipeline-schedule fails here, before any process starts; None when it is fine."""
    import json

    from .config import PipelineConfig
    try:
        parsed = json.loads(options) if options else {}
        if not isinstance(parsed, dict):
            return f"--pipeline-schedule-options must be a JSON object, got {options!r}"
        PipelineConfig.from_megatron(name, parsed, where="--pipeline-schedule")    # "auto" and its options too
    except (ValueError, json.JSONDecodeError) as exc:
        return str(exc)
    return None


def main(argv) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    torchrun = wavelet = False
    schedule = options = None
    while argv and argv[0] in ("--torchrun", "--wavelet", "--pipeline-schedule", "--pipeline-schedule-options"):
        flag = argv[0]
        if flag in ("--pipeline-schedule", "--pipeline-schedule-options"):
            if len(argv) < 2:
                print(f"ds-chimera launch: {flag} needs a value", file=sys.stderr)
                return 2
            if flag == "--pipeline-schedule":
                schedule = argv[1]
            else:
                options = argv[1]
            argv = argv[2:]
            continue
        torchrun |= flag == "--torchrun"
        wavelet |= flag == "--wavelet"
        argv = argv[1:]
    env = launch_env()
    if schedule is not None:
        error = _check_megatron_schedule(schedule, options)
        if error:
            print(f"ds-chimera launch: {error}", file=sys.stderr)
            return 2
        env["DS_CHIMERA_PIPELINE_SCHEDULE"] = schedule
        if options is not None:
            env["DS_CHIMERA_PIPELINE_OPTIONS"] = options
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
        cmd = [sys.executable, "-c", DEEPSPEED_RUNNER, *argv]
    started = time.time()
    try:
        return subprocess.call(cmd, env=env)
    finally:
        remove_shm_buffers(master_port(argv), started)


SHM_BUFFER = "deepspeed_allreduce_buffer"     # DeepSpeed's CPU accelerator's name (ops/csrc/cpu/comm/shm.cpp)
DEFAULT_PORT = "29500"                        # the deepspeed launcher's and torchrun's default master port


def master_port(argv: list) -> str | None:
    """The job's master port, from the launcher's own arguments (those before the script): the one given, the
    launchers' default without one, or None where the port is chosen at run time (torchrun's ``--standalone``
    or a rendezvous endpoint): then no buffer is known to be this job's."""
    own = []
    for arg in argv:
        if arg.endswith(".py"):
            break
        own.append(arg)
    for i, arg in enumerate(own):
        for flag in ("--master_port", "--master-port"):
            if arg == flag and i + 1 < len(own):
                return own[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    if any(arg.split("=", 1)[0] in ("--standalone", "--rdzv-endpoint", "--rdzv_endpoint") for arg in own):
        return None
    return DEFAULT_PORT


def remove_shm_buffers(port: str | None, since: float, folder: str = "/dev/shm") -> list:
    """Remove this node's shared-memory buffers of the job that ended: DeepSpeed's CPU accelerator makes one of
    about 70 MB per rank (``deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}``) and never removes it, so
    launches fill the host's memory. Only this user's, of this job's port, made or written since it started (a
    job on another port is left alone; with the port unknown, nothing is removed). Other nodes of a multi-node
    launch keep theirs. Returns the names removed."""
    if port is None or not os.path.isdir(folder):
        return []
    prefix, removed = f"{SHM_BUFFER}_{os.getuid()}_", []
    for name in os.listdir(folder):
        fields = name[len(prefix):].rsplit("_", 2)
        if not name.startswith(prefix) or len(fields) != 3 or fields[1] != str(port):
            continue
        path = os.path.join(folder, name)
        try:
            if os.stat(path).st_mtime >= since - 1.0:      # made (or written) since the job started
                os.unlink(path)
                removed.append(name)
        except OSError:            # gone already, or not ours to remove
            pass
    return removed
