"""``ds-chimera``: list, simulate, compare and plot pipeline schedules from the shell."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .schedules import registry
from .schedules.costs import COST_NAMES, Costs
from .sim.simulator import simulate


def _schedule_options(cls, args, costs: Costs, flags=("chunks", "pipelines", "order"), strict=True) -> dict:
    """CLI flags that this schedule takes. A given flag it does not take is an error, or with
    ``strict=False`` (ranking every schedule) is left out for that schedule."""
    options = {}
    for flag in flags:
        value = getattr(args, flag, None)
        if value is None or (not strict and not value):
            continue
        if flag not in cls.options:
            if not strict:
                continue
            raise ValueError(f"{cls.name}: unknown option {flag!r}; allowed options: "
                             f"{', '.join(sorted(cls.options)) or 'none'}")
        options[flag] = value
    if "costs" in cls.options:
        options["costs"] = costs
    return options


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", help="schedule name, or 'auto' to rank them all")
    p.add_argument("--program", help="simulate (and plot) a program file instead of a schedule: the text "
                                     "--dump-program writes, or another solver's output in that format")
    p.add_argument("--stages", type=int, help="pipeline ranks D")
    p.add_argument("--micro-batches", type=int, help="micro-batches per step N")
    p.add_argument("--chunks", type=int, help="chunks per rank V (interleaved, breadth-first)")
    p.add_argument("--pipelines", type=int, help="Chimera: down (= up) pipelines f, f | D/2")
    p.add_argument("--order", help="Chimera: auto, concat, forward-doubling, merged or zero-bubble")
    p.add_argument("--cost-fwd", type=float, default=1.0, help="forward cost per micro-batch and stage")
    p.add_argument("--cost-bwd", type=float, default=2.0, help="full backward cost")
    p.add_argument("--cost-wgrad", type=float, default=1.0, help="weight-grad share of the backward")
    p.add_argument("--cost-comm", type=float, default=0.0, help="latency of one p2p message")
    p.add_argument("--cost-allreduce", type=float, default=0.0, help="time of one stage's grad all-reduce")
    p.add_argument("--cost-send", type=float, default=0.0, help="sender's own time to post one p2p message")
    p.add_argument("--cost-recv", type=float, default=0.0, help="receiver's own time to take one arrived message")
    p.add_argument("--cost-sync-post", type=float, default=0.0, help="a rank's own time to post one gradient sync")
    p.add_argument("--cost-gather", type=float, default=0.0,
                   help="ZeRO-2/3: time to all-gather one stage's worth of sharded weights")
    p.add_argument("--cost-gather-post", type=float, default=0.0,
                   help="ZeRO-2/3: a rank's own time to post one chunk's all-gather")
    p.add_argument("--cost-gather-skew", type=float, default=0.0,
                   help="ZeRO-2/3: mean time from a rank's gather post to the later data-parallel peer's post")
    p.add_argument("--cost-step", type=float, default=0.0, help="optimizer step of one stage's worth of weights")
    p.add_argument("--cost-clip", type=float, default=0.0,
                   help="the global gradient norm's collective, from the last rank's arrival")
    p.add_argument("--cost-dispatch", type=float, default=0.0,
                   help="the runtime's host time around each compute action, beyond the op itself")
    p.add_argument("--measure-dispatch", action="store_true",
                   help="measure --cost-dispatch on this machine first (the runtime's executor on a one-rank program "
                        "of near-free layers, one process; in seconds, so give the other costs in seconds too)")
    p.add_argument("--layer-idle-ms", type=float, default=0.0,
                   help="with --measure-dispatch: around layers that leave the core idle this long per op, then "
                        "compute --layer-busy-ms (layers that wait; the code after a wait runs on a cold core), as "
                        "the planner measures it from its profile; 0: near-free layers")
    p.add_argument("--layer-busy-ms", type=float, default=0.0,
                   help="with --layer-idle-ms: the compute after each wait")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage: 2 and 3 add the chunks' weight gathers (and 3 their releases) to the program")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="data-parallel size: gradient syncs span DP copies of the pipeline (priced "
                        "even for one stage replica); sharded weights per rank are 1/DP")
    p.add_argument("--keep-gathered", action="store_true",
                   help="ZeRO-3: keep a chunk's weights gathered from its first to its last compute")
    p.add_argument("--max-activations", type=float, help="with --schedule auto: peak activation limit")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--plot", help="write a Gantt chart PNG here")
    p.add_argument("--dump-program", help="write the lowered program (one op per line) here")


def _simulate_one(name: str, args, costs: Costs):
    if args.program:
        from .schedules.from_program import ProgramSchedule
        from .schedules.lowering import Program
        schedule = ProgramSchedule(Program.load(args.program), args.program)
    else:
        cls = registry.get(name)
        schedule = cls(args.stages, args.micro_batches, **_schedule_options(cls, args, costs))
    program = schedule.lower()
    if args.zero >= 2:
        from .schedules.sharding import shard
        program = shard(program, args.zero, reshard_after_forward=not args.keep_gathered)
    if args.dump_program:
        program.dump(args.dump_program)
    result = simulate(program, costs, chunks_per_rank=schedule.chunks_per_rank, data_parallel=args.data_parallel)
    return schedule, result


def _check_target(args) -> None:
    """Either a program file, or a schedule with its stages and micro-batches."""
    if args.program:
        given = [f"--{flag.replace('_', '-')}" for flag in ("schedule", "stages", "micro_batches", "chunks",
                                                            "pipelines", "order") if getattr(args, flag) is not None]
        if given:
            raise ValueError(f"--program takes its ranks, stages and micro-batches from the file; drop {given[0]}")
        return
    missing = [f"--{flag.replace('_', '-')}" for flag in ("schedule", "stages", "micro_batches")
               if getattr(args, flag) is None]
    if missing:
        raise ValueError(f"simulate needs --schedule, --stages and --micro-batches (or --program FILE); "
                         f"missing {', '.join(missing)}")


def cmd_schedules(args) -> int:
    schedules = registry.available()
    width = max(map(len, schedules))
    for name, cls in sorted(schedules.items()):
        origin = "" if cls.__module__.startswith("ds_chimera.") else f"  [{cls.__module__}]"
        print(f"{name:<{width}}  {cls.summary}{origin}")
    return 0


def cmd_kernels(args) -> int:
    """Kernel backends for the convolution ops and whether each can run on this machine."""
    import torch

    from .ops import backends
    found = backends.available_backends()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for name, backend in sorted(found.items()):
        status = []
        for device in devices:
            ok, why = backend.available(device)
            status.append(f"{device.type}: {'yes' if ok else 'no (' + why + ')'}")
        origin = "" if type(backend).__module__.startswith("ds_chimera.") else f"  [{type(backend).__module__}]"
        print(f"{name:<8} {getattr(backend, 'description', '')}{origin}")
        print(f"{'':<8} {'; '.join(status)}")
    for device in devices:
        print(f"default on {device.type}: {backends.select(device).name}"
              f"{' (forced by ' + backends.ENV_VAR + ')' if backends.os.environ.get(backends.ENV_VAR) else ''}")
    return 0


def cmd_simulate(args) -> int:
    _check_target(args)
    if args.data_parallel < 1:
        raise ValueError(f"--data-parallel must be >= 1, got {args.data_parallel}")
    for flag, value in (("--layer-idle-ms", args.layer_idle_ms), ("--layer-busy-ms", args.layer_busy_ms)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a finite number of milliseconds >= 0, got {value}")
        if value and not args.measure_dispatch:
            raise ValueError(f"{flag} shapes the layers --measure-dispatch measures around: add --measure-dispatch, "
                             f"or drop {flag}")
    if args.layer_busy_ms and not args.layer_idle_ms:
        raise ValueError("--layer-busy-ms is the compute after each wait of --layer-idle-ms: give --layer-idle-ms too")
    if args.measure_dispatch:
        from .planner.deepspeed import SHAPED_ROUNDS
        from .runtime.host_cost import measure_dispatch
        shaped = {"idle_s": args.layer_idle_ms / 1e3, "busy_s": args.layer_busy_ms / 1e3, "rounds": SHAPED_ROUNDS} \
            if args.layer_idle_ms else {}
        args.cost_dispatch = measure_dispatch(**shaped)
        around = (f"around layers idling {args.layer_idle_ms:g} ms, then computing {args.layer_busy_ms:g} ms"
                  if shaped else "around near-free layers")
        print(f"measured: the runtime's host time per compute action {args.cost_dispatch * 1e3:.3f} ms {around} "
              f"(--cost-dispatch {args.cost_dispatch:.6f})", file=sys.stderr)
    costs = Costs(**{name: getattr(args, f"cost_{name}") for name in COST_NAMES})
    if args.schedule == "auto":
        return _rank_all(args, costs)
    schedule, result = _simulate_one(args.schedule, args, costs)
    summary = result.summary()
    if getattr(schedule, "order", None) and "order" in schedule.options:
        summary["order"] = schedule.order
    if args.trace:
        from .sim.trace import write_trace
        write_trace(args.trace, result.records, schedule.placement, label=schedule.name)
    if args.plot:
        from .sim.plot import plot_gantt
        plot_gantt(result.records, schedule.placement, args.plot,
                   title=f"{schedule.name} D={schedule.ranks} N={schedule.micro_batches}"
                         f"{' order=' + schedule.order if 'order' in schedule.options else ''}: "
                         f"makespan {result.makespan:g}, bubble {result.bubble_ratio:.3f}")
    if not args.json:
        print(f"{schedule!r}")
        print(f"  valid            {result.valid}")
        print(f"  makespan         {result.makespan:g}   (ideal {result.ideal:g})")
        print(f"  bubble ratio     {result.bubble_ratio:.4f}")
        print(f"  busy per rank    {[round(b, 3) for b in result.busy]}")
        print(f"  peak activations {[round(a, 3) for a in result.peak_activations]}")
        print(f"  weights per rank {[round(w, 3) for w in result.weights_per_rank]}")
        if result.gathers:
            held = [round(w / args.data_parallel + g, 3) for w, g in zip(result.weights_per_rank, result.peak_gathered)]
            print(f"  gathers per step {result.gathers}")
            print(f"  weights held     {held}  (shards at DP={args.data_parallel} + the most gathered at once)")
        for err in result.errors[:10]:
            print(f"  error: {err}")
        for rank, why in result.deadlock.items():
            print(f"  deadlock: rank {rank} {why}")
    print(json.dumps(summary) if args.json else "", end="\n" if args.json else "")
    return 0 if result.valid else 1


def _rank_all(args, costs: Costs) -> int:
    """Every synchronous schedule with each option set the planner tries (chunks, Chimera's pipelines and
    orders), unit stages; a given --chunks / --pipelines narrows the sets."""
    from .planner.search import Setting, option_grid
    rows = []
    setting = Setting(stages=args.stages, micro_batches=args.micro_batches)
    for name, cls in sorted(registry.available().items()):
        if not cls.synchronous:
            continue
        fixed = _schedule_options(cls, args, costs, flags=("chunks", "pipelines"), strict=False)
        grids = [g for g in option_grid(cls, setting, num_layers=4 * args.stages)
                 if all(g.get(k, v) == v for k, v in fixed.items() if k != "costs")] or [{}]
        for options in grids:
            label = name + "".join(f" {k}={v}" for k, v in options.items())
            try:
                schedule = cls(args.stages, args.micro_batches, **{**fixed, **options})
            except ValueError as exc:
                rows.append((label, None, str(exc)))
                continue
            result = simulate(schedule.lower(), costs, chunks_per_rank=schedule.chunks_per_rank)
            peak = max(result.peak_activations)
            if args.max_activations is not None and peak > args.max_activations + 1e-9:
                rows.append((label, None, f"peak activations {peak:g} > limit {args.max_activations:g}"))
            else:
                rows.append((label, result, ""))
    fits = sorted((r for r in rows if r[1] is not None), key=lambda r: r[1].makespan)
    width = max((len(r[0]) for r in rows), default=10) + 2
    print(f"{'rank':<5}{'schedule':<{width}}{'makespan':>10}{'bubble':>9}{'peak act':>10}{'weights':>9}")
    for i, (name, result, _) in enumerate(fits, 1):
        print(f"{i:<5}{name:<{width}}{result.makespan:>10g}{result.bubble_ratio:>9.3f}"
              f"{max(result.peak_activations):>10g}{max(result.weights_per_rank):>9g}")
    for name, _, why in rows:
        if why:
            print(f"  -    {name:<{width}}excluded: {why}")
    if args.json:
        print(json.dumps({"ranking": [dict(r[1].summary(), schedule=r[0]) for r in fits]}))
    return 0 if fits else 1


def cmd_plan(args) -> int:
    """Plan from a saved profile: print the choice and runners-up, write the "pipeline" section."""
    from .planner import Budget, Profile, Setting, plan
    from .planner.memory import GIB
    if not args.profile:
        raise ValueError("plan needs --profile FILE: a profile a \"schedule\": \"auto\" run wrote (its profile_file), "
                         "or one from ds_chimera.planner.profile_sequential")
    try:
        profile = Profile.load(args.profile)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--profile {args.profile!r} cannot be read: {exc}") from None
    for flag in ("stages", "micro_batches"):
        if getattr(args, flag) is None or getattr(args, flag) < 1:
            raise ValueError(f"plan needs --{flag.replace('_', '-')} >= 1")
    if args.memory_limit_gb is not None and not args.memory_limit_gb > 0:
        raise ValueError(f"--memory-limit-gb must be > 0, got {args.memory_limit_gb}")
    if args.max_activations is not None and not args.max_activations >= 1:
        raise ValueError(f"--max-activations must be >= 1, got {args.max_activations}")
    setting = Setting(stages=args.stages, micro_batches=args.micro_batches, data_parallel=args.data_parallel,
                      precision=args.precision, zero=args.zero, checkpoint_interval=args.checkpoint_interval,
                      allow_asynchronous=args.allow_asynchronous)
    budget = Budget(None if args.memory_limit_gb is None else args.memory_limit_gb * GIB, args.max_activations)
    result = plan(profile, setting, budget, exhaustive=args.exhaustive)
    print(result.report(runners_up=args.runners_up))
    if result.chosen is None:
        return 1
    section = result.pipeline_section()
    if args.out:
        from .atomic import write_text_atomic
        write_text_atomic(args.out, json.dumps({"pipeline": section}, indent=1) + "\n")
        print(f"wrote {args.out}: merge its \"pipeline\" section into the DeepSpeed config")
    if args.json:
        print(json.dumps({"pipeline": section, "step_s": result.chosen.step_s,
                          "peak_bytes": result.chosen.peak_bytes}))
    return 0


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="a profile JSON (written by a \"schedule\": \"auto\" run's profile_file)")
    p.add_argument("--stages", type=int, help="pipeline ranks D")
    p.add_argument("--micro-batches", type=int, help="micro-batches per step N")
    p.add_argument("--data-parallel", type=int, default=1, help="data-parallel size")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    p.add_argument("--checkpoint-interval", type=int, default=0, help="activation_checkpoint_interval")
    p.add_argument("--memory-limit-gb", type=float, help="GiB per rank (default: no limit)")
    p.add_argument("--max-activations", type=float, help="micro-batches of activations a rank may hold")
    p.add_argument("--allow-asynchronous", action="store_true", help="consider PipeDream, 2BW, PipeOptim, SpecTrain")
    p.add_argument("--exhaustive", action="store_true", help="simulate every candidate that fits (no pruning)")
    p.add_argument("--runners-up", type=int, default=8, help="how many runners-up to print")
    p.add_argument("--out", help="write {\"pipeline\": the chosen section} here")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-chimera", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("schedules", help="list every schedule, entry-point plugins included")
    sub.add_parser("kernels", help="list the convolution kernel backends (torch, cpp, triton, plugins)")
    sub.add_parser("launch", help="run a DeepSpeed script with the schedule switch: "
                                  "ds-chimera launch [--torchrun] [--wavelet] [--pipeline-schedule NAME] LAUNCHER_ARGS... script.py ARGS...")
    _add_sim_args(sub.add_parser("simulate", help="simulate a schedule and report its metrics"))
    _add_plan_args(sub.add_parser("plan", help="plan the fastest schedule, options and layer cut that fit memory, "
                                               "from a profile of the model"))
    plot = sub.add_parser("plot", help="simulate and write a Gantt chart (same flags as simulate)")
    _add_sim_args(plot)
    memory = sub.add_parser("memory", help="peak memory per device: Wavelet's offset waves, gang-scheduled "
                                           "tasks, one task with the doubled batch")
    memory.add_argument("--static", type=float, required=True, help="memory a task always holds (any unit)")
    memory.add_argument("--activations", type=float, required=True, help="a task's activations at their peak")
    memory.add_argument("--fwd", type=float, default=1.0, help="forward time of one task")
    memory.add_argument("--bwd", type=float, default=2.0, help="backward time of one task")
    memory.add_argument("--offset", type=float, default=0.5, help="the second wave's delay, a fraction of a cycle")
    memory.add_argument("--json", action="store_true")
    return parser


def cmd_memory(args) -> int:
    from .sim.memory import TaskMemory, wavelet_memory
    if not 0 <= args.offset < 1:
        raise ValueError(f"--offset must be a fraction of a cycle in [0, 1), got {args.offset}")
    task = TaskMemory(args.static, args.activations, args.fwd, args.bwd)
    peaks = dict(wavelet_memory(task), offset_waves=task.two_tasks_peak(args.offset))
    if args.json:
        print(json.dumps(peaks))
        return 0
    print(f"one task: static {args.static:g} + activations {args.activations:g}, F {args.fwd:g}, B {args.bwd:g}")
    print(f"  two waves offset by {args.offset:g} cycle   {peaks['offset_waves']:g}")
    print(f"  two tasks gang-scheduled         {peaks['gang']:g}")
    print(f"  one task with the doubled batch  {peaks['doubled_batch']:g}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "launch":      # everything after "launch" belongs to the launcher
        from .launch import main as launch_main
        return launch_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "schedules":
            return cmd_schedules(args)
        if args.command == "kernels":
            return cmd_kernels(args)
        if args.command == "memory":
            return cmd_memory(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "plot" and not args.plot:
            args.plot = (os.path.splitext(os.path.basename(args.program))[0] + ".png" if args.program else
                         f"{args.schedule}_D{args.stages}_N{args.micro_batches}.png")
        return cmd_simulate(args)
    except ValueError as exc:
        print(f"ds-chimera: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
