"""Gantt charts of simulated or measured runs (matplotlib, imported only when plotting)."""
from __future__ import annotations

from ..schedules.actions import Kind


def plot_gantt(records, placement, path: str, title: str = "") -> None:
    """One row per rank, one colour per micro-batch.

    Forward slices are solid, full backward hatched ``//``, input-grad hatched ``..`` and
    weight-grad hatched ``xx``. Where there are several replicas (Chimera), each slice is
    labelled with an arrow for its pipeline's direction: down (replica's stage 0 on a
    lower rank) or up.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_ranks = placement.num_ranks
    num_mbs = max(placement.num_micro_batches, 1)
    cmap = plt.get_cmap("tab20" if num_mbs > 10 else "tab10")
    hatch = {Kind.FORWARD: "", Kind.BACKWARD: "//", Kind.INPUT_GRAD: "..", Kind.WEIGHT_GRAD: "xx", Kind.STAGE_STEP: ""}
    arrows = {}
    if placement.num_replicas > 1:
        for replica, ranks in enumerate(placement.stage_ranks):
            arrows[replica] = "v" if ranks[-1] >= ranks[0] else "^"
    makespan = max((r[5] for r in records), default=1.0)
    fig, ax = plt.subplots(figsize=(min(4 + makespan * 0.35, 40), 1 + 0.6 * num_ranks))
    for rank, kind, chunk, mb, start, end in records:
        if end <= start:
            continue
        c = placement.chunks[chunk]
        ax.barh(rank, end - start, left=start, height=0.8, color=cmap(mb % cmap.N), hatch=hatch.get(kind, ""),
                edgecolor="black", linewidth=0.4)
        label = f"{kind}{mb}" + arrows.get(c.replica, "")
        if end - start >= 0.45:
            ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(num_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title or "pipeline schedule")
    from matplotlib.patches import Patch
    legend = [Patch(facecolor="white", edgecolor="black", hatch=h, label=n)
              for n, h in (("forward", ""), ("backward", "//"), ("input-grad", ".."), ("weight-grad", "xx"))]
    if arrows:
        legend.append(Patch(facecolor="white", edgecolor="white", label="v down / ^ up pipeline"))
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncol=len(legend))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
