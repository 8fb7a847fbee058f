"""How much of the measured step the simulator misses per compute action: a fit of ``Costs.dispatch``.

    python tools/dispatch_fit.py                       # benchmarks/schedules_results.json, ds_chimera rows
    python tools/dispatch_fit.py --runtime ds_chimera.megatron --grid 0 0.2 0.4 0.6

``benchmarks/schedules.py`` prices every row with the costs it measures apart from any step (calibrated F, I,
W; a waiting rank's latency; the host time per send, receive and sync post) and reports measured / "full sim".
What it leaves out is the runtime's own host time around each compute action (``Costs.dispatch``: the
executor's bookkeeping, autograd's entry and exit), which the schedules with the most actions pay most. This
replays each row's program (rebuilt from its schedule and options, the costs it recorded) with a per-action
``dispatch`` from a grid and prints measured / simulated per row. A diagnosis: the fitted value is not a
prediction; the harness and the planner must measure it apart from the step (issue 43, part 3).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

COST_S = 0.02          # benchmarks/schedules.py's F = I = W per rank and micro-batch
STAGES = 4
OPTIONS = {"gpipe": {}, "1f1b": {}, "interleaved chunks=2": {"chunks": 2}, "breadth-first chunks=2": {"chunks": 2},
           "chimera order=concat": {"order": "concat"}, "chimera order=merged": {"order": "merged"},
           "chimera order=forward-doubling": {"order": "forward-doubling"},
           "chimera order=zero-bubble": {"order": "zero-bubble"},
           "chimera order=zero-bubble,pipelines=2": {"order": "zero-bubble", "pipelines": 2},
           "zb-h1": {}, "zbv": {}, "dualpipev": {}}


def main():
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
    from schedules import with_loss
    from ds_chimera.schedules import build
    from ds_chimera.sim import Costs, simulate
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=os.path.join(os.path.dirname(HERE), "benchmarks",
                                                          "schedules_results.json"))
    parser.add_argument("--runtime", default="ds_chimera")
    parser.add_argument("--grid", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3, 0.4],
                        help="dispatch values to try, in ms per compute action")
    args = parser.parse_args()
    with open(args.results) as fh:
        rows = [r for r in json.load(fh) if r["runtime"] == args.runtime and "layer_costs_s" in r]
    programs = {}

    def ratio(row, dispatch_s: float) -> float:
        key = (row["schedule"], row["N"])
        if key not in programs:
            programs[key] = build(row["schedule"].split(" ")[0], STAGES, row["N"], **OPTIONS[row["schedule"]]).lower()
        f, i, w = row["layer_costs_s"]
        costs = Costs(fwd=f, bwd=i + w, wgrad=w, comm=row["waiting_latency_s"], send=row["send_s"],
                      recv=row["recv_s"], allreduce=row["allreduce_s"], sync_post=row["sync_post_s"],
                      dispatch=dispatch_s)
        # the last stage's loss, as the benchmark's full simulation adds it (rows recorded before it: none)
        stage_costs = with_loss(costs, programs[key].placement, row.get("loss_s", 0.0))
        return row["step_s"] / simulate(programs[key], costs, stage_costs=stage_costs).makespan

    fits = []
    for ms in args.grid:
        ratios = [ratio(row, ms / 1e3) for row in rows]
        spread = max(abs(r - 1) for r in ratios)
        print(f"dispatch {ms:.2f} ms: measured / simulated {min(ratios):.3f} .. {max(ratios):.3f} "
              f"(farthest {spread:.3f} from 1)")
        fits.append((spread, ms))
    ms = min(fits)[1]
    print(f"\nper row at dispatch {ms:.2f} ms (and at 0):")
    for row in rows:
        print(f"  {row['schedule']:<40} N={row['N']:<3} {ratio(row, ms / 1e3):.3f}  ({ratio(row, 0.0):.3f})")


if __name__ == "__main__":
    main()
