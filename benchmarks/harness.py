"""What the multi-rank benchmarks (and the diagnostics in ``tools/``) share; they import it from here.

- **Launch**: a script re-runs itself under ``torch.distributed.run`` with ``--worker`` on a free
  port; rank 0 writes the rows as JSON to ``--out``; the launching process echoes the workers'
  result lines and reads the rows back (``launch``, ``save_rows``, ``report``).
- **One gloo transport device** per process, shared by every gloo group (``share_one_device``).
- **The timed model**: layers that sleep for their cost (``TimedLayer``), the DeepSpeed engine and
  configuration built on it, its micro-batches, and its layers' measured costs (``calibrate``).
- **Rows stepping in turn**: every row is built first, then the rows take one step each per round,
  and each row's median step is reported (``median_steps_in_turn``).
- **Costs measured apart from the steps**, for the simulator: P2P latency (ping-pong and to a rank
  that has waited), the runtime's host time per message, one data-parallel collective.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed.distributed_c10d as c10d
from torch import nn

COST_S = 0.020      # F = I = W of every rank's share of the timed model, per micro-batch
LAYERS = 8          # timed layers
MICRO = 1           # samples per micro-batch
WIDTH = 16
SPIN_S = 0.0005     # the last part of each cost is spun, not slept: 9 wake-ups in 10 come sooner than this


# ---- launch ------------------------------------------------------------------------------------

def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """The options every timed benchmark takes: ``--quick``, ``--worker``, ``--micro-batches``, ``--repeats``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--micro-batches", type=int, nargs="+")
    parser.add_argument("--repeats", type=int)
    return parser


def json_object(text: str) -> dict:
    """An argparse ``type``: a JSON object given on the command line (a schedule's options)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def launch(script: str, worker_args: list, out: str, keep, nproc: int = 4):
    """Run ``script --worker *worker_args --out out`` on ``nproc`` gloo ranks.

    Echoes the workers' result lines, those that start with one of the prefixes ``keep`` (or
    for which the callable ``keep`` is true), and any error line. Returns the rows rank 0
    saved; on failure prints the output's tail and returns None.
    """
    wanted = keep if callable(keep) else (lambda line: line.startswith(tuple(keep)))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), script, "--worker", *map(str, worker_args), "--out", out]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if wanted(line) or "Error" in line:
            print(line, flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-5000:])
        print(f"the workers failed (exit code {proc.returncode})", flush=True)
        return None
    with open(out) as fh:
        return json.load(fh)


def free_port() -> int:
    """A port no one listens on now: runs beside each other (tests, two benchmarks) need not share 29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def report(rows, summarise=None) -> int:
    """Launcher side: the exit code for ``rows`` (None when the workers failed). Prints the
    optional ``summarise(rows)``, then the rows as one JSON line (the scripts' last line)."""
    if rows is None:
        return 1
    if summarise is not None:
        summarise(rows)
    print(json.dumps(rows))
    return 0


def save_rows(dist, rows: list, out: str) -> None:
    """Worker side: rank 0 writes ``rows`` to ``out`` (whole or not at all), then every rank
    leaves the process group."""
    if dist.get_rank() == 0:
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rows, fh)
        os.replace(tmp, out)
    dist.barrier()
    dist.destroy_process_group()


# ---- one gloo transport device per process ---------------------------------------------------

_devices: list = []


