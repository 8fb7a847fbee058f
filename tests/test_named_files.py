"""Every file the config names or a checkpoint holds, missing, truncated, garbage, of the wrong shape or written for
another layout: one ValueError naming the key (or checkpoint), the path, what is wrong and the fix."""
import json
from types import SimpleNamespace

import pytest
import torch

from ds_chimera.config import PipelineConfig
from ds_chimera.planner.deepspeed import _plan_section, _reused_plan, _saved_plan
from ds_chimera.planner.profile import Profile
from ds_chimera.named_files import read_named_file
from ds_chimera.runtime import checkpoint as ckpt
from ds_chimera.schedules.from_program import ProgramSchedule
from ds_chimera.schedules import build


class _OneRank:
    """torch.distributed as a single rank sees it (rank 0, broadcasts leave the object as it is)."""

    @staticmethod
    def get_rank():
        return 0

    @staticmethod
    def broadcast_object_list(objects, src=0):
        return None


def _damage(path, kind):
    if kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(b"\x00\xffnot this file at all\n")


# ---- plan_file --------------------------------------------------------------------------------

def _plan_file(tmp_path, section=None):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"pipeline": section or {"schedule": "1f1b", "parts": [0, 4, 8, 12, 16]}}, indent=1))
    return path


@pytest.mark.parametrize("damage,expected", [
    ("truncated", "JSONDecodeError: .*line"),
    ("garbage", "(UnicodeDecodeError|JSONDecodeError)"),
    ("wrong shape", 'expected \\{"pipeline": \\{"schedule": NAME'),
])
def test_a_damaged_plan_file_names_the_key_the_path_and_the_fix(tmp_path, damage, expected):
    path = _plan_file(tmp_path)
    if damage == "wrong shape":
        path.write_text(json.dumps({"pipeline": "chimera"}))
    else:
        _damage(path, damage)
    with pytest.raises(ValueError, match=f'"pipeline": plan_file .*plan.json.* cannot be used: .*{expected}') as err:
        _saved_plan(str(path), _OneRank)
    assert "delete it to plan again" in str(err.value)


def test_a_plan_file_for_another_layout_says_so_and_not_parts(tmp_path):
    module = SimpleNamespace(_layer_specs=[None] * 16, _grid=SimpleNamespace(pipe_parallel_size=2, data_parallel_size=1))
    pipeline = PipelineConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
                                              "pipeline": {"schedule": "auto"}})
    section = _plan_section(str(_plan_file(tmp_path)))          # 1f1b cut into 4 stages: written for D = 4
    with pytest.raises(ValueError, match="plan_file .* was written for 4 stages over 16 layers; this run cuts 16 "
                                         "layers into 2 stages .*delete it to plan again"):
        _reused_plan(pipeline, section, tmp_path / "plan.json", module)
    section["schedule"] = "chimaera"
    with pytest.raises(ValueError, match="plan_file .* cannot be used: unknown schedule 'chimaera'"):
        _reused_plan(pipeline, section, tmp_path / "plan.json", module)


# ---- profile_file -----------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong shape", "missing"])
def test_a_damaged_profile_file_names_the_key_the_path_and_the_fix(tmp_path, damage):
    from ds_chimera.planner.profile import LayerCost
    path = tmp_path / "profile.json"
    Profile((LayerCost("0:Linear", 1e-3, 2e-3, 1e-3, 64, 64, 256, 64),)).save(str(path))
    if damage == "wrong shape":
        path.write_text(json.dumps([1, 2, 3]))
    elif damage == "missing":
        path.unlink()
    else:
        _damage(path, damage)
    with pytest.raises(ValueError, match='"pipeline": profile_file .*profile.json.* (cannot be used|does not exist)'
                                         '.*delete it to profile again'):
        read_named_file('"pipeline": profile_file', path, Profile.load,
                        "delete it to profile again, or name a profile an earlier run of this model wrote")


# ---- program ----------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage", "another layout"])
def test_a_damaged_program_file_names_the_key_the_path_and_the_fix(tmp_path, damage):
    path = tmp_path / "zbv.program"
    path.write_text(build("zbv", 4, 8).lower().dump())
    if damage == "missing":
        path.unlink()
    elif damage == "another layout":
        with pytest.raises(ValueError, match='"program": .*zbv.program.* is a program for 4 pipeline ranks; this run '
                                             'has 2'):
            ProgramSchedule.from_file(str(path), 2, 8)
        return
    else:
        _damage(path, damage)
    with pytest.raises(ValueError, match='"pipeline": program .*zbv.program.* (does not exist|cannot be used).*'
                                         "--dump-program"):
        ProgramSchedule.from_file(str(path), 4, 8)


# ---- checkpoint files -------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_layout_file_names_the_checkpoint_and_the_fix(tmp_path, damage):
    tag = tmp_path / "global_step4"
    tag.mkdir()
    path = tag / ckpt.LAYOUT_FILE
    path.write_text(json.dumps({"schedule": "chimera", "stages": 4, "parts": [0, 4, 8, 12, 16]}))
    _damage(path, damage)
    with pytest.raises(ValueError, match="checkpoint .*global_step4: its layout file .* cannot be used.*load another "
                                         "tag, or its weights only"):
        ckpt.saved_layout(str(tmp_path), "global_step4")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_layer_file_names_the_file_and_the_fix(tmp_path, damage):
    path = tmp_path / "layer_03-model_states.pt"
    torch.save({"weight": torch.randn(64, 64), "bias": torch.zeros(64)}, path)
    _damage(path, damage)
    with pytest.raises(ValueError, match="checkpoint file .*layer_03-model_states.pt is damaged.*load another tag"):
        ckpt.load_written(str(path), "cpu")
