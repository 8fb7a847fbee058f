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


# ---- the DeepSpeed "pipeline" section: checked whole, on every rank, before any work -------------------
def _plan(section, **config):
    from ds_chimera.config import PipelineConfig
    from ds_chimera.runtime.plan import make_plan
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "pipeline": section, **config}
    return make_plan(PipelineConfig.from_deepspeed(config), 4, 1, 16,
                     lambda stages, method: [4 * i for i in range(stages + 1)])


@pytest.mark.parametrize("section,message", [
    ({"Schedule": "chimera"}, "unknown key 'Schedule'. Did you mean 'schedule'?"),
    ({"scheduler": "chimera"}, "unknown key 'scheduler'. Did you mean 'schedule'?"),
    ({"schedule": "chimera", "pipeline": 2}, "unknown key 'pipeline'. Did you mean 'pipelines'?"),
    ({"schedule": "1f1b", "chunk": 2}, "(schedule '1f1b'): unknown key 'chunk'."),
    ({"timeout": 10}, "has 'timeout' but no \"schedule\": name one of 1f1b,"),
    ({"schedule": "chimera", "costs": "cheap"}, "chimera: costs must be a mapping such as {\"fwd\": 1"),
    ({"schedule": "chimera", "costs": {"fwd": 1, "backward": 2}}, "unknown key 'backward'."),
    ({"schedule": "chimera", "timeout": float("nan")}, "timeout must be a finite number of seconds > 0, got nan"),
    ({"schedule": "chimera", "timeout": float("inf")}, "timeout must be a finite number of seconds > 0, got inf"),
    ({"schedule": "chimera", "timeout": True}, "timeout must be a finite number of seconds > 0, got True"),
    ({"schedule": "chimera", "program": "x.program"}, 'takes "schedule" (a name) or "program"'),
    ("chimera", 'must be a JSON object such as {"schedule": "chimera"}, got \'chimera\''),
])
def test_the_pipeline_section_is_checked_whole(section, message):
    with pytest.raises(ValueError) as err:
        _plan(section)
    assert message in str(err.value)


def test_only_deepspeeds_own_pipeline_keys_leave_the_stock_engine_alone():
    from ds_chimera.config import asks_for_schedule
    assert not asks_for_schedule(None) and not asks_for_schedule({"stages": 4, "partition": "uniform"})
    assert asks_for_schedule({"stages": 4, "Schedule": "chimera"})       # ours, so checked (and refused)
    with pytest.raises(ValueError, match='"pipeline" must be a JSON object'):
        asks_for_schedule(["chimera"])


def test_an_unwritable_trace_dir_fails_at_initialize(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"trace_dir '.*file/trace' cannot be created or written"):
        _plan({"schedule": "1f1b", "trace_dir": str(blocker / "trace")})
    assert _plan({"schedule": "1f1b", "trace_dir": str(tmp_path / "t")}).trace_dir == str(tmp_path / "t")
    assert (tmp_path / "t").is_dir()


def test_auto_batch_keys_are_the_hf_trainers_to_fill():
    from ds_chimera.config import without_auto_batch_keys
    assert without_auto_batch_keys({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                                    "gradient_accumulation_steps": 8}) == {"train_micro_batch_size_per_gpu": 2,
                                                                           "gradient_accumulation_steps": 8}
    with pytest.raises(ValueError, match='leaves every batch size to "auto".*"gradient_accumulation_steps": 8'):
        without_auto_batch_keys({k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                     "gradient_accumulation_steps")})
