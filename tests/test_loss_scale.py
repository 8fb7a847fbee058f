"""fp16 loss scaling (ds_chimera.runtime.loss_scale) against DeepSpeed's own DynamicLossScaler, the oracle:
the same scale at every step, the same skipped steps and the same step where the scale cannot go lower,
over random overflow sequences and every combination of the scaling keys."""
import itertools
import random

import pytest
import torch

from ds_chimera.runtime.loss_scale import LossScale, LossScaleConfig, has_overflow, overflow_anywhere


def _oracle(config: LossScaleConfig, monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)      # it logs on rank 0 only
    if not config.dynamic:
        return loss_scaler.CreateLossScaler(torch.half, config.loss_scale, False, None)
    return loss_scaler.CreateLossScaler(torch.half, 0, True, {
        "init_scale": 2 ** config.initial_scale_power, "scale_window": config.loss_scale_window,
        "delayed_shift": config.hysteresis, "consecutive_hysteresis": config.consecutive_hysteresis,
        "min_scale": config.min_loss_scale})


GRID = list(itertools.product((1, 2, 3), (False, True), (1, 3, 7), (1.0, 2.0 ** 9)))


@pytest.mark.parametrize("hysteresis,consecutive,window,min_scale", GRID)
def test_dynamic_scale_follows_deepspeeds_scaler_step_for_step(monkeypatch, hysteresis, consecutive, window, min_scale):
    config = LossScaleConfig(loss_scale=0, initial_scale_power=12, loss_scale_window=window, hysteresis=hysteresis,
                             consecutive_hysteresis=consecutive, min_loss_scale=min_scale)
    rng = random.Random(hash((hysteresis, consecutive, window, min_scale)) & 0xFFFF)
    # bursts of overflows and calm stretches: the scale falls, recovers, and (with a high floor) hits it
    overflows = [rng.random() < (0.6 if (i // 9) % 2 else 0.08) for i in range(120)]
    ours, theirs = LossScale(config), _oracle(config, monkeypatch)
    trajectory = []
    for step, overflow in enumerate(overflows):
        assert ours.scale == theirs.cur_scale, (step, trajectory[-5:])
        trajectory.append((overflow, ours.scale))
        try:
            theirs.update_scale(overflow)
        except Exception:
            with pytest.raises(FloatingPointError, match="the loss scale is at its minimum"):
                ours.update(overflow)
            return                            # both stop at the same step
        ours.update(overflow)
    assert ours.scale == theirs.cur_scale
    assert ours.skipped == sum(overflows)
    assert len({scale for _, scale in trajectory}) > 2      # the sequence moved the scale both ways


def test_static_scale_never_moves_but_overflows_are_still_skipped(monkeypatch):
    config = LossScaleConfig(loss_scale=128.0)
    ours, theirs = LossScale(config), _oracle(config, monkeypatch)
    for overflow in (True, False, True, True):
        ours.update(overflow)
        theirs.update_scale(overflow)
        assert ours.scale == theirs.cur_scale == 128.0
    assert ours.skipped == 3


def test_state_resumes_the_same_trajectory():
    config = LossScaleConfig(loss_scale_window=2, hysteresis=2)
    first, flags = LossScale(config), [True, False, False, True, True, False, False, False]
    for flag in flags[:4]:
        first.update(flag)
    resumed = LossScale(config)
    resumed.load_state_dict(first.state_dict())
    for flag in flags[4:]:
        first.update(flag)
        resumed.update(flag)
        assert resumed.state_dict() == first.state_dict()


@pytest.mark.parametrize("section,message", [
    ({"loss_scale": -1}, "loss_scale must be 0 (dynamic) or a finite positive number, got -1"),
    ({"loss_scale": True}, "loss_scale must be 0 (dynamic) or a finite positive number, got True"),
    ({"loss_scale_window": 0}, "loss_scale_window must be >= 1, got 0"),
    ({"hysteresis": "2"}, "hysteresis must be an integer >= 1, got '2'"),
    ({"min_loss_scale": 0}, "min_loss_scale must be a number > 0, got 0"),
    ({"consecutive_hysteresis": 1}, "consecutive_hysteresis must be true or false, got 1"),
])
def test_bad_scaling_keys_are_named(section, message):
    with pytest.raises(ValueError, match='"fp16": ' + message.replace("(", r"\(").replace(")", r"\)")):
        LossScaleConfig.from_section(section)


def test_one_rank_overflowing_skips_the_step_everywhere():
    finite, bad = [torch.ones(3), None], [torch.ones(3), torch.tensor([1.0, float("inf")])]
    assert not has_overflow(finite) and has_overflow(bad) and has_overflow([torch.tensor([float("nan")])])
    flags = [has_overflow(finite), has_overflow(bad), has_overflow(finite)]      # three ranks, one overflowed

    def max_over_ranks(flag):           # what a MAX all-reduce over the three ranks gives each of them
        flag.fill_(max(float(f) for f in flags))
    assert [overflow_anywhere(f, max_over_ranks) for f in flags] == [True, True, True]
    assert overflow_anywhere(False, None) is False
