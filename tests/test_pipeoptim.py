"""PipeOptim and the PipeDream family: predictors, weight versions, schedules (single process)."""
import copy
import math
import os
import sys

import pytest
import torch
from torch import nn

from ds_chimera.optim import LastUpdate, WeightVersions, make_predictor, register_predictor
from ds_chimera.optim.predictors import Predictor, SmoothedGradient
from ds_chimera.runtime.local import LocalPipeline
from ds_chimera.schedules import registry
from ds_chimera.sim.simulator import Costs, simulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed"))
import async_reference as model  # noqa: E402
import probes  # noqa: E402

ASYNC = ["pipedream", "pipedream-2bw", "pipeoptim", "spectrain"]


def scalar_param(value=1.0):
    return nn.Parameter(torch.tensor([value]))


def step_with(opt, predictor, p, grad):
    p.grad = torch.tensor([grad])
    predictor.before_step()
    opt.step()
    predictor.after_step()
    opt.zero_grad(set_to_none=True)


# ---- predictors: closed forms on hand-computed cases ---------------------------------------------
def test_sgd_momentum_predicts_with_the_momentum_buffer():
    p = scalar_param()
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)
    step_with(opt, pred, p, 0.25)
    # buf = 0.9 * 0.5 + 0.25 = 0.7; p = 1 - 0.05 - 0.07 = 0.88
    assert p.item() == pytest.approx(0.88)
    assert pred.predict(p, 3).item() == pytest.approx(0.88 - 0.1 * 3 * 0.7)
    assert pred.predict(p, 0) is p


def test_sgd_nesterov_predicts_with_its_last_update_direction():
    p = scalar_param()
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)
    step_with(opt, pred, p, 0.25)
    # step 2: buf = 0.7, direction = 0.25 + 0.9 * 0.7 = 0.88; p = 1 - 0.095 - 0.088
    assert p.item() == pytest.approx(0.817)
    assert pred.predict(p, 2).item() == pytest.approx(0.817 - 0.1 * 2 * 0.88)


def test_plain_sgd_with_weight_decay_predicts_with_the_decayed_gradient():
    p = scalar_param()
    opt = torch.optim.SGD([p], lr=0.1, weight_decay=0.1)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)          # direction 0.5 + 0.1 * 1.0 = 0.6
    assert p.item() == pytest.approx(0.94)
    assert pred.predict(p, 2).item() == pytest.approx(0.94 - 0.1 * 2 * 0.6)


def test_adam_predicts_with_bias_corrected_moments():
    p = scalar_param()
    opt = torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.999), eps=1e-3)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)          # m_hat = 0.5, v_hat = 0.25: direction 0.5 / (0.5 + 1e-3)
    direction = 0.5 / (0.5 + 1e-3)
    assert p.item() == pytest.approx(1 - 0.1 * direction)
    assert pred.predict(p, 3).item() == pytest.approx(p.item() - 0.1 * 3 * direction)
    step_with(opt, pred, p, -0.25)        # second step: the current bias corrections
    m, v = 0.9 * 0.05 + 0.1 * -0.25, 0.999 * 0.00025 + 0.001 * 0.0625
    direction = (m / (1 - 0.9 ** 2)) / (math.sqrt(v / (1 - 0.999 ** 2)) + 1e-3)
    assert pred.predict(p, 2).item() == pytest.approx(p.item() - 0.1 * 2 * direction)


def test_adamw_applies_decoupled_decay_separately():
    p = scalar_param()
    opt = torch.optim.AdamW([p], lr=0.1, eps=1e-3, weight_decay=0.01)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)
    direction = 0.5 / (0.5 + 1e-3)
    p1 = 1.0 * (1 - 0.1 * 0.01) - 0.1 * direction
    assert p.item() == pytest.approx(p1)
    assert pred.predict(p, 2).item() == pytest.approx(p1 - 0.1 * 2 * direction - 0.1 * 0.01 * 2 * p1)


def test_rmsprop_predicts_with_the_normalised_gradient_or_its_momentum():
    p = scalar_param()
    opt = torch.optim.RMSprop([p], lr=0.01, alpha=0.99, eps=1e-8)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)          # square_avg = 0.0025: direction 0.5 / 0.05 = 10
    assert p.item() == pytest.approx(0.9, rel=1e-5)
    assert pred.predict(p, 2).item() == pytest.approx(0.9 - 0.01 * 2 * 10, rel=1e-5)
    q = scalar_param()
    opt = torch.optim.RMSprop([q], lr=0.01, momentum=0.5)
    pred = make_predictor(opt)
    step_with(opt, pred, q, 0.5)
    buf = opt.state[q]["momentum_buffer"].item()
    assert pred.predict(q, 2).item() == pytest.approx(q.item() - 0.01 * 2 * buf)


