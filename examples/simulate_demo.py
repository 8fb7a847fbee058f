"""Simulator demo: compare every schedule on one pipeline and draw their Gantt charts.

Run with ``make demo-sim``.
"""
import os
import sys

from ds_chimera.schedules import registry
from ds_chimera.sim import Costs, simulate
from ds_chimera.sim.plot import plot_gantt


def main(out_dir: str = "demo_out/sim", stages: int = 4, micro_batches: int = 8) -> int:
    os.makedirs(out_dir, exist_ok=True)
    costs = Costs(fwd=1.0, bwd=2.0, wgrad=1.0)
    print(f"D={stages} ranks, N={micro_batches} micro-batches, F=1 B=2 (I=1 W=1)")
    print(f"{'schedule':<15}{'makespan':>9}{'bubble':>8}{'peak act':>10}{'weights':>9}  chart")
    for name, cls in sorted(registry.available().items()):
        schedule = cls(stages, micro_batches)
        result = simulate(schedule.lower(), costs)
        if not result.valid:
            print(f"{name}: INVALID {result.errors[:3]} {result.deadlock}")
            return 1
        path = os.path.join(out_dir, f"{name}.png")
        plot_gantt(result.records, schedule.placement, path,
                   title=f"{name}: D={stages} N={micro_batches} makespan {result.makespan:g}")
        print(f"{name:<15}{result.makespan:>9g}{result.bubble_ratio:>8.3f}"
              f"{max(result.peak_activations):>10g}{max(schedule.weights_per_rank()):>9g}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
