"""What recording a split backward's weight-gradient blocks costs a Megatron chunk's forward, hooked once per call
(one ``weight_blocks.BlockRecorder`` per chunk and call, what the host does) or once per forward (a recorder made
and closed around each forward, what the host did before).

    python tools/block_hooks.py                 # 8 transformer-like layers, 97 modules
    python tools/block_hooks.py --layers 2

One process, a warm core. The chunk: layers with the parameter-owning modules of a transformer layer (two norms,
QKV, projection, two MLP linears) and a few parameter-free containers. Medians of 200 forwards.
"""
import argparse
import statistics
import time

import torch
from torch import nn

from ds_chimera.megatron.weight_blocks import BlockRecorder


class Layer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.attention = nn.ModuleDict({"core": nn.Identity(), "dropout": nn.Identity()})
        self.mlp = nn.ModuleDict({"activation": nn.Identity()})

    def forward(self, x):
        x = x + self.proj(self.qkv(self.ln1(x))[..., :x.shape[-1]])
        return x + self.fc2(self.fc1(self.ln2(x)).relu())


def median_us(fn, rounds: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    if args.layers < 1 or args.hidden < 1:
        parser.error(f"--layers and --hidden must be at least 1, got {args.layers} and {args.hidden}")
    chunk = nn.Sequential(*[Layer(args.hidden) for _ in range(args.layers)])
    x = torch.randn(4, args.hidden, requires_grad=True)
    recorder = BlockRecorder(chunk)

    def hooked_once():
        with recorder.recording([]):
            chunk(x)

    def hooked_per_forward():
        each = BlockRecorder(chunk)
        with each.recording([]):
            chunk(x)
        each.close()
    once = median_us(hooked_once)
    per_forward = median_us(hooked_per_forward)
    recorder.close()
    alone = median_us(lambda: chunk(x))
    print(f"{len(list(chunk.modules()))} modules; forward alone {alone:.0f} us; recording the blocks adds "
          f"{once - alone:.0f} us hooked once per call, {per_forward - alone:.0f} us hooked per forward")


if __name__ == "__main__":
    main()
