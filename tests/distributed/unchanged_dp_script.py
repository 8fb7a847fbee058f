"""A plain DeepSpeed data-parallel script with no ds_chimera import and no wavelet key.

Each process trains 3 steps on its own seeded batches and prints its engine's class, its
losses and, after the last step, the model's weights: the launcher tests compare them with a
one-process reference.
"""
import json
import os
import sys

import torch

import deepspeed

STEPS, LR = 3, 0.1


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    cfg = {"train_batch_size": 2 * int(os.environ["WORLD_SIZE"]), "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 10 ** 6}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(STEPS):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if hasattr(engine, "drain"):
        engine.drain()
    weights = [p.detach().flatten().tolist() for p in engine.module.parameters()]
    compact = {"separators": (",", ":")}
    # one write per report: the tasks share the launcher's output
    sys.stdout.write(f"ENGINE={type(engine).__name__} LOCAL_RANK={os.environ['LOCAL_RANK']} RANK={rank} "
                     f"LOSSES={json.dumps(losses, **compact)} WEIGHTS={json.dumps(weights, **compact)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
