"""ZeRO-2/3 over the schedules' chunks on DeepSpeed, 4 gloo ranks: equal to single-process training,
the program's gathers and no more, sharded checkpoints (one launch: tests/deepspeed_runs.py).
"""
import pytest

ZERO_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "breadth-first": 2, "zb-h1": 1, "zbv": 2, "dualpipev": 2}
ZERO = [f"zero{z}-2x2-{s}" for s in ZERO_SCHEDULES for z in (2, 3)] + \
    ["zero3-4x1-breadth-first", "zero3-4x1-zbv", "zero3-2x2-breadth-first-keep"]
SCENARIOS = ZERO + ["zero3-ckpt-breadth-first"]


@pytest.mark.parametrize("scenario", ZERO)
def test_sharded_data_parallelism_equals_single_process_training(rank_results, scenario):
    """ZeRO-2/3 over the pipeline's chunks, Adam, the clip active: every rank's weights, losses, norms
    and eval loss as one process; one gather per chunk and step (ZeRO-2, or ZeRO-3 keeping its weights)."""
    for rank, per_rank in enumerate(rank_results):
        r = per_rank[scenario]
        assert max(r["ref_norms"]) > r["clip"], "the clip must be active"
        assert r["max_param_diff"] <= 1e-5 and r["compared_tensors"] >= 16, (rank, r["max_param_diff"])
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)), rank
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["ref_norms"], strict=True)), rank
        assert r["eval_diff"] <= 1e-5, rank
        assert r["gathers"] == [r["program_gathers"]] * 3           # the program's gathers, no more, each step
        chunks = ZERO_SCHEDULES[scenario.split("-", 2)[2].replace("-keep", "")]
        if scenario.startswith("zero2") or scenario.endswith("keep"):
            assert r["program_gathers"] == chunks
        # 1/DP of the weights stays on the rank between gathers
        dp = 2 if "2x2" in scenario else 1
        assert r["shard_bytes"] * dp == r["full_bytes"]
        if "breadth-first" in scenario:
            # one chunk's full gradients at a time (each reduce-scatter ends before the next chunk's
            # backward); ZeRO-3 gathers at most two chunks at once, from initialize on
            assert 0 < r["peak"]["grads"] <= r["chunk_bytes"], (rank, r["peak"])
            if scenario.startswith("zero3") and not scenario.endswith("keep"):
                assert r["peak"]["gathered_weights"] <= 2 * r["chunk_bytes"], (rank, r["peak"])


def test_breadth_first_gathers_less_than_depth_first_under_zero3(results):
    """The breadth-first paper's point, counted: 2V-1 gathers a step for V chunks, far more depth-first."""
    bf, interleaved = results["zero3-2x2-breadth-first"], results["zero3-2x2-interleaved"]
    assert bf["program_gathers"] == 2 * 2 - 1
    assert interleaved["program_gathers"] > 3 * bf["program_gathers"]
    assert results["zero3-4x1-breadth-first"]["program_gathers"] == 3


def test_sharded_checkpoints_resume_and_move_to_unsharded_runs(results):
    r = results["zero3-ckpt-breadth-first"]
    assert r["resume_diff"] == 0.0 and r["to_plain_diff"] == 0.0 and r["back_diff"] == 0.0
    assert "'zero': 3}" in r["refusal"] and "Load the weights only" in r["refusal"]
