"""Programs as data: the whole step in the program, printed and read back, proven, run locally.

The lowered program ends with the gradient syncs' wait, the clip and the optimizer step
(asynchronous ones have them before each stage's step); its text form round-trips for
every built-in schedule; the simulator refuses programs that skip those ops; the local
reference runs every single-route program on the shared executor, equal to one-process
training; and the package's imports only flow downwards.
"""
import ast
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from ds_chimera.schedules import build, registry
from ds_chimera.schedules.actions import (ACT, Action, Clip, ClipScope, Comm, SyncStart, Kind, Message,
                                          Step, SyncWait, parse_op)
from ds_chimera.schedules.costs import Costs
from ds_chimera.schedules.lowering import Program
from ds_chimera.sim.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [("gpipe", 4, 6, {}), ("1f1b", 4, 8, {}), ("interleaved", 2, 4, {"chunks": 2}),
         ("breadth-first", 2, 4, {"chunks": 3}), ("chimera", 4, 8, {}), ("chimera", 8, 8, {"pipelines": 2}),
         ("chimera", 4, 4, {"order": "zero-bubble"}), ("zb-h1", 4, 8, {}), ("zbv", 4, 8, {}),
         ("dualpipev", 4, 8, {}), ("pipedream", 4, 8, {}), ("pipedream-2bw", 4, 8, {}), ("pipeoptim", 4, 8, {}),
         ("spectrain", 4, 8, {})]


def test_every_op_prints_and_parses_back():
    ops = [Action(Kind.FORWARD, 12, 3), Action(Kind.WEIGHT_GRAD, 0, 10), Action(Kind.STAGE_STEP, 2, 7),
           Comm((Message(ACT, 0, 1, 3), Message("grad", 5, 4, 0)), ()), Comm((), (Message(ACT, 1, 2, 9),)),
           SyncStart(2, (1, 2)), SyncWait((0, 3)), Clip(ClipScope.GLOBAL), Clip(ClipScope.STAGE, 2),
           Step((0, 7))]
    texts = [str(op) for op in ops]
    assert texts[0] == "12F3" and texts[5] == "SYNC_START stage=2 ranks=1,2" and texts[8] == "CLIP scope=stage stage=2"
    assert [parse_op(t) for t in texts] == ops
    assert Action.parse(" 2I0 ") == (Kind.INPUT_GRAD, 2, 0) and Kind.INPUT_GRAD == "I"


@pytest.mark.parametrize("text,message", [("2X0", "not a compute action: '2X0'"), ("F2", "not a compute action"),
                                          ("SYNC_WAIT", "lacks the field 'stages'"),
                                          ("COMM send=act:0-1:3 recv=", "not a message: 'act:0-1:3'"),
                                          ("CLIP scope=sometimes", "'sometimes' is not a valid ClipScope"),
                                          ("STEP chunks", "expected key=value, got 'chunks'")])
def test_malformed_ops_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_op(text)


@pytest.mark.parametrize("name,d,n,options", CASES)
def test_the_program_is_the_whole_step_and_round_trips(name, d, n, options):
    schedule = build(name, d, n, **options)
    program = schedule.lower()
    for rank, ops in enumerate(program.ops):
        chunks = tuple(schedule.placement.chunks_on(rank))
        if schedule.synchronous:      # one flush: wait for the syncs, clip on the global norm, step every chunk
            assert ops[-3:] == [SyncWait(tuple(sorted({schedule.placement.chunks[c].stage for c in chunks}))),
                                Clip(ClipScope.GLOBAL), Step(chunks)]
        else:                         # each stage steps alone: its sync, its wait, its own clip, then S
            steps = [i for i, op in enumerate(ops) if type(op) is Action and op.kind == Kind.STAGE_STEP]
            assert steps
            for i in steps:
                stage = schedule.placement.chunks[ops[i].chunk].stage
                assert [type(op) for op in ops[i - 3:i]] == [SyncStart, SyncWait, Clip]
                assert ops[i - 1] == Clip(ClipScope.STAGE, stage) and ops[i - 2] == SyncWait((stage,))
    loaded = Program.load(program.dump())
    assert loaded.ops == program.ops and loaded.name == program.name and loaded.synchronous == program.synchronous
    assert loaded.placement.stage_ranks == program.placement.stage_ranks
    assert loaded.placement.mb_replica == program.placement.mb_replica and loaded.weights == program.weights
    costs = Costs(fwd=1.0, bwd=2.0, wgrad=1.0, comm=0.1, allreduce=0.5)
    assert simulate(loaded, costs).summary() == simulate(program, costs).summary()


