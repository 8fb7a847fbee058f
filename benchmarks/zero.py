"""Breadth-first with sharded data parallelism: ZeRO-3 against ZeRO-1, memory and step time.

    python benchmarks/zero.py             # N in {4, 8}
    python benchmarks/zero.py --quick     # N = 4, fewer repeats
    python benchmarks/zero.py --runs 3    # three launches; each row's median and range over them
    python benchmarks/zero.py --op-ms 80 --ballast-mib 8   # 4x longer ops and weights: this host's
                                          # fixed-size stalls a quarter of the share (RESULTS)
    python benchmarks/zero.py --rows interleaved:1 interleaved:3 --no-fsdp --cpu-load 4
                                          # some rows, with CPU load beside each rank (a diagnostic)

Four CPU ranks: 2 pipeline stages x 2 data-parallel, 4 chunks per rank. The timed model
(``harness.TimedLayer``) with weights that cost something to move: each timed layer (one per
chunk) carries a ballast parameter of ``--ballast-mib`` MiB. Every rank's share costs
F = I = W = 20 ms per micro-batch, plus what the ballast's gradient costs. For each row it
prints the median step / ideal, the chunk all-gathers per step, and the simulator's
prediction of the same program with costs measured in the run: from three traced steps, a
chunk's mean forward and backward and the runtime's mean host time around each action; from
the timed steps, the host's mean time in the optimizer step, in each gradient-sync post and in
each all-gather post, the mean time from a rank's all-gather post to its data-parallel peer's
(0 for the later one), and the global norm's collective (median, the last rank's); apart from
the steps, the all-gather of one chunk, the gradient reduce-scatter or all-reduce, the P2P
latency to a waiting rank and the host's time per message. Then the ZeRO-3 / ZeRO-1 step ratio
of breadth-first, and the memory each rank holds for ZeRO-0/1/2/3 (weights, gradients,
optimizer state at their peaks, and the activations autograd saved). torch.distributed.pipelining's
LoopedBFS with FSDP2 runs beside them where it runs on gloo; the row says why where it does not.
The last line is a JSON object with every row.
"""
import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (COST_S, LAYERS, MICRO, WIDTH, EntryLayer, TimedLayer, benchmark_parser,  # noqa: E402
                     collective_buffers, launch, median_step, median_steps_in_turn, p2p_host_costs,
                     p2p_waiting_latency, process_groups, release_groups, report, save_rows, share_one_device,
                     stage_layers, timed_collective)

CHUNKS = 4             # the LAYERS timed layers over 2 stages x 4 chunks: one per chunk
STAGES, DP = 2, 2

ROWS = [("breadth-first", 1), ("breadth-first", 2), ("breadth-first", 3), ("interleaved", 1), ("interleaved", 3)]


def ballast_layer_class():
    """A timed layer with ``numel`` extra weights (all of them get a gradient, as real weights do)."""
    import torch

    class BallastLayer(TimedLayer):
        def __init__(self, fwd_s, igrad_s, wgrad_s, numel):
            super().__init__(fwd_s, igrad_s, wgrad_s)
            self.ballast = torch.nn.Parameter(torch.zeros(numel))

        def forward(self, x):
            return super().forward(x) + self.ballast[:1] * 0      # the ballast's gradient: numel zeros
    return BallastLayer


def row_arg(text: str) -> tuple:
    """A row given as SCHEDULE:ZERO (``--rows interleaved:3``)."""
    schedule, _, zero = text.partition(":")
    if schedule not in ("breadth-first", "interleaved") or zero not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"a row is SCHEDULE:ZERO with SCHEDULE breadth-first or interleaved and "
                                         f"ZERO 0-3, got {text!r}")
    return schedule, int(zero)


