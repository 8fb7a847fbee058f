"""The runtime's host time per compute action (ds_chimera.runtime.host_cost), measured with the planner's links
and priced by the planner and ``ds-chimera simulate`` as the simulator's ``dispatch``."""
import json
import subprocess
import sys
import time

import pytest
import torch

from ds_chimera.planner.profile import LayerCost, Links, Profile
from ds_chimera.planner.search import Setting, plan
from ds_chimera.runtime import executor, host_cost
from netutil import run_ranks


def test_it_measures_the_runtimes_own_work_per_action(monkeypatch):
    plain = host_cost.measure_dispatch(rounds=15)
    assert 0.0 < plain < 0.01, plain       # tens of microseconds on a CPU host: the executor's, not a layer's

    forward = executor.StepRun._forward

    def slower(self, op):                  # 2 ms more in every forward: 16 of the program's 48 actions
        time.sleep(0.002)
        forward(self, op)
    monkeypatch.setattr(executor.StepRun, "_forward", slower)
    slowed = host_cost.measure_dispatch(rounds=15)
    # 2 ms * 16 / 48 = 0.67 ms, plus the sleeps' overshoot; the bounds leave room for a loaded host
    assert 0.45e-3 < slowed - plain < 3e-3, (plain, slowed)


class _Sleeping(torch.nn.Module):
    """A layer whose forward, input-grad and weight-grad each sleep 2 ms (the benchmarks' timed layers do the same)."""
    calls = 0

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        type(self).calls += 1
        time.sleep(0.002)
        return _SleepingGrad.apply(x) * self.weight


class _SleepingGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.002)
        return grad


def test_it_measures_around_the_layer_it_is_given():
    """Around layers that take their time (here by sleeping), the layers' own costs are taken off: what is left
    is the runtime's, a fraction of a millisecond, not the 2 ms a layer's op takes."""
    _Sleeping.calls = 0
    around = host_cost.measure_dispatch(rounds=3, layer=_Sleeping)
    # 3 warm-ups and 3 timed runs of 16 forwards each, and the layer costs' own forwards: the given layer ran
    assert _Sleeping.calls >= 6 * 16, _Sleeping.calls
    assert 0.0 <= around < 1e-3, around


def test_it_leaves_the_random_state_as_it_found_it():
    """The planner measures it before training starts: the run after planning draws what it would have."""
    import torch
    torch.manual_seed(7)
    host_cost.measure_dispatch(rounds=3)
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))


LINKS_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from ds_chimera.planner.links import measure_links
dist.init_process_group("gloo")
links = measure_links(dist, 0, 1, None, torch.device("cpu"), rounds=5, host_cost=lambda: 0.001 * (dist.get_rank() + 1))
print(json.dumps({"dispatch_s": links.dispatch_s}))
dist.destroy_process_group()
"""


def test_the_links_carry_the_mean_over_every_rank(tmp_path):
    script = tmp_path / "links.py"
    script.write_text(LINKS_SCRIPT)
    results, _ = run_ranks([str(script)], 2, {"OMP_NUM_THREADS": "1", "DS_CHIMERA_FAULT_MONITOR": "0"}, timeout_s=120)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, (rank, err[-2000:])
        assert abs(json.loads(out.strip().splitlines()[-1])["dispatch_s"] - 0.0015) < 1e-12    # (1 + 2 ms) / 2


SYNC_SCRIPT = r"""
import json
import torch, torch.distributed as dist
from ds_chimera.planner.links import sync_after_wait
dist.init_process_group("gloo")
took, post = sync_after_wait(dist, None, 1000, 0.05, 3, torch.device("cpu"))
own, own_post = sync_after_wait(dist, None, 1000, 0.05, 3, torch.device("cpu"), same_host=False)
print(json.dumps({"took": took, "post": post, "own": own, "own_post": own_post}))
dist.destroy_process_group()
"""


def test_a_gradient_sync_is_timed_from_its_last_members_post(tmp_path):
    """The last member idles 50 ms before it posts, as a rank finishing its last backward; the others wait. The
    sync's time starts at that post: a few milliseconds on a CPU host, not the 50 ms idle."""
    script = tmp_path / "sync.py"
    script.write_text(SYNC_SCRIPT)
    results, _ = run_ranks([str(script)], 2, {"OMP_NUM_THREADS": "1", "DS_CHIMERA_FAULT_MONITOR": "0"}, timeout_s=120)
    timed = []
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, (rank, err[-2000:])
        timed.append(json.loads(out.strip().splitlines()[-1]))
    assert timed[0] == timed[1]                  # the group's figure, the same on every member
    assert 0.0 < timed[0]["post"] <= timed[0]["took"] < 0.04, timed[0]
    # across hosts (clocks that differ) the last member's own post-to-result time: the same kind of figure
    assert 0.0 < timed[0]["own_post"] <= timed[0]["own"] < 0.04, timed[0]


def test_the_planner_prices_it_on_every_compute_action():
    layers = tuple(LayerCost(name=f"l{i}", fwd=0.01, bwd=0.02, wgrad=0.01, activation_bytes=1 << 20,
                             output_bytes=1 << 16, param_bytes=1 << 20) for i in range(8))
    setting = Setting(stages=4, micro_batches=8)
    steps = {}
    for dispatch in (0.0, 0.002):
        result = plan(Profile(layers, Links(dispatch_s=dispatch)), setting)
        steps[dispatch] = {(c.schedule, json.dumps(c.options, sort_keys=True), c.cut): c.step_s
                           for c in result.candidates if c.step_s is not None}
    both = steps[0.0].keys() & steps[0.002].keys()        # the search prunes by its bound: each its own set
    assert both
    for key in both:
        assert steps[0.002][key] > steps[0.0][key] + 0.002 * 8, key    # one micro-batch's actions on the path at least
    assert min(steps[0.002].values()) > min(steps[0.0].values()) + 0.002 * 8


