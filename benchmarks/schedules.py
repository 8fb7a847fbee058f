"""Schedules on the timed model, side by side with DeepSpeed's and torch's own.

    python benchmarks/schedules.py            # N in {4, 8, 16}
    python benchmarks/schedules.py --quick    # N = 8, fewer repeats

Four CPU ranks (gloo). Every rank's share of the model costs F = I = W = 20 ms per
micro-batch (8 timed layers, 2 per rank; 1 per chunk for 2-chunk schedules; a cost-free
entry layer first, see ``harness.TimedLayer``). For each
schedule it prints the median step time over ideal = N * (F + I + W), and the simulator's
prediction for the same program: with nominal costs, "calibrated" (the layers' measured costs
and the ping-pong latency) and "full" (also the latency to a rank that has been waiting, the
runtime's per-message host time, its host time per compute action (the planner's
``runtime.host_cost.measure_dispatch``), and the time of a gradient sync over the program's replica
groups from its last member's post and the host time of that post (the planner's
``planner.links.sync_after_wait``), each measured apart from the
steps, just before and just after each N's rows; the mean of the two is used). In the same
invocation it runs DeepSpeed's stock TrainSchedule (1F1B) and DualPipeV engines,
torch.distributed.pipelining's GPipe, 1F1B, LoopedBFS, Interleaved1F1B, InterleavedZeroBubble, ZBV and DualPipeV
schedules on the same layers, and a few schedules through ds_chimera's Megatron-Core
contract (``ds_chimera.megatron``).
For each N every row is built first, then the rows take turns, one step each per round, so
a burst of load on the shared host hits them alike.
The last line is a JSON object with every row.
"""
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (COST_S, LAYERS, MICRO, WIDTH, TimedLayer, benchmark_parser, calibrate, ds_config,  # noqa: E402
                     init_timed_model, label, launch, loss_cost, median_steps_in_turn, p2p_host_costs, p2p_latency,
                     p2p_waiting_latency, process_groups, random_batches, release_groups, report, save_rows,
                     stage_layers, timed_engine)

OURS = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"chunks": 2}), ("breadth-first", {"chunks": 2}),
        ("chimera", {"order": "concat"}), ("chimera", {"order": "merged"}), ("chimera", {"order": "forward-doubling"}),
        ("chimera", {"order": "zero-bubble"}), ("chimera", {"order": "zero-bubble", "pipelines": 2}),
        ("zb-h1", {}), ("zbv", {}), ("dualpipev", {})]
# the same runtime behind Megatron-Core's forward-backward contract (ds_chimera.megatron)
MEGATRON = [("1f1b", {}), ("interleaved", {"chunks": 2}), ("chimera", {"order": "merged"}),
            ("chimera", {"order": "zero-bubble"}), ("zb-h1", {}), ("zbv", {})]
SYNC_NUMEL = 3                # a timed chunk's gradients: one element per layer
MSE = torch.nn.MSELoss()      # every row's loss (DeepSpeed's loss_fn, the Megatron rows' loss function)


def megatron_loss(target):
    """The Megatron rows' loss function, which their forward_step returns: the loss, and its detached copy for the
    logged dict."""
    return lambda out: (MSE(out, target), {"loss": MSE(out, target).detach()})


# each runtime's loss on the last stage, given the target (the full simulation adds it to that stage's forward)
LOSSES = {"ds_chimera": lambda target: (lambda out: MSE(out, target)), "ds_chimera.megatron": megatron_loss}
PEERS = [("deepspeed", "TrainSchedule (1F1B)"), ("deepspeed", "DualPipeV"),
         ("torch", "GPipe"), ("torch", "1F1B"), ("torch", "LoopedBFS"), ("torch", "Interleaved1F1B"),
         ("torch", "InterleavedZeroBubble"), ("torch", "ZBVZeroBubble"), ("torch", "DualPipeV")]


