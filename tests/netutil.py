"""Helpers shared by the multi-process tests."""
import os
import random
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    """A TCP port free on loopback right now, for a rendezvous, chosen below the kernel's ephemeral range.

    A port from that range (what binding port 0 gives) can be taken by any outgoing connection before the
    launcher binds it, gloo's among them: with two launches at once (make test's two workers) one failed with
    EADDRINUSE. Below the range only another pick can collide, and the pick is random."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def remove_deepspeed_shm() -> None:
    """Remove the ~70 MB /dev/shm buffers DeepSpeed's CPU accelerator leaves after each launch."""
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
        if name.startswith("deepspeed_allreduce_buffer_"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def run_ranks(args: list, world: int, env: dict, timeout_s: float, exit_times: list | None = None) -> tuple:
    """Run ``python ARGS`` as ranks 0..world-1 of one gloo group, without torchrun.

    torchrun stops every rank when one dies; the fault tests need the survivors to fail on
    their own. Returns ([(returncode, stdout, stderr)] per rank, seconds taken); ``exit_times``,
    if given, receives each rank's ``time.time()`` at its exit. If any rank is still running
    after ``timeout_s``, all are killed and TimeoutError is raised.
    """
    port, procs, logs = free_port(), [], []
    for rank in range(world):
        rank_env = dict(os.environ, **env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")   # pipes could fill and block a rank
        logs.append((out, err))
        procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, stdout=out, stderr=err, text=True))
    start, ended = time.monotonic(), {}
    try:
        while len(ended) < world:
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = time.time()
            if time.monotonic() - start > timeout_s:
                tails = []
                for rank, (_, err) in enumerate(logs):
                    err.seek(0)
                    tails.append(f"--- rank {rank} stderr ---\n{err.read()[-2000:]}")
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(ended))} still running after "
                                   f"{timeout_s:g}s\n" + "\n".join(tails))
            time.sleep(0.05)
    except BaseException:
        for out, err in logs:
            out.close()
            err.close()
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = []
    for proc, (out, err) in zip(procs, logs):
        out.seek(0)
        err.seek(0)
        outputs.append((proc.returncode, out.read(), err.read()))
        out.close()
        err.close()
    if exit_times is not None:
        exit_times[:] = [ended[rank] for rank in range(world)]
    return outputs, time.monotonic() - start
