"""A schedule read from a program file: run another solver's program as if it were built in.

``"pipeline": {"program": "my.program"}`` (or ``ds-chimera simulate --program FILE``) loads
the text :meth:`Program.dump` writes. The program must fit the run (its ranks are the
pipeline's, its micro-batches the step's) and, like every program, is proven by the
simulator before anything runs it. Only synchronous programs run on the engines: the
asynchronous ones need their schedule's weight-version tables.
"""
from __future__ import annotations

from ..named_files import read_named_file
from .base import Schedule
from .lowering import Program


class ProgramSchedule(Schedule):
    """The placement and orders of a loaded :class:`Program`; :meth:`lower` returns the program itself."""

    name = "program"
    summary = "a program loaded from a file (another solver's output)"

    def __init__(self, program: Program, source: str = "<program>"):
        self.program, self.source = program, source
        self.ranks = program.num_ranks
        self.micro_batches = program.placement.num_micro_batches
        self.config = {}
        self.placement = program.placement
        self.orders = program.orders()
        self.synchronous = program.synchronous

    @classmethod
    def from_file(cls, path, stages: int, micro_batches: int) -> "ProgramSchedule":
        """Load ``path`` and check that it fits ``stages`` pipeline ranks and ``micro_batches`` per step."""
        where = f'"pipeline": {{"program": {str(path)!r}}}'
        program = read_named_file('"pipeline": program', path, Program.load,
                                  "pass a file that `ds-chimera simulate --dump-program FILE` (or Program.dump) wrote")
        if program.num_ranks != stages:
            raise ValueError(f"{where} is a program for {program.num_ranks} pipeline ranks; this run has {stages}")
        if program.placement.num_micro_batches != micro_batches:
            raise ValueError(f"{where} runs {program.placement.num_micro_batches} micro-batches per step; the "
                             f"config's batch sizes give {micro_batches} (gradient_accumulation_steps)")
        if not program.synchronous:
            raise ValueError(f"{where} is asynchronous; the engines run loaded programs only when they are "
                             f"synchronous (an asynchronous schedule's weight versions come from its own tables)")
        return cls(program, str(path))

    def lower(self) -> Program:
        return self.program

    def __repr__(self) -> str:
        return f"ProgramSchedule({self.source!r}, stages={self.ranks}, micro_batches={self.micro_batches})"
