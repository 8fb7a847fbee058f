"""Where one schedule's step goes, on the timed model: from the ideal to the measured step.

    python tools/step_breakdown.py                                   # chimera zero-bubble, f = 2, N = 8
    python tools/step_breakdown.py --schedule zbv --micro-batches 16
    python tools/step_breakdown.py --schedule chimera --options '{"order": "merged"}'

Four CPU ranks (gloo), the timed model of ``benchmarks/harness.py``. Two engines of the schedule take
turns: one traced (every op's start and end on every rank), one not (its median step is the
figure ``schedules.py`` reports). For each traced step the script replays the lowered program
on that step's own op durations (``simulate(durations=...)``) and prints, as ratios over
ideal = N * (F + I + W) with the nominal costs:

1. the schedule's own makespan at nominal costs (its bubble);
2. the same with the layers' costs calibrated single-process (``harness.calibrate``);
3. the replay on the ops' in-step durations, without messages: what the ops themselves cost in
   the step (slower than calibrated: cold caches after waits, 4 ranks on 2 cores), and the
   critical path's share of the slow ones (jitter);
4. the same replay with the latency to a waiting rank (``harness.p2p_waiting_latency``);
5. the last op's end (slowest rank): what the replay leaves unexplained is the runtime's
   per-message host time and the wake-ups between ops;
6. the untraced engine's median step: adds the end of the step (gradient syncs, optimizer
   step, the loss all-reduce).

Then the gaps between each rank's consecutive ops, in the traced steps and in the simulation
with calibrated costs and the waiting latency: per rank in all, and between two weight-grad
ops, where no message is awaited (a rank's host work between ops shows there: after a
stage's last W the runtime posts its gradient sync, the simulator's ``sync_post``).

Medians over the traced steps. A diagnosis, not a ranking: ``schedules.py`` compares runtimes.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(HERE), "benchmarks")   # the shared helpers: benchmarks/harness.py
sys.path.insert(0, BENCHMARKS)
from harness import (COST_S, LAYERS, WIDTH, TimedLayer, calibrate, ds_config, init_timed_model,  # noqa: E402
                     json_object, launch, median_steps_in_turn, p2p_waiting_latency, random_batches, report, save_rows,
                     timed_engine)


def op_gaps(records) -> tuple:
    """(sum of the gaps between consecutive ops, the gaps between two W ops) of one rank's records."""
    ops = sorted(records, key=lambda rec: rec[-2])
    pairs = list(zip(ops, ops[1:]))
    gaps = [b[-2] - a[-1] for a, b in pairs]
    ww = [gap for (a, b), gap in zip(pairs, gaps) if a[1] == b[1] == "W"]
    return sum(gaps), ww


def gap_summary(per_rank: list) -> tuple:
    """(mean over ranks of the gaps' sum, median gap between two W ops, 0 if none) of ``op_gaps`` per rank."""
    ww = [gap for _, gaps in per_rank for gap in gaps]
    return statistics.mean(total for total, _ in per_rank), statistics.median(ww) if ww else 0.0