def wanted(args, text: str) -> bool:
    """Whether ``--only`` (if given) selects the row labelled ``text``."""
    return not args.only or any(text.startswith(prefix) for prefix in args.only)


def worker(args):
    import ds_chimera  # noqa: F401
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    from ds_chimera.planner.links import sync_after_wait
    from ds_chimera.runtime.host_cost import measure_dispatch
    from ds_chimera.sim import Costs, simulate

    rank, world, layer_s, specs = init_timed_model()
    rows = []
    # the replica groups the programs sync over: Chimera's stage pairs (s, D-1-s), or every rank
    pair_groups = {tuple(sorted((r, world - 1 - r))): None for r in range(world)}
    for ranks in pair_groups:
        pair_groups[ranks] = dist.new_group(list(ranks))      # collective: every rank, same order

    def measure_costs(when: str, megatron: bool) -> dict:
        """The costs the simulations use, measured now, apart from any step."""
        latency = p2p_latency(dist, torch, rank)
        waiting = p2p_waiting_latency(dist, torch, rank, idle_s=layer_s)
        send_s, recv_s, late_recv_s = p2p_host_costs(dist, torch, rank)
        mine = next(ranks for ranks in pair_groups if rank in ranks)
        # a stage's gradient sync as a step meets it (the planner's links measure it so): a timed chunk's gradients
        pair_s, pair_post = sync_after_wait(dist, pair_groups[mine], SYNC_NUMEL, layer_s, 30, torch.device("cpu"))
        world_s, world_post = sync_after_wait(dist, None, SYNC_NUMEL, layer_s, 30, torch.device("cpu"))
        f_s, i_s, w_s = calibrate(torch, TimedLayer, layer_s, LAYERS // world, WIDTH)
        # the last stage's loss after its forward: DeepSpeed's loss_fn, and the Megatron rows' loss function
        target = torch.randn(MICRO, WIDTH)
        losses = {runtime: loss_cost(torch, TimedLayer, layer_s, LOSSES[runtime](target), WIDTH) for runtime in LOSSES}
        # the runtime's host time per compute action, every rank at once, the mean: around near-free layers (the
        # planner's measurement, a warm core) and around the timed layers, which sleep: the code after each of
        # their sleeps runs on a cold core, as it does in the steps (host_cost's docstring); the second is priced
        dispatch = torch.tensor([measure_dispatch(), measure_dispatch(rounds=9, layer=lambda: TimedLayer(
            layer_s, layer_s, layer_s))], dtype=torch.float64)
        dist.all_reduce(dispatch)
        warm_dispatch_s, dispatch_s = (dispatch / world).tolist()
        megatron_dispatch_s = megatron_dispatch(world, rank, layer_s) if megatron else 0.0
        if rank == 0:
            print(f"  measured {when}: one-way p2p latency {latency * 1e3:.2f} ms ping-pong, {waiting * 1e3:.2f} ms to "
                  f"a rank that has waited {layer_s * 1e3:.0f} ms; P2P host time per message: send "
                  f"{send_s * 1e3:.3f} ms, receive posted early {recv_s * 1e3:.3f} ms (posted when needed "
                  f"{late_recv_s * 1e3:.3f} ms); gradient sync over 2 ranks {pair_s * 1e3:.2f} ms, over "
                  f"{world} {world_s * 1e3:.2f} ms to every member, its post {pair_post * 1e3:.3f} / "
                  f"{world_post * 1e3:.3f} ms; timed-layer costs per rank share: F {f_s * 1e3:.2f} ms, "
                  f"I {i_s * 1e3:.2f} ms, W {w_s * 1e3:.2f} ms (nominal {COST_S * 1e3:.0f} each); the runtime's "
                  f"host time per compute action {dispatch_s * 1e3:.3f} ms around the timed layers "
                  f"({warm_dispatch_s * 1e3:.3f} ms around near-free ones; {megatron_dispatch_s * 1e3:.3f} ms through the "
                  f"Megatron contract); the loss after the last stage's forward "
                  + ", ".join(f"{seconds * 1e3:.3f} ms ({runtime})" for runtime, seconds in losses.items()), flush=True)
        return {"latency": latency, "waiting": waiting, "send": send_s, "recv": recv_s, "f": f_s, "i": i_s, "w": w_s,
                "allreduce_2": pair_s, f"allreduce_{world}": world_s, "sync_post_2": pair_post,
                f"sync_post_{world}": world_post, "dispatch_ds_chimera": dispatch_s, "warm_dispatch": warm_dispatch_s,
                "dispatch_ds_chimera.megatron": megatron_dispatch_s,
                **{f"loss_{runtime}": seconds for runtime, seconds in losses.items()}}

    def data(n):
        return random_batches(torch, WIDTH, n)

    def engine_step(config, module_cls=None):
        engine = timed_engine(specs, config, module_cls)
        batch = data(n)
        return engine, (lambda: engine.train_batch(iter(batch)))

    def peer_row(runtime, name, why):       # report, never hide: the row says why it is missing
        rows.append({"runtime": runtime, "schedule": name, "N": n, "error": repr(why)[:200]})
        if rank == 0:
            print(f"  {runtime:<10} {name:<28} N={n:<3} failed: {why!r}"[:240], flush=True)

    for n in args.micro_batches:
        ideal = n * 3 * COST_S
        groups_before = process_groups()      # this N's engines' groups are released after its rows
        entries = []       # (runtime, schedule label, step, lowered program or None): every row of this N
        for name, options in OURS:
            if not wanted(args, label(name, options)) or (name == "dualpipev" and n < 2 * world) or \
                    (name == "interleaved" and n % world):
                continue
            engine, step = engine_step(ds_config(n, (name, options)))
            entries.append(("ds_chimera", label(name, options), step, engine.plan.program))
        for name, options in MEGATRON:
            if not wanted(args, label(name, options)) or (args.only and "megatron" not in args.only) or \
                    (name == "interleaved" and n % world):
                continue
            step, program = megatron_contract_step(name, options, n, specs, world, rank, data)
            entries.append(("ds_chimera.megatron", label(name, options), step, program))
        for runtime, name in PEERS:
            if not wanted(args, name) or ("DualPipeV" in name and n < 2 * world) or \
                    (name in ("Interleaved1F1B", "InterleavedZeroBubble") and n % world):
                continue
            try:
                if runtime == "deepspeed":
                    _, step = engine_step(ds_config(n), DualPipeVModule if name == "DualPipeV" else None)
                else:
                    step = torch_pipelining_step(name, n, specs, world, rank, data)
                step()                   # warm-up here, so a peer that cannot run is reported, not fatal
            except Exception as exc:
                peer_row(runtime, name, exc)
                continue
            entries.append((runtime, name, step, None))
        if rank == 0:
            print(f"  timing {len(entries)} rows at N={n}: {args.repeats} rounds, the rows taking turns", flush=True)
        megatron = any(entry[0] == "ds_chimera.megatron" for entry in entries)
        before = measure_costs(f"before the N={n} rows", megatron)
        medians = median_steps_in_turn(dist, [entry[2] for entry in entries], args.repeats)
        after = measure_costs(f"after the N={n} rows", megatron)
        # the host's load drifts: the simulations use the mean of the costs measured around the rows
        cost = {key: (before[key] + after[key]) / 2 for key in before}
        calibrated_costs = Costs(fwd=cost["f"], bwd=cost["i"] + cost["w"], wgrad=cost["w"], comm=cost["latency"])

        def full_costs(program, runtime):
            """(Costs, StageCosts) of the full simulation: the last stage's forward also computes the loss."""
            size = sync_group_size(program)       # syncs over 2 ranks (Chimera's pairs) or over every rank
            measured = 2 if size == 2 else world
            sync = {name: cost[f"{name}_{measured}"] if size > 1 else 0.0 for name in ("allreduce", "sync_post")}
            costs = Costs(fwd=cost["f"], bwd=cost["i"] + cost["w"], wgrad=cost["w"], comm=cost["waiting"],
                          send=cost["send"], recv=cost["recv"], dispatch=cost[f"dispatch_{runtime}"], **sync)
            return costs, with_loss(costs, program.placement, cost[f"loss_{runtime}"])
        for (runtime, name, _, program), median in zip(entries, medians):
            row = {"runtime": runtime, "schedule": name, "N": n, "step_s": median, "vs_ideal": median / ideal}
            if program is None:
                rows.append(row)
                if rank == 0:
                    print(f"  {runtime:<10} {name:<28} N={n:<3} {median / ideal:6.3f} x ideal", flush=True)
                continue
            sim0 = simulate(program, Costs(fwd=COST_S, bwd=2 * COST_S, wgrad=COST_S)).makespan
            sim = simulate(program, calibrated_costs).makespan
            program_full_costs, program_stage_costs = full_costs(program, runtime)
            sim_full = simulate(program, program_full_costs, stage_costs=program_stage_costs).makespan
            row.update({"sim_nocomm_vs_ideal": sim0 / ideal, "sim_vs_ideal": sim / ideal, "measured_vs_sim": median / sim,
                        "sim_full_vs_ideal": sim_full / ideal, "measured_vs_sim_full": median / sim_full,
                        "latency_s": cost["latency"], "waiting_latency_s": cost["waiting"], "send_s": cost["send"],
                        "recv_s": cost["recv"], "allreduce_s": program_full_costs.allreduce,
                        "sync_post_s": program_full_costs.sync_post, "dispatch_s": cost[f"dispatch_{runtime}"],
                        "loss_s": cost[f"loss_{runtime}"], "layer_costs_s": [cost["f"], cost["i"], cost["w"]]})
            rows.append(row)
            if rank == 0:
                shown = "ds_chimera" if runtime == "ds_chimera" else "megatron  "
                print(f"  {shown} {name:<28} N={n:<3} {median / ideal:6.3f} x ideal"
                      f"  (simulated: nominal {sim0 / ideal:5.3f}, calibrated {sim / ideal:5.3f}, full "
                      f"{sim_full / ideal:5.3f}; measured/calibrated {median / sim:5.3f}, "
                      f"/ full {median / sim_full:5.3f})", flush=True)
        entries = engine = step = program = None
        release_groups(dist, groups_before)
    save_rows(dist, rows, args.out)


def with_loss(costs, placement, loss_s: float):
    """Every stage's costs as ``costs`` gives them, the last stage's forward with the loss added (StageCosts)."""
    from ds_chimera.schedules.costs import StageCosts
    from ds_chimera.schedules.actions import BACKWARD, FORWARD, WEIGHT_GRAD

    stages, size = placement.num_stages, placement.size
    fwd = [costs.of(FORWARD) * size] * stages
    fwd[-1] += loss_s
    return StageCosts(fwd=fwd, bwd=[costs.of(BACKWARD) * size] * stages, wgrad=[costs.of(WEIGHT_GRAD) * size] * stages,
                      activations=[size] * stages)


def sync_group_size(program) -> int:
    """The most ranks any gradient sync of ``program`` spans (1: the program has none)."""
    from ds_chimera.schedules.actions import SyncStart
    return max((len(set(op.ranks)) for ops in program.ops for op in ops if type(op) is SyncStart), default=1)


def megatron_dispatch(world: int, rank: int, layer_s: float, rounds: int = 9) -> float:
    """The Megatron rows' host time per compute action: what ``runtime.host_cost.measure_dispatch`` measures for
    the DeepSpeed rows, through the Megatron contract (its host's per-forward work, the forward_step function,
    its loss bookkeeping): the contract's call on a one-rank zbv program (every rank its own one-rank pipeline,
    all at once), one timed layer per chunk behind the cost-free entry layer, less the layers' own costs and
    the loss. Every rank's, the mean."""
    import ds_chimera.megatron as dsm
    from ds_chimera.runtime.host_cost import PROGRAM, time_per_action

    from harness import EntryLayer

    name, ranks, n = PROGRAM
    singles = [dist.new_group([r]) for r in range(world)]          # collective: every rank makes every group
    collection = type("OneRankPipeline", (), {"pp": singles[rank]})()
    forward_backward = dsm.get_forward_backward_func(name)
    placement = forward_backward.config.build_schedule(ranks, n).placement
    timed = lambda: TimedLayer(layer_s, layer_s, layer_s)      # noqa: E731
    chunks = []
    for c in placement.chunks_on(0):
        stage = placement.chunks[c].stage
        layers = ([EntryLayer()] if stage == 0 else []) + [timed()]
        chunk = megatron_chunk(layers, stage)
        chunk._ds_chimera_stage, chunk._ds_chimera_built_for = stage, (name, {})
        chunks.append(chunk)
    batch = random_batches(torch, WIDTH, n)
    last = placement.num_stages - 1

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        return model(x), megatron_loss(y) if model.stage == last else None

    def call():
        forward_backward(forward_step_func=forward_step, data_iterator=iter(batch), model=chunks, num_microbatches=n,
                         seq_length=1, micro_batch_size=MICRO, pg_collection=collection)
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
    value = torch.tensor([time_per_action(call, timed, WIDTH, torch.device("cpu"), rounds)], dtype=torch.float64)
    dist.all_reduce(value)
    for group in singles:
        dist.destroy_process_group(group)
    return float(value) / world


def megatron_chunk(layers, stage):
    """A model chunk with Megatron's chunk interface (``set_input_tensor``) over ``layers``."""
    class TimedChunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.stage, self.input = torch.nn.Sequential(*layers), stage, None

        def set_input_tensor(self, tensors):
            self.input = tensors[0]

        def forward(self, x):
            return self.layers(self.input if self.input is not None else x)
    return TimedChunk()


def megatron_contract_step(name, options, n, specs, world, rank, data):
    """One step through ds_chimera.megatron's forward-backward function on the same timed layers.

    The chunks follow Megatron's model-chunk interface (``set_input_tensor``); the step is
    the forward-backward call plus the optimizer step, as in Megatron's training loop.
    """

    import ds_chimera.megatron as dsm
    from ds_chimera.schedules.lowering import without_global_clip

    forward_backward = dsm.get_forward_backward_func(name, **options)
    schedule = forward_backward.config.build_schedule(world, n)
    placement = schedule.placement
    last = placement.num_stages - 1
    chunks = []
    for c in placement.chunks_on(rank):
        stage = placement.chunks[c].stage
        chunk = megatron_chunk(stage_layers(specs, stage, placement.num_stages), stage)
        # the tags build_model_chunks puts on the chunks it builds (these are not a Megatron provider's)
        chunk._ds_chimera_stage, chunk._ds_chimera_built_for = stage, (name, dict(options))
        chunks.append(chunk)
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-3)
    batch = data(n)
    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        out = model(x)
        return out, megatron_loss(y) if model.stage == last else None

    def step():
        forward_backward(forward_step_func=forward_step, data_iterator=iter(batch), model=chunks,
                         num_microbatches=n, seq_length=1, micro_batch_size=MICRO)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, without_global_clip(schedule.lower())     # the program the contract runs (Megatron clips)


