"""A small DynamicConv language model trained pipeline-parallel on CPU with any ds_chimera schedule.

    ds-chimera launch --torchrun --nproc_per_node 4 examples/train_pipeline.py --config configs/chimera.json

The script is a plain DeepSpeed pipeline script: ``PipelineModule`` of ``LayerSpec``s,
``deepspeed.initialize``, ``train_batch``. The schedule comes from the JSON config. The
model is ds_chimera.nn's DynamicConv LM (embedding, causal DynamicConv layers, head); the
data is generated: sequences that count upwards modulo the vocabulary with a random stride
per sequence, so the model must read the context to predict the next token.
At the end, rank 0 writes a Gantt chart of the last measured step next to the
simulator's prediction for the same schedule.
"""
import argparse
import glob
import json
import os
import time

import torch

import deepspeed
from deepspeed.pipe import PipelineModule

from ds_chimera.nn import counting_batches, lm_layer_specs, lm_loss

VOCAB, SEQ = 32, 16


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/chimera.json")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per pipeline step")
    parser.add_argument("--layers", type=int, default=6, help="DynamicConv layers")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--local_rank", type=int, default=0)   # passed by the deepspeed launcher
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank = torch.distributed.get_rank()
    with open(args.config) as fh:
        config = json.load(fh)
    # the shipped configs leave the batch to "auto" (the HF Trainer fills it); a DeepSpeed script sets it
    for key, value in (("train_micro_batch_size_per_gpu", args.micro_batch_size),
                       ("gradient_accumulation_steps", args.micro_batches)):
        if config.get(key, "auto") == "auto":
            config[key] = value
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    trace_dir = os.path.join(args.out, "trace")
    config.setdefault("pipeline", {})["trace_dir"] = trace_dir
    stages = int(os.environ.get("WORLD_SIZE", "1"))
    layers = lm_layer_specs(vocab_size=VOCAB, d_model=args.width, num_layers=args.layers, kernel_sizes=(3, 7, 15, 31),
                            num_heads=4, max_len=SEQ)
    net = PipelineModule(layers=layers, num_stages=stages, loss_fn=lm_loss, partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=net, config=config)
    data = counting_batches(engine.train_micro_batch_size_per_gpu(), seq_len=SEQ, vocab_size=VOCAB,
                            seed=1 + engine.grid.get_data_parallel_id())
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
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def plot_last_step(engine, trace_dir, out_dir):
    """Gantt of the measured last step (all ranks' traces) next to the simulator's prediction."""
    from ds_chimera.sim import Costs, simulate
    from ds_chimera.sim.plot import plot_gantt
    from ds_chimera.sim.trace import free_gaps
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
    def mean(kind):
        times = [e - s for _, k, _, _, s, e in records if k == kind]
        return sum(times) / len(times) / engine.placement.size if times else 0.0
    # a fused backward (B), or a split one (I then W: Chimera's default zero-bubble order, zbv)
    wgrad = mean("W")
    compute = Costs(fwd=mean("F"), bwd=(mean("I") + wgrad) if wgrad else mean("B"), wgrad=wgrad)
    # the runtime's host time per action (its sends included): the gaps between two consecutive
    # actions of a rank with nothing between them that waits; their mean, as the step adds them up
    host = [gap for rank, ops in enumerate(engine.plan.program.ops)
            for _, gap, _ in free_gaps(ops, sorted((r for r in records if r[0] == rank), key=lambda r: r[4]))]
    costs = Costs(fwd=compute.fwd, bwd=compute.bwd, wgrad=compute.wgrad, dispatch=sum(host) / len(host) if host else 0.0)
    sim = simulate(engine.plan.program, costs)
    predicted = os.path.join(out_dir, f"{name}_simulated.png")
    plot_gantt(sim.records, engine.placement, predicted, title=f"{name}: simulated with the measured mean costs (ms)")
    span = max(r[5] for r in records)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"last step: measured compute span {span:.1f} ms, simulated {sim.makespan:.1f} ms from the measured mean "
          f"op times and {costs.dispatch:.2f} ms of host time per action "
          f"({simulate(engine.plan.program, compute).makespan:.1f} ms without it). "
          + (f"The {engine.placement.num_ranks} ranks share {cores} CPU cores here, so ranks computing at the same "
             f"time slow each other, which the simulator (one device per rank) leaves out; benchmarks/ checks "
             f"its predictions on timed layers. " if cores < engine.placement.num_ranks else "")
          + f"Gantt charts: {measured}, {predicted}", flush=True)


if __name__ == "__main__":
    main()
