#!/usr/bin/env python3
"""A pipeline script of DeepSpeedExamples' shape (training/pipeline_parallelism/train.py), written here.

As users write it: every rank constructs every layer as an ``nn.Module`` instance (plus a
lambda), ``PipelineModule(layers=[...])``, ``deepspeed.initialize(args=..., training_data=...)``
with ``--deepspeed_config``, and ``engine.train_batch()`` on the engine's own data loader.
The only ds_chimera change a user makes is the config's ``"pipeline"`` key (and an
``import ds_chimera``, or ``ds-chimera launch``). CIFAR-10 and torchvision's AlexNet are
replaced by a synthetic CIFAR-shaped dataset and a scaled-down AlexNet-style network
(no dropout: its masks depend on the order of forwards, which differs between schedules).
With DSX_RESULT set, each rank also writes its losses and the weights of the layers it
owns, for the test to compare schedules with the stock engine.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import deepspeed
from deepspeed.pipe import PipelineModule

if os.environ.get("DSX_IMPORT_DS_CHIMERA") == "1":
    import ds_chimera  # noqa: F401  (the one line a user adds, when not using ds-chimera launch)


class SmallAlexNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(64, 32), nn.ReLU(inplace=True), nn.Linear(32, 32),
                                        nn.ReLU(inplace=True), nn.Linear(32, num_classes))


class SyntheticCIFAR(torch.utils.data.Dataset):
    """CIFAR-shaped samples, the same on every rank and run."""

    def __init__(self, size=512, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 10, (size,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=100, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = SmallAlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = SyntheticCIFAR()
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = []
    for step in range(args.steps):
        losses.append(engine.train_batch().item())
    return engine, losses


def write_result(engine, losses, path):
    """Test-only: this rank's losses and the layers it owns, by global layer index."""
    if hasattr(engine, "owned_layers"):
        layers = engine.owned_layers()
    elif engine.grid.get_data_parallel_id() == 0:
        module = engine.module
        layers = {module._local_start + i: f for i, f in enumerate(module.forward_funcs)}
    else:
        layers = {}
    weights = {idx: [p.detach().clone() for p in layer.parameters()] for idx, layer in layers.items()
               if isinstance(layer, nn.Module)}
    torch.save({"losses": losses, "weights": weights, "engine": type(engine).__name__},
               f"{path}.rank{dist.get_rank()}")


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
    engine, losses = train_pipe(args)
    if os.environ.get("DSX_RESULT"):
        write_result(engine, losses, os.environ["DSX_RESULT"])
