"""The asynchronous schedules (PipeOptim, PipeDream, 2BW, SpecTrain) on DeepSpeed, 4 gloo ranks: equal to the
independent model of each method and to LocalPipeline (one launch: tests/deepspeed_runs.py).
"""
import pytest

from tiers import FULL

ASYNC_OPTIONS = {"pipeoptim-code": {"steps_ahead": "code"}, "pipeoptim-last": {"predictor": "last-update"}}
ASYNC_KEYS = ["pipedream", "pipedream-2bw", "pipeoptim", "spectrain", "pipeoptim-code", "pipeoptim-last"]
ASYNC_BF16 = ["async-bf16-4x1-pipeoptim", "async-bf16-2x2-pipedream"] + (["async-bf16-4x1-spectrain"] if FULL else [])
ASYNC_BF16_PROBES = ["pipeoptim"] + (["pipedream-2bw"] if FULL else [])
CONTINUOUS = ["async-continuous-pipeoptim"] + (["async-continuous-pipedream", "async-continuous-spectrain-code"]
                                               if FULL else [])
ASYNC = ([f"async-{topo}-{k}" for topo in ("4x1", "2x2") for k in ASYNC_KEYS] + [f"async-probe-{k}" for k in ASYNC_KEYS]
         + ["async-ckpt-resume-pipeoptim", "async-ckpt-resume-2x2-pipedream"]
         + ASYNC_BF16 + [f"async-bf16-probe-{k}" for k in ASYNC_BF16_PROBES] + CONTINUOUS
         + ["async-clipped-4x1-pipeoptim", "async-clipped-2x2-pipedream"])
ASYNC_VERSUS = [s for s in ASYNC if s.startswith(("async-4x1", "async-2x2", "async-clipped"))]
SCENARIOS = ASYNC + ["bad-async-tied", "bad-async-actckpt", "bad-async-bf16", "bad-async-steps-ahead"]


@pytest.mark.parametrize("scenario", ASYNC_BF16)
def test_async_bf16_through_deepspeeds_bf16_optimizer(rank_results, scenario):
    """bf16 weights, fp32 master weights and state (predictions read them): fp32 training to bf16 rounding,
    against LocalPipeline and against the independent model of the method (async_reference)."""
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["max_param_diff"] < 5e-3 and r["model_param_diff"] < 5e-3, rank
        for ref in (r["ref_losses"], r["model_losses"]):
            assert len(ref) == len(r["losses"]) == 2
            assert all(abs(a - b) <= 5e-3 * abs(b) for a, b in zip(r["losses"], ref)), (rank, r["losses"], ref)
        assert r["versions_held"] == ([2, 2, 2, 1] if "4x1" in scenario else [2, 2, 1, 1])


@pytest.mark.parametrize("name", ASYNC_BF16_PROBES)
def test_async_bf16_weight_versions(results, name):
    from test_pipeoptim import expected_versions, observed_versions

    from ds_chimera.schedules import registry
    r = results[f"async-bf16-probe-{name}"]
    schedule = registry.build(name, 4, r["n"])
    assert observed_versions([tuple(e) for e in r["log"]], schedule) == expected_versions(schedule, r["calls"])


@pytest.mark.parametrize("scenario", ASYNC_VERSUS)
def test_async_engine_equals_the_methods_independent_model(rank_results, scenario):
    """On every rank, the same global mini-batches: the distributed engine equals the independent model of its
    method (tests/distributed/async_reference.py, which shares nothing with the runtime) in weights, the
    mean loss of each call and each call's last stage gradient norm; and LocalPipeline. Unclipped, so that a
    wrong gradient scale moves the weights; the clipped cases clip some updates and not others."""
    stages, n = (4, 8) if "4x1" in scenario else (2, 4)
    interval = stages if "2bw" in scenario else 1         # 2BW accumulates D micro-batches per update
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["model_param_diff"] <= 1e-6, (rank, r["model_param_diff"])
        assert r["max_param_diff"] <= 1e-6, (rank, r["max_param_diff"])
        assert len(r["losses"]) == len(r["model_losses"]) == len(r["ref_losses"]) == 2
        assert r["model_loss_diff"] <= 1e-5 and r["max_loss_diff"] <= 1e-5, rank
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["model_norms"])), (rank, r["norms"],
                                                                                          r["model_norms"])
        assert r["global_steps"] == 2 * n // interval          # two calls, one optimizer step per update
        assert r["updates"] == stages * 2 * n // interval
        if "clipped" in scenario:
            assert 0 < r["updates_clipped"] < r["updates"], "clipping must be active on some updates only"
        else:
            assert r["clip"] > 1e3 and r["updates_clipped"] == 0


