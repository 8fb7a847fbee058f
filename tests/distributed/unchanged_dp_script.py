"""A plain DeepSpeed data-parallel script with no ds_chimera import and no wavelet key."""
import os

import torch

import deepspeed


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    cfg = {"train_batch_size": 2 * int(os.environ["WORLD_SIZE"]), "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 10 ** 6}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(3):
        x = torch.randn(2, 4)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if hasattr(engine, "drain"):
        engine.drain()
    print(f"ENGINE={type(engine).__name__} LOCAL_RANK={os.environ['LOCAL_RANK']}", flush=True)


if __name__ == "__main__":
    main()