def test_program_files_name_the_bad_line(tmp_path):
    text = build("1f1b", 2, 2).lower().dump()
    path = tmp_path / "p.program"
    path.write_text(text.replace("rank 1\n", "rank 1\n0Q1\n"))
    with pytest.raises(ValueError, match=r"p.program:\d+: not a compute action: '0Q1'"):
        Program.load(str(path))
    with pytest.raises(ValueError, match="missing ds_chimera-program, name"):
        Program.load("ranks 2\nstages 2\n")
    with pytest.raises(ValueError, match="expected 'rank 1', got 'rank 2'"):
        Program.load(text.replace("rank 1\n", "rank 2\n"))


def _without(program, kinds):
    ops = [[op for op in rank_ops if type(op) not in kinds] for rank_ops in program.ops]
    return Program(program.name, program.placement, ops, program.synchronous, program.weights)


def test_the_simulator_refuses_a_step_without_its_tail():
    program = build("chimera", 4, 4).lower()
    assert simulate(program).valid
    no_step = simulate(_without(program, {Step}))
    assert any("never steps the optimizer on chunks" in e for e in no_step.errors)
    no_wait = simulate(_without(program, {SyncWait}))
    assert any("steps the optimizer while the gradient syncs of stages" in e for e in no_wait.errors)
    # one rank without the global clip: the others wait for it forever
    ops = [list(o) for o in program.ops]
    ops[2] = [op for op in ops[2] if type(op) is not Clip]
    stuck = simulate(Program(program.name, program.placement, ops, True, program.weights))
    assert not stuck.valid and any("waits for every rank to reach its global clip" in why
                                   for why in stuck.deadlock.values())
    asynchronous = build("pipeoptim", 4, 8).lower()
    no_wait = simulate(_without(asynchronous, {SyncWait}))
    assert any("still pending (no SYNC_WAIT before it)" in e for e in no_wait.errors)


