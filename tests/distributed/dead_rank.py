"""One rank dies in the middle of step 2; the others must stop with a clear error, not hang.

Started as 4 plain processes (not torchrun, which would kill the survivors itself).
"""
import os
import sys

import torch

import deepspeed
import ds_chimera  # noqa: F401
from deepspeed.pipe import LayerSpec, PipelineModule

DIE_RANK, DIE_STEP = int(os.environ.get("DIE_RANK", "2")), 2
state = {"step": 0}


class Fragile(torch.nn.Linear):
    def forward(self, x):
        if state["step"] == DIE_STEP and int(os.environ["RANK"]) == DIE_RANK:
            os._exit(17)       # a crash: no exception, no cleanup
        return super().forward(x)


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    net = PipelineModule(layers=[LayerSpec(Fragile, 4, 4) for _ in range(8)], num_stages=4,
                         loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
           "pipeline": {"schedule": sys.argv[1], "timeout": float(sys.argv[2])}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    data = [(torch.randn(1, 4), torch.randn(1, 4)) for _ in range(8)]
    for step in range(1, 5):
        state["step"] = step
        engine.train_batch(iter(data))
    print("finished all steps", flush=True)


if __name__ == "__main__":
    main()
