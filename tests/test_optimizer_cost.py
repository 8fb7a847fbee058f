"""The optimizer step's cost (ds_chimera.planner.optimizer_cost): measured on the job's optimizer kind and priced
by the planner per stage copy a rank steps."""
import json
import logging

import pytest
import torch

from ds_chimera.logs import get_logger
from ds_chimera.planner import LayerCost, Links, Profile, Setting, plan
from ds_chimera.planner.optimizer_cost import measure_step, measured_step_s, optimizer_maker, stage_tensors


def test_the_optimizer_is_the_jobs_kind_with_its_settings():
    instance = torch.optim.AdamW([torch.zeros(3, requires_grad=True)], lr=0.1, weight_decay=0.25)
    make, described = optimizer_maker({"optimizer": {"type": "SGD"}}, instance)     # the instance wins
    rebuilt = make([torch.zeros(2, requires_grad=True)])
    assert type(rebuilt) is torch.optim.AdamW and described == "AdamW"
    assert rebuilt.defaults["weight_decay"] == 0.25 and rebuilt.defaults["lr"] == 0.1

    # a DeepSpeed section: its own keys (torch_adam) are dropped, the rest taken; betas as a tuple
    make, described = optimizer_maker({"optimizer": {"type": "Adam", "params": {
        "lr": 3e-4, "betas": [0.8, 0.9], "torch_adam": True}}})
    built = make([torch.zeros(2, requires_grad=True)])
    assert type(built) is torch.optim.Adam and built.defaults["betas"] == (0.8, 0.9)

    make, described = optimizer_maker({"optimizer": {"type": "OneBitLamb"}})
    assert type(make([torch.zeros(2, requires_grad=True)])) is torch.optim.Adam
    assert described == "Adam (for OneBitLamb)"
    make, described = optimizer_maker({})
    assert described == "Adam"


def test_a_mean_stage_is_one_tensor_per_layer_and_big_stages_are_scaled():
    tensors, scale = stage_tensors([100, 300, 0, 200, 200], 2)
    assert tensors == [200, 200] and scale == 1.0           # 4 layers with parameters, 800 over 2 stages
    tensors, scale = stage_tensors([1 << 20] * 4, 1, cap=1 << 20)
    assert sum(tensors) <= 1 << 20 and scale == pytest.approx(4.0)
    assert stage_tensors([0, 0], 2) == ([], 0.0)


def test_a_bigger_stage_takes_longer_to_step():
    make, _ = optimizer_maker({"optimizer": {"type": "Adam"}})
    small = measure_step(make, [10_000] * 4, 4, "cpu", rounds=5, idle_s=0.0)
    big = measure_step(make, [4_000_000] * 4, 4, "cpu", rounds=5, idle_s=0.0)
    assert 0 < small < big, (small, big)
    assert measure_step(make, [0, 0], 2, "cpu") == 0.0


def test_an_optimizer_that_cannot_be_rebuilt_prices_no_step_and_says_so():
    class Picky(torch.optim.SGD):
        def __init__(self, params, lr=0.1, needs=None):
            if needs is None:
                raise TypeError("Picky needs its model")
            super().__init__(params, lr=lr)

    instance = Picky([torch.zeros(1, requires_grad=True)], needs=object())
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        assert measured_step_s({}, instance, [100, 100], 2, "cpu") == 0.0
    finally:
        get_logger().removeHandler(handler)
    assert any("could not be timed with Picky" in m and "Picky needs its model" in m for m in seen), seen


def _layers(n=8):
    return tuple(LayerCost(name=f"l{i}", fwd=0.01, bwd=0.02, wgrad=0.01, activation_bytes=1 << 20,
                           output_bytes=1 << 16, param_bytes=1 << 20, params=1 << 18) for i in range(n))


def _steps(profile, setting):
    result = plan(profile, setting, exhaustive=True, only=["1f1b", "chimera"], cuts=("uniform",))
    return {(c.schedule, json.dumps(c.options, sort_keys=True)): c.step_s for c in result.candidates
            if c.step_s is not None}, result


def test_the_planner_prices_the_step_per_stage_copy_a_rank_holds():
    step = 0.003
    setting = Setting(stages=4, micro_batches=8)
    without, _ = _steps(Profile(_layers(), Links()), setting)
    priced, result = _steps(Profile(_layers(), Links(), optimizer_step_s=step), setting)
    one_f_one_b = '{}'
    assert priced[("1f1b", one_f_one_b)] - without[("1f1b", one_f_one_b)] == pytest.approx(step)
    doubled = [key for key in priced if key[0] == "chimera" and json.loads(key[1]).get("pipelines") == 2]
    assert doubled
    for key in priced:
        if key[0] == "chimera":      # 2f stage copies per rank: f = 1 steps two, f = 2 four
            copies = 2 * json.loads(key[1]).get("pipelines", 1)
            assert priced[key] - without[key] == pytest.approx(copies * step), key
    assert "with the optimizer step (3.000 ms per stage's weights)" in result.report()


def test_under_zero_each_data_parallel_rank_steps_its_share():
    step = 0.004
    plain = Setting(stages=4, micro_batches=8, data_parallel=2)
    zero = Setting(stages=4, micro_batches=8, data_parallel=2, zero=1)
    profile = Profile(_layers(), Links(), optimizer_step_s=step)
    base = Profile(_layers(), Links())
    key = ("1f1b", "{}")
    assert _steps(profile, plain)[0][key] - _steps(base, plain)[0][key] == pytest.approx(step)
    assert _steps(profile, zero)[0][key] - _steps(base, zero)[0][key] == pytest.approx(step / 2)


def test_a_profile_keeps_its_step_and_one_without_it_prices_none():
    profile = Profile(_layers(2), Links(), optimizer_step_s=0.002)
    assert Profile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    newer = profile.to_json()
    newer["layers"][0]["from_a_later_version"] = 1          # a profile a later version wrote still loads
    newer["links"]["also_later"] = 2.0
    assert Profile.from_json(newer) == profile
    old = profile.to_json()
    del old["optimizer_step_s"]
    for layer in old["layers"]:
        del layer["fwd_idle"]
    again = Profile.from_json(old)
    assert again.optimizer_step_s == 0.0 and all(layer.fwd_idle == 0.0 for layer in again.layers)


def test_a_reused_profile_prices_the_step_for_this_runs_pipeline():
    """The step was timed on a mean stage of the pipeline the profile was measured for: a profile_file of a
    two-stage run, reused on four stages, prices each stage's step at half."""
    key = ("1f1b", "{}")
    base = _steps(Profile(_layers(), Links()), Setting(stages=4, micro_batches=8))[0][key]
    reused = Profile(_layers(), Links(), meta={"optimizer_step_stages": 2}, optimizer_step_s=0.004)
    assert _steps(reused, Setting(stages=4, micro_batches=8))[0][key] - base == pytest.approx(0.002)


def test_under_zero_offload_the_step_is_timed_on_the_cpu():
    """The offloaded optimizer steps on the CPU: timed there, even where the job's device is a GPU (this host
    has none, so a timing on "cuda" would fail and price nothing)."""
    offload = {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert measured_step_s(offload, None, [1000, 1000], 2, "cuda") > 0
