"""The loop every multi-rank test worker runs: named scenarios on all ranks, one JSON for the tests."""
import json
import os
import sys
import time
import traceback

import torch.distributed as tdist


def _groups() -> set:
    from torch.distributed import distributed_c10d
    return set(distributed_c10d._world.pg_map)


def _destroy_groups_since(before: set) -> None:
    """Destroy the process groups a scenario's engine created: an engine keeps its groups (gloo
    threads and sockets) for the process's life, and a hundred engines in one process made the
    kernel's scheduling cost as much as the work. The collection frees the engines (held in
    reference cycles) now; what survives it is frozen (``gc.freeze``), so the next scenario's
    collection walks only what that scenario made: a full walk of the heap (torch, DeepSpeed and
    what they import lazily, about 130,000 objects) cost 0.1-0.2 s a scenario, now about 1 ms."""
    import gc
    gc.collect()
    gc.freeze()
    tdist.barrier()
    for group in _groups() - before:
        if group is not tdist.GroupMember.WORLD:
            tdist.destroy_process_group(group)


def rank_path(out_path: str, rank: int) -> str:
    return f"{out_path}.rank{rank}"


def run_scenarios(scenarios: dict, out_path: str, names: list) -> None:
    """Run ``names`` in order on every rank; every rank writes its own {name: result} to
    ``rank_path(out_path, rank)`` and rank 0 also to ``out_path``, atomically.

    The parent checks every rank's results, not rank 0's view only. A scenario that raises
    stops the group: its traceback goes to stderr (and the caller's launcher reports the
    failure), never into a result that looks like a pass.
    """
    results = {}
    timing = os.environ.get("DS_CHIMERA_SCENARIO_TIMES")      # a path: each scenario's seconds, for trimming
    for name in names:
        start = time.perf_counter()
        before = _groups()
        try:
            results[name] = scenarios[name]()
        except Exception:
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            raise
        _destroy_groups_since(before)
        if timing and tdist.get_rank() == 0:
            with open(timing, "a") as fh:
                threads, fds = len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
                fh.write(f"{time.perf_counter() - start:.2f} {name} threads={threads} fds={fds}\n")
    rank = tdist.get_rank()
    for path in [rank_path(out_path, rank)] + ([out_path] if rank == 0 else []):
        with open(path + ".tmp", "w") as fh:
            json.dump(results, fh, indent=1)
        os.replace(path + ".tmp", path)
    tdist.barrier()
