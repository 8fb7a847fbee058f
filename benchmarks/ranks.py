"""Launch a benchmark's worker on several CPU ranks and collect its rows: the part every
multi-rank benchmark script shares.

The script re-runs itself under ``torch.distributed.run`` with ``--worker``; rank 0 writes
the rows as JSON to ``--out``; the launching process echoes the workers' result lines and
reads the rows back.
"""
import json
import os
import socket
import subprocess
import sys


def launch(script: str, worker_args: list, out: str, keep, nproc: int = 4):
    """Run ``script --worker *worker_args --out out`` on ``nproc`` gloo ranks.

    Echoes the workers' result lines, those that start with one of the prefixes ``keep`` (or
    for which the callable ``keep`` is true), and any error line. Returns the rows rank 0
    saved; on failure prints the output's tail and returns None.
    """
    wanted = keep if callable(keep) else (lambda line: line.startswith(tuple(keep)))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), script, "--worker", *map(str, worker_args), "--out", out]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if wanted(line) or "Error" in line:
            print(line, flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-5000:])
        print(f"the workers failed (exit code {proc.returncode})", flush=True)
        return None
    with open(out) as fh:
        return json.load(fh)


def free_port() -> int:
    """A port no one listens on now: runs beside each other (tests, two benchmarks) need not share 29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def report(rows, summarise=None) -> int:
    """Launcher side: the exit code for ``rows`` (None when the workers failed). Prints the
    optional ``summarise(rows)``, then the rows as one JSON line (the scripts' last line)."""
    if rows is None:
        return 1
    if summarise is not None:
        summarise(rows)
    print(json.dumps(rows))
    return 0


def save_rows(dist, rows: list, out: str) -> None:
    """Worker side: rank 0 writes ``rows`` to ``out`` (whole or not at all), then every rank
    leaves the process group."""
    if dist.get_rank() == 0:
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rows, fh)
        os.replace(tmp, out)
    dist.barrier()
    dist.destroy_process_group()