def test_cli_simulates_a_program_file_like_its_schedule(tmp_path):
    path = tmp_path / "zbv.program"
    run = [sys.executable, "-m", "ds_chimera.cli", "simulate"]
    direct = subprocess.run(run + ["--schedule", "zbv", "--stages", "4", "--micro-batches", "8", "--json",
                                   "--dump-program", str(path)], capture_output=True, text=True)
    assert direct.returncode == 0, direct.stderr
    loaded = subprocess.run(run + ["--program", str(path), "--json"], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    import json
    a, b = json.loads(direct.stdout.splitlines()[-1]), json.loads(loaded.stdout.splitlines()[-1])
    assert a["makespan"] == b["makespan"] and a["valid"] and b["valid"] and a["busy"] == b["busy"]
    both = subprocess.run(run + ["--program", str(path), "--stages", "4"], capture_output=True, text=True)
    assert both.returncode == 2 and "--program takes its ranks, stages and micro-batches from the file" in both.stderr
    neither = subprocess.run(run + ["--stages", "4"], capture_output=True, text=True)
    assert neither.returncode == 2 and "missing --schedule, --micro-batches" in neither.stderr


def test_a_loaded_program_must_fit_the_run(tmp_path):
    from ds_chimera.schedules.from_program import ProgramSchedule
    path = tmp_path / "c.program"
    build("chimera", 4, 8).lower().dump(str(path))
    assert ProgramSchedule.from_file(str(path), 4, 8).lower().ops == Program.load(str(path)).ops
    with pytest.raises(ValueError, match="a program for 4 pipeline ranks; this run has 2"):
        ProgramSchedule.from_file(str(path), 2, 8)
    with pytest.raises(ValueError, match="runs 8 micro-batches per step; the config's batch sizes give 4"):
        ProgramSchedule.from_file(str(path), 4, 4)
    build("pipeoptim", 4, 8).lower().dump(str(path))
    with pytest.raises(ValueError, match="is asynchronous; the engines run loaded programs only when"):
        ProgramSchedule.from_file(str(path), 4, 8)


# ---- the local reference: every single-route program on the shared executor -------------------------
@pytest.mark.parametrize("name,options", [("1f1b", {}), ("gpipe", {}), ("interleaved", {"chunks": 2}),
                                          ("breadth-first", {"chunks": 2}), ("zb-h1", {}), ("zbv", {}),
                                          ("dualpipev", {})])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_local_pipeline_equals_one_process_training(name, options, clip):
    """Unclipped and clipped (the global norm over every stage): a wrong gradient scale fails unclipped."""
    from ds_chimera.runtime.local import LocalPipeline
    torch.manual_seed(0)
    schedule = registry.build(name, 2, 4, **options)
    stages = [nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(schedule.placement.num_stages)]
    reference = copy.deepcopy(nn.Sequential(*stages))
    pipe = LocalPipeline(schedule, stages, [torch.optim.SGD(m.parameters(), lr=0.5) for m in stages],
                         nn.functional.mse_loss, clip=clip)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        batches = [(torch.randn(3, 5), torch.randn(3, 5)) for _ in range(4)]
        loss = pipe.train_batch(batches)
        ref_opt.zero_grad()
        ref_loss = sum(nn.functional.mse_loss(reference(x), y) for x, y in batches) / 4
        ref_loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            assert norm > 2 * clip            # the clip is active in this case
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    compared = list(zip(nn.Sequential(*stages).parameters(), reference.parameters()))
    assert len(compared) == 2 * schedule.placement.num_stages       # a weight and a bias per stage
    assert max((p - q).abs().max().item() for p, q in compared) < 1e-6


def test_the_executor_marks_each_op_for_the_profiler():
    from ds_chimera.runtime.local import LocalPipeline
    stages = [nn.Linear(3, 3), nn.Linear(3, 3)]
    pipe = LocalPipeline(registry.build("1f1b", 2, 2), stages, [torch.optim.SGD(m.parameters(), lr=0.1)
                                                               for m in stages], nn.functional.mse_loss)
    batches = [(torch.randn(2, 3), torch.randn(2, 3)) for _ in range(2)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.train_batch(batches)
    names = {event.name for event in prof.events()}
    assert {"ds_chimera.0F0", "ds_chimera.1B1", "ds_chimera.CLIP scope=global", "ds_chimera.STEP chunks=1"} <= names


def test_traces_use_device_events_where_the_device_has_them(monkeypatch):
    """An accelerator's actions are timed by events on its stream, resolved after the step."""
    from ds_chimera.runtime import tracing

    class FakeEvent:
        clock = 0.0

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            FakeEvent.clock += 0.25           # each mark lands 250 ms of device time later
            self.at = FakeEvent.clock

        def synchronize(self):
            pass

        def elapsed_time(self, other):        # milliseconds, as torch's events report
            return (other.at - self.at) * 1000.0

    class FakeDevice:
        Event = FakeEvent

        @staticmethod
        def is_available():
            return True

    monkeypatch.setattr(torch, "fakedev", FakeDevice, raising=False)
    clock = tracing.clock_for("fakedev:0")
    assert isinstance(clock, tracing.DeviceClock)
    trace = tracing.StepTrace(3, clock=clock)
    start = clock.mark()
    trace.add(Kind.FORWARD, 0, 1, start, clock.mark())
    assert trace.records() == [(3, Kind.FORWARD, 0, 1, pytest.approx(0.25), pytest.approx(0.5))]
    monkeypatch.undo()
    assert isinstance(tracing.clock_for("cpu"), tracing.HostClock)


def test_logs_are_rank_prefixed_and_quiet_off_rank_zero():
    code = "from ds_chimera.logs import get_logger; log = get_logger(); log.info('hello'); log.warning('careful')"
    out = {rank: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=dict(os.environ, RANK=str(rank))).stderr for rank in (0, 2)}
    assert "[ds_chimera rank 0] hello" in out[0] and "[ds_chimera rank 0] careful" in out[0]
    assert "hello" not in out[2] and "[ds_chimera rank 2] careful" in out[2]
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, RANK="2", DS_CHIMERA_LOG_LEVEL="info")).stderr
    assert "[ds_chimera rank 2] hello" in loud


