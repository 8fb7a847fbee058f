"""What a batch-size ramp-up costs per iteration: set_train_batch_size before every train_batch, as Megatron-DeepSpeed's
pretrain_gpt.py calls it, with the micro-batch count changing every few iterations, side by side with DeepSpeed's stock
engine on the same cost-free model (4 CPU ranks).

Per row: the median time of a set_train_batch_size call that keeps the count (most iterations), the first call with a
new count (the programs are built and proven then), a call back to a count built before, and the median iteration
(set_train_batch_size + train_batch) over stock's.

    python benchmarks/batch_size_rampup.py [--iterations 60] [--every 5]
"""
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

ROWS = [None, ("1f1b", {}), ("chimera", {}), ("zbv", {}), ("interleaved", {"chunks": 2})]
COUNTS = (4, 8)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import ds_chimera  # noqa: F401
    from deepspeed.pipe import LayerSpec
    harness.share_one_device()
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    specs = harness.model_specs(LayerSpec, 0.0, harness.LAYERS)         # cost-free layers: host time only
    batches = harness.random_batches(torch, harness.WIDTH, max(COUNTS))
    counts = [COUNTS[(i // args.every) % len(COUNTS)] for i in range(args.iterations)]
    rows = []
    for schedule in ROWS:
        keep = harness.process_groups()
        engine = harness.timed_engine(specs, harness.ds_config(COUNTS[0], schedule))
        same, new, back, iteration, seen = [], [], [], [], {COUNTS[0]}
        for i, n in enumerate(counts):
            dist.barrier()
            start = time.perf_counter()
            engine.set_train_batch_size(n * harness.MICRO)
            set_s = time.perf_counter() - start
            engine.train_batch(iter(batches[:n]))
            iteration.append(time.perf_counter() - start)
            if i and n == counts[i - 1]:
                same.append(set_s)
            elif n not in seen:
                new.append(set_s)
            else:
                back.append(set_s)
            seen.add(n)
        times = torch.tensor([statistics.median(same), max(new or [0.0]), statistics.median(back or [0.0]),
                              statistics.median(iteration[len(COUNTS) * args.every:])])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)         # the slowest rank's figure
        rows.append({"row": "stock 1F1B" if schedule is None else harness.label(*schedule),
                     "set_same_ms": times[0].item() * 1e3, "set_new_ms": times[1].item() * 1e3,
                     "set_back_ms": times[2].item() * 1e3, "iteration_ms": times[3].item() * 1e3})
        del engine
        harness.release_groups(dist, keep)
    harness.save_rows(dist, rows, args.out)


def summarise(rows) -> None:
    stock = rows[0]["iteration_ms"]
    print(f"{'row':<24}{'set, same N':>13}{'set, new N':>12}{'set, back':>11}{'iteration':>11}{'/ stock':>9}")
    for r in rows:
        print(f"{r['row']:<24}{r['set_same_ms']:>11.3f}ms{r['set_new_ms']:>10.2f}ms{r['set_back_ms']:>9.3f}ms"
              f"{r['iteration_ms']:>9.2f}ms{r['iteration_ms'] / stock:>9.3f}")


def main() -> int:
    parser = harness.benchmark_parser(__doc__)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--every", type=int, default=5, help="iterations between changes of the micro-batch count")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--iterations", args.iterations, "--every", args.every]
        rows = harness.launch(os.path.abspath(__file__), extra, os.path.join(tmp, "rows.json"), keep=[])
    return harness.report(rows, summarise)


if __name__ == "__main__":
    sys.exit(main())