def test_simulate_measures_it_when_asked():
    base = [sys.executable, "-m", "ds_chimera.cli", "simulate", "--schedule", "zbv", "--stages", "4",
            "--micro-batches", "8", "--cost-fwd", "0.01", "--cost-bwd", "0.02", "--cost-wgrad", "0.01", "--json"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=120)
    measured = subprocess.run(base + ["--measure-dispatch"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and measured.returncode == 0, (plain.stderr[-2000:], measured.stderr[-2000:])
    assert "the runtime's host time per compute action" in measured.stderr
    makespan = [json.loads(p.stdout.strip().splitlines()[-1])["makespan"] for p in (plain, measured)]
    assert makespan[1] > makespan[0]


# ---- around layers shaped as the model's: the profile's idle share, the planner's choice of layer ----------------

def test_the_profile_sees_how_long_a_layer_leaves_the_core_idle():
    """A layer that sleeps leaves the core idle for most of its forward; one that computes does not."""
    from ds_chimera.planner import profile_sequential

    class Computing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
            return x * self.weight

    for attempt in range(2):      # a burst of load from the other test worker can take the core from the computing one
        sleeping, computing = profile_sequential([_Sleeping(), Computing()], torch.randn(1, 4, requires_grad=True),
                                                 loss=lambda out: out.sum()).layers
        try:
            assert 0.7 * sleeping.fwd < sleeping.fwd_idle <= sleeping.fwd, sleeping
            assert computing.fwd_idle < 0.5 * computing.fwd, computing
            return
        except AssertionError:
            if attempt == 1:
                raise


def test_the_planner_measures_around_layers_that_wait_as_the_models_do():
    from ds_chimera.planner.deepspeed import BUSY_CAP_S, IDLE_CAP_S, SHAPED_ROUNDS, _around_layers

    def measure(**shape):
        return shape

    def layer(fwd, idle):
        return LayerCost(name="l", fwd=fwd, bwd=2 * fwd, wgrad=fwd, activation_bytes=0, output_bytes=0, param_bytes=0,
                         fwd_idle=idle)
    assert _around_layers(measure, [layer(0.004, 0.0), layer(0.002, 0.00001)]) is measure   # compute-bound: warm
    assert _around_layers(measure, [layer(0.1, 0.002)]) is measure         # descheduled 2% of the time: still warm
    shaped = _around_layers(measure, [layer(0.004, 0.003), layer(0.002, 0.001)])
    assert shaped() == {"rounds": SHAPED_ROUNDS, "idle_s": pytest.approx(0.002), "busy_s": pytest.approx(0.001)}
    capped = _around_layers(measure, [layer(0.5, 0.4)])()
    assert capped["idle_s"] == IDLE_CAP_S and capped["busy_s"] == BUSY_CAP_S
    assert _around_layers(None, [layer(0.004, 0.003)]) is None


def test_around_a_shaped_layer_its_own_time_is_taken_off():
    """The shaped layer's F, I and W each take its idle and busy time; the host time per action around it is the
    runtime's, a fraction of a millisecond (more than around near-free layers on a host whose cores go cold)."""
    shape = host_cost.Shape(0.002, 0.0005)
    own = host_cost.layer_costs(lambda: host_cost.ShapedLayer(shape), 16, "cpu", 5)
    for kind in "FIW":
        assert 0.0024 < own[kind] < 0.006, own
    assert shape.inside > 3 * 5 * 0.0025                 # its waits, read as they went: F, I and W, five rounds
    without_waits = host_cost.layer_costs(lambda: host_cost.ShapedLayer(shape), 16, "cpu", 5, clock=shape)
    for kind in "FIW":
        assert 0.0 <= without_waits[kind] < 0.001, without_waits      # the layer's own code, not its waits
    around = host_cost.measure_dispatch(rounds=3, idle_s=0.002, busy_s=0.0005)
    assert 0.0 <= around < 1e-3, around


def test_simulate_measures_it_around_layers_that_wait_when_asked():
    base = [sys.executable, "-m", "ds_chimera.cli", "simulate", "--schedule", "zbv", "--stages", "4",
            "--micro-batches", "8", "--cost-fwd", "0.01", "--cost-bwd", "0.02", "--cost-wgrad", "0.01", "--json"]
    shaped = subprocess.run(base + ["--measure-dispatch", "--layer-idle-ms", "2", "--layer-busy-ms", "0.5"],
                            capture_output=True, text=True, timeout=180)
    assert shaped.returncode == 0, shaped.stderr[-2000:]
    assert "around layers idling 2 ms, then computing 0.5 ms" in shaped.stderr
    for extra, message in ((["--layer-idle-ms", "2"], "add --measure-dispatch"),
                           (["--measure-dispatch", "--layer-idle-ms", "-1"], "--layer-idle-ms must be a finite number"),
                           (["--measure-dispatch", "--layer-busy-ms", "1"], "give --layer-idle-ms too")):
        refused = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and message in refused.stderr, (extra, refused.stderr[-1000:])