@contextlib.contextmanager
def cpu_load(copies: int, period_s: float = 0.005):
    """A diagnostic: a thread that every ``period_s`` copies and adds ``copies`` pairs of 2 MiB
    tensors, CPU load beside the rank's work (docs/investigations/zero3-simulator-gap.md)."""
    import threading

    import torch
    if copies <= 0:
        yield
        return
    stop = threading.Event()

    def burn():
        a, b = torch.zeros(2 ** 19), torch.zeros(2 ** 19)
        while not stop.wait(period_s):
            for _ in range(copies):
                a.copy_(b)
                b.add_(1.0)
    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def timed_specs(cost_s: float, numel: int) -> list:
    """The benchmark's model: the cost-free entry layer, then LAYERS timed layers of ``numel``
    ballast weights each, every rank's share costing ``cost_s`` per op and micro-batch."""
    from deepspeed.pipe import LayerSpec

    layer_s = cost_s * STAGES / LAYERS
    ballast = ballast_layer_class()
    return [LayerSpec(EntryLayer)] + [LayerSpec(ballast, layer_s, layer_s, layer_s, numel) for _ in range(LAYERS)]


def build_engine(specs, schedule: str, zero: int, n: int):
    """A DeepSpeed engine of ``specs`` running ``schedule`` at ZeRO ``zero`` with N = ``n``."""
    import torch

    import deepspeed
    from deepspeed.pipe import PipelineModule
    cfg = {"train_batch_size": n * MICRO * DP, "train_micro_batch_size_per_gpu": MICRO,
           "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
           "pipeline": {"schedule": schedule, "chunks": CHUNKS, "timeout": 600}}
    if zero:
        cfg["zero_optimization"] = {"stage": zero}
        cfg["zero_allow_untested_optimizer"] = True
    net = PipelineModule(layers=specs, num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    return deepspeed.initialize(model=net, config=cfg, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4))[0]


