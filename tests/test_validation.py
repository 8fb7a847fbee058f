"""Every bad input raises a ValueError that names the parameter, the value and what is allowed."""
import pytest

from ds_chimera.schedules import build, get
from ds_chimera.sim import Costs

CASES = [
    ("1f1b", 0, 4, {}, "stages must be >= 1, got 0"),
    ("1f1b", 4, 0, {}, "micro_batches must be >= 1, got 0"),
    ("1f1b", 4.0, 4, {}, "stages must be an integer >= 1, got 4.0"),
    ("gpipe", 4, True, {}, "micro_batches must be an integer >= 1, got True"),
    ("1f1b", 4, 4, {"chunks": 2}, "1f1b: unknown option 'chunks'; allowed options: none"),
    ("chimera", 5, 8, {}, "chimera needs an even number of stages, got 5"),
    ("chimera", 8, 8, {"pipelines": 3}, "pipelines must divide stages/2 = 4 (allowed: [1, 2, 4]), got 3"),
    ("chimera", 8, 8, {"pipelines": 0}, "pipelines must be >= 1, got 0"),
    ("chimera", 4, 8, {"order": "zigzag"}, "order must be one of auto, concat, forward-doubling, merged, zero-bubble; got 'zigzag'"),
    ("chimera", 4, 8, {"costs": {"fwd": -1}}, "cost fwd must be a finite number >= 0, got -1"),
    ("interleaved", 4, 6, {}, "interleaved needs micro_batches to be a multiple of stages (4), got 6"),
    ("interleaved", 4, 8, {"chunks": 0}, "chunks must be >= 1, got 0"),
    ("breadth-first", 4, 8, {"chunks": "2"}, "chunks must be an integer >= 1, got '2'"),
    ("dualpipev", 4, 7, {}, "dualpipev needs micro_batches >= 2 * stages = 8, got 7"),
    ("zbv", 4, 8, {"order": "x"}, "zbv: unknown option 'order'"),
]


@pytest.mark.parametrize("name,d,n,options,message", CASES)
def test_bad_schedule_options(name, d, n, options, message):
    with pytest.raises(ValueError) as err:
        build(name, d, n, **options)
    assert message in str(err.value)


def test_unknown_schedule_lists_the_available_ones():
    with pytest.raises(ValueError) as err:
        get("chimaera")
    text = str(err.value)
    assert "unknown schedule 'chimaera'" in text
    for name in ("1f1b", "chimera", "zbv", "breadth-first", "dualpipev"):
        assert name in text


@pytest.mark.parametrize("kwargs,message", [
    ({"fwd": 0}, "costs fwd and bwd must be > 0"),
    ({"bwd": -2}, "cost bwd must be a finite number >= 0, got -2"),
    ({"wgrad": 3.0}, "cost wgrad must be at most bwd (2.0), got 3.0"),
    ({"comm": "fast"}, "cost comm must be a finite number >= 0, got 'fast'"),
])
def test_bad_costs(kwargs, message):
    with pytest.raises(ValueError) as err:
        Costs(**kwargs)
    assert message in str(err.value)


def test_placement_rejects_ranks_out_of_range():
    from ds_chimera.schedules import Placement
    with pytest.raises(ValueError, match="stage 1 of replica 0 is on rank 5, allowed 0..1"):
        Placement(2, 2, [[0, 5]], [0])
    with pytest.raises(ValueError, match="replica 0 places 1 stages, expected 2"):
        Placement(2, 2, [[0]], [0])
