"""Every schedule lowers to a complete, ordered, deadlock-free program with the right metrics."""
import itertools

import pytest

from ds_chimera.schedules import FORWARD, available, build
from ds_chimera.schedules.actions import BACKWARD, INPUT_GRAD, WEIGHT_GRAD, Comm, SyncStart
from ds_chimera.sim import Costs, simulate

UNIT = Costs(fwd=1.0, bwd=1.0, wgrad=0.5)
SPLIT = Costs(fwd=1.0, bwd=2.0, wgrad=1.0)     # F = I = W = 1


def grid():
    """Synchronous schedules over many shapes (asynchronous ones: tests/test_pipeoptim.py)."""
    for name in sorted(name for name, cls in available().items() if cls.synchronous):
        for d in range(2, 9):
            if name == "chimera" and d % 2:
                continue
            lo = 2 * d if name == "dualpipev" else 2 if name == "chimera" else 1     # chimera: one per direction
            step = d if name == "interleaved" else 1
            ns = sorted({n for n in (lo, lo + 1, d, d + 1, 2 * d, 3 * d, 3 * d + 1, 4 * d, 8 * d)
                         if n >= lo and n % step == 0 and n >= step})
            chunks = range(1, 5) if name in ("interleaved", "breadth-first") else [None]
            for n, v in itertools.product(ns, chunks):
                yield name, d, n, v


def make(name, d, n, v=None, **kw):
    if v is not None:
        kw["chunks"] = v
    return build(name, d, n, **kw)


def test_grid_is_complete_and_deadlock_free():
    checked = 0
    for name, d, n, v in grid():
        schedule = make(name, d, n, v)
        result = simulate(schedule.lower(), SPLIT)
        assert result.valid, (name, d, n, v, result.errors[:3], result.deadlock)
        split = name in ("zb-h1", "zbv") or getattr(schedule, "order", None) == "zero-bubble"
        kinds = {a.kind for order in schedule.orders for a in order}
        assert kinds == ({FORWARD, INPUT_GRAD, WEIGHT_GRAD} if split else {FORWARD, BACKWARD}), name
        per_chunk = 3 if split else 2
        assert sum(len(o) for o in schedule.orders) == per_chunk * n * schedule.placement.num_stages
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("pipelines", [1, 2, 4])
@pytest.mark.parametrize("order", ["concat", "merged", "forward-doubling"])
def test_chimera_never_drops_work(order, pipelines):
    for n in (2 * pipelines, 2 * pipelines + 1, 8, 23, 24, 25, 64):
        schedule = build("chimera", 8, n, order=order, pipelines=pipelines)
        result = simulate(schedule.lower(), SPLIT)
        assert result.valid, (order, pipelines, n, result.errors[:3], result.deadlock)
        assert sum(len(o) for o in schedule.orders) == 2 * n * 8
        assert schedule.weights_per_rank() == [2.0 * pipelines] * 8


@pytest.mark.parametrize("pipelines", [1, 2, 4])
def test_chimera_refuses_fewer_micro_batches_than_pipelines(pipelines):
    """With N < 2f some replica would get no micro-batch: its layers held, never trained."""
    with pytest.raises(ValueError, match=f"needs micro_batches .*>= {2 * pipelines}, got {2 * pipelines - 1}"):
        build("chimera", 8, 2 * pipelines - 1, pipelines=pipelines)


@pytest.mark.parametrize("pipelines", [1, 2, 4])
def test_chimera_zero_bubble_is_complete_within_1f1b_memory(pipelines):
    for n in (2 * pipelines, 2 * pipelines + 1, 8, 23, 24, 25, 64):
        schedule = build("chimera", 8, n, order="zero-bubble", pipelines=pipelines)
        result = simulate(schedule.lower(), SPLIT)
        assert result.valid, (pipelines, n, result.errors[:3], result.deadlock)
        kinds = [a.kind for order in schedule.orders for a in order]
        assert sorted(set(kinds)) == sorted({FORWARD, INPUT_GRAD, WEIGHT_GRAD})
        assert len(kinds) == 3 * n * 8
        assert max(result.peak_activations) <= 8      # 1F1B's peak: D micro-batches in flight
        assert schedule.weights_per_rank() == [2.0 * pipelines] * 8