def test_last_update_serves_any_optimizer_with_the_applied_step():
    p = scalar_param()
    opt = torch.optim.Adagrad([p], lr=0.1)
    pred = make_predictor(opt)
    assert isinstance(pred, LastUpdate)
    step_with(opt, pred, p, 0.5)          # Adagrad's first step: 0.5 / sqrt(0.25) = 1
    assert p.item() == pytest.approx(0.9, rel=1e-5)
    assert pred.predict(p, 2).item() == pytest.approx(0.9 - 0.1 * 2 * 1.0, rel=1e-5)


def test_smoothed_gradient_is_spectrains_moving_average():
    p = scalar_param()
    opt = torch.optim.AdamW([p], lr=0.1)
    pred = SmoothedGradient(opt, smoothing=0.9)
    step_with(opt, pred, p, 0.5)
    step_with(opt, pred, p, 0.25)         # v = 0.9 * (0.1 * 0.5) + 0.1 * 0.25 = 0.07, in torch's units / (1 - 0.9)
    assert pred.predict(p, 2).item() == pytest.approx(p.item() - 0.1 * 2 * 0.7)


def test_smoothed_gradient_matches_momentum_sgds_own_step_in_steady_state():
    p = scalar_param()
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    spec, optim_pred = SmoothedGradient(opt, smoothing=0.9), make_predictor(opt)
    for _ in range(200):                  # a constant gradient: both converge to g / (1 - momentum)
        p.grad = torch.tensor([0.5])
        spec.before_step()
        optim_pred.before_step()
        opt.step()
    assert spec.direction(p).item() == pytest.approx(optim_pred.direction(p).item(), rel=1e-6)


def test_auto_chooses_by_optimizer_class_and_names_are_checked():
    params = [scalar_param()]
    assert make_predictor(torch.optim.SGD(params, lr=0.1)).name == "sgd"
    assert make_predictor(torch.optim.AdamW(params, lr=0.1)).name == "adam"
    assert make_predictor(torch.optim.RMSprop(params, lr=0.1)).name == "rmsprop"
    assert make_predictor(torch.optim.AdamW(params, lr=0.1), "last-update").name == "last-update"
    with pytest.raises(ValueError, match="unknown weight predictor 'nope'.*available: auto"):
        make_predictor(torch.optim.SGD(params, lr=0.1), "nope")
    with pytest.raises(ValueError, match="predictor 'adam' reads the state of"):
        make_predictor(torch.optim.SGD(params, lr=0.1), "adam")


def test_plain_adam_with_decoupled_decay_is_predicted_like_adamw():
    p = scalar_param()
    opt = torch.optim.Adam([p], lr=0.1, eps=1e-3, weight_decay=0.01, decoupled_weight_decay=True)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)
    direction = 0.5 / (0.5 + 1e-3)
    p1 = 1.0 * (1 - 0.1 * 0.01) - 0.1 * direction
    assert p.item() == pytest.approx(p1)
    assert pred.predict(p, 2).item() == pytest.approx(p1 - 0.1 * 2 * direction - 0.1 * 0.01 * 2 * p1)


def test_a_registered_predictor_for_a_subclass_beats_the_builtin():
    class MyAdam(torch.optim.Adam):
        pass

    class MyAdamPredictor(Predictor):
        name = "my-adam"

        def direction(self, p):
            return torch.ones_like(p)

    register_predictor(MyAdam, MyAdamPredictor)
    assert isinstance(make_predictor(MyAdam([scalar_param()], lr=0.1)), MyAdamPredictor)
    assert make_predictor(torch.optim.Adam([scalar_param()], lr=0.1)).name == "adam"


def test_register_predictor_is_the_extension_point():
    class MyOpt(torch.optim.SGD):
        pass

    class MyPredictor(Predictor):
        name = "mine"

        def direction(self, p):
            return torch.ones_like(p)

    register_predictor(MyOpt, MyPredictor)
    p = scalar_param()
    pred = make_predictor(MyOpt([p], lr=0.5))
    assert isinstance(pred, MyPredictor)
    assert pred.predict(p, 2).item() == pytest.approx(1.0 - 0.5 * 2)


