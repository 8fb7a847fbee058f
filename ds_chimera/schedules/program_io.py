"""Programs as text: print one, save it, load one written by hand or by another solver.

The format is line based; ``#`` starts a comment::

    ds_chimera-program 1
    name chimera
    synchronous true
    ranks 4
    stages 4
    replica 0 0,1,2,3          stage -> rank of replica 0
    replica 1 3,2,1,0
    micro_batches 0,0,1,1      micro-batch -> replica it flows through
    weights 2,2,2,2            optional: weight copies per rank, in stage units
    rank 0
    0F0                        one op per line, as str(op) writes it
    COMM send=act:0>1:0 recv=
    ...

A loaded program is only data: the simulator proves it (complete, ordered, free of
deadlock) before anything runs it, exactly as a lowered schedule.
"""
from __future__ import annotations

import os

from .actions import parse_op
from .placement import Placement

MAGIC = "ds_chimera-program"
VERSION = 1


def _ints(values) -> str:
    return ",".join(str(int(v)) for v in values)


def dump_program(program, path=None) -> str:
    """The text of ``program`` (a :class:`~.lowering.Program`); written atomically to ``path`` if given."""
    placement = program.placement
    lines = [f"{MAGIC} {VERSION}", f"name {program.name}", f"synchronous {str(program.synchronous).lower()}",
             f"ranks {placement.num_ranks}", f"stages {placement.num_stages}"]
    lines += [f"replica {r} {_ints(ranks)}" for r, ranks in enumerate(placement.stage_ranks)]
    lines.append(f"micro_batches {_ints(placement.mb_replica)}")
    if program.weights is not None:
        lines.append("weights " + ",".join(repr(float(w)) for w in program.weights))
    for rank, ops in enumerate(program.ops):
        lines.append(f"rank {rank}")
        lines.extend(str(op) for op in ops)
    text = "\n".join(lines) + "\n"
    if path is not None:
        from ..atomic import write_text_atomic
        write_text_atomic(path, text)
    return text


def parse_program(source) -> dict:
    """The fields of a Program (keyword arguments of its constructor) from a path or from program text.

    Errors name the line. :meth:`Program.load <.lowering.Program.load>` builds the Program.
    """
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                           and os.path.exists(source)):
        with open(source) as fh:
            text, where = fh.read(), str(source)
    elif isinstance(source, str):
        text, where = source, "<text>"
    else:
        raise ValueError(f"Program.load takes a path or program text, got {type(source).__name__}")
    header: dict = {}
    replicas: dict = {}
    ops: list = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        try:
            if ops or word == "rank":
                if word == "rank":
                    if int(rest) != len(ops):
                        raise ValueError(f"expected 'rank {len(ops)}', got {line!r}")
                    ops.append([])
                else:
                    ops[-1].append(parse_op(line))
            elif word == MAGIC:
                if int(rest) != VERSION:
                    raise ValueError(f"format version {rest} is not supported (this reader: {VERSION})")
                header[word] = rest
            elif word == "replica":
                index, _, ranks = rest.partition(" ")
                replicas[int(index)] = [int(r) for r in ranks.split(",") if r]
            elif word in ("name", "synchronous", "ranks", "stages", "micro_batches", "weights"):
                header[word] = rest
            else:
                raise ValueError(f"unknown line {line!r}")
        except ValueError as exc:
            raise ValueError(f"{where}:{number}: {exc}") from None
    missing = [key for key in (MAGIC, "name", "synchronous", "ranks", "stages", "micro_batches") if key not in header]
    if missing:
        raise ValueError(f"{where}: not a ds_chimera program: missing {', '.join(missing)}")
    if sorted(replicas) != list(range(len(replicas))) or not replicas:
        raise ValueError(f"{where}: replicas must be numbered 0..R-1, got {sorted(replicas)}")
    if header["synchronous"] not in ("true", "false"):
        raise ValueError(f"{where}: synchronous must be true or false, got {header['synchronous']!r}")
    placement = Placement(int(header["ranks"]), int(header["stages"]), [replicas[r] for r in sorted(replicas)],
                          [int(m) for m in header["micro_batches"].split(",") if m])
    if len(ops) != placement.num_ranks:
        raise ValueError(f"{where}: {len(ops)} rank sections for {placement.num_ranks} ranks")
    weights = [float(w) for w in header["weights"].split(",")] if "weights" in header else None
    return {"name": header["name"], "placement": placement, "ops": ops, "synchronous": header["synchronous"] == "true",
            "weights": weights}