def share_one_device() -> None:
    """Make every gloo process group created from now on in this process use one transport
    device. Safe to call twice. Call it before the default process group is created.

    torch gives each gloo process group its own TCP transport device, and each device runs an
    event-loop thread that wakes 100 times a second even when nothing is sent (a 10 ms
    ``epoll_wait``). A benchmark that keeps two dozen engines alive, each with its own groups,
    then has over a hundred such threads per rank: measured here with 50 idle groups, 5,700
    context switches a second per process against 100 with one shared device. On 2 cores
    shared by 4 ranks that steals time from whichever engine is stepping, the peers' included
    (``tools/idle_engines.py``). One real training job has a handful of groups, so the benchmarks
    give all groups one device: the rows then measure schedules and runtimes, not idle threads.
    """
    base = c10d.ProcessGroupGloo
    if getattr(base, "_shares_one_device", False):
        return

    class SharedDeviceGloo(base):
        """torch's gloo process group, built on this process's one shared device."""
        _shares_one_device = True

        def __init__(self, store, rank, size, timeout=None):
            options = base._Options()
            if timeout is not None:
                options._timeout = timeout
            if not _devices:
                _devices.append(base.create_default_device())
            options._devices = [_devices[0]]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


# ---- the timed model -------------------------------------------------------------------------

def hold_until(deadline: float, spin_s: float = SPIN_S) -> None:
    """Return at ``deadline`` (a perf_counter time): sleep most of the wait (freeing the core),
    spin the last ``spin_s``, yielding the core to any other runnable rank at each turn."""
    rest = deadline - time.perf_counter()
    if rest > spin_s:
        time.sleep(rest - spin_s)
    while time.perf_counter() < deadline:
        os.sched_yield()


def hold(seconds: float, spin_s: float = SPIN_S) -> None:
    """Take ``seconds`` of wall time, accurately."""
    hold_until(time.perf_counter() + seconds, spin_s)


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, igrad_s, spin_s):
        ctx.igrad_s, ctx.spin_s = igrad_s, spin_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        hold(ctx.igrad_s, ctx.spin_s)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, like, wgrad_s, spin_s):
        ctx.wgrad_s, ctx.spin_s = wgrad_s, spin_s
        return weight.expand_as(like).clone()

    @staticmethod
    def backward(ctx, grad):
        hold(ctx.wgrad_s, ctx.spin_s)
        return grad.sum().reshape(1), None, None, None