def test_predictor_state_round_trips():
    p = scalar_param()
    opt = torch.optim.SGD([p], lr=0.1)
    pred = make_predictor(opt)
    step_with(opt, pred, p, 0.5)
    fresh = make_predictor(opt)
    fresh.load_state_dict(pred.state_dict())
    assert fresh.predict(p, 2).item() == pred.predict(p, 2).item() != p.item()
    with pytest.raises(ValueError, match="saved by 'sgd'"):
        LastUpdate(opt).load_state_dict(pred.state_dict())


# ---- weight versions --------------------------------------------------------------------------
def one_step(module, opt, pred):
    module(torch.randn(4, 3)).sum().backward()
    pred.before_step()
    opt.step()
    pred.after_step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("batch_shape", [(5, 3), (2, 5, 3)])
def test_predicted_forward_backward_sees_live_weights_without_inplace_swaps(batch_shape):
    torch.manual_seed(0)
    layer = nn.Linear(3, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    pred = make_predictor(opt)
    one_step(layer, opt, pred)
    versions = WeightVersions(layer, "predict", pred)
    x = torch.randn(*batch_shape, requires_grad=True)
    out = versions.forward(0, (x,), steps_ahead=3)
    w_hat = layer.weight.detach() - 0.1 * 3 * opt.state[layer.weight]["momentum_buffer"]
    b_hat = layer.bias.detach() - 0.1 * 3 * opt.state[layer.bias]["momentum_buffer"]
    y = x.detach() @ w_hat.T + b_hat
    assert torch.allclose(out, y)                          # the forward used W_hat
    with torch.no_grad():
        layer.weight.add_(1.0)                             # an update lands before the backward
    out.pow(2).sum().backward()
    assert torch.allclose(x.grad, (2 * y) @ layer.weight.detach())      # input grad: live weights
    assert not torch.allclose(x.grad, (2 * y) @ w_hat)
    assert torch.allclose(layer.weight.grad, (2 * y).reshape(-1, 4).T @ x.detach().reshape(-1, 3))
    assert versions.peak_versions == 2


def test_stashed_forward_backward_sees_the_forward_version():
    torch.manual_seed(0)
    layer = nn.Linear(3, 4)
    versions = WeightVersions(layer, "stash")
    x = torch.randn(5, 3, requires_grad=True)
    w0 = layer.weight.detach().clone()
    out = versions.forward(0, (x,))
    with torch.no_grad():
        layer.weight.add_(1.0)
    out.sum().backward()
    assert torch.allclose(x.grad, torch.ones(5, 4) @ w0)
    assert layer.weight.grad is not None


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="weight policy must be one of live, stash, predict"):
        WeightVersions(nn.Linear(2, 2), "swap")


# ---- schedules ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ASYNC)
@pytest.mark.parametrize("stages,n", [(1, 4), (2, 4), (4, 8), (4, 32), (8, 16)])
def test_async_schedules_are_valid_and_fill_the_pipeline(name, stages, n):
    schedule = registry.build(name, stages, n)
    result = simulate(schedule.lower(), Costs(fwd=1.0, bwd=2.0, wgrad=1.0))
    assert result.valid, result.errors[:3]
    assert not schedule.synchronous
    # one fill and one drain per call: makespan (N + D - 1) (F + B)
    assert result.makespan == pytest.approx((n + stages - 1) * 3.0)
    steps = [a for a in schedule.orders[0] if a.kind == "S"]
    assert len(steps) == n // schedule.update_interval()


def test_version_distance_is_d_minus_1_minus_k_in_steady_state():
    schedule = registry.build("pipeoptim", 4, 16)
    for k in range(4):
        gaps = [schedule.steps_ahead(k, mb) for mb in range(16)]
        assert gaps[4:12] == [3 - k] * 8
        assert gaps[:3 - k] == list(range(3 - k))      # the warm-up after a flush is nearer
    code = registry.build("pipeoptim", 4, 16, steps_ahead="code")
    assert code.steps_ahead(0, 8) == 4
    assert registry.build("pipeoptim", 4, 16, steps_ahead=2).steps_ahead(3, 8) == 2