# ---- layering: imports only flow downwards --------------------------------------------------------------
LAYERS = {   # package -> ds_chimera packages it must not import
    # the schedules may price orders with the simulator (SIMULATOR_IR below keeps that a layer of its own)
    "schedules": {"runtime", "integrations", "megatron", "hf", "wavelet", "optim", "nn", "ops", "planner"},
    "sim": {"runtime", "integrations", "megatron", "hf", "wavelet", "planner"},
    "runtime": {"integrations", "megatron", "hf", "planner"},
    # the planner prices with the simulator and reads the schedules; the entry points call it
    "planner": {"runtime", "integrations", "megatron", "hf", "wavelet"},
}
LEAVES = ("validation.py", "atomic.py", "logs.py", "autograd_calls.py", "tensor_tree.py", "agreed.py")
# the one timing model sits between the schedules' IR and the schedule builders that search orders with it
SIMULATOR_IR = {"schedules.actions", "schedules.costs", "schedules.lowering", "schedules.placement"}


def _imports(path):
    tree = ast.parse(open(path).read())
    package = os.path.relpath(os.path.dirname(path), os.path.join(ROOT, "ds_chimera")).split(os.sep)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = [p for p in base if p != "."] + (node.module.split(".") if node.module else [])
                yield ".".join(target)
            elif node.module and node.module.startswith("ds_chimera"):
                yield node.module[len("ds_chimera."):]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ds_chimera"):
                    yield alias.name[len("ds_chimera."):]


def test_imports_only_flow_downwards():
    seen = 0
    for package, forbidden in LAYERS.items():
        folder = os.path.join(ROOT, "ds_chimera", package)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                for target in _imports(os.path.join(folder, name)):
                    seen += 1
                    assert target.split(".")[0] not in forbidden, f"{package}/{name} imports {target}"
                    if package == "schedules" and target.split(".")[0] == "sim":
                        assert target == "sim.simulator", f"schedules/{name} imports {target}"
    below = set(_imports(os.path.join(ROOT, "ds_chimera", "sim", "simulator.py")))
    assert below and below <= SIMULATOR_IR, below - SIMULATOR_IR
    for leaf in LEAVES:
        assert not list(_imports(os.path.join(ROOT, "ds_chimera", leaf))), leaf
    schedules = os.path.join(ROOT, "ds_chimera", "schedules")
    for name in os.listdir(schedules):
        if name.endswith(".py"):
            assert "import torch" not in open(os.path.join(schedules, name)).read(), name
    assert seen > 40


