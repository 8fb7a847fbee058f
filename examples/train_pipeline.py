"""A small pipeline-parallel language model trained on CPU with any ds_chimera schedule.

    ds-chimera launch --torchrun --nproc_per_node 4 examples/train_pipeline.py --config configs/chimera.json

The script is a plain DeepSpeed pipeline script: ``PipelineModule`` of ``LayerSpec``s,
``deepspeed.initialize``, ``train_batch``. The schedule comes from the JSON config. The
data is generated: sequences that count upwards modulo the vocabulary with a random
stride per sequence, so the model must read the context to predict the next token.
At the end, rank 0 writes a Gantt chart of the last measured step next to the
simulator's prediction for the same schedule.
"""
import argparse
import glob
import json
import os
import time

import torch
from torch import nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule

VOCAB, WIDTH, SEQ = 32, 64, 16


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class CausalMixer(nn.Module):
    """Residual block: a causal mix over positions, then an MLP (tiny, CPU-friendly)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(SEQ, SEQ)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)), persistent=False)

    def forward(self, x):
        h = self.norm1(x).transpose(1, 2)
        x = x + torch.nn.functional.linear(h, self.mix.weight * self.mask, self.mix.bias).transpose(1, 2)
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(micro_batch, seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, VOCAB, (micro_batch, 1), generator=g)
        stride = torch.randint(1, 4, (micro_batch, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/chimera.json")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--local_rank", type=int, default=0)   # passed by the deepspeed launcher
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank = torch.distributed.get_rank()
    with open(args.config) as fh:
        config = json.load(fh)
    trace_dir = os.path.join(args.out, "trace")
    config.setdefault("pipeline", {})["trace_dir"] = trace_dir
    stages = int(os.environ.get("WORLD_SIZE", "1"))
    layers = [LayerSpec(Embed)] + [LayerSpec(CausalMixer) for _ in range(args.blocks)] + [LayerSpec(Head)]
    net = PipelineModule(layers=layers, num_stages=stages, loss_fn=lm_loss, partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=net, config=config)
    data = batches(engine.train_micro_batch_size_per_gpu(), seed=1 + engine.grid.get_data_parallel_id())
    if rank == 0:
        print(f"training with {type(engine).__name__}, schedule {config['pipeline'].get('schedule')}, "
              f"{engine.gradient_accumulation_steps()} micro-batches per step", flush=True)
    first = last = None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss = engine.train_batch(data).item()
        took = time.perf_counter() - start
        first = loss if first is None else first
        last = loss
        if rank == 0:
            print(f"step {step:4d}  loss {loss:.4f}  {engine.train_batch_size() / took:8.1f} samples/s", flush=True)
    if rank == 0:
        total = time.perf_counter() - t0
        print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps, {args.steps * engine.train_batch_size() / total:.1f} "
              f"samples/s overall", flush=True)
    torch.distributed.barrier()
    if rank == 0 and hasattr(engine, "schedule"):
        plot_last_step(engine, trace_dir, args.out)


def plot_last_step(engine, trace_dir, out_dir):
    """Gantt of the measured last step (all ranks' traces) next to the simulator's prediction."""
    from ds_chimera.sim import Costs, simulate
    from ds_chimera.sim.plot import plot_gantt
    last = sorted(glob.glob(os.path.join(trace_dir, "step*-rank000.json")))[-1]
    prefix = os.path.basename(last).split("-rank")[0]
    records = []
    for path in sorted(glob.glob(os.path.join(trace_dir, f"{prefix}-rank*.json"))):
        for e in json.load(open(path))["traceEvents"]:
            if e.get("ph") == "X":
                a = e["args"]
                records.append((e["pid"], e["name"][0], a["chunk"], a["micro_batch"], e["ts"] / 1e6,
                                (e["ts"] + e["dur"]) / 1e6))
    t0 = min(r[4] for r in records)
    records = [(r, k, c, m, (s - t0) * 1e3, (e - t0) * 1e3) for r, k, c, m, s, e in records]   # ms
    name = engine.schedule.name
    measured = os.path.join(out_dir, f"{name}_measured.png")
    plot_gantt(records, engine.placement, measured, title=f"{name}: measured last step (ms)")
    fwd = [e - s for _, k, _, _, s, e in records if k == "F"]
    bwd = [e - s for _, k, _, _, s, e in records if k in "BI"]
    costs = Costs(fwd=sum(fwd) / len(fwd) / engine.placement.size, bwd=sum(bwd) / len(bwd) / engine.placement.size,
                  wgrad=0.0)
    sim = simulate(engine.plan.program, costs)
    predicted = os.path.join(out_dir, f"{name}_simulated.png")
    plot_gantt(sim.records, engine.placement, predicted, title=f"{name}: simulated with the measured mean costs (ms)")
    span = max(r[5] for r in records)
    print(f"last step: measured compute span {span:.1f} ms, simulated {sim.makespan:.1f} ms; "
          f"Gantt charts: {measured}, {predicted}", flush=True)


if __name__ == "__main__":
    main()
