"""The tables of docs/investigations/megatron-deepspeed.md from the runs sweep.sh made.

    python3 tools/megatron_deepspeed/sweep_tables.py [SWEEP_DIR]        (default $MDS_SWEEP or /tmp/mds/inv)

Loss differences are in units of 1e-6 (Megatron logs the loss to 7 significant digits, so for these losses
1e-6 is one unit of the last logged digit); ms/iteration is the median of iterations 3..N of one run.
"""
import os
import statistics
import sys

from compare import load as read_loss_file        # run.py's loss.tsv: iteration -> (loss, lr, ms)

SCHEDULES = ["1f1b", "chimera", "zbv", "interleaved", "breadth-first", "auto"]
OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MDS_SWEEP", "/tmp/mds/inv")
RUNS = os.path.join(OUT, "runs")


def load(name):
    path = os.path.join(RUNS, name, "loss.tsv")
    if not os.path.exists(path):
        return None
    return read_loss_file(path)[1] or None


def med(rows):
    return statistics.median(rows[i][2] for i in rows if i >= 3)


def diff(ref, run, first=1):
    """max |dloss| in 1e-6 units, the iterations that differ, and any problem (missing iterations, lr)"""
    its = [i for i in range(first, max(ref) + 1)]
    missing = [i for i in its if i not in run]
    lr = [i for i in its if i in run and run[i][1] != ref[i][1]]
    d = {i: round((run[i][0] - ref[i][0]) * 1e6) for i in its if i in run}
    nz = [i for i in its if d.get(i)]
    note = (f"missing {missing} " if missing else "") + (f"lr differs at {lr}" if lr else "")
    return max((abs(v) for v in d.values()), default=None), nz, note.strip()


def fmt(m, nz, note=""):
    s = "0 (all equal)" if m == 0 else f"{m}e-6 at {', '.join(map(str, nz))}"
    return s + (f"; {note}" if note else "")


def chosen(name):
    for line in open(os.path.join(RUNS, name, "log.txt"), errors="replace"):
        if line.startswith("  chosen: "):
            return line[len("  chosen: "):].split(": step")[0]
    return "-"


def main():
    stock = load("stock")
    samples = [n for n in ("stock", "stock_t2", "stock_t3", "stock_t4") if load(n)]
    ref = statistics.median(med(load(n)) for n in samples)
    print("## 1. 20 iterations against stock\n")
    print("| schedule | max abs dloss vs stock (iterations that differ) | ms/iteration, each run | median | / stock |")
    print("|---|---|---|---|---|")
    print(f"| stock | reference; {', '.join(fmt(*diff(stock, load(n))) for n in samples[1:])} | "
          f"{' / '.join('%.0f' % med(load(n)) for n in samples)} | {ref:.0f} | 1.00 |")
    for s in SCHEDULES:
        runs = [n for n in (s, s + "_t2", s + "_t3") if load(n)]
        ds = [fmt(*diff(stock, load(n))) for n in runs]
        same = "same in every run" if len(set(ds)) == 1 else "; ".join(ds[1:]) + " in the repeats"
        ms = [med(load(n)) for n in runs]
        extra = f"; chose {', '.join(chosen(n) for n in runs)}" if s == "auto" else ""
        print(f"| {s} | {ds[0]} ({same}{extra}) | {' / '.join('%.0f' % x for x in ms)} | "
              f"{statistics.median(ms):.0f} | {statistics.median(ms) / ref:.2f} |")
    print("\n## 2. resumed from its own checkpoint at iteration 10 (iterations 11..20)\n")
    print("| schedule | vs its uninterrupted run | vs stock uninterrupted |")
    print("|---|---|---|")
    for s in ["stock"] + SCHEDULES + ["auto_planfile"]:
        r = load(s + "_resume")
        if r is None:
            print(f"| {s} | no iterations (see its log) | - |")
            continue
        print(f"| {s} | {fmt(*diff(load(s), r, 11))} | {fmt(*diff(stock, r, 11))} |")
    print("\n## 3. stock checkpoint at iteration 10 loaded under each schedule (iterations 11..20)\n")
    print("| schedule | vs stock uninterrupted | vs the schedule's own uninterrupted run |")
    print("|---|---|---|")
    for s in SCHEDULES:
        r = load(s + "_fromstock")
        if r:
            extra = f" (chose {chosen(s + '_fromstock')})" if s == "auto" else ""
            print(f"| {s}{extra} | {fmt(*diff(stock, r, 11))} | {fmt(*diff(load(s), r, 11))} |")
    b = load("stock_bf16")
    if b:
        print("\n## 4. bf16, 6 iterations\n")
        names = [n for n in ("1f1b", "chimera") if load(n + "_bf16")]
        print("| iteration | stock | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for i in sorted(b):
            print(f"| {i} | {b[i][0]:.6f} | " + " | ".join(f"{load(n + '_bf16')[i][0]:.6f}" for n in names) + " |")
        print(f"| ms/iteration (3..6) | {med(b):.0f} | " + " | ".join(f"{med(load(n + '_bf16')):.0f}" for n in names) + " |")


if __name__ == "__main__":
    main()
