"""Does an engine step slower when other, idle engines live in the same processes?

    python tools/idle_engines.py                       # 25 idle engines, 2 pairs
    python tools/idle_engines.py --idle 12 --pairs 3

``schedules.py`` builds every row of an N first and steps them in turn, so each step runs
beside 25 engines that are not stepping (each with its own gloo process groups and their
threads). This times one schedule (chimera zero-bubble, f = 2, N = 8, the timed model) in
fresh 4-rank launches, alternately without and with ``--idle`` extra engines built and never
stepped, and prints the median step over ideal for each launch, and the native threads per
process. The idle engines are built twice: with torch's gloo transport, one device (and one
event-loop thread that wakes every 10 ms) per process group, and with one device shared by
all groups (``harness.share_one_device``, what the benchmarks use).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(HERE), "benchmarks")   # the shared helpers: benchmarks/harness.py
sys.path.insert(0, BENCHMARKS)
from harness import (COST_S, WIDTH, ds_config, init_timed_model, launch, median_steps_in_turn,  # noqa: E402
                     random_batches, report, save_rows, timed_engine)
from schedules import OURS  # noqa: E402  (the idle engines: schedules.py's own rows)

SCHEDULE = ("chimera", {"order": "zero-bubble", "pipelines": 2})
N = 8


def worker(args):
    import torch
    import torch.distributed as dist

    import ds_chimera  # noqa: F401  (the "pipeline" config key)

    rank, _, _, specs = init_timed_model(device_per_group=args.device_per_group)

    active = timed_engine(specs, ds_config(N, SCHEDULE))
    idle = [timed_engine(specs, ds_config(N, OURS[i % len(OURS)])) for i in range(args.idle)]   # never stepped
    batch = random_batches(torch, WIDTH, N)
    step = median_steps_in_turn(dist, [lambda: active.train_batch(iter(batch))], args.repeats)[0]
    with open("/proc/self/status") as fh:
        threads = int(next(line for line in fh if line.startswith("Threads")).split()[1])
    transport = "a gloo device per group" if args.device_per_group else "one gloo device"
    row = {"idle_engines": len(idle), "vs_ideal": step / (N * 3 * COST_S), "threads": threads,
           "device_per_group": args.device_per_group}
    if rank == 0:
        print(f"  idle {len(idle):>3} engines, {transport:<23}, {threads:>4} threads per process: "
              f"{row['vs_ideal']:.3f} x ideal", flush=True)
    save_rows(dist, [row], args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=25, help="idle engines in the 'with' launches (default 25)")
    parser.add_argument("--pairs", type=int, default=2, help="without/with launch pairs (default 2)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device-per-group", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "idle_engines_results.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.idle < 1 or args.pairs < 1:
        parser.error(f"--idle and --pairs must be >= 1, got {args.idle} and {args.pairs}")
    print(f"4 ranks, {SCHEDULE[0]} {json.dumps(SCHEDULE[1])}, N = {N}; launches alternate: alone, beside "
          f"{args.idle} idle engines with a gloo device per group (torch's default), and beside them with one "
          f"gloo device per process", flush=True)
    rows = []
    for _ in range(args.pairs):
        for idle, per_group in ((0, False), (args.idle, True), (args.idle, False)):
            extra = ["--device-per-group"] if per_group else []
            got = launch(__file__, ["--idle", idle, "--repeats", args.repeats, *extra], args.out, ("  idle",))
            if got is None:
                return report(None)
            rows += got
    return report(rows, summarise)


def summarise(rows):
    def span(pick):
        got = [r["vs_ideal"] for r in rows if pick(r)]
        return f"{min(got):.3f}-{max(got):.3f}"
    print(f"alone {span(lambda r: r['idle_engines'] == 0)} x ideal; beside idle engines, a gloo device per group "
          f"{span(lambda r: r['idle_engines'] > 0 and r['device_per_group'])}, one gloo device "
          f"{span(lambda r: r['idle_engines'] > 0 and not r['device_per_group'])}")


if __name__ == "__main__":
    sys.exit(main() or 0)
