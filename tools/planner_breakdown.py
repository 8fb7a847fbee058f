"""Where the planner's prediction of one candidate parts from its measured step, on the planner benchmark's model.

    python tools/planner_breakdown.py                  # Chimera zero-bubble, 2 pipelines, uniform cut, N = 8
    python tools/planner_breakdown.py --section '{"schedule": "zbv"}' --cut time

Four CPU ranks (gloo; ``--ranks``), the timed model of ``benchmarks/planner.py`` (unequal layers). An ``"auto"`` engine profiles
the layers and measures the links inside ``deepspeed.initialize``, as the benchmark's; the planner's search then
prices the candidate (``--section``'s schedule and options, ``--cut``'s layer cut). Two engines run that candidate,
taking turns: one traced, one not (its median step is the measured one). Printed, in ms:

1. the planner's prediction and the links' costs it used;
2. the candidate's program replayed on the traced steps' own op durations with the same costs: what the ops
   costing what they cost in the step (not what the profile timed alone) would have predicted;
3. the same replay with the runtime's host time per action measured around the model's own layers (a 1x block),
   every rank at once, instead of the planner's (around layers shaped as the profile's mean layer: it waits,
   then computes; docs/investigations/zero-bubble-host-time.md, parts 4 and 6);
4. the measured step; the last compute action's end, measured (slowest rank) and in the replay: what follows it
   is the step's end (the last gradient syncs, the optimizer step); and each stage's F, I, W in the step over
   its profiled cost.

A diagnosis, not a ranking: ``benchmarks/planner.py`` compares the pick with the sweep.
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
from harness import (MICRO, WIDTH, json_object, launch, median_steps_in_turn, report, save_rows,  # noqa: E402
                     share_one_device)


def worker(args):
    import torch
    import torch.distributed as dist

    import deepspeed
    import ds_chimera  # noqa: F401  (the "pipeline" switch)
    from torch.utils.data import TensorDataset

    import planner as bench
    from ds_chimera.planner import Profile, Setting, plan
    from ds_chimera.planner.cuts import stage_costs
    from ds_chimera.planner.search import _costs
    from ds_chimera.runtime.host_cost import measure_dispatch
    from ds_chimera.schedules import registry
    from ds_chimera.sim import simulate

    section = dict(args.section)
    name = section.pop("schedule")
    n = args.micro_batches
    share_one_device()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layer_cls, specs = bench.model_specs()
    box = [tempfile.mkdtemp(prefix="dsc_planner_breakdown_") if rank == 0 else None]
    dist.broadcast_object_list(box, 0)

    def engine_for(pipeline, training_data=None):
        return bench.planned_engine(specs, n, pipeline, training_data=training_data)

    profile_file = os.path.join(box[0], "profile.json")
    engine_for({"schedule": "auto", "profile_file": profile_file},
               training_data=TensorDataset(torch.randn(64, WIDTH), torch.randn(64, WIDTH)))
    profile = Profile.load(profile_file)
    setting = Setting(stages=world, micro_batches=n)
    found = [c for c in plan(profile, setting, exhaustive=True, only=[name]).candidates
             if c.options == section and c.cut == args.cut]
    if not found or found[0].step_s is None:
        raise SystemExit(f"the planner did not price {name} {section} cut={args.cut}: "
                         f"{found[0].excluded if found else 'no such candidate'}")
    cand = found[0]
    pipeline = {"schedule": name, **section, "parts": cand.parts}
    traced = engine_for({**pipeline, "trace_dir": os.path.join(box[0], "trace")})
    plain = engine_for(pipeline)
    batch = [(torch.randn(MICRO, WIDTH), torch.randn(MICRO, WIDTH)) for _ in range(n)]
    records = []

    def traced_step():
        traced.train_batch(iter(batch))
        records.append(list(traced.executor.records))
    medians = median_steps_in_turn(dist, [traced_step, lambda: plain.train_batch(iter(batch))], args.repeats)
    records = records[1:]                        # the warm-up round's step is not timed
    around = torch.tensor([measure_dispatch(rounds=7, layer=lambda: layer_cls(1, bench.PARAMS, bench.ACT_BYTES))],
                          dtype=torch.float64)
    dist.all_reduce(around)
    around_s = float(around) / world
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    schedule = registry.get(name)(world, n, **section)
    program, placement = schedule.lower(), schedule.placement
    costs = _costs(profile, cand.parts, setting, placement)
    stages = stage_costs(list(profile.layers), cand.parts, setting.checkpoint_interval)
    cold = dataclasses.replace(costs, dispatch=around_s)
    replays, cold_replays, ratios, last_ends, replay_last_ends = [], [], {}, [], []
    for step in range(len(records)):
        durations = {}
        for per_rank in gathered:
            for _, kind, chunk, mb, start, end in per_rank[step]:
                durations[(kind, chunk, mb)] = end - start
                stage = placement.chunks[chunk].stage
                ratios.setdefault((str(kind), stage), []).append((end - start) / max(stages.of(kind, stage), 1e-12))
        replay = simulate(program, costs, stage_costs=stages, durations=durations)
        replays.append(replay.makespan)
        replay_last_ends.append(max(rec[-1] for rec in replay.records))
        last_ends.append(max(rec[-1] for per_rank in gathered for rec in per_rank[step]))
        cold_replays.append(simulate(program, cold, stage_costs=stages, durations=durations).makespan)
    result = {"schedule": name, "options": section, "cut": args.cut, "N": n, "predicted_s": cand.step_s,
              "replay_s": statistics.median(replays),
              "replay_around_layers_s": statistics.median(cold_replays),
              "last_action_end_s": statistics.median(last_ends), "replay_last_action_end_s": statistics.median(replay_last_ends), "dispatch_around_layers_s": around_s, "step_s": medians[1], "traced_step_s": medians[0],
              "allreduce_s": costs.allreduce, "comm_s": costs.comm, "dispatch_s": costs.dispatch,
              "in_step_over_profiled": {f"{kind}{stage}": statistics.median(v) for (kind, stage), v in ratios.items()}}
    if rank == 0:
        print(f"  planner-breakdown {name} {json.dumps(section)} cut={args.cut} N={n} (ms)", flush=True)
        print(f"  planner-breakdown   {cand.step_s * 1e3:8.1f}  predicted (message {costs.comm * 1e3:.3f}, a stage's "
              f"gradient sync {costs.allreduce * 1e3:.3f}, host time per action {costs.dispatch * 1e3:.3f}, "
              f"optimizer step per stage {costs.step * 1e3:.3f})", flush=True)
        print(f"  planner-breakdown   {result['replay_s'] * 1e3:8.1f}  replayed on the ops' in-step durations, the same "
              f"costs otherwise", flush=True)
        print(f"  planner-breakdown   {result['replay_around_layers_s'] * 1e3:8.1f}  the same, host time per action "
              f"{around_s * 1e3:.3f} (measured around the model's layers)", flush=True)
        print(f"  planner-breakdown   {medians[1] * 1e3:8.1f}  measured (median; predicted / measured "
              f"{cand.step_s / medians[1]:.3f})", flush=True)
        print(f"  planner-breakdown   the last compute action ends at {result['last_action_end_s'] * 1e3:.1f} measured, "
              f"{result['replay_last_action_end_s'] * 1e3:.1f} in the replay: the step's end takes "
              f"{(medians[1] - result['last_action_end_s']) * 1e3:.1f} measured, "
              f"{(result['replay_s'] - result['replay_last_action_end_s']) * 1e3:.1f} simulated", flush=True)
        print("  planner-breakdown   in step / profiled: " + ", ".join(
            f"{key} {value:.3f}" for key, value in sorted(result["in_step_over_profiled"].items())), flush=True)
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    save_rows(dist, [result], args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", type=json_object, default='{"schedule": "chimera", "pipelines": 2, "order": "zero-bubble"}',
                        help="the candidate's schedule and options as JSON (default: %(default)s)")
    parser.add_argument("--cut", default="uniform", choices=("time", "parameters", "uniform"))
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4, help="pipeline stages, one rank each (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "planner_breakdown.json"))
    args = parser.parse_args()
    if "schedule" not in args.section:
        parser.error(f"--section must be a JSON object with a \"schedule\", got {json.dumps(args.section)}")
    if args.worker:
        return worker(args)
    return report(launch(__file__, ["--section", json.dumps(args.section), "--cut", args.cut, "--micro-batches",
                                    args.micro_batches, "--repeats", args.repeats], args.out, ("  planner-breakdown",),
                         nproc=args.ranks))


if __name__ == "__main__":
    sys.exit(main() or 0)
