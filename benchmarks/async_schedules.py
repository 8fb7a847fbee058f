"""Asynchronous schedules (PipeOptim, PipeDream, 2BW, SpecTrain) on the timed model.

    python benchmarks/async_schedules.py            # N = 32 and 64 mini-batches per call
    python benchmarks/async_schedules.py --quick    # N = 32, fewer repeats

Four CPU ranks (gloo), F = I = W = 20 ms per rank and mini-batch, as benchmarks/schedules.py.
For each schedule it prints:

- per call: median train_batch time / (N * (F + I + W)), the no-bubble ideal per mini-batch,
  next to the simulator's prediction for the same program (calibrated costs);
- steady state: the time between consecutive forwards on the first rank in the middle of
  the call, over F + I + W, from the runtime's own trace. One call fills and drains the
  pipeline once (see ds_chimera/runtime/async_engine.py), so this is the throughput of a
  pipeline that stays full.

With ``fill=continuous`` the pipeline stays full across calls: consecutive calls read on from
one stream, and per mini-batch is the mean over ``repeats`` back-to-back calls (one timed
window, no barrier between the calls; the fill happens in the warm-up call, the drain after).

In the same run: ds_chimera's synchronous 1f1b with the same N, and DeepSpeed's stock
TrainSchedule (1F1B) with N = 8 and with the same N, per micro-batch. AdamW everywhere, so
the prediction's cost is in the numbers. The last line is a JSON object with every row.
"""
import itertools
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (COST_S, LAYERS, WIDTH, TimedLayer, benchmark_parser, calibrate, ds_config,  # noqa: E402
                     init_timed_model, launch, median_step, p2p_latency, random_batches, report, save_rows,
                     timed_engine)

OURS = [("pipeoptim", {"fill": "continuous"}), ("pipedream", {"fill": "continuous"}),
        ("pipeoptim", {}), ("spectrain", {}), ("pipedream", {}), ("pipedream-2bw", {}), ("1f1b", {})]


def worker(args):
    import torch
    import torch.distributed as dist

    import ds_chimera  # noqa: F401
    from ds_chimera.sim import Costs, simulate

    rank, world, layer_s, specs = init_timed_model()
    latency = p2p_latency(dist, torch, rank)
    f_s, i_s, w_s = calibrate(torch, TimedLayer, layer_s, LAYERS // world, WIDTH)
    slot = 3 * COST_S
    rows = []

    def adamw(p):
        return torch.optim.AdamW(p, lr=1e-3)

    def timed(step, repeats):
        return median_step(dist, step, repeats)

    def data(n):
        return random_batches(torch, WIDTH, n)

    trace_root = [tempfile.mkdtemp(prefix="dsc_async_") if rank == 0 else None]
    dist.broadcast_object_list(trace_root, 0)
    for n in args.micro_batches:
        for name, options in OURS:
            if args.only and name + (" fill=continuous" if options.get("fill") else "") not in args.only:
                continue
            trace_dir = os.path.join(trace_root[0], f"{name}-{n}-{len(rows)}")
            engine = timed_engine(specs, ds_config(n, (name, options), trace_dir), optimizer=adamw)
            batch = data(n)
            continuous = options.get("fill") == "continuous"
            if continuous:        # the pipeline stays full: calls read on from one endless stream
                stream = itertools.cycle(batch)

                def calls(count=args.repeats):
                    for _ in range(count):
                        engine.train_batch(stream)
                # one window of back-to-back calls: a barrier between calls would drain the skew
                median = timed(calls, 1) / args.repeats
                program = engine.part_programs["steady"]
            else:
                median = timed(lambda: engine.train_batch(iter(batch)), args.repeats)
                program = engine.plan.program
            sim = simulate(program, Costs(fwd=f_s, bwd=i_s + w_s, wgrad=w_s, comm=latency)).makespan
            if continuous:        # a steady call alone never finishes in the simulator: use the per-slot cost
                sim = n * (f_s + i_s + w_s)
            # steady state from this run's last trace: forwards on rank 0 from mini-batch D to N - D
            starts = sorted(r[4] for r in engine.executor.records if r[1] == "F")
            steady = None
            if rank == 0 and n > 3 * world:
                lo, hi = world, n - world
                steady = (starts[hi] - starts[lo]) / (hi - lo)
            holder = [steady]
            dist.broadcast_object_list(holder, 0)
            steady = holder[0]
            if continuous:
                engine.drain()
            name_label = name + (" fill=continuous" if continuous else "")
            row = {"runtime": "ds_chimera", "schedule": name_label, "N": n, "call_s": median,
                   "per_minibatch_vs_ideal": median / (n * slot), "sim_vs_ideal": sim / (n * slot),
                   "measured_vs_sim": median / sim,
                   "steady_vs_ideal": steady / slot if steady else None,
                   "weight_versions": engine.weight_versions_held() if hasattr(engine, "weight_versions_held")
                   else 1}
            rows.append(row)
            if rank == 0:
                print(f"  ds_chimera {name_label:<30} N={n:<3} per mini-batch {row['per_minibatch_vs_ideal']:6.3f} x ideal "
                      f"(simulated {row['sim_vs_ideal']:5.3f}; measured/sim {row['measured_vs_sim']:5.3f}); "
                      f"steady state {row['steady_vs_ideal'] or float('nan'):5.3f} x ideal", flush=True)
        for stock_n in sorted({8, n}):
            engine = timed_engine(specs, ds_config(stock_n), optimizer=adamw)
            batch = data(stock_n)
            median = timed(lambda: engine.train_batch(iter(batch)), args.repeats)
            rows.append({"runtime": "deepspeed", "schedule": "TrainSchedule (1F1B)", "N": stock_n, "call_s": median,
                         "per_minibatch_vs_ideal": median / (stock_n * slot)})
            if rank == 0:
                print(f"  deepspeed  {'TrainSchedule':<30} N={stock_n:<3} per micro-batch "
                      f"{median / (stock_n * slot):6.3f} x ideal", flush=True)
    if rank == 0:
        shutil.rmtree(trace_root[0], ignore_errors=True)
    save_rows(dist, rows, args.out)


def main():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--out", default="benchmarks/async_schedules_results.json")
    parser.add_argument("--only", nargs="+", help="rows to run, e.g. 'pipeoptim fill=continuous' 1f1b")
    args = parser.parse_args()
    args.micro_batches = args.micro_batches or ([32] if args.quick else [32, 64])
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.worker:
        return worker(args)
    print(f"4 ranks, F = I = W = {COST_S * 1e3:.0f} ms per rank and mini-batch; ideal = F + I + W per mini-batch",
          flush=True)
    worker_args = ["--repeats", args.repeats, "--micro-batches", *args.micro_batches] + \
        (["--only", *args.only] if args.only else [])
    return report(launch(__file__, worker_args, args.out, ("  ds_chimera", "  deepspeed")))


if __name__ == "__main__":
    sys.exit(main())