def chunk_numel(numel: int) -> int:
    """Floats in one chunk's weights: its timed layers' ballast and their own weight each."""
    return (LAYERS // (CHUNKS * STAGES)) * (numel + 1)


def data_parallel_group(dist):
    """This rank's data-parallel pair, numbered as DeepSpeed's grid numbers them (every rank
    creates every pair's group, in the same order, as collective creation requires)."""
    mine = None
    for stage in range(STAGES):
        members = [stage * DP + k for k in range(DP)]
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def make_batches(n: int) -> list:
    """N micro-batches of (input, target), the same in every row and on every rank."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [(torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)) for _ in range(n)]


def worker(args):
    import torch
    import torch.distributed as dist

    import deepspeed
    import ds_chimera  # noqa: F401
    from ds_chimera.schedules.costs import Costs
    from ds_chimera.schedules.sharding import gathers_per_rank
    from ds_chimera.sim.simulator import simulate

    share_one_device()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    stages, dp = STAGES, DP
    cost_s = args.op_ms / 1e3
    numel = int(args.ballast_mib * 2 ** 20 / 4)
    trace_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), ".zero_traces")
    specs = timed_specs(cost_s, numel)
    rows = []
    chunk_bytes = chunk_numel(numel) * 4
    engine_for = functools.partial(build_engine, specs)

    # the costs the simulations use, measured apart from the steps
    dp_group = data_parallel_group(dist)
    gather_s = collective_time(dist, torch, dp_group, chunk_bytes // 4, "gather")
    scatter_s = collective_time(dist, torch, dp_group, chunk_bytes // 4, "reduce_scatter")
    # the reduce-scatter as the step meets it: after a chunk's backward of N micro-batches, each member's own
    backward_s = 2 * cost_s / CHUNKS
    scatter_after = {n: collective_after_compute(dist, torch, dp_group, chunk_bytes // 4, "reduce_scatter", n,
                                                 backward_s) for n in args.micro_batches}
    allreduce_s = collective_time(dist, torch, dp_group, chunk_bytes // 4, "all_reduce")
    waiting_s = p2p_waiting_latency(dist, torch, rank, idle_s=cost_s)     # to a rank that waited for its input
    send_s, recv_s, _ = p2p_host_costs(dist, torch, rank)
    if rank == 0:
        print(f"  costs: one chunk ({chunk_bytes / 2 ** 20:.1f} MiB) all-gather {gather_s * 1e3:.1f} ms, "
              f"reduce-scatter {scatter_s * 1e3:.1f} ms, all-reduce {allreduce_s * 1e3:.1f} ms; p2p latency to "
              f"a waiting rank {waiting_s * 1e3:.2f} ms, host time per send {send_s * 1e3:.3f} ms, per receive "
              f"{recv_s * 1e3:.3f} ms; reduce-scatter after a chunk's backward (partner's lag included) "
              + ", ".join(f"{s * 1e3:.1f} ms at N = {n}" for n, s in scatter_after.items()), flush=True)

    for n in args.micro_batches:
        keep = process_groups()
        engines, steps = [], []
        with cpu_load(args.cpu_load):     # 0 (the default): no load
            for schedule, zero in args.rows:
                engine = engine_for(schedule, zero, n)
                batches = make_batches(n)
                posts = []      # when each all-gather was posted: the data-parallel peers' skew
                spent = {name: timed(owner, name) for owner, name in (
                    (engine.optimizer, "step"), (engine.host, "start_grad_sync"), (engine.host, "clip_gradients"),
                    (engine.executor, "run"))}
                spent["gather_weights"] = timed(engine.host, "gather_weights", posts)
                engines.append((schedule, zero, engine, spent, posts))
                steps.append(lambda e=engine, b=batches: e.train_batch(iter(b)))
            times = median_steps_in_turn(dist, steps, args.repeats)
            for (schedule, zero, engine, spent, posts), step_s in zip(engines, times):
                ideal = n * 3 * cost_s
                program = engine.plan.program
                # the first step (the warm-up round: allocations, the optimizer state's creation) left out
                timed_steps = {name: values[len(values) // (args.repeats + 1):] for name, values in spent.items()}
                median = {name: statistics.median(values) if values else 0.0 for name, values in timed_steps.items()}
                # host work the step adds up: its mean, this host's stalls included
                mean = {name: statistics.mean(values) if values else 0.0 for name, values in timed_steps.items()}
                # the global norm's own time: the last rank to arrive waits for nobody
                clip_s = reduced(dist, torch, median["clip_gradients"], dist.ReduceOp.MIN)
                skew_s = post_skew(dist, posts[len(posts) // (args.repeats + 1):], dp_group)
                program_s = reduced(dist, torch, median["run"], dist.ReduceOp.MAX)
                # one chunk's forward and backward, in stage units
                fwd, bwd, gaps = traced_costs(engine, make_batches(n), trace_dir, send_s)
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, gaps)         # some ranks have no such pair (a gather between)
                every = [gap for mine in every for gap in mine]
                dispatch = statistics.mean(every) if every else 0.0
                costs = Costs(fwd=fwd, bwd=bwd, wgrad=bwd / 2, gather=gather_s * CHUNKS,
                              gather_post=mean["gather_weights"], gather_skew=skew_s,
                              allreduce=(scatter_after[n] if zero >= 2 else allreduce_s), comm=waiting_s, send=send_s,
                              recv=recv_s, sync_post=mean["start_grad_sync"], clip=clip_s,
                              step=mean["step"] / engine.placement.size / CHUNKS, dispatch=max(dispatch, 0.0))
                sim = simulate(program, costs, data_parallel=dp)
                row = {"schedule": schedule, "zero": zero, "N": n, "step_s": step_s, "vs_ideal": step_s / ideal,
                       "gathers": gathers_per_rank(program)[engine.pipe_rank] if zero >= 2 else 0,
                       "sim_s": sim.makespan, "measured_vs_sim": step_s / sim.makespan, "program_s": program_s,
                       "program_vs_sim": program_s / sim.makespan, "around_program_s": step_s - program_s,
                       "costs": costs.__dict__}
                rows.append(row)
                if rank == 0:
                    print(f"  zero N={n} {schedule} ZeRO-{zero}: {row['vs_ideal']:.3f} x ideal, {row['gathers']} "
                          f"gathers/step, measured/simulated: step {row['measured_vs_sim']:.3f}, program "
                          f"{row['program_vs_sim']:.3f} (the engine around the program "
                          f"{row['around_program_s'] * 1e3:.1f} ms; host time per action {costs.dispatch * 1e3:.2f} "
                          f"ms, per gather post {costs.gather_post * 1e3:.2f} ms, peers' post skew "
                          f"{costs.gather_skew * 1e3:.2f} ms)", flush=True)
        if args.fsdp:
            rows.append(fsdp_looped_bfs(torch, dist, rank, n, specs, stages, dp, make_batches, args.repeats, cost_s))
        del engines, steps
        release_groups(dist, keep)
    if args.memory:
        rows.extend(memory_rows(torch, dist, rank, engine_for, make_batches, dp_group))
    save_rows(dist, rows, args.out)


def timed(owner, name: str, starts: list | None = None) -> list:
    """Wrap ``owner.name`` (the optimizer's step, the host's gradient-sync post and clip, the executor's
    run of the program) to record how long each call takes on the host (seconds), and when each
    began in ``starts`` if given."""
    times, call = [], getattr(owner, name)

    def timed_call(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        times.append(time.perf_counter() - start)
        if starts is not None:
            starts.append(start)
        return out
    setattr(owner, name, timed_call)
    return times


def post_skew(dist, posts: list, dp_group) -> float:
    """Mean over every rank's all-gather posts of the time to the latest data-parallel peer's post of
    the same gather, 0 where the rank is the latest (the members run one program, so each one's k-th
    post is the same chunk's).
    ``perf_counter`` reads CLOCK_MONOTONIC, one clock for every process on this host."""
    peers = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(peers, posts, group=dp_group)
    counts = [len(p) for p in peers]
    paired = len(set(counts)) == 1
    # a mismatch goes to every rank, so all of them raise instead of the others waiting below
    waits = [max(p[k] for p in peers) - mine for k, mine in enumerate(posts)] if paired else counts
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (paired, waits))
    unequal = [theirs for ok, theirs in every if not ok]
    if unequal:
        raise RuntimeError(f"data-parallel peers posted different numbers of gathers: {unequal}")
    every = [wait for _, mine in every for wait in mine]
    return statistics.mean(every) if every else 0.0


def reduced(dist, torch, value: float, op) -> float:
    """``value`` reduced over every rank with ``op`` (MIN, MAX)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return float(tensor)


def traced_costs(engine, batches, trace_dir, send_s: float, steps: int = 3) -> tuple:
    """(forward, backward) of one chunk per micro-batch, in stage units: means over ``steps`` traced
    steps' actions (a makespan adds durations up, so the mean is what predicts it, the sleeps'
    overshoot and a sharded chunk's gradient buffer, made at its first backward of a step,
    included); and the runtime's host time around each action: the gaps between two consecutive
    actions with nothing between them that can wait (only sends, each ``send_s`` of host time,
    taken off), less a sharded action's wait for its chunk's gathered weights (the simulator
    prices the gather). Returns (forward, backward, gaps)."""
    from ds_chimera.schedules.actions import Action, Gather
    from ds_chimera.sim.trace import free_gaps
    ops = engine.plan.program.ops[engine.pipe_rank]
    actions = [op for op in ops if type(op) is Action]
    sharded = any(type(op) is Gather for op in ops)
    fwds, bwds, gaps = [], [], []
    os.makedirs(trace_dir, exist_ok=True)
    untraced = engine.plan.config           # a PipelineConfig is immutable: the traced steps run on a copy
    traced = dataclasses.replace(untraced, trace_dir=trace_dir)
    for _ in range(steps):
        with timed_calls(engine.host, ("wait_weights",)) as spent:
            engine.plan.config = traced
            try:
                engine.train_batch(iter(batches))
            finally:
                engine.plan.config = untraced
        # the executor waits for the chunk's weights before every action of a sharded program
        before = spent["wait_weights"] if sharded else [0.0] * len(actions)
        if len(before) != len(actions):
            raise RuntimeError("the executor's weight waits no longer match the program's actions: "
                               "traced_costs must follow executor.StepRun._action")
        records = engine.executor.records
        fwds += [end - start for _, kind, _, _, start, end in records if kind == "F"]
        bwds += [end - start for _, kind, _, _, start, end in records if kind == "B"]
        gaps += [gap - sends * send_s - before[index] for index, gap, sends in free_gaps(ops, records)]
    size = engine.placement.size
    return statistics.mean(fwds) / size, statistics.mean(bwds) / size, gaps


@contextlib.contextmanager
def timed_calls(owner, names):
    """Time each call of ``owner``'s methods ``names`` within the block: {name: [seconds, ...]}.
    The methods are the owner's own again afterwards."""
    own = {name: owner.__dict__.get(name) for name in names}     # an instance attribute already, or None
    spent = {name: timed(owner, name) for name in names}
    try:
        yield spent
    finally:
        for name, previous in own.items():
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def collective_time(dist, torch, group, numel, kind, rounds=10) -> float:
    """Median time of one collective of ``numel`` floats over ``group`` (both members), apart from any step."""
    full, shard = collective_buffers(dist, torch, group, numel)
    times = []
    for _ in range(rounds + 1):
        dist.barrier(group=group)
        times.append(timed_collective(dist, group, kind, full, shard))
    return statistics.median(times[1:])


def collective_after_compute(dist, torch, group, numel, kind, slices, slice_s, rounds=20) -> float:
    """Mean time from a member's own post of a collective to its end, when each member first computed
    on its own (``slices`` timed sleeps of ``slice_s``, as the timed layers do), like a rank that posts
    a chunk's reduce-scatter after its backward: the data-parallel partner's lag is part of it. The
    collective alone (:func:`collective_time`) misses that lag; the step pays it at every sync."""
    full, shard = collective_buffers(dist, torch, group, numel)
    waits = []
    for _ in range(rounds + 1):
        dist.barrier(group=group)
        for _ in range(slices):
            time.sleep(slice_s)
        waits.append(timed_collective(dist, group, kind, full, shard))
    mean = torch.tensor([statistics.mean(waits[1:])], dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    return float(mean) / dist.get_world_size(group)


def fsdp_looped_bfs(torch, dist, rank, n, specs, stages, dp, data, repeats, cost_s) -> dict:
    """torch.distributed.pipelining's LoopedBFS with FSDP2 over the data-parallel pairs, if it runs on gloo."""
    row = {"schedule": "torch LoopedBFS + FSDP2", "zero": 3, "N": n}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed import pipelining as pp

        mesh = init_device_mesh("cpu", (dp, stages), mesh_dim_names=("dp", "pp"))
        pp_rank = mesh["pp"].get_local_rank()
        modules = []
        for s in range(pp_rank, CHUNKS * stages, stages):
            module = torch.nn.Sequential(*stage_layers(specs, s, CHUNKS * stages))
            fully_shard(module, mesh=mesh["dp"])
            modules.append((s, module))
        pipe_stages = [pp.PipelineStage(m, s, CHUNKS * stages, torch.device("cpu"), group=mesh["pp"].get_group())
                       for s, m in modules]
        schedule = pp.ScheduleLoopedBFS(pipe_stages, n_microbatches=n, loss_fn=torch.nn.MSELoss())
        params = [p for _, m in modules for p in m.parameters()]
        opt = torch.optim.Adam(params, lr=1e-4)
        batch = data(n)
        x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])

        def step():
            opt.zero_grad()
            schedule.step(*((x,) if pp_rank == 0 else ()), **({"target": y} if pp_rank == stages - 1 else {}))
            opt.step()
        step_s = median_step(dist, step, repeats)
        row.update(step_s=step_s, vs_ideal=step_s / (n * 3 * cost_s))
        if rank == 0:
            print(f"  zero N={n} torch LoopedBFS + FSDP2: {row['vs_ideal']:.3f} x ideal", flush=True)
    except Exception as exc:           # report, never hide: the row says why it is missing
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if rank == 0:
            print(f"  zero N={n} torch LoopedBFS + FSDP2: does not run here ({row['error']})", flush=True)
    return row


def memory_rows(torch, dist, rank, engine_for, data, dp_group) -> list:
    """Bytes each rank holds under ZeRO-0/1/2/3 (breadth-first, DP = 2, Adam): weights, gradients and
    optimizer state at their peaks over a step, and the activations autograd saved."""
    rows, zero1_together = [], None
    for zero in (0, 1, 2, 3):
        engine = engine_for("breadth-first", zero, 4)
        saved = {"now": 0, "peak": 0}

        def pack(t):
            saved["now"] += t.numel() * t.element_size()
            saved["peak"] = max(saved["peak"], saved["now"])
            return t

        def unpack(t):
            saved["now"] -= t.numel() * t.element_size()
            return t
        batches = data(4)
        engine.train_batch(iter(batches))          # the optimizer state exists from the first step on
        shards = engine.host.shards
        if shards is not None:
            shards.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            engine.train_batch(iter(batches))
        state = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim())
        if zero == 1:       # ZeRO-1 keeps fp32 master partitions besides the state
            state += sum(t.numel() * t.element_size() for t in engine.optimizer.single_partition_of_fp32_groups)
        if shards is not None:
            weights = shards.peak["gathered_weights"] + shards.peak["shards"]
            grads = shards.peak["grads"] + sum(s.shard.numel() * 4 for s in shards.by_chunk.values())
            together = shards.peak["total"]        # weights and gradients held at the same moment
            chunk = max(s.nbytes for s in shards.by_chunk.values())
            # each chunk's flat buffer is padded to a multiple of DP elements: the shards' share of that
            padding = sum(s.nbytes - sum(p.numel() * 4 for p in s.params) for s in shards.by_chunk.values())
        else:
            params = [p for p in engine.module.parameters()]
            weights = sum(p.numel() * p.element_size() for p in params)
            grads = weights       # a full gradient per weight until the step
            together, chunk, padding = weights + grads, 0, 0
        row = {"memory": True, "zero": zero, "rank": rank, "weights": weights, "grads": grads, "optimizer": state,
               "activations": saved["peak"], "weights_and_grads": together, "chunk": chunk,
               "padding": padding}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        if rank == 0:
            worst = {k: max(g[k] for g in gathered)
                     for k in ("weights", "grads", "optimizer", "activations", "weights_and_grads", "chunk",
                               "padding")}
            print(f"  memory ZeRO-{zero}: weights {worst['weights'] / 2 ** 20:.1f} MiB, grads "
                  f"{worst['grads'] / 2 ** 20:.1f} MiB, optimizer {worst['optimizer'] / 2 ** 20:.1f} MiB, "
                  f"activations {worst['activations'] / 2 ** 10:.1f} KiB; weights + grads at once "
                  f"{worst['weights_and_grads'] / 2 ** 20:.1f} MiB (largest rank)", flush=True)
            if zero == 1:
                zero1_together = worst["weights_and_grads"]
            if zero == 3:
                dp = dist.get_world_size(dp_group)
                # weights and gradients: each rank's shard of both is 1/DP of the padded buffers
                bound = (zero1_together + 2 * worst["padding"]) / dp + 2 * worst["chunk"]
                print(f"  memory ZeRO-3 bound: 1/DP of ZeRO-1's weights + grads (each chunk padded to a multiple "
                      f"of DP elements: {2 * worst['padding'] // dp} bytes) plus two chunks' gathered weights = "
                      f"{bound} bytes ({bound / 2 ** 20:.1f} MiB); held {worst['weights_and_grads']} bytes: "
                      f"{'met' if worst['weights_and_grads'] <= bound else 'NOT met'}", flush=True)
        rows.append(row)
    return rows


