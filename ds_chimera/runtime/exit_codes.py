"""How a process that must end from a fault-monitor thread ends with the code its script asked for.

After a failure the process cannot go through the interpreter's normal exit (destroying process
groups with unmatched messages aborts in C++), so it ends with ``os._exit``; these keep the exit code
a script's own ``sys.exit`` requested, and flush what was printed first.
"""
from __future__ import annotations

import os
import sys

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
    finally:
        os._exit(code)
