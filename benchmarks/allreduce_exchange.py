"""gloo's ring all-reduce against ds_chimera's direct exchange, by size and group size.

    python benchmarks/allreduce_exchange.py
    python benchmarks/allreduce_exchange.py --rounds 60 --sizes 64 65536

Four CPU ranks (gloo). For each tensor size (bytes of fp32 per member) and each group (2 ranks:
Chimera's replica pairs; 4 ranks: every rank), the two all-reduces take turns, one call each
per round. A call is timed as a pipeline step pays for it: from the moment its last member
posts it (that member first idles 20 ms, like a rank finishing its last backward; the others
are already waiting) to the moment every member holds the result (``time.perf_counter`` is
CLOCK_MONOTONIC, one clock for every process of the machine). The last member rotates.
It also prints how long the last member's post alone took (the host time a rank pays
before it can go on computing).
Prints the medians and ring / exchange; the runtime picks the exchange up to the limits
of ``ds_chimera.runtime.allreduce`` (``EXCHANGE_MAX_BYTES``, ``EXCHANGE_MAX_SENT``).

Then the same choice inside whole steps (``--steps``, default on): the timed model of
``schedules.py`` at N = 4, where the step's end weighs most, with DeepSpeed's default
gradient clipping (1.0: a gradient-norm all-reduce at the end of every step). Two engines
of each schedule take turns, one with every runtime all-reduce on gloo's ring, one with
the exchange; it prints the median step over ideal of each and their ratio.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ranks import launch, report, save_rows  # noqa: E402

IDLE_S = 0.020
SIZES = [16, 1024, 16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024]
STEP_SCHEDULES = [("chimera", {"order": "zero-bubble", "pipelines": 2}), ("chimera", {}), ("1f1b", {})]
STEP_N = 4


def time_to_everyone(dist, torch, rank, members, post, round_index) -> tuple:
    """Seconds from the last member's post (``post()`` returns a work) to the last member's
    result, and the seconds the last member's post itself took (every rank gets both)."""
    last = members[round_index % len(members)]
    dist.barrier()
    posted = returned = done = 0.0
    if rank in members:
        if rank == last:
            time.sleep(IDLE_S)
        posted = time.perf_counter()
        work = post()
        returned = time.perf_counter()
        work.wait()
        done = time.perf_counter()
    mine = rank == last
    stamps = torch.tensor([posted if mine else 0.0, returned - posted if mine else 0.0, done], dtype=torch.float64)
    dist.all_reduce(stamps, op=dist.ReduceOp.MAX)
    return float(stamps[2] - stamps[0]), float(stamps[1])


def worker(args):
    import torch
    import torch.distributed as dist

    from ds_chimera.runtime.allreduce import ExchangeAllReduce
    from schedules import init_timed_model

    rank, world, _, specs = init_timed_model()
    groups = {2: ([0, world - 1], dist.new_group([0, world - 1])), world: (list(range(world)), dist.new_group())}
    rows = []
    for size in args.sizes:
        buf = torch.ones(max(1, size // 4))
        for members, group in groups.values():
            def ring():
                return dist.all_reduce(buf, group=group, async_op=True)

            def exchange():
                return ExchangeAllReduce(buf, group)
            times = {"ring": [], "exchange": []}
            posts = {"ring": [], "exchange": []}
            for i in range(args.rounds + 1):
                for name, post in (("ring", ring), ("exchange", exchange)):
                    took, post_s = time_to_everyone(dist, torch, rank, members, post, i)
                    if i:                                  # round 0 warms both up
                        times[name].append(took)
                        posts[name].append(post_s)
            ring_s, exchange_s = (statistics.median(times[k]) for k in ("ring", "exchange"))
            ring_post, exchange_post = (statistics.median(posts[k]) for k in ("ring", "exchange"))
            row = {"bytes": size, "ranks": len(members), "ring_s": ring_s, "exchange_s": exchange_s,
                   "ring_over_exchange": ring_s / exchange_s, "ring_post_s": ring_post, "exchange_post_s": exchange_post}
            rows.append(row)
            if rank == 0:
                print(f"  all-reduce {size:>8} B over {len(members)} ranks: ring {ring_s * 1e3:7.2f} ms, exchange "
                      f"{exchange_s * 1e3:7.2f} ms, ring / exchange {ring_s / exchange_s:5.2f}; the post alone: ring "
                      f"{ring_post * 1e3:.3f} ms, exchange {exchange_post * 1e3:.3f} ms", flush=True)
    if args.steps:
        rows += steps_with_each(dist, torch, rank, specs, args.step_repeats)
    save_rows(dist, rows, args.out)


def steps_with_each(dist, torch, rank, specs, repeats: int) -> list:
    """Median steps of engines whose all-reduces take the ring, and of engines that use the exchange."""
    import ds_chimera  # noqa: F401  (the "pipeline" config key)
    from ds_chimera.runtime import allreduce
    from schedules import COST_S, ds_config, label, median_steps_in_turn, random_batches, timed_engine
    from timed_model import WIDTH

    exchange_limit = allreduce.EXCHANGE_MAX_BYTES
    batch = random_batches(torch, WIDTH, STEP_N)
    rows = []
    for name, options in STEP_SCHEDULES:
        config = dict(ds_config(STEP_N, (name, options)), gradient_clipping=1.0)
        engines = {"ring": timed_engine(specs, config), "exchange": timed_engine(specs, config)}

        def step_with(kind):
            def step():
                allreduce.EXCHANGE_MAX_BYTES = exchange_limit if kind == "exchange" else -1   # -1: nothing qualifies
                try:
                    engines[kind].train_batch(iter(batch))
                finally:
                    allreduce.EXCHANGE_MAX_BYTES = exchange_limit
            return step
        ring_s, exchange_s = median_steps_in_turn(dist, [step_with("ring"), step_with("exchange")], repeats)
        ideal = STEP_N * 3 * COST_S
        row = {"schedule": label(name, options), "N": STEP_N, "ring_vs_ideal": ring_s / ideal,
               "exchange_vs_ideal": exchange_s / ideal, "ring_over_exchange": ring_s / exchange_s}
        rows.append(row)
        if rank == 0:
            print(f"  step {row['schedule']:<38} N={STEP_N}, clipping 1.0: ring {row['ring_vs_ideal']:.3f} x ideal, "
                  f"exchange {row['exchange_vs_ideal']:.3f} x ideal, ring / exchange {row['ring_over_exchange']:.3f}",
                  flush=True)
        engines = None
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per member (fp32)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-steps", dest="steps", action="store_false", help="skip the whole-step comparison")
    parser.add_argument("--step-repeats", type=int, default=15)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "allreduce_exchange.json"))
    args = parser.parse_args()
    if any(size < 4 for size in args.sizes) or args.rounds < 1:
        parser.error(f"--sizes must be >= 4 bytes and --rounds >= 1; got {args.sizes}, {args.rounds}")
    if args.worker:
        return worker(args)
    extra = ["--step-repeats", args.step_repeats] + ([] if args.steps else ["--no-steps"])
    return report(launch(__file__, ["--sizes", *args.sizes, "--rounds", args.rounds, *extra], args.out,
                         ("  all-reduce", "  step")))


if __name__ == "__main__":
    sys.exit(main() or 0)
