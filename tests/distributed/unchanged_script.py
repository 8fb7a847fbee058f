"""A user's DeepSpeed pipeline script that never imports ds_chimera.

Trains 4 calls of 4 micro-batches (layers seeded by DeepSpeed's seed_layers, seeded data) and
prints, on every rank, the engine's class, the schedule it runs (if the engine names one) and
each call's loss: the launcher tests compare the losses with one-process references.
"""
import json
import sys

import torch

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule

STEPS, MICRO_BATCHES, BASE_SEED, LR = 4, 4, 1234, 0.1

deepspeed.init_distributed(dist_backend="gloo")
net = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4) for _ in range(4)], num_stages=2,
                     loss_fn=torch.nn.MSELoss(), partition_method="uniform", seed_layers=True, base_seed=BASE_SEED)
cfg = {"train_batch_size": MICRO_BATCHES, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
       "pipeline": {"schedule": sys.argv[1]}}
engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, optimizer=lambda p: torch.optim.SGD(p, lr=LR))


def batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(1, 4, generator=g), torch.randn(1, 4, generator=g)) for _ in range(MICRO_BATCHES)]


losses = [engine.train_batch(iter(batches(step))).item() for step in range(STEPS)]
schedule = getattr(getattr(engine, "schedule", None), "name", None)
compact = json.dumps(losses, separators=(",", ":"))
# one write per report: the ranks share the launcher's output
sys.stdout.write(f"ENGINE={type(engine).__name__} SCHEDULE={json.dumps(schedule)} LOSSES={compact}\n")
sys.stdout.flush()
torch.distributed.barrier()
torch.distributed.destroy_process_group()   # a clean exit: no gloo teardown race
