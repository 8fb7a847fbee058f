"""Compare two runs of run.py: per-iteration lm-loss differences, the max abs difference (and the iteration where
it is largest), and each run's median time per iteration (the first --skip iterations, which include warm-up,
left out of the median; default 1).

Why: the loss files carry timings too, so a plain diff always differs; this prints what matters.

    python3 tools/megatron_deepspeed/compare.py RUN_A RUN_B [--skip N] [--from IT]
        (run dirs or their loss.tsv files; --from IT: compare losses from iteration IT on, e.g. 11 for a resume
        from iteration 10 against the uninterrupted run)
Exit status 0 if both runs have the same iterations (from IT on), identical losses and (fp16) loss scales, 1
otherwise.
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
            cols = line.rstrip("\n").split("\t")
            it, loss, lr, ms = cols[:4]
            scale = cols[4] if len(cols) > 4 and cols[4] != "-" else None      # fp16 runs log their loss scale
            rows[int(it)] = (float(loss), float(lr), float(ms), scale)
    return path, rows


def main():
    argv, skip, first = sys.argv[1:], 1, None
    for opt in ("--skip", "--from"):
        if opt in argv:
            i = argv.index(opt)
            val = int(argv[i + 1])
            del argv[i:i + 2]
            skip, first = (val, first) if opt == "--skip" else (skip, val)
    if len(argv) != 2:
        sys.exit(__doc__)
    (pa, a), (pb, b) = load(argv[0]), load(argv[1])
    if first is not None:
        a = {i: r for i, r in a.items() if i >= first}
        b = {i: r for i, r in b.items() if i >= first}
    print(f"A: {pa}\nB: {pb}")
    print(f"{'iter':>4}  {'loss A':>13}  {'loss B':>13}  {'B - A':>11}  {'lr A':>9}  {'lr B':>9}")
    max_diff, max_it, n_diff, same = 0.0, None, 0, set(a) == set(b)
    for it in sorted(set(a) | set(b)):
        la, lb = a.get(it), b.get(it)
        if la is None or lb is None:
            print(f"{it:>4}  {'-' if la is None else f'{la[0]:.6E}':>13}  {'-' if lb is None else f'{lb[0]:.6E}':>13}")
            continue
        d = round(lb[0] - la[0], 12)      # logged to 7 significant digits: no float residue in the ranking
        n_diff += d != 0
        if abs(d) > max_diff:
            max_diff, max_it = abs(d), it
        flag = "" if la[1] == lb[1] else "  (lr differs)"
        print(f"{it:>4}  {la[0]:13.6E}  {lb[0]:13.6E}  {d:11.3E}  {la[1]:9.3E}  {lb[1]:9.3E}{flag}")
    common = sorted(set(a) & set(b))
    scales_differ = [it for it in common if a[it][3] != b[it][3]]
    if any(a[it][3] is not None for it in common):
        print("loss scales: " + (f"differ at iteration(s) {scales_differ}" if scales_differ else
                                 "equal at every common iteration") + "; iterations absent from a run were skipped "
                                                                      "(no lm loss logged)")
    print(f"iterations: A {len(a)}, B {len(b)}, common {len(common)}")
    where = f"first at iteration {max_it}, {n_diff} iteration(s) differ" if n_diff else "all equal"
    print(f"max |loss B - loss A|: {max_diff:.3E} ({where}; losses are logged to 7 significant digits)")
    for name, rows in (("A", a), ("B", b)):
        kept = sorted(rows)[skip:] or sorted(rows)
        if kept:
            times = [rows[i][2] for i in kept]
            print(f"median ms/iteration {name}: {statistics.median(times):.1f}  (iterations {kept[0]}..{kept[-1]})")
    sys.exit(0 if same and max_diff == 0.0 and common and not scales_differ else 1)


if __name__ == "__main__":
    main()