class TimedLayer(nn.Module):
    """A layer that sleeps for its cost: schedules, not the 2 CPU cores, are measured.

    Forward sleeps F; the input-grad path sleeps I; the weight-grad path sleeps W. They are
    separate autograd functions, so a fused backward pays I + W and a split backward pays
    each once, where the schedule puts it. Sleeping frees the cores, so 4 ranks on 2 cores
    measure the schedule and the runtime's own overhead.

    Each cost is held to a deadline, so a layer takes its nominal cost and not more: a plain
    ``time.sleep`` overshoots by its wake-up latency (0.15-0.5 ms per 10 ms on this VM,
    depending on the host's load), and the first Python code after a sleep runs slowly on a
    vCPU that went idle. The forward's deadline counts from the layer's entry, so its own
    autograd bookkeeping is inside F; each backward path's deadline counts from its entry.

    The spun tail is short (0.5 ms) and yields the core at every turn. Four ranks share two
    cores, so spinning ranks compete for them: with a 1 ms spin that did not yield, one hold
    in ten came back 0.4-0.5 ms late inside a pipeline step, and the timed layers, not the
    schedule or the runtime, cost the step 2-3% (``tools/step_breakdown.py``, chimera zero-bubble
    with two pipelines at N = 8: 1.095-1.099x ideal with that spin, 1.066-1.076x with this one).
    """
    spin_s = SPIN_S     # 0: plain sleeps, every core left free (for benchmarks whose communication needs CPU)

    def __init__(self, fwd_s: float, igrad_s: float, wgrad_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.costs = (fwd_s, igrad_s, wgrad_s)

    def forward(self, x):
        start = time.perf_counter()
        fwd_s, igrad_s, wgrad_s = self.costs
        out = _InputPath.apply(x, igrad_s, self.spin_s) + _WeightPath.apply(self.weight, x.detach(), wgrad_s,
                                                                           self.spin_s)
        hold_until(start + fwd_s, self.spin_s)
        return out


class EntryLayer(nn.Module):
    """The model's cost-free first layer, with a parameter (an embedding's place): the first
    timed layer's input-grad path is then needed, and paid, like every other stage's.

    Without it, the first stage's input-grad work would be free (nothing below its first timed
    layer needs a gradient), so every runtime would run stage 0 one I per micro-batch cheaper
    than the "ideal" and the simulator assume."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.weight


def model_specs(layer_spec, layer_s: float, layers: int) -> list:
    """The timed model as DeepSpeed layer specs: the entry layer, then ``layers`` timed layers
    of ``layer_s`` each for F, I and W. Cut it with ``partition_method="uniform"``: the entry
    layer then joins the first stage."""
    return [layer_spec(EntryLayer)] + [layer_spec(TimedLayer, layer_s, layer_s, layer_s) for _ in range(layers)]


def stage_layers(specs: list, stage: int, num_stages: int) -> list:
    """Built layers of ``stage``, cut as DeepSpeed's uniform partition cuts ``specs``."""
    from deepspeed.runtime.utils import partition_uniform
    bounds = partition_uniform(len(specs), num_stages)
    return [spec.build() for spec in specs[bounds[stage]:bounds[stage + 1]]]


def init_timed_model(device_per_group: bool = False):
    """Join the gloo process group and build the timed model's layer specs.

    Every gloo group of the process shares one transport device (``share_one_device``), unless
    ``device_per_group`` (torch's default). Returns (rank, world size, seconds per timed
    layer and op, specs): every rank's share of the LAYERS timed layers costs COST_S per op,
    behind the cost-free entry layer.
    """
    import torch.distributed as dist

    import deepspeed
    from deepspeed.pipe import LayerSpec

    if not device_per_group:
        share_one_device()
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    layer_s = COST_S * world / LAYERS
    return dist.get_rank(), world, layer_s, model_specs(LayerSpec, layer_s, LAYERS)


def timed_engine(specs: list, config: dict, module_cls=None, optimizer=None):
    """A DeepSpeed engine of the timed model: ``specs`` cut uniformly over every rank, MSE loss,
    SGD (lr 1e-3) unless ``optimizer``. With ds_chimera imported, ``config``'s "pipeline" key
    picks the schedule; without it DeepSpeed's own engine runs."""
    import torch.distributed as dist

    import deepspeed
    from deepspeed.pipe import PipelineModule

    net = (module_cls or PipelineModule)(layers=specs, num_stages=dist.get_world_size(), loss_fn=torch.nn.MSELoss(),
                                         partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=net, config=config,
                                           optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=1e-3)))
    return engine


def ds_config(n: int, schedule=None, trace_dir=None) -> dict:
    """DeepSpeed config for N micro-batches, with ds_chimera's ``(name, options)`` schedule if given."""
    cfg = {"train_batch_size": n * MICRO, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0}
    if schedule:
        cfg["pipeline"] = {"schedule": schedule[0], **schedule[1]}
        if trace_dir:
            cfg["pipeline"]["trace_dir"] = trace_dir
    return cfg


def label(name, options):
    """A schedule's row label: its name, then its options as key=value."""
    return name + ("" if not options else " " + ",".join(f"{k}={v}" for k, v in options.items()))


def random_batches(torch, width: int, n: int) -> list:
    """n (input, target) micro-batches of the timed model."""
    return [(torch.randn(MICRO, width), torch.randn(MICRO, width)) for _ in range(n)]


