"""A user's 4-stage DeepSpeed pipeline script that never imports ds_chimera, for the multi-node launch test.

    multinode_script.py [--local_rank=N] SCHEDULE        (the deepspeed launcher adds --local_rank)

Trains 3 calls of 4 micro-batches (8 Linear(4, 4) layers seeded by DeepSpeed's seed_layers, seeded
data, SGD) over 4 pipeline stages and prints, on every rank, where torchrun put it (RANK, LOCAL_RANK,
GROUP_RANK: the node), the engine's class and schedule, each call's loss and the rank's final weights
(every parameter it holds, in its engine's order, as exact float hex): the test compares them between
a launch as two node groups and one as a single group.
"""
import json
import os
import sys

import torch

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule

STEPS, MICRO_BATCHES, BASE_SEED, LR = 3, 4, 1234, 0.1

deepspeed.init_distributed(dist_backend="gloo")
net = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4) for _ in range(8)], num_stages=4,
                     loss_fn=torch.nn.MSELoss(), partition_method="uniform", seed_layers=True, base_seed=BASE_SEED)
cfg = {"train_batch_size": MICRO_BATCHES, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
       "pipeline": {"schedule": [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]}}
engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, optimizer=lambda p: torch.optim.SGD(p, lr=LR))


def batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(1, 4, generator=g), torch.randn(1, 4, generator=g)) for _ in range(MICRO_BATCHES)]


losses = [engine.train_batch(iter(batches(step))).item() for step in range(STEPS)]
weights = [v.hex() for p in engine.module.parameters() for v in p.detach().flatten().tolist()]
schedule = getattr(getattr(engine, "schedule", None), "name", None)
compact = {"separators": (",", ":")}
where = " ".join(f"{key}={os.environ.get(key)}" for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE"))
# one write per report: the ranks share the launcher's output
sys.stdout.write(f"ENGINE={type(engine).__name__} {where} SCHEDULE={json.dumps(schedule)} "
                 f"LOSSES={json.dumps([v.hex() for v in losses], **compact)} "
                 f"WEIGHTS={json.dumps(weights, **compact)}\n")
sys.stdout.flush()
torch.distributed.barrier()
torch.distributed.destroy_process_group()   # a clean exit: no gloo teardown race
