"""The runtime's all-reduce on 4 gloo ranks: small CPU tensors go by a direct exchange.

It must give the sum (as gloo's ring does, to rounding), bitwise the same on every member
(Chimera's replicas stay identical), keep several syncs on one group apart, leave large
tensors to the ring, and turn a silent peer into the runtime's clear error.
"""
import json
import os

import pytest

from netutil import run_ranks

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "allreduce_worker.py")
TOLERANCE = {"torch.float64": 1e-12, "torch.float32": 1e-5, "torch.bfloat16": 0.1}


@pytest.fixture(scope="module")
def reports():
    outputs, _ = run_ranks([SCRIPT], 4, {"OMP_NUM_THREADS": "1"}, timeout_s=180)
    found = {}
    for rank, (code, out, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        found[rank] = json.loads(out.strip().splitlines()[-1])
    return found


def test_small_tensors_take_the_exchange_and_sum_correctly(reports):
    for report in reports.values():
        cases = report["cases"]
        assert len(cases) == 8          # every rank is in the world group and in one pair
        for case in cases:
            assert case["exchange"], case
            assert case["err_vs_exact"] <= TOLERANCE[case["dtype"]], case
            assert case["err_vs_ring"] <= TOLERANCE[case["dtype"]], case


def test_every_member_gets_bitwise_the_same_result(reports):
    for report in reports.values():
        assert all(case["members_bitwise_equal"] for case in report["cases"]), report["cases"]


def test_syncs_in_flight_on_one_group_stay_apart(reports):
    for report in reports.values():
        assert report["in_flight_err"] < 1e-6


def test_large_tensors_take_the_ring(reports):
    for report in reports.values():
        assert report["small_uses_exchange"] and not report["big_uses_exchange"]
        assert report["big_is_ring_work"] and report["big_sum_ok"]


def test_a_silent_peer_is_a_clear_error(reports):
    for rank in (0, 1, 2):
        text = reports[rank]["missing_peer"]
        assert "stage 9" in text and "died or is stuck" in text, text
    assert "missing_peer" not in reports[3]
