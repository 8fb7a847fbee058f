"""The runtime's own host time per step: the timed model with cost-free layers, beside DeepSpeed's engine.

    python tools/host_time.py                                  # this tree, 3 launches
    python tools/host_time.py --trees /tmp/old-tree . --pairs 3   # two source trees, launches alternating

With every layer's cost 0 (no sleep, no spin), a step is only what the runtime itself does: autograd
bookkeeping, posting and taking messages, waits and their hand-overs, syncs. Four CPU ranks on two cores,
so the figures are the host's load as much as the code's: compare rows within one launch (each printed
over DeepSpeed's stock engine in the same launch), and trees over alternating launches. ``--trees``
puts each tree first on ``PYTHONPATH`` (a ``git worktree`` of another commit), so one script times both.
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
from harness import (WIDTH, TimedLayer, ds_config, init_timed_model, launch, median_steps_in_turn,  # noqa: E402
                     model_specs, random_batches, report, save_rows, timed_engine)

N = 8
ROWS = [("DeepSpeed stock 1F1B", None), ("1f1b", ("1f1b", {})), ("zbv", ("zbv", {})),
        ("chimera zero-bubble f=2", ("chimera", {"order": "zero-bubble", "pipelines": 2}))]


def worker(args):
    import torch
    import torch.distributed as dist

    import ds_chimera
    from deepspeed.pipe import LayerSpec

    TimedLayer.spin_s = 0.0
    rank, _, _, _ = init_timed_model()
    specs = model_specs(LayerSpec, 0.0, 8)
    steps = []
    for _, schedule in ROWS:
        torch.manual_seed(0)
        engine = timed_engine(specs, ds_config(N, schedule))
        batch = random_batches(torch, WIDTH, N)
        steps.append(lambda engine=engine, batch=batch: engine.train_batch(iter(batch)))
    times = median_steps_in_turn(dist, steps, args.repeats)
    rows = [{"tree": os.path.dirname(os.path.dirname(ds_chimera.__file__)), "row": name, "step_ms": t * 1e3,
             "over_stock": t / times[0]} for (name, _), t in zip(ROWS, times)]
    if rank == 0:
        print("  host time: " + "; ".join(f"{r['row']} {r['step_ms']:.1f} ms ({r['over_stock']:.3f})" for r in rows), flush=True)
    save_rows(dist, rows, args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=[os.path.dirname(HERE)], help="source trees to time")
    parser.add_argument("--pairs", type=int, default=3, help="launches per tree (alternating)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "host_time_results.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.pairs < 1 or args.repeats < 1:
        parser.error(f"--pairs and --repeats must be >= 1, got {args.pairs} and {args.repeats}")
    print(f"4 ranks, cost-free layers, N = {N}, median of {args.repeats} steps per row; each row over DeepSpeed's "
          f"stock engine in the same launch", flush=True)
    rows, base = [], os.environ.get("PYTHONPATH", "")
    for _ in range(args.pairs):
        for tree in args.trees:
            os.environ["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), base])
            print(f" {tree}:", flush=True)
            got = launch(__file__, ["--repeats", args.repeats], args.out, ("  host time:",))
            if got is None:
                return report(None)
            rows += got
    return report(rows, summarise)


def summarise(rows):
    for tree in dict.fromkeys(r["tree"] for r in rows):
        cells = []
        for name, _ in ROWS[1:]:
            got = [r["over_stock"] for r in rows if r["tree"] == tree and r["row"] == name]
            cells.append(f"{name} {statistics.median(got):.3f} [{min(got):.3f}, {max(got):.3f}]")
        print(f"{tree}: over stock, median [range]: " + "; ".join(cells))


if __name__ == "__main__":
    sys.exit(main() or 0)
