"""Convergence of asynchronous pipelines: does weight prediction close the staleness gap?

Trains one MLP classifier (8 blocks) on a generated task under synchronous training (the
reference), PipeDream (stale, weight stashing), PipeDream-2BW, SpecTrain and PipeOptim,
with D = 4 and 8 stages, SGD with momentum and AdamW, several seeds. Every method sees
the same mini-batches in the same order and makes the same number of updates.

The pipelines run in one process (``ds_chimera.runtime.LocalPipeline``), executing the
same schedules, weight policies and predictors as the DeepSpeed engine; the multi-rank
tests show the engine and LocalPipeline agree to 1e-6. This keeps the study about the
method: D ranks on a 2-core machine would measure the CPU.

Data: inputs x ~ N(0, I_32) labelled by a fixed random teacher network (10 classes),
generated here; nothing is downloaded.

    python benchmarks/pipeoptim_convergence.py            # full study, about 10 minutes on 2 cores
    python benchmarks/pipeoptim_convergence.py --quick    # D = 8, fewer seeds and updates
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds_chimera.runtime.local import LocalPipeline  # noqa: E402
from ds_chimera.schedules import registry  # noqa: E402

IN, HIDDEN, CLASSES, BLOCKS = 32, 64, 10, 8
METHODS = ["sync", "pipedream", "pipedream-2bw", "spectrain", "pipeoptim"]
OPTIMIZERS = {
    "sgdm": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01),
}


def make_data(train: int = 8192, test: int = 2048, seed: int = 0):
    """A classification task from a random teacher: learnable, not linearly trivial."""
    g = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(IN, 128, generator=g) / IN ** 0.5, torch.randn(128, CLASSES, generator=g) / 128 ** 0.5]
    x = torch.randn(train + test, IN, generator=g)
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)
    return (x[:train], y[:train]), (x[train:], y[train:])


class Residual(nn.Module):
    """x + relu(W x + b): deep enough to pipeline, trainable by plain SGD at depth 8."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


def make_blocks(seed: int) -> list:
    torch.manual_seed(seed)
    blocks = [nn.Linear(IN, HIDDEN)]
    blocks += [Residual(HIDDEN) for _ in range(BLOCKS - 2)]
    blocks.append(nn.Linear(HIDDEN, CLASSES))
    return blocks


def stages_of(blocks: list, stages: int) -> list:
    per = len(blocks) // stages
    return [nn.Sequential(*blocks[k * per:(k + 1) * per]) for k in range(stages)]


def evaluate(pipe: LocalPipeline, data) -> tuple:
    x, y = data
    logits = pipe.forward(x)
    return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def run(method: str, stages: int, opt_name: str, seed: int, train, test, updates: int, batch: int,
        per_call: int, eval_every: int) -> dict:
    """Train with ``method``; returns the test-loss curve and the final test loss and accuracy."""
    modules = stages_of(make_blocks(seed), stages)
    optimizers = [OPTIMIZERS[opt_name](m.parameters()) for m in modules]
    if method == "sync":
        schedule, split = registry.build("1f1b", stages, 1), 1          # one mini-batch, one update per call
    elif method == "pipedream-2bw":
        schedule, split = registry.build(method, stages, per_call * stages), stages   # D micro-batches per update
    else:
        schedule, split = registry.build(method, stages, per_call), 1
    pipe = LocalPipeline(schedule, modules, optimizers, nn.functional.cross_entropy)
    updates_per_call = 1 if method == "sync" else per_call
    order = torch.Generator().manual_seed(1000 + seed)
    x, y = train
    perm, pos = torch.randperm(len(x), generator=order), 0
    curve, done = [], 0
    while done < updates:
        micro = []
        for _ in range(updates_per_call):
            if pos + batch > len(x):
                perm, pos = torch.randperm(len(x), generator=order), 0
            idx = perm[pos:pos + batch]
            pos += batch
            micro += [(x[part], y[part]) for part in idx.chunk(split)]
        pipe.train_batch(micro)
        done += updates_per_call
        if done % eval_every == 0 or done >= updates:
            curve.append((done, evaluate(pipe, test)[0]))
    loss, acc = evaluate(pipe, test)
    tail = [v for _, v in curve[-4:]]
    return {"curve": curve, "loss": loss, "acc": acc, "tail": sum(tail) / len(tail)}


