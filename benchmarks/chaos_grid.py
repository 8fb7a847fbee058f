"""The chaos grid: one rank fails on purpose; how fast do the others end, and is anything lost?

    python benchmarks/chaos_grid.py --cases 40         # a seeded draw of 40 cases
    python benchmarks/chaos_grid.py --cases 0          # the whole grid (408 cases, hours)

Each case starts 4 ranks without a launcher (as ranks on other nodes run: nothing kills the
survivors for them), makes one rank raise, die (SIGKILL) or stop (SIGSTOP) at one point
(forward, backward, send, receive, gradient sync, optimizer step, checkpoint save) of 1f1b,
chimera, zbv, pipeoptim or Wavelet, and checks what ``tests/chaos.py`` checks: every survivor
exits within the bound (raise and kill 10 s, stop timeout + 5 s) naming the victim, the last
complete checkpoint loads, and resuming reproduces the uninterrupted run. It prints one line
per case, then the grid size, the share contained and the worst exit time per fault kind.
The last line is a JSON object with every case.
"""
import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from chaos import FAULTS, check_case, grid, run_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=40, help="cases drawn from the shuffled grid (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = grid(args.seed, args.cases or None)
    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="dsc_chaos_") as out:
            try:
                worst = check_case(case, run_case(case, out))
                rows.append({"case": str(case), "fault": case.fault, "contained": True, "worst_exit_s": worst})
            except AssertionError as exc:
                rows.append({"case": str(case), "fault": case.fault, "contained": False,
                             "why": str(exc).splitlines()[0][:300]})
        row = rows[-1]
        print(f"{row['case']:<40} " + (f"contained, slowest survivor {row['worst_exit_s']:.2f}s after the fault"
                                       if row["contained"] else f"NOT contained: {row['why']}"), flush=True)
    total = len(grid(args.seed))
    print(f"grid: {total} cases; ran {len(rows)} (seed {args.seed}); contained {sum(r['contained'] for r in rows)}"
          f" of {len(rows)}")
    for fault in FAULTS:
        times = [r["worst_exit_s"] for r in rows if r["fault"] == fault and r["contained"]]
        if times:
            print(f"  {fault:<6} {len(times)} cases, worst exit {max(times):.2f}s after the fault")
    print(json.dumps(rows))
    return 0 if all(r["contained"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