def test_weight_copies_per_stage():
    assert simulate(registry.build("pipedream", 4, 8).lower()).weights_per_rank == [4, 3, 2, 1]   # as reported
    assert registry.build("pipedream", 4, 8).weights_per_rank() == [4, 3, 2, 1]
    assert registry.build("pipedream", 8, 16).weights_per_rank() == [8, 7, 6, 5, 4, 3, 2, 1]
    assert registry.build("pipedream-2bw", 4, 8).weights_per_rank() == [2, 2, 2, 1]
    assert registry.build("pipeoptim", 4, 8).weights_per_rank() == [2, 2, 2, 1]
    assert registry.build("spectrain", 4, 8).weights_per_rank() == [2, 2, 2, 1]


@pytest.mark.parametrize("name,options,message", [
    ("pipeoptim", {"steps_ahead": "future"}, "steps_ahead must be 'paper'.*got 'future'"),
    ("pipeoptim", {"steps_ahead": -1}, "steps_ahead must be"),
    ("pipeoptim", {"steps_ahead": True}, "steps_ahead must be"),
    ("pipeoptim", {"predictor": 3}, "predictor must be 'auto' or a predictor name"),
    ("pipedream-2bw", {"update_interval": 3}, r"micro_batches \(8\) must be a multiple of the update interval \(3\)"),
    ("pipedream-2bw", {"update_interval": 0}, "update_interval must be >= 1"),
    ("spectrain", {"smoothing": 1.0}, r"smoothing must be a number in \[0, 1\)"),
    ("pipedream", {"chunks": 2}, "unknown option 'chunks'"),
])
def test_bad_async_options_are_named(name, options, message):
    with pytest.raises(ValueError, match=message):
        registry.build(name, 4, 8, **options)


# ---- the methods, run in one process --------------------------------------------------------------
def probe_pipeline(name, stages=4, n=8, **options):
    schedule = registry.build(name, stages, n, **options)
    modules = [probes.VersionProbe() for _ in range(stages)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=1.0) for m in modules]
    return schedule, LocalPipeline(schedule, modules, optimizers, nn.functional.mse_loss)


# The probes train by plain SGD: SpecTrain predicts exactly with no smoothing (its default
# 0.9 assumes momentum SGD, and would look 10x too far ahead here).
PROBE_SPECTRAIN = {"smoothing": 0.0}


def expected_versions(schedule, calls):
    """(kind, chunk, mb, call) -> the version each method's definition says that pass sees.

    Asynchronous methods: the independent model's (async_reference: its own unit-time
    timetable of asynchronous 1F1B and each method's rule), nothing read from the schedule's
    tables. A prediction s updates ahead reads v + s on a probe. Synchronous schedules: the
    call's version, every pass.
    """
    if schedule.synchronous:
        return {(kind, k, mb, call): call for call in range(calls) for kind in "FB"
                for k in range(schedule.ranks) for mb in range(schedule.micro_batches)}
    cfg = schedule.config
    return model.probe_versions(schedule.name, schedule.ranks, schedule.micro_batches, calls,
                                cfg.get("update_interval"), cfg.get("steps_ahead", "paper"))


def observed_versions(log, schedule):
    """The probes' readings as versions: an update of G accumulated micro-batches adds G."""
    per_update = schedule.micro_batches if schedule.synchronous else \
        model.default_interval(schedule.name, schedule.ranks, schedule.config.get("update_interval"))
    seen, count = {}, {}
    for kind, chunk, mb, value in log:
        call = count.get((kind, chunk, mb), 0)
        count[(kind, chunk, mb)] = call + 1
        seen[(kind, chunk, mb, call)] = value / per_update
    return seen


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name,options", [("pipedream", {}), ("pipedream-2bw", {}), ("pipeoptim", {}),
                                          ("spectrain", PROBE_SPECTRAIN), ("pipeoptim", {"steps_ahead": "code"}),
                                          ("pipeoptim", {"steps_ahead": 2}), ("1f1b", {})])
