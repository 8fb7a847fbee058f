"""The vocabulary every consumer shares: compute actions, messages and the ops of a program.

Tuples (not classes with behaviour) so that a schedule of a million actions stays cheap
to build, hash, compare and simulate. Every op has a one-line text form (``str(op)``),
which :func:`parse_op` reads back: programs can be printed, saved and loaded (see
:mod:`.program_io`).

A lowered program is the whole training step of one rank:

    compute    2F0 2B0 2I0 2W0 2S0   chunk, kind, micro-batch (as torch's pipelining writes them)
    COMM       sends posted, then receives awaited
    SYNC_START post the all-reduce of one stage's gradients
    SYNC_WAIT  wait for the posted syncs of some stages
    CLIP       clip the gradients (the global norm, or one stage's own)
    STEP       the optimizer step of some chunks
    GATHER     post the all-gather of a chunk's sharded weights (sharded data parallelism)
    RELEASE    free a chunk's gathered weights
"""
from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple


class Kind(StrEnum):
    """What a compute action does. A ``str``: ``Kind.FORWARD == "F"``."""

    FORWARD = "F"
    BACKWARD = "B"        # full backward: input grad and weight grad together
    INPUT_GRAD = "I"      # split backward, first half: grad w.r.t. the chunk's input
    WEIGHT_GRAD = "W"     # split backward, second half: grad w.r.t. the chunk's weights
    STAGE_STEP = "S"      # one chunk's optimizer step inside the pipeline (schedules with no flush)


class Payload(StrEnum):
    """What a point-to-point message carries."""

    ACT = "act"           # a chunk's output, to the next chunk's forward
    GRAD = "grad"         # a chunk's input gradient, to the previous chunk's backward


class OpKind(StrEnum):
    """The non-compute ops of a lowered program (their first word in the text form)."""

    COMM = "COMM"
    SYNC_START = "SYNC_START"
    SYNC_WAIT = "SYNC_WAIT"
    CLIP = "CLIP"
    STEP = "STEP"
    GATHER = "GATHER"
    RELEASE = "RELEASE"


class ClipScope(StrEnum):
    GLOBAL = "global"     # one norm over every unique parameter of the model (synchronous steps)
    STAGE = "stage"       # one stage's own norm (asynchronous steps: stages update alone)


FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, STAGE_STEP = Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, \
    Kind.WEIGHT_GRAD, Kind.STAGE_STEP
ACT, GRAD = Payload.ACT, Payload.GRAD
COMPUTE_KINDS = tuple(Kind)
BACKWARD_KINDS = (BACKWARD, INPUT_GRAD)   # the kinds that produce an input gradient
GRADIENT_KINDS = (BACKWARD, WEIGHT_GRAD)  # the kinds after which a chunk's weight gradients exist


def split_chunks(order) -> set:
    """The chunks whose backward an order splits into I and W (their forwards record blocks for W)."""
    return {a.chunk for a in order if a.kind == INPUT_GRAD}


def activation_peaks(orders: list, chunk_size=None) -> list:
    """Each rank's peak of held activations, counted along its order: a forward adds its chunk's
    ``chunk_size`` (default 1: micro-batches), a full backward or a weight-grad frees it. The count
    does not depend on timing, so it is the simulator's and the runtime's."""
    peaks = []
    for order in orders:
        live = peak = 0
        for action in order:
            if action.kind == Kind.FORWARD:
                live += 1 if chunk_size is None else chunk_size[action.chunk]
                peak = max(peak, live)
            elif action.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
                live -= 1 if chunk_size is None else chunk_size[action.chunk]
        peaks.append(peak)
    return peaks


def _ints(values) -> str:
    return ",".join(str(int(v)) for v in values)


