"""The runtime's own host time per step, every synchronous schedule over DeepSpeed's stock 1F1B engine.

    python benchmarks/host_overhead.py                                  # this tree, 3 launches, N = 8 and 16
    python benchmarks/host_overhead.py --trees /tmp/old-tree . --pairs 3   # two source trees, launches alternating
    python benchmarks/host_overhead.py --only zbv 1f1b --profile 10     # + where each row's CPU goes, by function

The timed model with every layer's cost 0 (no sleep, no spin): a step is then only what the runtime itself
does (autograd bookkeeping, posting and taking messages, waits and their hand-overs, syncs, the step), the
regime of fast GPU kernels, where the runtime's host time is the step. Each row's median step is printed over
stock's in the same launch (the rows step in turn, so a burst of load hits them alike). Four CPU ranks on two
cores: the figures are the host's load as much as the code's, so compare rows within a launch, and trees over
alternating launches. ``--trees`` puts each tree first on ``PYTHONPATH`` (a ``git worktree`` of another commit).
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (WIDTH, TimedLayer, ds_config, init_timed_model, label, launch,  # noqa: E402
                     median_steps_in_turn, model_specs, random_batches, release_groups, process_groups, report,
                     save_rows, timed_engine)
from schedules import OURS  # noqa: E402

STOCK = "DeepSpeed stock 1F1B"
ROWS = [(STOCK, None)] + [(label(name, options), (name, options)) for name, options in OURS]


def worker(args):
    import torch
    import torch.distributed as dist

    import ds_chimera
    from deepspeed.pipe import LayerSpec

    TimedLayer.spin_s = 0.0
    rank, world, _, _ = init_timed_model()
    specs = model_specs(LayerSpec, 0.0, 8)
    rows = []
    for n in args.micro_batches:
        keep = process_groups()
        wanted = [(name, schedule) for name, schedule in ROWS if schedule is None or not args.only
                  or schedule[0] in args.only or name in args.only]
        wanted = [(name, schedule) for name, schedule in wanted
                  if not (schedule and schedule[0] == "dualpipev" and n < 2 * world)]
        steps = []
        for _, schedule in wanted:
            torch.manual_seed(0)
            engine = timed_engine(specs, ds_config(n, schedule))
            batch = random_batches(torch, WIDTH, n)
            steps.append(lambda engine=engine, batch=batch: engine.train_batch(iter(batch)))
        times = median_steps_in_turn(dist, steps, args.repeats)
        if args.profile:
            profile_rows(dist, rank, [name for name, _ in wanted], steps, args.profile, args.profile_dump)
        got = [{"tree": os.path.dirname(os.path.dirname(ds_chimera.__file__)), "N": n, "row": name,
                "step_ms": t * 1e3, "over_stock": t / times[0]} for (name, _), t in zip(wanted, times)]
        if rank == 0:
            print(f"  host time N={n}: " + "; ".join(f"{r['row']} {r['step_ms']:.1f} ms ({r['over_stock']:.3f})"
                                                   for r in got), flush=True)
        rows += got
        del steps
        release_groups(dist, keep)
    save_rows(dist, rows, args.out)


def profile_rows(dist, rank, names, steps, repeats, dump=None, top=14):
    """Each row's CPU time on its main thread (waits excluded: ``time.thread_time``), by function,
    over ``repeats`` steps, summed over the ranks; rank 0 prints each row's top functions by own time.
    ``dump``: a folder for each rank's pstats file per row (``python -m pstats`` reads them)."""
    import cProfile
    import pstats
    import time

    for name, step in zip(names, steps):
        profiler = cProfile.Profile(time.thread_time)
        dist.barrier()
        profiler.enable()
        for _ in range(repeats):
            step()
        profiler.disable()
        dist.barrier()
        if dump:
            os.makedirs(dump, exist_ok=True)
            profiler.dump_stats(os.path.join(dump, f"{name.replace(' ', '_')}.rank{rank}.prof"))
        stats = pstats.Stats(profiler).stats     # (file, line, function) -> (calls, prim calls, own, cumulative, callers)
        own = [(key, v[1], v[2]) for key, v in stats.items()]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own)
        if rank != 0:
            continue
        total: dict = {}
        for per_rank in gathered:
            for key, calls, seconds in per_rank:
                c, s = total.get(key, (0, 0.0))
                total[key] = (c + calls, s + seconds)
        cpu = sum(s for _, s in total.values())
        print(f"  profile {name}: main-thread CPU {cpu / repeats * 1e3:.1f} ms per step, all ranks", flush=True)
        for (path, line, func), (calls, seconds) in sorted(total.items(), key=lambda kv: -kv[1][1])[:top]:
            where = f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{line}" if line else path
            print(f"  profile {name}:   {seconds / repeats * 1e3:6.2f} ms {calls / repeats:7.1f} calls  {func}  {where}",
                  flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=[os.path.dirname(HERE)], help="source trees to time")
    parser.add_argument("--pairs", type=int, default=3, help="launches per tree (alternating)")
    parser.add_argument("--repeats", type=int, default=40, help="timed steps per row (after one warm-up)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16], metavar="N")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="schedules or row labels to time (stock always)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timing, profile STEPS steps of each row (CPU by function)")
    parser.add_argument("--profile-dump", metavar="DIR", help="with --profile: write each rank's pstats file per row")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "host_overhead_results.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.pairs < 1 or args.repeats < 1 or min(args.micro_batches) < 1:
        parser.error(f"--pairs, --repeats and --micro-batches must be >= 1, got {args.pairs}, {args.repeats} and "
                     f"{args.micro_batches}")
    known = {schedule[0] for _, schedule in ROWS[1:]} | {name for name, _ in ROWS[1:]}
    unknown = sorted(set(args.only or []) - known)
    if unknown:
        parser.error(f"--only: unknown {unknown}; rows are {sorted(known)}")
    print(f"4 ranks, cost-free layers, N = {args.micro_batches}, median of {args.repeats} steps per row; each row "
          f"over DeepSpeed's stock engine in the same launch", flush=True)
    rows, base = [], os.environ.get("PYTHONPATH", "")
    for launch_no in range(args.pairs):
        for tree in args.trees:
            os.environ["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), base])
            print(f" {tree}:", flush=True)
            extra = ["--profile-dump", os.path.abspath(args.profile_dump)] if args.profile_dump else []
            got = launch(__file__, ["--repeats", args.repeats, "--profile", args.profile, "--micro-batches",
                                    *args.micro_batches, *(["--only", *args.only] if args.only else []), *extra],
                         args.out, ("  host time", "  profile"))
            if got is None:
                return report(None)
            rows += [dict(r, launch=launch_no) for r in got]
    with open(args.out, "w") as fh:         # every launch's rows (each launch's worker wrote its own only)
        json.dump(rows, fh)
    return report(rows, summarise)


def summarise(rows):
    """Per tree and N: each row's median over stock and its range over the launches; the worst row."""
    for tree in dict.fromkeys(r["tree"] for r in rows):
        for n in dict.fromkeys(r["N"] for r in rows):
            mine = [r for r in rows if r["tree"] == tree and r["N"] == n and r["row"] != STOCK]
            cells, worst = [], (0.0, "")
            for name in dict.fromkeys(r["row"] for r in mine):
                got = [r["over_stock"] for r in mine if r["row"] == name]
                median = statistics.median(got)
                worst = max(worst, (median, name))
                cells.append(f"{name} {median:.3f} [{min(got):.3f}, {max(got):.3f}]")
            print(f"{tree} N={n}: over stock, median [range]: " + "; ".join(cells))
            print(f"{tree} N={n}: the highest median: {worst[1]} {worst[0]:.3f}")


if __name__ == "__main__":
    sys.exit(main() or 0)
