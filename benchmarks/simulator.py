"""How long planning takes as pipelines grow: build + lower + simulate, up to D=64, N=1024.

    python benchmarks/simulator.py            # full table
    python benchmarks/simulator.py --quick    # D <= 16 only

Prints one row per (schedule, D, N) with the three phases' seconds and the total; the
target is an interactive planner, under 2 s for D=64, N=1024.
"""
import argparse
import json
import time

from ds_chimera.schedules import build
from ds_chimera.sim import Costs, simulate

SIZES = [(4, 32), (16, 128), (32, 512), (64, 1024)]
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"chunks": 2}), ("breadth-first", {"chunks": 2}),
             ("chimera", {"order": "concat"}), ("chimera", {"order": "merged"}), ("chimera", {}),
             ("chimera", {"order": "zero-bubble"}), ("zb-h1", {}), ("zbv", {}), ("dualpipev", {})]


def measure(name, options, d, n, costs):
    t0 = time.perf_counter()
    schedule = build(name, d, n, **options)
    t1 = time.perf_counter()
    program = schedule.lower()
    t2 = time.perf_counter()
    result = simulate(program, costs)
    t3 = time.perf_counter()
    assert result.valid, (name, d, n, result.errors[:3], result.deadlock)
    ops = sum(len(o) for o in program.ops)
    return {"schedule": name + ("" if not options else " " + ",".join(f"{k}={v}" for k, v in options.items())),
            "D": d, "N": n, "ops": ops, "build_s": t1 - t0, "lower_s": t2 - t1, "simulate_s": t3 - t2,
            "total_s": t3 - t0, "bubble": result.bubble_ratio}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    costs = Costs(fwd=1.0, bwd=2.0, wgrad=1.0)
    rows = []
    print(f"{'schedule':<24}{'D':>4}{'N':>6}{'ops':>10}{'build s':>9}{'lower s':>9}{'sim s':>8}{'total s':>9}{'bubble':>8}")
    for name, options in SCHEDULES:
        for d, n in sizes:
            row = measure(name, options, d, n, costs)
            rows.append(row)
            print(f"{row['schedule']:<24}{d:>4}{n:>6}{row['ops']:>10}{row['build_s']:>9.3f}{row['lower_s']:>9.3f}"
                  f"{row['simulate_s']:>8.3f}{row['total_s']:>9.3f}{row['bubble']:>8.3f}", flush=True)
    worst = max((r for r in rows if r["D"] == sizes[-1][0]), key=lambda r: r["total_s"])
    print(json.dumps({"largest": f"D={sizes[-1][0]} N={sizes[-1][1]}", "worst_total_s": round(worst["total_s"], 3),
                      "worst_schedule": worst["schedule"]}))


if __name__ == "__main__":
    main()