def torch_pipelining_step(name, n, specs, world, rank, data):
    """One training step of torch.distributed.pipelining's schedule ``name`` on the same layers."""
    from torch import nn
    from torch.distributed import pipelining as pp

    looped = name in ("LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble")
    vshape = name in ("ZBVZeroBubble", "DualPipeV")
    num_stages = 2 * world if (looped or vshape) else world
    if looped:
        mine = [rank, rank + world]
    elif vshape:
        mine = [rank, 2 * world - 1 - rank]
    else:
        mine = [rank]
    stages, params = [], []
    for s in mine:
        torch.manual_seed(s)
        module = nn.Sequential(*stage_layers(specs, s, num_stages))
        params += list(module.parameters())
        stages.append(pp.PipelineStage(module, s, num_stages, torch.device("cpu")))
    loss_fn = nn.MSELoss()
    cls = {"GPipe": pp.ScheduleGPipe, "1F1B": pp.Schedule1F1B, "LoopedBFS": pp.ScheduleLoopedBFS,
           "Interleaved1F1B": pp.ScheduleInterleaved1F1B, "InterleavedZeroBubble": pp.ScheduleInterleavedZeroBubble,
           "ZBVZeroBubble": pp.ScheduleZBVZeroBubble,
           "DualPipeV": pp.ScheduleDualPipeV}[name]
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=n, loss_fn=loss_fn)
    opt = torch.optim.SGD(params, lr=1e-3)
    batch = data(n)
    x = torch.cat([b[0] for b in batch])
    y = torch.cat([b[1] for b in batch])
    first = any(s == 0 for s in mine)
    last = any(s == num_stages - 1 for s in mine)

    def step():
        opt.zero_grad()
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": []} if last else {}
        schedule.step(*args, **kwargs)
        opt.step()
    return step


