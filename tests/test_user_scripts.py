"""DeepSpeed pipeline scripts as their users write them, against DeepSpeed's stock engine.

``distributed/dsexamples_pipeline.py`` has the shape of DeepSpeedExamples' pipeline
script: ``nn.Module`` instances and a lambda as layers, ``training_data=`` and
``engine.train_batch()``, the config from ``--deepspeed_config``. It runs unchanged on 4
ranks under stock DeepSpeed and, with only the config's ``"pipeline"`` key added, under
``ds-chimera launch`` (and under plain torchrun with ``import ds_chimera``): the losses on
every rank and the final weights equal the stock engine's.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from netutil import free_port
from tiers import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "distributed", "dsexamples_pipeline.py")
STEPS = 4


def run_script(tmp_path, schedule, launcher="ds-chimera"):
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}}}
    if schedule is not None:
        config["pipeline"] = {"schedule": schedule}
    name = schedule or "stock"
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    result = tmp_path / f"{name}.pt"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", DSX_RESULT=str(result))
    port = str(free_port())
    if launcher == "ds-chimera":
        cmd = [sys.executable, "-m", "ds_chimera.cli", "launch", "--torchrun", "--nproc_per_node", "4",
               "--master_port", port]
    else:         # plain torchrun, the script importing ds_chimera itself
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", port]
        env["DSX_IMPORT_DS_CHIMERA"] = "1"
    proc = subprocess.run(cmd + [SCRIPT, "-p", "4", "--steps", str(STEPS), "--deepspeed_config", str(path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(f"{result}.rank{r}", weights_only=False) for r in range(4)]
    weights = {}
    for part in ranks:
        for idx, tensors in part["weights"].items():
            assert idx not in weights, f"layer {idx} reported twice"
            weights[idx] = tensors
    return [part["losses"] for part in ranks], weights, {part["engine"] for part in ranks}


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("stock"), None)


# CI: a schedule other than DeepSpeed's under each launch form; DS_CHIMERA_FULL=1 adds 1f1b (stock's own)
CASES = [("chimera", "ds-chimera"), ("zbv", "torchrun")] + \
    ([("1f1b", "ds-chimera")] if FULL else [])


@pytest.mark.parametrize("schedule,launcher", CASES)
def test_the_script_unchanged_equals_the_stock_engine(stock, tmp_path, schedule, launcher):
    stock_losses, stock_weights, stock_engines = stock
    losses, weights, engines = run_script(tmp_path, schedule, launcher)
    assert stock_engines == {"PipelineEngine"} and engines == {"ScheduledPipelineEngine"}
    for rank in range(4):          # train_batch returns the global mean loss on every rank
        assert len(losses[rank]) == STEPS
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses[rank], stock_losses[0])), \
            (rank, losses[rank], stock_losses[0])
    assert sorted(weights) == sorted(stock_weights)
    compared = [(p, q) for idx in weights for p, q in zip(weights[idx], stock_weights[idx], strict=True)]
    assert len(compared) == 10            # 2 convolutions and 3 linear layers, a weight and a bias each
    assert max((p - q).abs().max().item() for p, q in compared) <= 1e-5
