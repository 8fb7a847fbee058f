"""Files the package writes load back without unpickling anything else: a tampered one is refused."""
import os
import pickle

import pytest
import torch

from ds_chimera.atomic import torch_save_atomic
from ds_chimera.runtime.checkpoint import load_written


class _Payload:
    """An object whose unpickling would create a file: what a tampered checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_what_the_package_writes_loads_back(tmp_path):
    layer = torch.nn.Linear(3, 2)
    adam = torch.optim.AdamW(layer.parameters(), lr=1e-3, betas=(0.9, 0.95))
    layer(torch.randn(4, 3)).sum().backward()
    adam.step()
    written = {"shards": [p.detach().clone() for p in layer.parameters()], "optimizer": adam.state_dict(),
               "name": "adam", "exp_avg": {0: torch.ones(2)}}          # a shard file and a predictor's state
    torch_save_atomic(written, tmp_path / "state.pt")
    loaded = load_written(tmp_path / "state.pt", "cpu")
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert all(torch.equal(a, b) for a, b in zip(loaded["shards"], written["shards"]))
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], written["optimizer"]["state"][0]["exp_avg"])


def test_a_tampered_checkpoint_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "layer_00-model_states.pt"
    torch.save({"weight": torch.ones(1), "extra": _Payload(marker)}, path, pickle_module=pickle)
    with pytest.raises(ValueError, match="holds objects other than tensors and plain containers"):
        load_written(path, "cpu")
    assert not marker.exists()


def test_stale_folders_are_removed_only_where_this_package_staged_them(tmp_path):
    """A save supersedes what an interrupted one left (TAG.incomplete, TAG.old); a user's own folders with those
    endings, which hold no marker, are never removed, and a save that would need their names is refused."""
    from ds_chimera.runtime import checkpoint as ckpt
    users = [tmp_path / "experiments.old", tmp_path / "notes.incomplete"]
    for folder in users:
        folder.mkdir()
        (folder / "keep.txt").write_text("mine")
    crashed = ckpt.start_staging(str(tmp_path), "global_step5")      # a save that died before publishing
    assert os.path.isfile(os.path.join(crashed, ckpt.STAGING_MARKER))
    ckpt.remove_stale(str(tmp_path))
    assert not os.path.exists(crashed)
    assert all((folder / "keep.txt").read_text() == "mine" for folder in users)
    with pytest.raises(ValueError, match="experiments.old exists and was not made by ds_chimera"):
        ckpt.start_staging(str(tmp_path), "experiments")
    with pytest.raises(ValueError, match="notes.incomplete exists and was not made by ds_chimera"):
        ckpt.start_staging(str(tmp_path), "notes")
    assert all((folder / "keep.txt").read_text() == "mine" for folder in users)
