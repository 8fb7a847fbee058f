"""Compare two runs of run.py: per-iteration lm-loss differences, the max abs difference, and each run's median
time per iteration (the first iteration, which includes warm-up, left out of the median).

Why: the loss files carry timings too, so a plain diff always differs; this prints what matters.

    python3 tools/megatron_deepspeed/compare.py RUN_A RUN_B      (run dirs or their loss.tsv files)
Exit status 0 if both runs have the same iterations and identical losses, 1 otherwise.
"""
import os
import statistics
import sys


def load(path):
    if os.path.isdir(path):
        path = os.path.join(path, "loss.tsv")
    rows = {}
    with open(path) as fh:
        next(fh)
        for line in fh:
            it, loss, lr, ms = line.split("\t")
            rows[int(it)] = (float(loss), float(lr), float(ms))
    return path, rows


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    (pa, a), (pb, b) = load(sys.argv[1]), load(sys.argv[2])
    print(f"A: {pa}\nB: {pb}")
    print(f"{'iter':>4}  {'loss A':>13}  {'loss B':>13}  {'B - A':>11}  {'lr A':>9}  {'lr B':>9}")
    max_diff, same = 0.0, set(a) == set(b)
    for it in sorted(set(a) | set(b)):
        la, lb = a.get(it), b.get(it)
        if la is None or lb is None:
            print(f"{it:>4}  {'-' if la is None else f'{la[0]:.6E}':>13}  {'-' if lb is None else f'{lb[0]:.6E}':>13}")
            continue
        d = lb[0] - la[0]
        max_diff = max(max_diff, abs(d))
        flag = "" if la[1] == lb[1] else "  (lr differs)"
        print(f"{it:>4}  {la[0]:13.6E}  {lb[0]:13.6E}  {d:11.3E}  {la[1]:9.3E}  {lb[1]:9.3E}{flag}")
    common = sorted(set(a) & set(b))
    print(f"iterations: A {len(a)}, B {len(b)}, common {len(common)}")
    print(f"max |loss B - loss A|: {max_diff:.3E}  (losses are logged to 7 significant digits)")
    for name, rows in (("A", a), ("B", b)):
        times = [rows[i][2] for i in sorted(rows)[1:]] or [rows[i][2] for i in rows]
        if times:
            print(f"median ms/iteration {name}: {statistics.median(times):.1f}  (iterations 2..{max(rows)})")
    sys.exit(0 if same and max_diff == 0.0 and common else 1)


if __name__ == "__main__":
    main()