def main():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--ballast-mib", type=float, default=2.0, help="extra weights per timed layer")
    parser.add_argument("--op-ms", type=float, default=COST_S * 1e3,
                        help="F = I = W per rank and micro-batch, in ms: a longer op leaves this host's fixed-size "
                             "stalls a smaller share of the step")
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--rows", type=row_arg, nargs="+", default=ROWS, metavar="SCHEDULE:ZERO",
                        help="the rows to time (default: all five)")
    parser.add_argument("--no-fsdp", dest="fsdp", action="store_false", help="leave out torch's LoopedBFS + FSDP2")
    parser.add_argument("--cpu-load", type=int, default=0, metavar="K",
                        help="diagnostic: a thread per rank copying K pairs of 2 MiB tensors every 5 ms during the "
                             "rows, to see what CPU load does to the prediction")
    parser.add_argument("--runs", type=int, default=1,
                        help="launch the whole measurement this many times (this host's load drifts between "
                             "runs) and summarise each row over them")
    parser.add_argument("--out", default="benchmarks/zero_results.json")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    args.micro_batches = args.micro_batches or ([4] if args.quick else [4, 8])
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.worker:
        return worker(args)
    if not args.op_ms > 0:
        parser.error(f"--op-ms must be > 0, got {args.op_ms}")
    print(f"2 stages x 2 data-parallel, F = I = W = {args.op_ms:g} ms per rank and micro-batch, "
          f"{args.ballast_mib:g} MiB per timed layer", flush=True)
    if args.cpu_load < 0:
        parser.error(f"--cpu-load must be >= 0, got {args.cpu_load}")
    worker_args = ["--repeats", args.repeats, "--micro-batches", *args.micro_batches,
                   "--ballast-mib", args.ballast_mib, "--op-ms", args.op_ms, "--cpu-load", args.cpu_load,
                   "--rows", *(f"{s}:{z}" for s, z in args.rows)] + ([] if args.memory else ["--no-memory"]) \
        + ([] if args.fsdp else ["--no-fsdp"])
    rows = []
    for run in range(args.runs):
        if args.runs > 1:
            print(f"run {run + 1} of {args.runs}", flush=True)
        got = launch(__file__, worker_args, args.out, ("  zero", "  memory", "  costs"))
        if got is None:
            return report(None)
        rows += [dict(row, run=run) for row in got]
    if args.runs > 1:
        with open(args.out, "w") as fh:
            json.dump(rows, fh)
    return report(rows, summarise)


