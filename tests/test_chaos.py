"""Chaos: a rank that raises, dies or stops ends the whole job within seconds, names its origin, loses nothing.

The suite runs a few cases that cover every engine and fault kind; the whole seeded grid
(engines x victims x points x faults) runs with ``DS_CHIMERA_CHAOS=full`` (or a number:
that many cases of the shuffled grid), as ``benchmarks/chaos_grid.py`` records in RESULTS.
"""
import os

import pytest

from chaos import Case, check_case, grid, run_case

SUITE = [Case("chimera", 1, "forward", "raise"), Case("1f1b", 2, "send", "kill"),
         Case("zbv", 3, "save", "stop", timeout=5.0), Case("pipeoptim", 0, "step", "raise"),
         Case("wavelet", 2, "sync", "kill")]
FULL = os.environ.get("DS_CHIMERA_CHAOS")
CASES = SUITE if not FULL else grid(seed=0, size=None if FULL == "full" else int(FULL))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_one_rank_fails_every_rank_ends(case, tmp_path):
    check_case(case, run_case(case, str(tmp_path)))
