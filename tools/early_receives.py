"""Receives posted ahead of need against receives posted when needed, on the same engines.

    python tools/early_receives.py [--micro-batches 16] [--repeats 7]

gloo holds a send until its receive is posted, so a receive posted only when its data is
needed pays a round trip between the two ranks' communication threads. The executor posts
the receives of the next two receiving comm batches early (``StepExecutor.recv_lookahead``).
This script runs each schedule on one engine and alternates steps with the lookahead at 2
(the default) and at 0 (each receive posted when needed), so both see the same machine
state. Four CPU ranks, the timed model of ``benchmarks/harness.py``. The last line is JSON.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(HERE), "benchmarks")   # the shared helpers: benchmarks/harness.py
sys.path.insert(0, BENCHMARKS)
from harness import (COST_S, WIDTH, ds_config, init_timed_model, label, launch, median_steps_in_turn,  # noqa: E402
                     random_batches, report, save_rows, timed_engine)
SCHEDULES = [("1f1b", {}), ("interleaved", {"chunks": 2}), ("zb-h1", {}), ("zbv", {})]


def worker(args):
    import torch
    import torch.distributed as dist

    import ds_chimera  # noqa: F401

    rank, _, _, specs = init_timed_model()
    n = args.micro_batches
    ideal = n * 3 * COST_S
    rows = []
    for name, options in SCHEDULES:
        engine = timed_engine(specs, ds_config(n, (name, options)))
        batch = random_batches(torch, WIDTH, n)

        def step_with(lookahead, engine=engine, batch=batch):
            def step():
                engine.executor.recv_lookahead = lookahead
                engine.train_batch(iter(batch))
            return step
        early, late = median_steps_in_turn(dist, [step_with(2), step_with(0)], args.repeats)
        rows.append({"schedule": label(name, options), "N": n, "early_s": early, "late_s": late,
                     "early_vs_ideal": early / ideal, "late_vs_ideal": late / ideal, "speedup": late / early})
        if rank == 0:
            print(f"  {label(name, options):<24} N={n:<3} early {early / ideal:6.3f} x ideal, when needed "
                  f"{late / ideal:6.3f} x ideal: {late / early:5.3f}x", flush=True)
    save_rows(dist, rows, args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "early_receives_results.json"))
    args = parser.parse_args()
    if args.micro_batches < 4 or args.micro_batches % 4:
        parser.error(f"--micro-batches must be a multiple of 4 (the ranks), got {args.micro_batches}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.worker:
        return worker(args)
    print("4 ranks, timed model; steps alternate between receives posted early and when needed", flush=True)
    return report(launch(__file__, ["--micro-batches", args.micro_batches, "--repeats", args.repeats], args.out,
                         lambda line: line.startswith("  ") and "x ideal" in line))


if __name__ == "__main__":
    sys.exit(main() or 0)