def summarise(results: dict, methods: list) -> dict:
    out = {}
    for method in methods:
        losses = [r["loss"] for r in results[method]]
        accs = [r["acc"] for r in results[method]]
        # paired by seed: every method starts from the same weights and sees the same data
        paired = [r["loss"] - s["loss"] for r, s in zip(results[method], results["sync"])]
        out[method] = {"loss": statistics.fmean(losses), "loss_std": statistics.pstdev(losses),
                       "acc": statistics.fmean(accs), "acc_std": statistics.pstdev(accs),
                       "tail": statistics.fmean(r["tail"] for r in results[method]),
                       "vs_sync": statistics.fmean(paired), "vs_sync_std": statistics.pstdev(paired)}
    for key, gap_key in (("loss", "gap_closed"), ("tail", "gap_closed_tail")):
        stale, sync = out["pipedream"][key], out["sync"][key]
        for method in methods:
            gap = stale - sync
            out[method][gap_key] = (stale - out[method][key]) / gap if gap > 0 else float("nan")
    return out


def plot(curves: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(d, o) for d, o, _ in curves})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (stages, opt_name) in zip(axes[0], keys):
        for method in METHODS:
            runs = curves.get((stages, opt_name, method))
            if not runs:
                continue
            steps = [s for s, _ in runs[0]]
            mean = [statistics.fmean(r[i][1] for r in runs) for i in range(len(steps))]
            ax.plot(steps, mean, label=method)
        ax.set_title(f"D={stages}, {opt_name}")
        ax.set_xlabel("updates")
        ax.set_ylabel("test loss")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D = 8 only, 2 seeds, 480 updates")
    parser.add_argument("--stages", type=int, nargs="+", default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32, help="samples per mini-batch (per update)")
    parser.add_argument("--per-call", type=int, default=32, help="mini-batches per train_batch call (pipeline fill)")
    parser.add_argument("--plot", default="benchmarks/pipeoptim_convergence.png")
    args = parser.parse_args(argv)
    stages_list = args.stages or ([8] if args.quick else [4, 8])
    seeds = args.seeds or (2 if args.quick else 3)
    updates = args.updates or (480 if args.quick else 1536)
    if updates % args.per_call:
        parser.error(f"--updates ({updates}) must be a multiple of --per-call ({args.per_call})")
    for stages in stages_list:
        if BLOCKS % stages:
            parser.error(f"--stages {stages} must divide the model's {BLOCKS} blocks")
    torch.set_num_threads(1)
    train, test = make_data()
    summary, curves = {}, {}
    started = time.perf_counter()
    for stages in stages_list:
        for opt_name in OPTIMIZERS:
            results = {m: [] for m in METHODS}
            for method in METHODS:
                for seed in range(seeds):
                    r = run(method, stages, opt_name, seed, train, test, updates, args.batch, args.per_call,
                            eval_every=args.per_call * max(1, updates // args.per_call // 16))
                    results[method].append(r)
                    curves.setdefault((stages, opt_name, method), []).append(r["curve"])
                print(f"[{time.perf_counter() - started:6.0f}s] D={stages} {opt_name:5s} {method:14s} "
                      f"test loss {statistics.fmean(r['loss'] for r in results[method]):.4f} "
                      f"acc {statistics.fmean(r['acc'] for r in results[method]):.4f}", flush=True)
            summary[(stages, opt_name)] = summarise(results, METHODS)
    print()
    print(f"{updates} updates of {args.batch} samples, {args.per_call} mini-batches per call, {seeds} seeds.")
    print("final test loss and accuracy: mean +- std over seeds; minus sync: the paired difference per seed;")
    print("gap closed = (stale - method) / (stale - sync), stale = pipedream, on the final test loss and on the")
    print("mean of the last 4 evaluations (tail), which is less noisy")
    print(f"{'D':>3} {'optimizer':9} {'method':14} {'test loss':>18} {'minus sync':>18} {'accuracy':>16} "
          f"{'gap closed':>11} {'tail loss':>10} {'gap (tail)':>11}")
    for (stages, opt_name), rows in summary.items():
        for method in METHODS:
            r = rows[method]
            print(f"{stages:>3} {opt_name:9} {method:14} {r['loss']:>9.4f} +- {r['loss_std']:.4f} "
                  f"{r['vs_sync']:>+9.4f} +- {r['vs_sync_std']:.4f} {r['acc']:>8.4f} +- {r['acc_std']:.4f} "
                  f"{r['gap_closed']:>11.2f} {r['tail']:>10.4f} {r['gap_closed_tail']:>11.2f}")
    if args.plot:
        plot(curves, args.plot, f"test loss, {updates} updates, mean of {seeds} seeds")
        print(f"plot: {args.plot}")
    deepest = max(stages_list)
    quick = {opt: {"sync": summary[(deepest, opt)]["sync"]["loss"],
                   "pipedream": summary[(deepest, opt)]["pipedream"]["loss"],
                   "pipeoptim": summary[(deepest, opt)]["pipeoptim"]["loss"],
                   "gap_closed": summary[(deepest, opt)]["pipeoptim"]["gap_closed"]} for opt in OPTIMIZERS}
    print(json.dumps(quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
