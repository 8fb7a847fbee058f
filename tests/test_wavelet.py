"""Wavelet: layout, memory model, options, and the tick-tock engine on 4 CPU processes."""
import json
import os
import subprocess
import sys

import pytest
import torch

from netutil import free_port

from ds_chimera.sim.memory import TaskMemory, wavelet_memory
from ds_chimera.wavelet import TICK, TOCK, WaveLayout, wavelet_reference

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "wavelet_worker.py")


def test_layout_pairs_each_tick_task_with_the_tock_task_on_its_device():
    tasks = [WaveLayout(r, 8, 4) for r in range(8)]          # 2 nodes x 2 devices x 2 waves
    assert [t.wave for t in tasks] == [TICK, TICK, TOCK, TOCK] * 2
    assert [t.device for t in tasks] == [0, 1, 0, 1] * 2
    assert [t.partner for t in tasks] == [2, 3, 0, 1, 6, 7, 4, 5]
    assert tasks[0].wave_ranks(TICK) == [0, 1, 4, 5] and tasks[0].wave_ranks(TOCK) == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="ranks per node \\(3\\) must be even"):
        WaveLayout(0, 3, 3)


def test_memory_model_offset_waves_peak_below_gang_scheduling():
    # B = 2F: at tick's peak the tock task is three quarters through its backward
    task = TaskMemory(static=1.0, activations=4.0, fwd=1.0, bwd=2.0)
    m = wavelet_memory(task)
    assert m["gang"] == 2 * 1.0 + 2 * 4.0
    assert m["offset_waves"] == pytest.approx(2 * 1.0 + 1.25 * 4.0)
    assert m["doubled_batch"] == 1.0 + 2 * 4.0
    assert m["one_task"] == 5.0
    # F = B: the two triangles interleave exactly, the activations never exceed one task's
    assert wavelet_memory(TaskMemory(0.0, 1.0, 1.0, 1.0))["offset_waves"] == pytest.approx(1.0)
    assert task.two_tasks_peak(0.0) == m["gang"]
    with pytest.raises(ValueError, match="activations must be a number >= 0"):
        TaskMemory(1.0, -1.0)


def test_wavelet_options_are_checked_before_any_work():
    from ds_chimera.wavelet.engine import wavelet_options
    assert wavelet_options({"wavelet": {"enabled": True}}) == {"offset": 0.5, "timeout": 300.0}
    with pytest.raises(ValueError, match="'waves' is not understood; allowed: enabled, offset, timeout"):
        wavelet_options({"wavelet": {"enabled": True, "waves": 3}})
    with pytest.raises(ValueError, match=r"offset.*in \[0, 1\), got 1.5"):
        wavelet_options({"wavelet": {"offset": 1.5}})
    with pytest.raises(ValueError, match="wavelet with ZeRO stage 1"):
        wavelet_options({"wavelet": {}, "zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError, match="wavelet with bf16"):
        wavelet_options({"wavelet": {}, "bf16": {"enabled": True}})


def test_reference_recurrence_is_one_update_stale():
    """W(n) = W(n-1) - lr g(W(n-2)): checked on a 1-d quadratic, by hand."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    x, y = torch.ones(1, 1), torch.zeros(1, 1)       # loss = w^2, gradient 2w
    wavelet_reference(model, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.functional.mse_loss,
                      lambda wave, step: [(x, y)], steps=2)
    w = [1.0, 1.0]                                   # W(-1) = W(0) = 1
    for _ in range(4):
        w.append(w[-1] - 0.1 * 2 * w[-2])
    assert model.weight.item() == pytest.approx(w[-1])


def _env(extra=None):
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra or {}))


def test_engine_equals_the_documented_recurrence(tmp_path):
    out = tmp_path / "wavelet.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
           str(free_port()), WORKER, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["waves"] == {"tick": [0, 1], "tock": [2, 3]}
    assert r["max_diff_between_tasks"] == 0.0        # one model on all four tasks
    assert r["max_diff_reference"] <= 1e-6           # exactly the staleness-1 recurrence
    assert r["max_diff_sync"] > 1e-3                 # and measurably not synchronous training
    assert r["global_steps"] == r["updates"]         # every task applied every update of both waves
    # NCCL-ready: no collective or message (training, drain, checkpoint save and load) ran on a group that
    # holds both tasks of a device; they talk through shared memory, the checkpoint barriers via the store
    assert r["calls"] >= 4 and r["groups_with_a_device_pair"] == []      # (4 steps: 4 wave all-reduces at least)


def held_check(variant: list) -> dict:
    """From the counted bytes of one run: are the waves offset (each device's peak at most 0.75 of
    its two tasks' peaks added, which gang scheduling reaches), and did every task hold nothing
    for the backward once its backward ended."""
    from ds_chimera.wavelet.meter import pair_peaks
    ratios = []
    for task in variant:
        if task["wave"] == TICK:                         # the tick task's rows hold both tasks of its device
            peaks = pair_peaks(task["rows"])
            ratios.append(peaks["saved_sum"] / (peaks["saved_tick"] + peaks["saved_tock"]))
    return {"offset": max(ratios) <= 0.75, "released": all(v == 0 for t in variant for v in t["after_backward"]),
            "ratios": [round(r, 2) for r in ratios]}


def test_waves_are_offset_and_release_each_micro_batch_by_the_counted_bytes(tmp_path):
    """The check passes for the offset waves and fails for a gang-scheduled run and for a task that
    keeps each micro-batch's graph (and its saved tensors) past the backward."""
    out = tmp_path / "memory.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
           str(free_port()), WORKER, "--memory", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = json.loads(out.read_text())
    offset, gang, held = (held_check(runs[name]) for name in ("offset", "gang", "held"))
    assert offset["offset"] and offset["released"], offset
    assert not gang["offset"] and gang["released"], gang
    assert not held["released"], held


def test_cli_reports_the_memory_model():
    import subprocess
    out = subprocess.run([sys.executable, "-m", "ds_chimera.cli", "memory", "--static", "1", "--activations", "4",
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    peaks = json.loads(out.stdout)
    assert peaks["offset_waves"] == pytest.approx(7.0) and peaks["gang"] == 10.0 and peaks["doubled_batch"] == 9.0
    bad = subprocess.run([sys.executable, "-m", "ds_chimera.cli", "memory", "--static", "1", "--activations", "4",
                          "--offset", "1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--offset must be a fraction of a cycle" in bad.stderr