@pytest.mark.parametrize("d", [2, 4, 6, 8])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_chimera_zero_bubble_waits_only_for_the_nearest_pipeline_head(d, k):
    n = k * d
    span = simulate(build("chimera", d, n, order="zero-bubble").lower(), SPLIT).makespan
    assert span == pytest.approx(3 * n + (d - 1) // 2)
    zbv = simulate(build("zbv", d, n).lower(), SPLIT).makespan
    assert span == pytest.approx(zbv - 0.5)      # ZB-V's last rank waits (D-1)/2 units
    # D/2 pipelines each way: every rank heads one, so nothing waits (at D stage copies of weights)
    every = simulate(build("chimera", d, n, order="zero-bubble", pipelines=d // 2).lower(), SPLIT)
    assert every.makespan == pytest.approx(3 * n)


@pytest.mark.parametrize("d,n", [(2, 2), (4, 4), (4, 8), (4, 32), (8, 8), (8, 16), (8, 32)])
def test_chimera_auto_fits_1f1b_activations_and_is_the_fastest_that_fits(d, n):
    # switching from 1F1B to Chimera must not need more activation memory: the default
    # order holds at most 1F1B's peak, and no order that fits is faster under the same costs
    costs = Costs()
    one_f_one_b = max(simulate(build("1f1b", d, n).lower(), costs).peak_activations)
    chosen = build("chimera", d, n)
    result = simulate(chosen.lower(), costs)
    assert max(result.peak_activations) <= one_f_one_b
    for order in ("concat", "forward-doubling", "merged", "zero-bubble"):
        other = simulate(build("chimera", d, n, order=order).lower(), costs)
        if max(other.peak_activations) <= one_f_one_b:
            assert result.makespan <= other.makespan + 1e-9, order



def test_chimera_auto_takes_forward_doubling_only_with_the_memory_for_it():
    # the default at D = 4, N = 8 (the runtime tests' "chimera" scenarios run it)
    assert build("chimera", 4, 8).order == "zero-bubble" and build("chimera", 4, 8, recompute=True).order == "concat"
    # with no weight-grad to defer, zero-bubble gains nothing and forward-doubling (2D activations) is fastest
    costs = {"fwd": 1, "bwd": 2, "wgrad": 0}
    assert build("chimera", 4, 8, costs=costs).order == "concat"
    assert build("chimera", 4, 8, costs=costs, max_activations=8).order == "forward-doubling"


def test_chimera_max_activations_is_checked():
    with pytest.raises(ValueError, match="max_activations must be a number of micro-batches >= 1.*got 0"):
        build("chimera", 4, 8, max_activations=0)
    with pytest.raises(ValueError, match="max_activations bounds the choice of order: auto"):
        build("chimera", 4, 8, order="concat", max_activations=8)


@pytest.mark.parametrize("d", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpipe_and_1f1b_bubble_closed_form(d, k):
    n = k * d
    for name in ("gpipe", "1f1b"):
        result = simulate(build(name, d, n).lower(), UNIT)
        assert result.bubble_ratio == pytest.approx((d - 1) / (n + d - 1)), name


@pytest.mark.parametrize("d", [2, 4, 6, 8])
def test_chimera_bubble_closed_form_at_n_equals_d(d):
    result = simulate(build("chimera", d, d, order="concat").lower(), UNIT)
    assert result.bubble_ratio == pytest.approx((d - 2) / (2 * d + d - 2))


@pytest.mark.parametrize("d", [4, 8])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_chimera_concatenation_keeps_one_unit_bubble(d, k):
    result = simulate(build("chimera", d, k * d, order="concat").lower(), UNIT)
    assert result.bubble_ratio == pytest.approx((d - 2) / (2 * k * d + d - 2))


@pytest.mark.parametrize("name", ["interleaved", "breadth-first"])
@pytest.mark.parametrize("d,v,k", [(2, 2, 1), (4, 2, 2), (4, 3, 1), (4, 4, 2), (8, 2, 1), (8, 4, 3)])
def test_looped_bubble_closed_form(name, d, v, k):
    n = k * d
    result = simulate(build(name, d, n, chunks=v).lower(), UNIT)
    assert result.bubble_ratio == pytest.approx((d - 1) / (v * n + d - 1))


@pytest.mark.parametrize("d,n", [(2, 4), (4, 4), (4, 8), (4, 16), (6, 12), (8, 8), (8, 32)])
def test_zero_bubble_beats_1f1b(d, n):
    one = simulate(build("1f1b", d, n).lower(), SPLIT)
    h1 = simulate(build("zb-h1", d, n).lower(), SPLIT)
    bubble_1f1b = one.makespan - one.ideal
    assert h1.makespan - h1.ideal <= 0.5 * bubble_1f1b + 1e-9
    assert max(h1.peak_activations) <= d
    if n >= 2 * d:
        for name in ("zbv", "dualpipev"):
            assert simulate(build(name, d, n).lower(), SPLIT).makespan < one.makespan, name
    else:
        assert simulate(build("zbv", d, n).lower(), SPLIT).makespan < one.makespan


@pytest.mark.parametrize("d", [2, 4, 8])
def test_peak_activations(d):
    n = 2 * d
    assert simulate(build("gpipe", d, n).lower(), UNIT).peak_activations == [n] * d
    assert simulate(build("1f1b", d, n).lower(), UNIT).peak_activations == list(range(d, 0, -1))
    chimera = simulate(build("chimera", d, d, order="concat").lower(), UNIT).peak_activations
    assert all(d // 2 + 1 <= a <= d for a in chimera), chimera
    assert max(chimera) == d


def test_weights_per_rank():
    assert build("1f1b", 4, 8).weights_per_rank() == [1.0] * 4
    assert build("interleaved", 4, 8, chunks=2).weights_per_rank() == [1.0] * 4
    assert build("chimera", 4, 8).weights_per_rank() == [2.0] * 4
    assert build("zbv", 4, 8).weights_per_rank() == [1.0] * 4


def test_chimera_auto_picks_the_fastest_order():
    costs = Costs(fwd=1.0, bwd=2.0, wgrad=1.0)
    chosen = build("chimera", 8, 32, costs=costs, max_activations=16)    # room for every order
    spans = {o: simulate(build("chimera", 8, 32, order=o).lower(), costs).makespan
             for o in ("concat", "merged", "forward-doubling", "zero-bubble")}
    assert spans[chosen.order] == min(spans.values())
    # with backward = 2 x forward, plain concatenation falls behind 1F1B at N >= 4D ...
    one = simulate(build("1f1b", 8, 32).lower(), costs).makespan
    assert spans["concat"] > one
    # ... and both remedies beat it.
    assert spans["merged"] < one and spans["forward-doubling"] < one


@pytest.mark.parametrize("d,n,f", [(4, 12, 1), (8, 16, 2), (4, 8, 2)])
def test_chimera_auto_prices_its_orders_on_the_simulator_with_syncs_and_host_time(d, n, f):
    """The order search prices each candidate on the simulator (the package's one timing model), so the gradient
    syncs and the hosts' per-message time count: the chosen order is the fastest of those that fit."""
    for costs in ({"allreduce": 0.5}, {"fwd": 1, "bwd": 2, "wgrad": 1, "allreduce": 1.3, "sync_post": 0.2,
                                       "comm": 0.1, "send": 0.05, "recv": 0.05}):
        chosen = build("chimera", d, n, pipelines=f, costs=costs, max_activations=2 * n)
        spans = {o: simulate(build("chimera", d, n, pipelines=f, order=o).lower(), Costs(**costs)).makespan
                 for o in ("concat", "merged", "forward-doubling", "zero-bubble")}
        assert spans[chosen.order] == pytest.approx(min(spans.values()), abs=1e-12), (costs, spans)


def test_chimera_down_and_up_pipelines_are_mirrored():
    placement = build("chimera", 4, 4).placement
    assert placement.stage_ranks == [[0, 1, 2, 3], [3, 2, 1, 0]]
    assert placement.stage_group(0) == (0, 3)
    placement = build("chimera", 8, 8, pipelines=2).placement
    assert placement.stage_ranks == [[0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 0, 1, 2, 3],
                                     [7, 6, 5, 4, 3, 2, 1, 0], [3, 2, 1, 0, 7, 6, 5, 4]]


def test_lowering_posts_sends_before_receives_and_syncs_early():
    program = build("chimera", 4, 8, order="concat").lower()
    for ops in program.ops:
        batches = [op for op in ops if isinstance(op, Comm)]
        assert batches and all(op.sends or op.recvs for op in batches)
        syncs = [i for i, op in enumerate(ops) if isinstance(op, SyncStart)]
        assert len(syncs) == 2      # one per stage held
        # the first stage to finish syncs before the rank's last compute, inside the step
        last_compute = max(i for i, op in enumerate(ops) if hasattr(op, "kind"))
        assert syncs[0] < last_compute


def test_comm_cost_adds_latency_on_the_critical_path():
    # GPipe's critical path crosses D-1 links forward and D-1 back: makespan grows by 2(D-1)c.
    base = simulate(build("gpipe", 4, 8).lower(), Costs(1, 2, 1, comm=0.0)).makespan
    slow = simulate(build("gpipe", 4, 8).lower(), Costs(1, 2, 1, comm=0.5)).makespan
    assert slow == pytest.approx(base + 2 * 3 * 0.5)
    # 1F1B also pays latency in its steady state, so it can only be slower still.
    base = simulate(build("1f1b", 4, 8).lower(), Costs(1, 2, 1, comm=0.0)).makespan
    assert simulate(build("1f1b", 4, 8).lower(), Costs(1, 2, 1, comm=0.5)).makespan > base + 3


def test_host_send_and_receive_costs_occupy_the_ranks():
    # D=2, N=1: F, send, (latency), receive, F, B, send, (latency), receive, B
    program = build("gpipe", 2, 1).lower()
    plain = simulate(program, Costs(1, 2, 1, comm=0.5))
    host = simulate(program, Costs(1, 2, 1, comm=0.5, send=0.1, recv=0.2))
    assert plain.makespan == pytest.approx(7.0)
    assert host.makespan == pytest.approx(7.0 + 2 * (0.1 + 0.2))
    assert host.busy == plain.busy          # host time is not compute
    # the critical path of GPipe on 4 ranks crosses 2 (D - 1) messages
    program = build("gpipe", 4, 8).lower()
    base = simulate(program, Costs(1, 2, 1, comm=0.5)).makespan
    assert simulate(program, Costs(1, 2, 1, comm=0.5, send=0.1, recv=0.2)).makespan >= base + 2 * 3 * 0.3 - 1e-9
    with pytest.raises(ValueError, match="send"):
        Costs(send=-1.0)


@pytest.mark.parametrize("d,n", [(2, 4), (3, 5), (4, 8), (8, 32)])
def test_list_scheduler_makespan_is_the_simulators(d, n):
    from ds_chimera.schedules.base import vshape_placement
    from ds_chimera.schedules.lowering import lower
    from ds_chimera.schedules.timing import list_schedule
    placement = vshape_placement(d, n)
    orders, span = list_schedule(placement, [float(d)] * d, with_makespan=True)
    assert span == simulate(lower("zbv", placement, orders), SPLIT).makespan


def test_replay_with_measured_op_durations():
    """simulate(durations=...) replays each op on its own time: equal durations give the per-kind makespan, a
    slow op on the critical path delays the end by its excess, and an op it does not name keeps its cost."""
    schedule = build("1f1b", 2, 2)
    program = schedule.lower()
    costs = Costs(fwd=1.0, bwd=2.0, wgrad=1.0)
    size = schedule.placement.size
    same = {(a.kind, a.chunk, a.mb): costs.of(a.kind) * size for order in schedule.orders for a in order}
    span = simulate(program, costs).makespan
    assert simulate(program, costs, durations=same).makespan == pytest.approx(span)
    assert simulate(program, costs, durations={}).makespan == pytest.approx(span)
    slow = dict(same)
    slow[(FORWARD, 0, 0)] += 3.0        # micro-batch 0's first forward: everything waits for it
    assert simulate(program, costs, durations=slow).makespan == pytest.approx(span + 3.0)


def test_readme_schedule_table_is_the_simulators():
    """The README's schedule table is generated (python -m ds_chimera.sim.table --write README.md): it must
    equal what the simulator gives for today's code, so its figures cannot drift."""
    import os
    from ds_chimera.sim.table import BEGIN, END, schedule_table
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    shown = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == schedule_table()
    assert "| `chimera` |" in shown and "order zero-bubble" in shown


def test_chimera_on_one_stage_is_one_copy_running_every_micro_batch():
    """A 1-stage PipelineModule (pure data parallelism): both replicas would be the whole model on one rank, so
    Chimera runs one copy's forward and backward per micro-batch, which is 1F1B's (and the stock engine's) order."""
    from ds_chimera.schedules.chimera import Chimera
    from ds_chimera.schedules.classic import OneFOneB
    from ds_chimera.sim import simulate
    for n in (1, 2, 5):
        chimera, one_f_one_b = Chimera(1, n), OneFOneB(1, n)
        assert chimera.orders == one_f_one_b.orders and chimera.placement.num_replicas == 1
        assert simulate(chimera.lower()).valid
    with pytest.raises(ValueError, match="pipelines must be 1"):
        Chimera(1, 4, pipelines=2)