def main():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--out", default="benchmarks/schedules_results.json")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only the rows whose schedule label starts with one of these (e.g. zbv 1f1b TrainSchedule)")
    args = parser.parse_args()
    args.micro_batches = args.micro_batches or ([8] if args.quick else [4, 8, 16])
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.worker:
        return worker(args)
    print(f"4 ranks, F = I = W = {COST_S * 1e3:.0f} ms per rank and micro-batch; ratios are median step / ideal",
          flush=True)
    worker_args = ["--repeats", args.repeats, "--micro-batches", *args.micro_batches] + \
        (["--only", *args.only] if args.only else [])
    return report(launch(__file__, worker_args, args.out,
                         ("  ds_chimera", "  megatron", "  deepspeed", "  torch", "  measured", "  timing")), summarise)


def summarise(rows):
    ok = [r for r in rows if "vs_ideal" in r]
    for n in sorted({r["N"] for r in ok}):
        best = min((r for r in ok if r["N"] == n and r["runtime"] == "ds_chimera"), key=lambda r: r["vs_ideal"],
                   default=None)
        stock = [r for r in ok if r["N"] == n and r["schedule"].startswith("TrainSchedule")]
        line = f"N={n}: " + (f"best ds_chimera {best['schedule']} {best['vs_ideal']:.3f} x ideal" if best else "")
        if stock:
            line += f"; DeepSpeed stock 1F1B {stock[0]['vs_ideal']:.3f} x ideal"
            chim = [r for r in ok if r["N"] == n and r["schedule"].startswith("chimera")]
            if chim:
                fastest = min(chim, key=lambda r: r["step_s"])
                line += f"; {fastest['schedule']} throughput / stock 1F1B = {stock[0]['step_s'] / fastest['step_s']:.2f}"
        print(line)
    worst = max((r["measured_vs_sim"] for r in ok if "measured_vs_sim" in r), default=float("nan"))
    worst_full = max((r["measured_vs_sim_full"] for r in ok if "measured_vs_sim_full" in r), default=float("nan"))
    print(f"worst measured/simulated over ds_chimera rows: {worst:.3f} (calibrated: compute and ping-pong latency), "
          f"{worst_full:.3f} (full: also a waiting rank's latency, the per-message and per-action host time, the gradient "
          f"sync and its post)")


if __name__ == "__main__":
    sys.exit(main() or 0)
