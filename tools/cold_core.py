"""What the first code after an idle wait costs on this host: the cold-core effect the timed model meets.

    python tools/cold_core.py                 # one process
    python tools/cold_core.py --processes 4   # four at once, as the benchmarks' ranks run on 2 cores

For each idle time it sleeps that long, then times one small tensor op (an add of two 16-element tensors),
a 16-element MSE loss (what the timed model's last stage computes) and a 200-step Python loop, each the first
thing run after the wake-up; then the same with no idle time between. Medians in microseconds.

Why it matters: on a virtual CPU that went idle, the first code to run after the wait finds its caches cold,
and it runs several times slower than back to back. The benchmarks' timed layers sleep for their cost, so
the runtime's own code between two layers always runs just after a sleep, and pays this; the planner's
measurement of the runtime's host time per action (``runtime.host_cost``, near-free layers, no sleep)
runs on a warm core. ``benchmarks/schedules.py`` therefore prices the host time per action measured around
the timed layers (docs/investigations/zero-bubble-host-time.md, part 4).
"""
import argparse
import multiprocessing
import statistics
import time

IDLE_S = (0.0, 0.0001, 0.001, 0.003, 0.01)


def measure(rounds: int) -> dict:
    import torch

    x, y = torch.randn(1, 16), torch.randn(1, 16)

    def python_loop():
        total = 0
        for i in range(200):
            total += i

    work = {"add": lambda: torch.add(x, y), "mse loss": lambda: torch.nn.functional.mse_loss(x, y),
            "python loop": python_loop}
    results = {}
    for idle in IDLE_S:
        for name, fn in work.items():
            times = []
            for _ in range(rounds):
                if idle:
                    time.sleep(idle)
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            results[(idle, name)] = statistics.median(times) * 1e6
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    if args.processes < 1 or args.rounds < 1:
        parser.error(f"--processes and --rounds must be at least 1, got {args.processes} and {args.rounds}")
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        per_process = pool.map(measure, [args.rounds] * args.processes)
    names = ["add", "mse loss", "python loop"]
    print(f"median us of the first code after an idle wait, {args.processes} process(es) at once "
          f"(the median over processes of each one's median of {args.rounds})")
    print(f"{'idle before':>12} " + " ".join(f"{name:>12}" for name in names))
    for idle in IDLE_S:
        cells = [statistics.median(p[(idle, name)] for p in per_process) for name in names]
        print(f"{idle * 1e3:>9.1f} ms " + " ".join(f"{cell:12.1f}" for cell in cells))


if __name__ == "__main__":
    main()