@pytest.mark.parametrize("key", ASYNC_KEYS)
def test_weight_copies_each_rank_holds(rank_results, key):
    from ds_chimera.schedules import registry
    name = "pipeoptim" if key.startswith("pipeoptim") else key
    held = rank_results[0][f"async-4x1-{key}"]["versions_held"]
    assert held == registry.build(name, 4, 8, **ASYNC_OPTIONS.get(key, {})).weights_per_rank()
    # the last stage's backward follows its forward at once, except where s = D-k looks one update further
    assert held == {"pipedream": [4, 3, 2, 1], "pipeoptim-code": [2, 2, 2, 2]}.get(key, [2, 2, 2, 1])
    for topo in ("4x1", "2x2"):          # the independent model's count, rank by rank
        for rank, per_rank in enumerate(rank_results):
            r = per_rank[f"async-{topo}-{key}"]
            assert r["versions_held"][rank] == r["model_versions_held"][r["stage_of_rank"][0]], (topo, rank)


@pytest.mark.parametrize("key", ASYNC_KEYS)
def test_instrumented_run_shows_each_methods_weight_versions(results, key):
    """Every forward and backward on every rank reads the version its method's definition gives
    (expected_versions: from the independent model's timetable, async_reference.pass_plan)."""
    from test_pipeoptim import PROBE_SPECTRAIN, expected_versions, observed_versions

    from ds_chimera.schedules import registry
    r = results[f"async-probe-{key}"]
    options = PROBE_SPECTRAIN if key == "spectrain" else ASYNC_OPTIONS.get(key, {})
    schedule = registry.build("pipeoptim" if key.startswith("pipeoptim") else key, 4, r["n"], **options)
    observed = observed_versions([tuple(e) for e in r["log"]], schedule)
    expected = expected_versions(schedule, r["calls"])
    assert len(observed) == len(expected) == 2 * 4 * r["n"] * r["calls"]
    assert observed == expected


@pytest.mark.parametrize("scenario,files", [("async-ckpt-resume-pipeoptim", 4), ("async-ckpt-resume-2x2-pipedream", 0)])
def test_async_checkpoint_resume_is_exact(results, scenario, files):
    r = results[scenario]
    assert r["max_param_diff"] == 0.0
    assert len([f for f in r["files"] if f.startswith("ds_chimera_predictor")]) == files


@pytest.mark.parametrize("scenario,message", [
    ("bad-async-tied", "weights tied across layers (TiedLayerSpec) would diverge"),
    ("bad-async-actckpt", "activation_checkpoint_interval=1: recomputation in the backward would see the live"),
    ("bad-async-bf16", "schedule 'spectrain' with bf16 and data parallelism: DeepSpeed's BF16_Optimizer shards"),
    ("bad-async-steps-ahead", "steps_ahead must be 'paper' (s = D-1-k), 'code' (s = D-k) or an integer >= 0; got 'later'"),
])
def test_bad_async_config_fails_at_initialize(results, scenario, message):
    assert message in (results[scenario]["error"] or "")


@pytest.mark.parametrize("scenario", CONTINUOUS)
def test_pipeline_kept_full_across_calls(rank_results, scenario):
    """fill='continuous': 2 calls of 8 then drain() equal one asynchronous 1F1B run over the 19 mini-batches,
    of the independent model (async_reference) and of LocalPipeline; on every rank."""
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["model_param_diff"] <= 1e-6 and r["max_param_diff"] <= 1e-6, rank
        assert abs(r["mean_loss"] - r["model_mean_loss"]) <= 1e-5, rank
        assert abs(r["mean_loss"] - r["ref_mean_loss"]) <= 1e-5, rank
        assert r["global_steps"] == r["total"]           # every mini-batch one update, the drained ones too
