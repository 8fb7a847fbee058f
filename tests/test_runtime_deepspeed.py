"""Every synchronous schedule on DeepSpeed, 4 gloo ranks: equal to single-process training.

The DeepSpeed runtime's scenarios run in one 4-rank launch per family (tests/deepspeed_runs.py), so a
crashing scenario fails its family only: this file's are the schedules against one process (plain, data
parallel, clipped, tied, checkpointed, ZeRO-1, bf16); the others are test_runtime_deepspeed_*.py.
"""
import pytest

from tiers import FULL

SCHEDULES = ["gpipe", "1f1b", "interleaved", "breadth-first", "chimera", "chimera-fd", "chimera-merged",
             "chimera-concat", "chimera-zb", "zb-h1", "zbv", "dualpipev"]
# at D = 4, N = 8 Chimera's default order is zero-bubble: "chimera" there is "chimera-zb"
EQUIV = [f"equiv-{topo}-{s}" for topo in ("4x1", "2x2") for s in SCHEDULES
         if (topo, s) != ("4x1", "chimera-zb")] + ["equiv-4x1-chimera-zb-f2"]
UNCLIPPED = EQUIV + ["program-4x1-chimera-zb", "unclipped-tied-4x1-chimera", "unclipped-zero1-2x2-breadth-first",
                     "unclipped-actckpt-4x1-chimera"]
CLIPPED = ["clipped-4x1-chimera", "clipped-2x2-chimera", "clipped-4x1-interleaved", "tied-4x1-chimera",
           "tied-4x1-1f1b", "tied-2x2-zbv", "zero1-2x2-breadth-first", "zero1-2x2-zbv", "zero1-2x2-zbv-tied",
           "zero1-2x2-breadth-first-end", "zero1-4x1-chimera", "zero1-4x1-1f1b-tied"] + \
    (["zero1-2x2-chimera", "zero1-4x1-chimera-tied"] if FULL else [])     # make test-full: the other ZeRO-1 copies
INPLACE = ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1", "zbv"]
SCENARIOS = UNCLIPPED + CLIPPED + [
    "actckpt-4x1-chimera", "actckpt-4x1-zb-h1", "actckpt-4x1-chimera-zb", "actckpt-4x1-interleaved", "stock-clipping",
    "bf16-4x1-chimera", "bf16-2x2-zbv", "bf16-4x1-stock", "bf16-4x1-1f1b-noclip", "inplace-actckpt"]


@pytest.mark.parametrize("scenario", UNCLIPPED + CLIPPED)
def test_schedule_equals_single_process_training(rank_results, scenario):
    """On every rank: weights, the global mean loss, the eval loss and the gradient norm of each step.

    The unclipped cases are what catch a wrong gradient scale (a clipped step rescales it
    away); the clipped ones check the clip on the true global norm.
    """
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        if scenario in UNCLIPPED:
            assert max(r["ref_norms"]) < r["clip"], "the clip must stay inactive: the gradient scale is under test"
        else:
            assert max(r["ref_norms"]) > r["clip"], "clipping must be active for this test to mean anything"
        assert r["max_param_diff"] <= 1e-5, (rank, r["max_param_diff"])
        assert r["compared_tensors"] >= r["reference_tensors"] > 0
        assert r["max_loss_diff"] <= 1e-5, rank     # train_batch returns the global mean loss on every rank
        assert r["eval_diff"] <= 1e-5, rank
        assert len(r["norms"]) == len(r["ref_norms"]) == 3
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["ref_norms"])), (rank, r["norms"],
                                                                                       r["ref_norms"])
        assert r["replica_spread"] == 0.0      # Chimera's replicas (and DP copies) stay identical
        # the actckpt case checkpoints blocks of (Linear, Tanh): each Tanh runs again in the backward
        assert r["tanh_forwards_per_micro_batch"] == (2.0 if "actckpt" in scenario else 1.0)


@pytest.mark.parametrize("scenario", EQUIV)
def test_receives_are_posted_ahead_of_need(results, scenario):
    # gloo holds a send until its receive is posted; steps after the first (shapes known)
    # post receives early, so the data can arrive while the rank computes
    assert results[scenario]["early_receives"] > 0


def test_chimera_holds_two_replicas_per_stage(results):
    assert results["equiv-4x1-chimera"]["copies"] == 2
    assert results["equiv-2x2-chimera"]["copies"] == 4      # 2 replicas x 2 data-parallel
    assert results["equiv-4x1-1f1b"]["copies"] == 1
    assert results["equiv-4x1-chimera-zb-f2"]["copies"] == 4   # two pipelines each way


@pytest.mark.parametrize("scenario,forwards", [
    # blocks of two layers (Linear, Tanh): checkpointed (they have parameters), so each Tanh runs twice
    ("actckpt-4x1-chimera", 2.0), ("actckpt-4x1-interleaved", 2.0),
    # blocks of one layer under a split backward: as DeepSpeed, only the Linear blocks are checkpointed,
    # a parameter-free Tanh runs once (and results still equal single-process training)
    ("actckpt-4x1-zb-h1", 1.0), ("actckpt-4x1-chimera-zb", 1.0)])
def test_activation_checkpointing(results, scenario, forwards):
    r = results[scenario]
    assert r["max_param_diff"] <= 1e-5 and r["max_loss_diff"] <= 1e-5
    assert r["tanh_forwards_per_micro_batch"] == forwards


def test_global_norm_clipping_where_deepspeed_stock_is_wrong(results):
    r = results["stock-clipping"]
    assert r["ours"] <= 1e-5
    assert r["stock"] > 1e-3      # DeepSpeed 0.19.8's fp32 pipeline clipping uses a partial norm


@pytest.mark.parametrize("scenario", ["bf16-4x1-chimera", "bf16-2x2-zbv", "bf16-4x1-1f1b-noclip"])
def test_bf16_with_deepspeeds_bf16_optimizer(results, scenario):
    """bf16 weights, fp32 master weights and grads: as close to fp32 training as DeepSpeed's own bf16."""
    r, stock = results[scenario], results["bf16-4x1-stock"]
    assert r["max_param_diff"] <= 2 * stock["max_param_diff"] + 1e-4
    assert r["max_param_diff"] < 5e-3
    assert all(abs(a - b) <= 3e-3 * abs(b) for a, b in zip(r["losses"], r["ref_losses"]))
    assert r["replica_spread"] == 0.0


@pytest.mark.parametrize("name", INPLACE)
def test_activation_checkpointing_with_in_place_layers_trains_as_the_stock_engine(results, name):
    """DeepSpeed checkpoints only blocks with parameters: a lone ReLU(inplace=True) runs as it is."""
    r = results["inplace-actckpt"]
    assert len(r[name]) == len(r["stock"]) == 2
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r[name], r["stock"])), (name, r)


@pytest.mark.parametrize("scenario,early", [("zero1-2x2-breadth-first", 2), ("zero1-2x2-zbv", 2),
                                            ("zero1-2x2-breadth-first-end", 0)])
def test_zero1_reduces_each_chunk_when_it_is_done(results, scenario, early):
    """ZeRO-1: a chunk's gradients go to ZeRO's reduction at its SyncStart (both chunks per rank), or all at the end."""
    assert results[scenario]["zero1_early_chunks"] == early