# ---- sharded data parallelism: where the weights are gathered -------------------------------------------
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_breadth_first_gathers_each_chunk_twice_but_the_last(chunks):
    from ds_chimera.schedules.actions import Gather, Release
    from ds_chimera.schedules.sharding import gathers_per_rank, shard
    program = build("breadth-first", 2, 8, chunks=chunks).lower()
    zero3 = shard(program, 3)
    assert gathers_per_rank(zero3) == [2 * chunks - 1] * 2
    result = simulate(zero3, Costs(gather=0.5))
    assert result.valid and max(result.peak_gathered) <= 2 / chunks + 1e-12       # two chunks at most
    kept = shard(program, 3, reshard_after_forward=False)
    assert gathers_per_rank(kept) == [chunks] * 2 and simulate(kept).valid
    zero2 = shard(program, 2)
    assert gathers_per_rank(zero2) == [chunks] * 2
    assert not [op for ops in zero2.ops for op in ops if type(op) is Release]       # ZeRO-2 keeps its weights
    assert Program.load(zero3.dump()).ops == zero3.ops
    # depth-first switches chunks all the time: far more gathers for the same work
    interleaved = shard(build("interleaved", 2, 8, chunks=chunks).lower(), 3)
    assert min(gathers_per_rank(interleaved)) > 2 * (2 * chunks - 1)
    # each gather is posted a compute action ahead of its use
    ops, second = zero3.ops[0], zero3.placement.chunks_on(0)[1]
    first = next(i for i, op in enumerate(ops) if type(op) is Gather and op.chunk == second)
    compute_after = [op for op in ops[first + 1:] if type(op) is Action]
    assert compute_after[0].chunk != second and compute_after[1].chunk == second


def test_the_simulator_checks_the_weights_are_there():
    from ds_chimera.schedules.actions import Gather, Release
    from ds_chimera.schedules.sharding import shard
    program = shard(build("breadth-first", 2, 4, chunks=2).lower(), 3)
    no_gather = [[op for op in ops if not (type(op) is Gather and op.chunk == 2)] for ops in program.ops]
    errors = simulate(Program("x", program.placement, no_gather, True)).errors
    assert any("computes without chunk 2's weights (no GATHER, or after RELEASE)" in e for e in errors)
    twice = [list(ops) for ops in program.ops]
    twice[0].insert(0, Gather(0))
    assert any("gathers chunk 0 while its weights are already gathered" in e
               for e in simulate(Program("x", program.placement, twice, True)).errors)
    stray = [list(ops) for ops in program.ops]
    stray[1].append(Release(1))
    assert any("releases chunk 1, whose weights are not gathered" in e
               for e in simulate(Program("x", program.placement, stray, True)).errors)
    with pytest.raises(ValueError, match="'pipeoptim' is asynchronous"):
        shard(build("pipeoptim", 2, 4).lower(), 3)


def test_gathers_the_step_and_the_clip_cost_time_in_the_simulation():
    from ds_chimera.schedules.sharding import shard
    program = build("1f1b", 2, 4).lower()
    plain = simulate(program).makespan
    assert simulate(program, Costs(step=0.5)).makespan == pytest.approx(plain + 0.5)
    # the global norm's collective: once per step, after every rank has arrived
    assert simulate(program, Costs(clip=0.25)).makespan == pytest.approx(plain + 0.25)
    # the first gather of the step cannot hide behind anything
    assert simulate(shard(program, 3), Costs(gather=0.75)).makespan == pytest.approx(plain + 0.75)
    # posting a gather holds the rank: 1f1b at ZeRO-3 gathers its one chunk once, at the start
    assert simulate(shard(program, 3), Costs(gather_post=0.125)).makespan == pytest.approx(plain + 0.125)
    # the gather ends after the later data-parallel peer's post: the skew delays it like a longer gather
    assert simulate(shard(program, 3), Costs(gather_skew=0.25)).makespan == pytest.approx(plain + 0.25)
    # ... and hides, like the gather, behind compute that does not need the weights yet: interleaved
    # ZeRO-3 gathers 11 times on rank 0, yet a small skew delays only the step's first gather
    looped = shard(build("interleaved", 2, 4, chunks=2).lower(), 3)
    base = simulate(looped).makespan
    assert simulate(looped, Costs(gather_skew=0.25)).makespan == pytest.approx(base + 0.25)


