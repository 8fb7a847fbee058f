"""Breadth-first with ZeRO-1: each chunk's gradient reduction when the chunk is done, against all at the end.

    python tools/zero1_overlap.py [--payload 4000000] [--repeats 5]

Four CPU ranks as 2 pipeline stages x 2 data-parallel replicas, breadth-first with 2 chunks
per rank, on the timed model (F = I = W = 20 ms per rank share and micro-batch). Each timed
layer also carries ``--payload`` extra parameters, so the data-parallel reduction moves real
bytes. The timed layers sleep without spinning, so the reductions get every free core. Rows,
in one invocation, built side by side and stepped in turn (a burst of host load hits all alike):

- ZeRO-1 with ``"zero1_reduce": "chunk"`` (the default). Chunk v's gradients go to ZeRO's
  partitioned reduction as soon as its last backward is done, while chunk v-1 still computes.
- ZeRO-1 with ``"zero1_reduce": "end"``. DeepSpeed's own order: everything after the flush.
- ZeRO-0 (plain data parallelism). ds_chimera posts each stage's all-reduce asynchronously
  at the same point.

It prints median step time / ideal for each row and the ratios between them. The last line
is JSON.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(os.path.dirname(HERE), "benchmarks")   # the shared helpers: benchmarks/harness.py
sys.path.insert(0, BENCHMARKS)
from harness import (COST_S, LAYERS, MICRO, WIDTH, TimedLayer, launch, median_steps_in_turn,  # noqa: E402
                     random_batches, report, save_rows)


def worker(args):
    import torch
    from torch import nn
    import torch.distributed as dist

    import deepspeed
    import ds_chimera  # noqa: F401
    from deepspeed.pipe import LayerSpec, PipelineModule

    class PayloadLayer(TimedLayer):
        """A timed layer with ``size`` more parameters: gradients worth reducing."""

        def __init__(self, fwd_s, igrad_s, wgrad_s, size):
            super().__init__(fwd_s, igrad_s, wgrad_s)
            self.payload = nn.Parameter(torch.zeros(size))

        spin_s = 0.0        # plain sleeps: the reductions below need every free core

        def forward(self, x):
            return super().forward(x) + 0.0 * self.payload[:1].sum()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    stages = 2
    layer_s = COST_S * stages / LAYERS
    specs = [LayerSpec(PayloadLayer, layer_s, layer_s, layer_s, args.payload) for _ in range(LAYERS)]
    n = args.micro_batches
    ideal = n * 3 * COST_S
    rows, engines = [], []
    for label, zero, reduce in (("ZeRO-1, reduce per chunk", 1, "chunk"), ("ZeRO-1, reduce at the end", 1, "end"),
                                ("ZeRO-0, async all-reduce per stage", 0, None)):
        cfg = {"train_batch_size": n * MICRO * 2, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 9,
               "gradient_clipping": 0.0, "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
               "pipeline": {"schedule": "breadth-first", "chunks": 2}}
        if reduce:
            cfg["pipeline"]["zero1_reduce"] = reduce
        net = PipelineModule(layers=specs, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters(),
                                               optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
        engines.append((label, engine))
    batch = random_batches(torch, WIDTH, n)
    # rows take turns, so a burst of host load hits them alike
    medians = median_steps_in_turn(dist, [lambda e=engine: e.train_batch(iter(batch)) for _, engine in engines],
                                   args.repeats)
    for (label, _), median in zip(engines, medians):
        rows.append({"row": label, "step_s": median, "vs_ideal": median / ideal})
        if rank == 0:
            print(f"  {label:<36} {median / ideal:6.3f} x ideal ({median * 1e3:.0f} ms)", flush=True)
    save_rows(dist, rows, args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload", type=int, default=4_000_000, help="extra parameters per timed layer")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "zero1_overlap_results.json"))
    args = parser.parse_args()
    if args.payload < 1:
        parser.error(f"--payload must be >= 1, got {args.payload}")
    if args.worker:
        return worker(args)
    print(f"2 stages x 2 data-parallel, breadth-first V=2, N={args.micro_batches}, {args.payload:,} extra parameters "
          f"per layer ({args.payload * 4 * LAYERS // 2 / 2 ** 20:.0f} MiB of gradients per rank)", flush=True)
    rows = launch(__file__, ["--payload", args.payload, "--micro-batches", args.micro_batches, "--repeats", args.repeats],
                  args.out, lambda line: line.startswith("  ") and "x ideal" in line)
    return report(rows, summarise)


def summarise(rows):
    by = {r["row"]: r["step_s"] for r in rows}
    print(f"end / per-chunk step time (ZeRO-1): {by['ZeRO-1, reduce at the end'] / by['ZeRO-1, reduce per chunk']:.3f}; "
          f"ZeRO-1 per-chunk / ZeRO-0: {by['ZeRO-1, reduce per chunk'] / by['ZeRO-0, async all-reduce per stage']:.3f}")


if __name__ == "__main__":
    sys.exit(main() or 0)
