"""A user's DeepSpeed pipeline script that never imports ds_chimera."""
import sys

import torch

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule

deepspeed.init_distributed(dist_backend="gloo")
net = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4) for _ in range(4)], num_stages=2,
                     loss_fn=torch.nn.MSELoss())
cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
       "pipeline": {"schedule": sys.argv[1]}}
engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
loss = engine.train_batch(iter([(torch.randn(1, 4), torch.randn(1, 4)) for _ in range(4)]))
print(f"ENGINE={type(engine).__name__} LOSS={loss.item():.4f}", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()   # a clean exit: no gloo teardown race