def calibrate(torch, layer_cls, layer_s, layers_per_rank, width, repeats=15):
    """Measured F, I and W of one rank's share of timed layers (sleep overshoot, autograd cost).

    One layer is timed alone, single process, and scaled by the layers per rank. The
    simulator is fed these, so measured/simulated isolates the runtime's own overhead.
    """
    layer = layer_cls(layer_s, layer_s, layer_s)
    f_t, i_t, w_t = [], [], []
    for _ in range(repeats):
        x = torch.randn(1, width, requires_grad=True)
        start = time.perf_counter()
        y = layer(x)
        mid = time.perf_counter()
        torch.autograd.grad(y, [x], grad_outputs=torch.ones_like(y), retain_graph=True)
        end = time.perf_counter()
        torch.autograd.grad(y, [layer.weight], grad_outputs=torch.ones_like(y))
        f_t.append(mid - start)
        i_t.append(end - mid)
        w_t.append(time.perf_counter() - end)
    values = torch.tensor([statistics.median(v) * layers_per_rank for v in (f_t, i_t, w_t)], dtype=torch.float64)
    torch.distributed.broadcast(values, 0)
    return tuple(float(v) for v in values)


def loss_cost(torch, layer_cls, layer_s, loss, width, repeats=15):
    """Measured time of ``loss(output)`` right after a timed layer's forward, as the planner's profile closes a
    model's last layer with its loss (rank 0's median, on every rank).

    The loss is the model's work, not the runtime's, so neither ``calibrate`` nor the runtime's host time per
    action holds it. It is small, but it runs just after the layer's sleep, on a cold core
    (``tools/cold_core.py``): a 16-element MSE loss then takes a few hundred microseconds, not ten.
    """
    layer = layer_cls(layer_s, layer_s, layer_s)
    times = []
    for _ in range(repeats):
        out = layer(torch.randn(1, width, requires_grad=True))
        start = time.perf_counter()
        loss(out)
        times.append(time.perf_counter() - start)
    value = torch.tensor([statistics.median(times)], dtype=torch.float64)
    torch.distributed.broadcast(value, 0)
    return float(value)


# ---- rows stepping in turn -------------------------------------------------------------------

def median_steps_in_turn(dist, steps: list, repeats: int) -> list:
    """Median wall time of each of ``steps`` on all ranks, after one warm-up round.

    The steps take turns, one call each per round, so a burst of load on this shared host
    hits every row alike instead of whichever row was running then. Each round takes the rows in
    another order (seeded by the round, so every rank agrees): no row always follows the same one
    (a step right after a long one, or first after the warm-up, can run differently).
    """
    import random
    for step in steps:
        step()
    times = [[] for _ in steps]
    for round_ in range(repeats):
        for i in random.Random(round_).sample(range(len(steps)), len(steps)):
            step = steps[i]
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def median_step(dist, step, repeats: int) -> float:
    """Median wall time of ``step`` on all ranks (barriers around each), after one warm-up call."""
    return median_steps_in_turn(dist, [step], repeats)[0]


def process_groups() -> set:
    """The process groups that exist now (torch's registry of them)."""
    return set(c10d._world.pg_map)


def release_groups(dist, keep: set) -> None:
    """Destroy every process group created since ``keep`` was taken, on every rank in one order.

    An engine that lives on, even idle, slows the others' steps: its gloo groups keep their
    threads (``tools/idle_engines.py`` measured 1-5% beside 25 idle engines). Each N's rows are
    released before the next N's are built, so they do not pile up across N.
    """
    import gc

    for group in [g for g in c10d._world.pg_map if g not in keep and g is not c10d.GroupMember.WORLD]:
        dist.destroy_process_group(group)
    gc.collect()


# ---- costs measured apart from the steps -----------------------------------------------------

def p2p_latency(dist, torch, rank, rounds=200):
    """Median one-way latency of a small tensor between ranks 0 and 1 (half a round trip)."""
    buf = torch.zeros(16)
    times = []
    dist.barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    value = torch.tensor([statistics.median(times) if rank == 0 else 0.0])
    dist.broadcast(value, 0)
    return float(value)


