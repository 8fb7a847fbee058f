"""One rank of a bad-input case: a small 4-stage PipelineModule, a config (or a checkpoint) the harness made bad.

    python bad_input_worker.py save OUTDIR              trains one step under 1f1b and saves OUTDIR/ckpt (tag t1)
    python bad_input_worker.py run OUTDIR SECTION.json  initialize with that "pipeline" section, load
                                                        OUTDIR/ckpt when LOAD=1, train one step

4 plain processes, no launcher (see tests/test_bad_inputs.py). Nothing is caught: an error ends the rank.
"""
import json
import os
import sys

import torch

import deepspeed
import ds_chimera  # noqa: F401
from deepspeed.pipe import LayerSpec, PipelineModule

WIDTH, N = 16, 8


def engine_for(section: dict):
    layers = [LayerSpec(torch.nn.Linear, WIDTH, WIDTH) if i % 2 == 0 else LayerSpec(torch.nn.Tanh) for i in range(16)]
    net = PipelineModule(layers=layers, num_stages=4, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         seed_layers=True, base_seed=1234)
    cfg = {"train_batch_size": N, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "pipeline": section}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg,
                                           optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    return engine


def batches():
    g = torch.Generator().manual_seed(0)
    return iter([(torch.randn(1, WIDTH, generator=g), torch.randn(1, WIDTH, generator=g)) for _ in range(N)])


def main():
    phase, out = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    if phase == "save":
        engine = engine_for({"schedule": "1f1b", "timeout": 30})
        engine.train_batch(batches())
        engine.save_checkpoint(os.path.join(out, "ckpt"), tag="t1")
    else:
        with open(sys.argv[3]) as fh:
            engine = engine_for(json.load(fh))
        if os.environ.get("LOAD") == "1":
            engine.load_checkpoint(os.path.join(out, "ckpt"), tag="t1")
        engine.train_batch(batches())
    torch.distributed.barrier()
    print("no error", flush=True)


if __name__ == "__main__":
    main()