def test_the_runtimes_host_time_per_action_is_paid_before_each_compute():
    """1f1b, D = 2, N = 4 at unit costs (F 1, B 2) takes 15; the critical path runs rank 0's first
    forward, the four micro-batches over rank 1 (8 actions), and rank 0's last backward: 10 actions,
    each ``dispatch`` later. A rank's busy time stays its compute alone."""
    program = build("1f1b", 2, 4).lower()
    plain = simulate(program, Costs())
    assert plain.makespan == 15.0
    slowed = simulate(program, Costs(dispatch=0.1))
    assert slowed.makespan == pytest.approx(15.0 + 10 * 0.1)
    assert slowed.busy == plain.busy
    first = min(start for rank, _, _, _, start, _ in slowed.records if rank == 0)
    assert first == pytest.approx(0.1)
    with pytest.raises(ValueError, match="dispatch must be a finite number >= 0, got -1"):
        Costs(dispatch=-1)


def test_one_chunks_full_gradients_at_a_time_and_the_reduce_scatters_are_priced():
    """Breadth-first under sharding: a chunk's first backward waits for the reduce-scatter before it, so
    one chunk's full gradients exist at once; the simulator prices those reduce-scatters when the syncs
    span data-parallel copies of the pipeline, even where the program's own groups are one rank."""
    from ds_chimera.schedules.actions import BACKWARD, SyncStart, SyncWait
    from ds_chimera.schedules.sharding import shard
    program = shard(build("breadth-first", 2, 4, chunks=3).lower(), 3)
    for rank, ops in enumerate(program.ops):
        waits = [i for i, op in enumerate(ops) if type(op) is SyncWait]
        assert len(waits) == 3, rank                     # before chunks 2 and 1's backwards, and the last
        for i in waits[:-1]:
            nxt = ops[i + 1]
            assert type(nxt) is Action and nxt.kind == BACKWARD and nxt.mb == 0
            synced = [op.stage for op in ops[:i] if type(op) is SyncStart]
            assert ops[i].stages == (synced[-1],) and program.placement.chunks[nxt.chunk].stage != synced[-1]
    plain = simulate(program).makespan
    assert simulate(program, Costs(allreduce=0.4)).makespan == pytest.approx(plain)     # one rank: no collective
    # at DP 2 every reduce-scatter costs 0.4; each one is waited for on the critical path (the next
    # chunk's backward, or the step): three of them
    priced = simulate(program, Costs(allreduce=0.4), data_parallel=2)
    assert priced.valid and priced.makespan == pytest.approx(plain + 3 * 0.4)
    with pytest.raises(ValueError, match="data_parallel must be an integer >= 1, got 0"):
        simulate(program, data_parallel=0)


def test_cli_simulates_sharded_programs():
    out = subprocess.run([sys.executable, "-m", "ds_chimera.cli", "simulate", "--schedule", "breadth-first",
                          "--chunks", "4", "--stages", "2", "--micro-batches", "8", "--zero", "3", "--data-parallel",
                          "2", "--cost-gather", "0.3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "gathers per step [7, 7]" in out.stdout and "weights held     [1.0, 1.0]" in out.stdout


def test_no_two_modules_import_each_other():
    """Import circles (at module level or inside functions) hide which module is the lower layer."""
    import ast
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_chimera")
    modules = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    imports = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                found |= {t for t in [target] + [f"{target}.{a.name}" for a in node.names] if t in modules}
        imports[module] = found - {module}
    circles = sorted((a, b) for a in imports for b in imports[a] if a < b and a in imports.get(b, ()) and
                     not b.startswith(a + "."))        # a package importing its own submodule is not a circle
    assert not circles, circles