class Action(NamedTuple):
    """One unit of compute on one rank: ``kind`` of micro-batch ``mb`` through chunk ``chunk``."""

    kind: Kind
    chunk: int
    mb: int

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``"2F0"`` -> Action(F, chunk 2, micro-batch 0)."""
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not a compute action: {text!r} (expected CHUNK KIND MB, e.g. '2F0'; "
                             f"kinds {', '.join(k.value for k in Kind)})")
        return cls(Kind(match.group(2)), int(match.group(1)), int(match.group(3)))


_ACTION = re.compile(r"(\d+)([FBIWS])(\d+)")


class Message(NamedTuple):
    """A point-to-point tensor: an activation (``act``) or an input gradient (``grad``)."""

    kind: Payload
    src: int   # producing chunk
    dst: int   # consuming chunk
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.src}>{self.dst}:{self.mb}"

    @classmethod
    def parse(cls, text: str) -> "Message":
        match = _MESSAGE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not a message: {text!r} (expected KIND:SRC>DST:MB, e.g. 'act:0>1:3')")
        return cls(Payload(match.group(1)), int(match.group(2)), int(match.group(3)), int(match.group(4)))


_MESSAGE = re.compile(r"(act|grad):(\d+)>(\d+):(\d+)")


class Comm(NamedTuple):
    """Sends and receives posted together. Sends never block; the receives are awaited.

    Posting every send of a batch before waiting on any receive is what makes two
    pipelines flowing in opposite directions unable to deadlock each other.
    """

    sends: tuple
    recvs: tuple
    code = OpKind.COMM

    def __str__(self) -> str:
        return f"COMM send={','.join(map(str, self.sends))} recv={','.join(map(str, self.recvs))}"


class SyncStart(NamedTuple):
    """Start the all-reduce of one model stage's gradients over the ranks holding a replica.

    Non-blocking: it is posted right after the rank's last backward of that stage, so it
    overlaps with the rest of the schedule; a :class:`SyncWait` waits for it.
    """

    stage: int
    ranks: tuple
    code = OpKind.SYNC_START

    def __str__(self) -> str:
        return f"SYNC_START stage={self.stage} ranks={_ints(self.ranks)}"


class SyncWait(NamedTuple):
    """Wait for every sync this rank posted for ``stages`` (the host's own syncs, tied weights, too)."""

    stages: tuple
    code = OpKind.SYNC_WAIT

    def __str__(self) -> str:
        return f"SYNC_WAIT stages={_ints(self.stages)}"


class Clip(NamedTuple):
    """Clip gradients to the configured norm: the model's global norm, or ``stage``'s own.

    The global clip is a collective of every rank of the pipeline (their squared norms
    are summed); the host skips it when no clipping is configured.
    """

    scope: ClipScope
    stage: int = -1
    code = OpKind.CLIP

    def __str__(self) -> str:
        return f"CLIP scope={self.scope}" + (f" stage={self.stage}" if self.scope == ClipScope.STAGE else "")


class Step(NamedTuple):
    """Step the optimizer on ``chunks`` (every chunk of the rank at a flush)."""

    chunks: tuple
    code = OpKind.STEP

    def __str__(self) -> str:
        return f"STEP chunks={_ints(self.chunks)}"


class Gather(NamedTuple):
    """Post the all-gather of ``chunk``'s weight shards over data parallelism (ZeRO-2/3).

    Non-blocking: posted a compute op ahead of the chunk's use, so it overlaps the
    previous chunk's compute; the chunk's next compute waits for it.
    """

    chunk: int
    code = OpKind.GATHER

    def __str__(self) -> str:
        return f"GATHER chunk={self.chunk}"


class Release(NamedTuple):
    """Free ``chunk``'s gathered weights (ZeRO-3): only its shard stays until the next GATHER."""

    chunk: int
    code = OpKind.RELEASE

    def __str__(self) -> str:
        return f"RELEASE chunk={self.chunk}"


OPS = (Action, Comm, SyncStart, SyncWait, Clip, Step, Gather, Release)
_OP_WORDS = {k.value for k in OpKind}


def _fields(words: list, text: str) -> dict:
    out = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"op {text!r}: expected key=value, got {word!r}")
        out[key] = value
    return out


def _int_list(value: str) -> tuple:
    return tuple(int(v) for v in value.split(",") if v != "")


def parse_op(text: str):
    """Read back one op from its ``str()``; a ValueError names what is wrong."""
    text = text.strip()
    head, _, rest = text.partition(" ")
    if head not in _OP_WORDS:
        return Action.parse(text)
    fields = _fields(rest.split(), text)
    try:
        if head == OpKind.COMM:
            sends = tuple(Message.parse(m) for m in fields.get("send", "").split(",") if m)
            recvs = tuple(Message.parse(m) for m in fields.get("recv", "").split(",") if m)
            return Comm(sends, recvs)
        if head == OpKind.SYNC_START:
            return SyncStart(int(fields["stage"]), _int_list(fields["ranks"]))
        if head == OpKind.SYNC_WAIT:
            return SyncWait(_int_list(fields["stages"]))
        if head == OpKind.CLIP:
            scope = ClipScope(fields["scope"])
            return Clip(scope, int(fields["stage"]) if scope == ClipScope.STAGE else -1)
        if head == OpKind.GATHER:
            return Gather(int(fields["chunk"]))
        if head == OpKind.RELEASE:
            return Release(int(fields["chunk"]))
        return Step(_int_list(fields["chunks"]))
    except KeyError as missing:
        raise ValueError(f"op {text!r} lacks the field {missing}") from None
