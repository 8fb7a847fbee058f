"""How a process that must end from a fault-monitor thread ends with the code its script asked for.

After a failure the process cannot go through the interpreter's normal exit (destroying process
groups with unmatched messages aborts in C++), so it ends with ``os._exit``; these keep the exit code
a script's own ``sys.exit`` requested, flush what was printed first, and end the process's
multiprocessing children first: ``os._exit`` skips multiprocessing's own exit handler, so a Manager's
server (Megatron's async checkpoint writer starts one) or a pool's workers would outlive the process.
"""
from __future__ import annotations

import os
import sys
import time

EXIT_CODES = {"code": 0}


def record_exit_codes() -> None:
    """Remember the code a later ``sys.exit(code)`` asks for: :meth:`FaultMonitor.close` must end a
    failed job's process itself (see there) and should end it with the script's own code."""
    if getattr(sys.exit, "_ds_chimera", False):
        return
    original = sys.exit

    def exit_recording(code=None):
        EXIT_CODES["code"] = code
        original(code)
    exit_recording._ds_chimera = True
    sys.exit = exit_recording


def requested_exit_code() -> int:
    code = EXIT_CODES["code"]
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")          # sys.exit("message"): printed, status 1, as Python does
    return 1


def flush_and_exit(message: str, code: int = 1) -> None:
    try:
        sys.stdout.flush()
        if message:
            sys.stderr.write(message + "\n")
        sys.stderr.flush()
        end_child_processes()
    finally:
        os._exit(code)


def end_child_processes(timeout_s: float = 2.0) -> None:
    """What multiprocessing's exit handler would do, bounded: managers shut down (their finalizers), then
    every child still running terminated, and killed if it has not ended within ``timeout_s``."""
    if "multiprocessing" not in sys.modules:
        return
    try:
        import multiprocessing
        from multiprocessing import util
        util._run_finalizers(0)            # a Manager's shutdown (it terminates a server that does not stop)
        children = multiprocessing.active_children()
        for child in children:
            child.terminate()
        deadline = time.monotonic() + timeout_s
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
    except Exception:       # the process ends either way; nothing here may keep it alive
        pass