def test_each_forward_and_backward_sees_its_definitions_version(name, options, stages):
    """LocalPipeline's probes read, in every pass of 3 calls, the version the independent model gives."""
    n = 2 * stages
    schedule, pipe = probe_pipeline(name, stages, n, **options)
    batches = [(torch.randn(2, 3), torch.randn(2, 3)) for _ in range(n)]
    probes.LOG.clear()
    for _ in range(3):
        pipe.train_batch(batches)
    observed, expected = observed_versions(probes.LOG, schedule), expected_versions(schedule, 3)
    assert len(observed) == len(expected) == 2 * stages * n * 3
    assert observed == expected
    if name == "pipeoptim" and not options:     # exact prediction: the forward sees the backward's version
        later = [(k, v) for k, v in observed.items() if k[3] > 0]
        fwd = {k[1:]: v for k, v in later if k[0] == "F"}
        assert all(fwd[k[1:]] == v for k, v in later if k[0] == "B")
    held = [1] * stages if schedule.synchronous else \
        model.versions_held(name, stages, n, steps_ahead=options.get("steps_ahead", "paper"))
    assert [v.peak_versions for v in pipe.versions] == held
    if not schedule.synchronous:
        assert schedule.weights_per_rank() == held


# ---- LocalPipeline against the independent model of each method (async_reference) ------------------------
def _sgd(**kw):
    return lambda p: torch.optim.SGD(p, **kw), lambda: model.SGD(**kw)


def _adam(decoupled=False, **kw):
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if decoupled:
        kw.setdefault("weight_decay", 0.1)
    return lambda p: torch_cls(p, **kw), lambda: model.Adam(decoupled=decoupled, **kw)


MOMENTUM, ADAM, ADAMW = _sgd(lr=0.1, momentum=0.9), _adam(lr=0.01), _adam(decoupled=True, lr=0.01)
MODEL_CASES = [  # (method, D, N, optimizer, schedule options, clip)
    ("pipedream", 4, 8, MOMENTUM, {}, 0.0), ("pipedream", 3, 6, ADAM, {}, 0.0),
    ("pipedream-2bw", 4, 8, MOMENTUM, {}, 0.0), ("pipedream-2bw", 3, 6, ADAMW, {}, 0.0),
    ("pipedream-2bw", 4, 8, ADAM, {"update_interval": 2}, 0.0),
    ("pipeoptim", 4, 8, MOMENTUM, {}, 0.0), ("pipeoptim", 4, 8, ADAM, {}, 0.0), ("pipeoptim", 4, 8, ADAMW, {}, 0.0),
    ("pipeoptim", 3, 6, ADAMW, {}, 0.0), ("pipeoptim", 2, 4, MOMENTUM, {}, 0.0),
    ("pipeoptim", 4, 8, _sgd(lr=0.1, weight_decay=0.05), {}, 0.0),
    ("pipeoptim", 4, 8, _sgd(lr=0.1, momentum=0.9, nesterov=True), {}, 0.0),
    ("pipeoptim", 4, 8, _adam(lr=0.01, weight_decay=0.05), {}, 0.0),
    ("pipeoptim", 4, 8, MOMENTUM, {"steps_ahead": "code"}, 0.0), ("pipeoptim", 3, 6, ADAMW, {"steps_ahead": 2}, 0.0),
    ("pipeoptim", 4, 8, ADAMW, {"predictor": "last-update"}, 0.0), ("pipeoptim", 4, 8, MOMENTUM, {}, 0.1),
    ("spectrain", 4, 8, MOMENTUM, {}, 0.0), ("spectrain", 4, 8, ADAMW, {}, 0.0),
    ("spectrain", 3, 6, ADAM, {"smoothing": 0.5, "steps_ahead": "code"}, 0.0),
]


def _stage():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh())


@pytest.mark.parametrize("name,stages,n,optimizer,options,clip", MODEL_CASES,
                         ids=[f"{c[0]}-D{c[1]}-{i}" for i, c in enumerate(MODEL_CASES)])