def worker(args):
    import torch
    import torch.distributed as dist

    import ds_chimera  # noqa: F401  (the "pipeline" config key)

    from ds_chimera.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD
    from ds_chimera.sim import Costs, simulate

    rank, world, layer_s, specs = init_timed_model()
    n, options = args.micro_batches, args.options
    ideal = n * 3 * COST_S
    trace_dir = tempfile.mkdtemp(prefix="ds_chimera_breakdown_") if rank == 0 else None
    box = [trace_dir]
    dist.broadcast_object_list(box, 0)
    records = []
    engines = [timed_engine(specs, ds_config(n, (args.schedule, options), trace_dir))
               for trace_dir in (box[0], None)]                 # traced, then not
    batch = random_batches(torch, WIDTH, n)

    def traced_step():
        engines[0].train_batch(iter(batch))
        records.append(list(engines[0].executor.records))

    def plain_step():
        engines[1].train_batch(iter(batch))

    f_s, i_s, w_s = calibrate(torch, TimedLayer, layer_s, LAYERS // world, WIDTH)
    waiting = p2p_waiting_latency(dist, torch, rank, idle_s=layer_s)
    medians = median_steps_in_turn(dist, [traced_step, plain_step], args.repeats)
    records = records[1:]                                   # the warm-up round's step is not timed
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    program, placement = engines[0].plan.program, engines[0].placement
    nominal = simulate(program, Costs(fwd=COST_S, bwd=2 * COST_S, wgrad=COST_S)).makespan
    calibrated = simulate(program, Costs(fwd=f_s, bwd=i_s + w_s, wgrad=w_s)).makespan
    with_latency = simulate(program, Costs(fwd=f_s, bwd=i_s + w_s, wgrad=w_s, comm=waiting))
    sim_gap_per_rank, sim_ww_gap = gap_summary([op_gaps([rec for rec in with_latency.records if rec[0] == r])
                                                 for r in range(world)])
    # one rank's share; a chunk pays it x its size
    calibrated_op = {FORWARD: f_s, BACKWARD: i_s + w_s, INPUT_GRAD: i_s, WEIGHT_GRAD: w_s}
    rows = []
    for step in range(len(records)):
        durations, last_end = {}, 0.0
        for per_rank in gathered:
            for _, kind, chunk, mb, start, end in per_rank[step]:
                durations[(kind, chunk, mb)] = end - start
                last_end = max(last_end, end)
        replay = simulate(program, Costs(), durations=durations).makespan
        replay_comm = simulate(program, Costs(comm=waiting), durations=durations).makespan
        gap_per_rank, ww_gap = gap_summary([op_gaps(per_rank[step]) for per_rank in gathered])
        row = {"replay": replay, "replay_comm": replay_comm, "last_op_end": last_end,
               "gap_per_rank_s": gap_per_rank, "ww_gap_s": ww_gap}
        for kind in calibrated_op:
            took = [d for (k, _, _), d in durations.items() if k == kind]
            if took:
                row[f"{kind}_vs_calibrated"] = statistics.mean(took) / (calibrated_op[kind] * placement.size)
        rows.append(row)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    per_kind = ", ".join(f"{kind} {med[f'{kind}_vs_calibrated']:.3f}" for kind in calibrated_op
                         if f"{kind}_vs_calibrated" in med)
    result = {"schedule": args.schedule, "options": options, "N": n, "nominal": nominal / ideal,
              "calibrated": calibrated / ideal, **{k: v for k, v in med.items() if k.endswith("_vs_calibrated")},
              "replay": med["replay"] / ideal, "replay_comm": med["replay_comm"] / ideal,
              "last_op_end": med["last_op_end"] / ideal, "step_traced": medians[0] / ideal,
              "step": medians[1] / ideal, "waiting_latency_s": waiting, "layer_costs_s": [f_s, i_s, w_s],
              "gap_per_rank_s": med["gap_per_rank_s"], "ww_gap_s": med["ww_gap_s"],
              "sim_gap_per_rank_s": sim_gap_per_rank, "sim_ww_gap_s": sim_ww_gap}
    if rank == 0:
        label = args.schedule + (" " + json.dumps(options) if options else "")
        print(f"  breakdown {label}, N={n}, 4 ranks; ratios over ideal = N x 3 x {COST_S * 1e3:.0f} ms "
              f"(medians of {len(rows)} traced steps)", flush=True)
        lines = [
            ("the schedule at nominal costs (its bubble)", result["nominal"]),
            (f"+ calibrated layer costs (F {f_s * 1e3:.2f}, I {i_s * 1e3:.2f}, W {w_s * 1e3:.2f} ms)",
             result["calibrated"]),
            (f"replayed on the ops' in-step durations (x calibrated: {per_kind})",
             result["replay"]),
            (f"+ {waiting * 1e3:.2f} ms latency to a waiting rank per message", result["replay_comm"]),
            ("the last op's end, measured (slowest rank)", result["last_op_end"]),
            ("the step, untraced engine (median)", result["step"]),
        ]
        for text, value in lines:
            print(f"  breakdown   {value:6.3f}  {text}", flush=True)
        print(f"  breakdown gaps between a rank's consecutive ops: {result['gap_per_rank_s'] * 1e3:.2f} ms per rank "
              f"in the step, {result['sim_gap_per_rank_s'] * 1e3:.2f} ms simulated (calibrated costs, latency); "
              f"between two W ops: {result['ww_gap_s'] * 1e3:.2f} ms each, "
              f"{result['sim_ww_gap_s'] * 1e3:.2f} ms simulated", flush=True)
    if rank == 0 and args.dump:
        with open(args.dump, "w") as f:
            json.dump({"steps": [[per_rank[step] for per_rank in gathered] for step in range(len(records))],
                       "simulated": [list(rec) for rec in with_latency.records], "costs_s": [f_s, i_s, w_s],
                       "waiting_latency_s": waiting}, f)
    save_rows(dist, [result], args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="chimera")
    parser.add_argument("--options", type=json_object, default='{"order": "zero-bubble", "pipelines": 2}',
                        help="the schedule's options as JSON (default: %(default)s; '{}' for none)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dump", default=None,
                        help="write every traced step's op records and the simulated ones to this JSON file")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "step_breakdown.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from ds_chimera.schedules import build
    try:
        build(args.schedule, 4, args.micro_batches, **args.options)    # bad names and options fail here, before launching
    except ValueError as exc:
        parser.error(str(exc))
    return report(launch(__file__, ["--schedule", args.schedule, "--options", json.dumps(args.options), "--micro-batches",
                                    args.micro_batches, "--repeats", args.repeats]
                                   + (["--dump", os.path.abspath(args.dump)] if args.dump else []), args.out, ("  breakdown",)))


if __name__ == "__main__":
    sys.exit(main() or 0)
