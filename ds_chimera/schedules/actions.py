"""The vocabulary every consumer shares: compute actions, messages and lowered operations.

Tuples (not classes with behaviour) so that a schedule of a million actions stays cheap
to build, hash, compare and simulate.
"""
from __future__ import annotations

from typing import NamedTuple

FORWARD = "F"
BACKWARD = "B"          # full backward: input grad and weight grad together
INPUT_GRAD = "I"        # split backward, first half: grad w.r.t. the chunk's input
WEIGHT_GRAD = "W"       # split backward, second half: grad w.r.t. the chunk's weights
STEP = "S"              # per-chunk optimizer step, emitted by schedules with no flush

COMPUTE_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, STEP)
BACKWARD_KINDS = (BACKWARD, INPUT_GRAD)   # the kinds that produce an input gradient


class Action(NamedTuple):
    """One unit of compute on one rank: ``kind`` of micro-batch ``mb`` through chunk ``chunk``."""

    kind: str
    chunk: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


class Message(NamedTuple):
    """A point-to-point tensor: an activation (``act``) or an input gradient (``grad``)."""

    kind: str
    src: int   # producing chunk
    dst: int   # consuming chunk
    mb: int


class CommBatch(NamedTuple):
    """Sends and receives posted together. Sends never block; the receives are awaited.

    Posting every send of a batch before waiting on any receive is what makes two
    pipelines flowing in opposite directions unable to deadlock each other.
    """

    sends: tuple
    recvs: tuple


class GradSync(NamedTuple):
    """Start the all-reduce of one model stage's gradients over the ranks holding a replica.

    Non-blocking: it is posted right after the rank's last backward of that stage, so it
    overlaps with the rest of the schedule; :class:`OptimizerStep` waits for it.
    """

    stage: int
    ranks: tuple


class OptimizerStep(NamedTuple):
    """Wait for every pending gradient sync of this rank, then step the optimizer."""

    chunks: tuple