def p2p_waiting_latency(dist, torch, rank, idle_s: float, rounds=40):
    """Median one-way latency, ranks 0 -> 1, to a receiver that has been waiting ``idle_s``.

    The pipeline's critical path runs through ranks waiting for their input. A thread that
    has slept that long wakes far more slowly on this VM than one in a ping-pong loop, so
    this, not the ping-pong figure, is the latency a waiting rank sees. The sender stamps
    each message with ``time.perf_counter()`` (CLOCK_MONOTONIC, shared by the processes of
    one machine) and the receiver subtracts it from its own clock on arrival.
    """
    stamp = torch.zeros(1, dtype=torch.float64)
    delays = []
    dist.barrier()
    for _ in range(rounds):
        if rank == 0:
            time.sleep(idle_s)
            stamp[0] = time.perf_counter()
            dist.send(stamp, 1)
        elif rank == 1:
            dist.recv(stamp, 0)
            delays.append(time.perf_counter() - float(stamp[0]))
    value = torch.tensor([statistics.median(delays) if delays else 0.0], dtype=torch.float64)
    dist.all_reduce(value)                         # only rank 1 measured
    return float(value)


def p2p_host_costs(dist, torch, rank, rounds=100):
    """Median host time of the runtime's own P2P per message, ranks 0 -> 1.

    Returns (send, receive, late receive): posting one send; posting one receive ahead of
    need and taking it once its data has arrived (what the executor does); and, for
    comparison, taking an arrived message whose receive is posted only then. Measured apart
    from any step, so the simulator that uses them is not fitted to the steps.
    """
    from ds_chimera.runtime.p2p import P2P
    from ds_chimera.schedules.actions import Message

    p2p = P2P(lambda p: p, torch.device("cpu"), 2, 60.0)
    p2p.max_pending = 4 * rounds        # later phases' sends wait for receives taken after a barrier
    payload = torch.randn(MICRO, 16)
    sends, preposts, takes, late = [], [], [], []
    messages = [Message("act", 0, 1, i) for i in range(3 * rounds + 1)]
    if rank == 0:
        p2p.send(messages[0], 1, payload)          # the edge's one header goes first
    elif rank == 1:
        p2p.recv(messages[0], 0, "warm-up")
    phases = [range(1 + k * rounds, 1 + (k + 1) * rounds) for k in range(3)]
    for phase, ids in enumerate(phases):
        if rank == 1 and phase < 2:                # the executor posts receives ahead of need
            for i in ids:
                start = time.perf_counter()
                p2p.prepost(messages[i], 0, "timing")
                preposts.append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            for i in ids:
                if phase == 0:                         # spaced out: each send is timed alone
                    time.sleep(0.002)
                start = time.perf_counter()
                p2p.send(messages[i], 1, payload)
                if phase == 0:
                    sends.append(time.perf_counter() - start)
        elif rank == 1 and phase == 0:
            for i in ids:
                p2p.recv(messages[i], 0, "timing")
        dist.barrier()
        if rank == 1 and phase > 0:                # every message of the phase has been sent
            for i in ids:
                time.sleep(0.001)
                start = time.perf_counter()
                p2p.recv(messages[i], 0, "timing")
                (takes if phase == 1 else late).append(time.perf_counter() - start)
    p2p.flush()
    median = statistics.median
    values = torch.tensor([median(sends) if sends else 0.0, median(preposts) + median(takes) if takes else 0.0,
                           median(late) if late else 0.0], dtype=torch.float64)
    dist.all_reduce(values)                        # rank 0 measured the first, rank 1 the others
    dist.barrier()
    return tuple(float(v) for v in values)


def collective_buffers(dist, torch, group, numel) -> tuple:
    """(full, shard) buffers of a chunk of ``numel`` floats for a collective over ``group``."""
    size = dist.get_world_size(group)
    full = torch.zeros(numel - numel % size)
    return full, torch.zeros(full.numel() // size)


def timed_collective(dist, group, kind: str, full, shard) -> float:
    """Seconds one collective (``gather``, ``reduce_scatter`` or ``all_reduce``) takes from its post on."""
    start = time.perf_counter()
    if kind == "gather":
        dist.all_gather_into_tensor(full, shard, group=group)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full, group=group)
    else:
        dist.all_reduce(full, group=group)
    return time.perf_counter() - start