def test_local_pipeline_equals_the_independent_model(name, stages, n, optimizer, options, clip):
    """3 calls (each filled and drained): weights and each call's mean loss equal the model's within 1e-6."""
    torch_opt, model_opt = optimizer
    torch.manual_seed(0)
    modules = [_stage() for _ in range(stages)]
    mine = copy.deepcopy(modules)
    start = copy.deepcopy(modules)
    pipe = LocalPipeline(registry.build(name, stages, n, **options), modules,
                         [torch_opt(m.parameters()) for m in modules], nn.functional.mse_loss, clip=clip)
    reference = model.AsyncReference(name, mine, model_opt, clip=clip,
                                     steps_ahead=options.get("steps_ahead", "paper"),
                                     predictor="last-update" if options.get("predictor") == "last-update"
                                     else "optimizer", smoothing=options.get("smoothing", 0.9),
                                     update_interval=options.get("update_interval"))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [(torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)) for _ in range(n)]
        assert pipe.train_batch(batches) == pytest.approx(reference.train_call(batches), rel=1e-6, abs=1e-7)
    pairs = [(p, q, r) for a, b, c in zip(modules, mine, start)
             for p, q, r in zip(a.parameters(), b.parameters(), c.parameters())]
    assert len(pairs) == 4 * stages
    assert max((p - q).abs().max().item() for p, q, _ in pairs) <= 1e-6
    assert min((q - r).abs().max().item() for _, q, r in pairs) > 1e-3          # every tensor trained
    # what the model ran is what its plan (the expected versions above) says
    plan = model.pass_plan(name, stages, n, 3, options.get("update_interval"), options.get("steps_ahead", "paper"))
    assert reference.seen == plan
    if clip:
        norms = [x for per_stage in reference.norms for x in per_stage]
        assert min(norms) < clip < max(norms)


def test_the_models_timetable_is_asynchronous_1f1b():
    """Written out by hand for D = 4, N = 6: D-1-k warm-up forwards, then one forward and one backward, each
    backward followed by the update; the update distance is D-1-k once full, the warm-up's nearer."""
    slots = model.async_1f1b(4, 6)
    orders = [" ".join(f"{kind}{mb}" for now in slots for k, kind, mb in now if k == stage and kind != "S")
              for stage in range(4)]
    assert orders == ["F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5", "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
                      "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5", "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"]
    steps = [[kind for now in slots for k, kind, _ in now if k == stage] for stage in range(4)]
    assert all(s.count("S") == 6 and all(s[i + 1] == "S" for i, kind in enumerate(s) if kind == "B") for s in steps)
    gaps = {key: b - f for key, (f, b) in model.call_versions(slots, 4).items()}
    assert [[gaps[(k, mb)] for mb in range(6)] for k in range(4)] == [[0, 1, 2, 3, 3, 3], [0, 1, 2, 2, 2, 2],
                                                                     [0, 1, 1, 1, 1, 1], [0] * 6]
    assert len(slots) == 2 * (6 + 4 - 1)         # unit slots: one fill and one drain


@pytest.mark.parametrize("name", ASYNC)
@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                                      lambda p: torch.optim.AdamW(p, lr=0.01)])
def test_with_one_stage_every_method_is_plain_training(name, make_opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    reference = copy.deepcopy(model)
    n = 6
    batches = [(torch.randn(3, 6), torch.randn(3, 6)) for _ in range(n)]
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    pipe = LocalPipeline(registry.build(name, 1, n), [model], [opt], nn.functional.mse_loss)
    for _ in range(2):
        pipe.train_batch(batches)
        for x, y in batches:
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


# ---- fill = continuous: the pipeline stays full across calls ---------------------------------------
@pytest.mark.parametrize("name", ["pipedream", "pipeoptim", "spectrain"])
@pytest.mark.parametrize("stages,n,calls", [(1, 4, 2), (2, 4, 3), (4, 8, 3), (8, 8, 2)])
def test_continuous_calls_fill_the_pipeline_once(name, stages, n, calls):
    """first + steady calls + drain: valid, and one fill and drain for the whole run."""
    schedule = registry.build(name, stages, n, fill="continuous")
    total = calls * n + stages - 1
    result = simulate(schedule.unrolled_program(calls), Costs(fwd=1.0, bwd=2.0, wgrad=1.0))
    assert result.valid, result.errors[:3]
    assert result.makespan == pytest.approx((total + stages - 1) * 3.0)
    # the same orders as one asynchronous 1F1B call over every mini-batch
    assert schedule.unrolled_orders(calls) == registry.build(name, stages, total).orders
    steady = schedule.part_steps_ahead()["steady"]
    assert {steady[(k, j)] for k in range(stages) for j in range(n)} <= set(range(stages))
    assert all(steady[(k, j)] == stages - 1 - k for k in range(stages) for j in range(n))


def test_continuous_is_refused_where_the_drain_cannot_end_an_update():
    with pytest.raises(ValueError, match="fill='continuous' is not supported"):
        registry.build("pipedream-2bw", 4, 8, fill="continuous")
    with pytest.raises(ValueError, match="fill must be 'call'.*or 'continuous'"):
        registry.build("pipeoptim", 4, 8, fill="forever")