def summarise(rows):
    timed = [r for r in rows if "step_s" in r and "memory" not in r]
    runs = sorted({r.get("run", 0) for r in timed})
    for run in runs:
        mine = [r for r in timed if r.get("run", 0) == run]
        for n in sorted({r["N"] for r in mine}):
            by = {(r["schedule"], r["zero"]): r for r in mine if r["N"] == n}
            one, three = by.get(("breadth-first", 1)), by.get(("breadth-first", 3))
            if one and three:
                print(f"run {run + 1}, N={n}: breadth-first ZeRO-3 / ZeRO-1 step = "
                      f"{three['step_s'] / one['step_s']:.3f}")
        for key, what in (("measured_vs_sim", "step"), ("program_vs_sim", "program")):
            sims = [r[key] for r in mine if key in r]
            if sims:
                print(f"run {run + 1}: measured/simulated {what}: {min(sims):.3f} to {max(sims):.3f}")
    if len(runs) > 1:            # each row over the runs: median [lowest, highest]
        print("over the runs, median [range]: step / ideal; measured / simulated step")
        for key in sorted({(r["N"], r["schedule"], r["zero"]) for r in timed}):
            same = [r for r in timed if (r["N"], r["schedule"], r["zero"]) == key]
            cells = []
            for field in ("vs_ideal", "measured_vs_sim"):
                values = sorted(r[field] for r in same if field in r)
                if values:
                    cells.append(f"{statistics.median(values):.3f} [{values[0]:.3f}, {values[-1]:.3f}]")
            print(f"  N={key[0]} {key[1]} ZeRO-{key[2]}: " + "; ".join(cells))


if __name__ == "__main__":
    sys.exit(main() or 0)
