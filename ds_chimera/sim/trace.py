"""Chrome / Perfetto trace export: one process per rank, one slice per compute action.

The runtime writes measured runs in this same format, so a simulated and a measured
step can be opened side by side in chrome://tracing or ui.perfetto.dev. ``free_gaps``
reads a measured rank's host time between actions against its program.
"""
from __future__ import annotations

from ..atomic import write_json_atomic
from ..schedules.actions import Action, Comm, Kind

KIND_NAMES = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.INPUT_GRAD: "input-grad",
              Kind.WEIGHT_GRAD: "weight-grad", Kind.STAGE_STEP: "step"}


def trace_events(records, placement=None, time_unit_us: float = 1000.0, label: str = "sim") -> list:
    """Trace events for (rank, kind, chunk, mb, start, end) records; times scaled to microseconds."""
    events = []
    ranks = sorted({r[0] for r in records})
    for rank in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"{label} rank {rank}"}})
    for rank, kind, chunk, mb, start, end in records:
        args = {"chunk": chunk, "micro_batch": mb}
        if placement is not None:
            c = placement.chunks[chunk]
            args.update(stage=c.stage, replica=c.replica)
        events.append({"name": f"{kind}{mb}", "cat": KIND_NAMES.get(kind, kind), "ph": "X", "pid": rank,
                       "tid": 0, "ts": start * time_unit_us, "dur": max(end - start, 0) * time_unit_us,
                       "args": args})
    return events


def write_trace(path: str, records, placement=None, time_unit_us: float = 1000.0, label: str = "sim") -> None:
    write_json_atomic(path, {"traceEvents": trace_events(records, placement, time_unit_us, label),
                             "displayTimeUnit": "ms"})


def free_gaps(rank_ops, records) -> list:
    """(action index, gap, sends) for every two consecutive compute actions of one rank whose
    program has nothing between them that can wait (only sends): the gap is host time alone, what
    the costs ``dispatch`` and ``send`` price. ``records``: that rank's (rank, kind, chunk, mb,
    start, end), one per Action of ``rank_ops``, in program order; the index is the later action's."""
    gaps, done, between = [], -1, []
    for op in rank_ops:
        if type(op) is not Action:
            between.append(op)
            continue
        if 0 <= done < len(records) - 1 and all(type(o) is Comm and not o.recvs for o in between):
            gaps.append((done + 1, records[done + 1][4] - records[done][5], sum(len(o.sends) for o in between)))
        done, between = done + 1, []
    return gaps
