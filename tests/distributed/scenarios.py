"""The loop every multi-rank test worker runs: named scenarios on all ranks, one JSON for the tests."""
import json
import os
import sys
import traceback

import torch.distributed as tdist


def run_scenarios(scenarios: dict, out_path: str, names: list) -> None:
    """Run ``names`` in order on every rank; rank 0 writes {name: result} to ``out_path`` atomically.

    A scenario that raises stops the group: its traceback goes to stderr (and the caller's
    launcher reports the failure), never into a result that looks like a pass.
    """
    results = {}
    for name in names:
        try:
            results[name] = scenarios[name]()
        except Exception:
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            raise
    if tdist.get_rank() == 0:
        with open(out_path + ".tmp", "w") as fh:
            json.dump(results, fh, indent=1)
        os.replace(out_path + ".tmp", out_path)
    tdist.barrier()
