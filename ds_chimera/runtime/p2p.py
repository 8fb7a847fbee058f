"""Point-to-point transfer of activations and gradients between chunks on different ranks.

Each transfer is a fixed-size int64 header (count, dtypes, shapes) followed by the
tensors, so shapes may change from micro-batch to micro-batch. Sends are posted without
blocking; receives wait with a deadline, so a dead or stuck peer becomes a clear error
instead of a hang. With gloo, messages are told apart by tag, and receives are posted ahead
of need (:meth:`P2P.prepost`): gloo's sender holds the data until the receiver has posted
its receive, so a receive posted only when needed costs a round trip and several thread
wake-ups. Posted early, the data lands while the rank computes. NCCL ignores tags and
matches in issue order, so there every (edge, kind) gets its own two-rank group; the
simulator checks that each edge's sends and receives run in the same micro-batch order.
"""
from __future__ import annotations

import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from . import faults
from .faults import PeerTimeout
from .tensors import as_tuple

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.bool, torch.uint8, torch.int8, torch.int16]
HEADER = 128
MAX_DIMS = 8


PENDING_PER_CHUNK = 4      # sends kept in flight per pipeline chunk before the oldest is waited for
LOSS_TAG = 1 << 28         # losses sent between ranks after a step: above every pipeline message tag


def wait_or_fail(work, timeout_s: float, what: str, source: str = "ds_chimera", peer: str = "the peer rank") -> None:
    """Wait for ``work``, or for what the callable ``work`` posts, within ``timeout_s`` seconds.

    gloo reports a dead peer either when an operation is posted (a closed connection) or
    while it is awaited (a timeout); both become one clear error naming ``what``. A wait that
    would block is one the fault monitor can end: another rank's failure stops it
    (:class:`~.faults.JobFailed`) within a heartbeat instead of the timeout.
    """
    start = time.monotonic()
    try:
        if callable(work):
            work = work()
        monitor = faults.current()
        if monitor is not None and not work.is_completed():
            monitor.wait_interruptibly(work, timeout_s)
        else:
            work.wait(timedelta(seconds=timeout_s))
    except faults.JobFailed:
        raise
    except Exception as exc:
        raise PeerTimeout(f"{source}: {what} did not arrive after {time.monotonic() - start:.1f}s "
                          f"(timeout {timeout_s:g}s): {peer} died or is stuck. Cause: {exc}") from exc


# A gloo send whose Work object is dropped is cancelled: its receiver then waits until its timeout
# (measured here with two ranks: the message is lost). Sends that may outlive the object that posted
# them (the asynchronous engine's loss, sent without a barrier at the end of a call) are held here
# until they complete; teardown waits for them before it destroys the groups.
_HELD_SENDS: list = []


def hold_until_sent(work, tensor) -> None:
    """Keep ``work`` (and the ``tensor`` it sends) alive until the send completes, whoever drops it."""
    _HELD_SENDS[:] = [(w, t) for w, t in _HELD_SENDS if not w.is_completed()]
    _HELD_SENDS.append((work, tensor))


def finish_held_sends(timeout_s: float) -> None:
    """Wait (bounded) for every held send; one that cannot complete is dropped after the deadline."""
    deadline = time.monotonic() + timeout_s
    while _HELD_SENDS:
        work, _ = _HELD_SENDS.pop(0)
        try:
            work.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except Exception:     # a dead peer: nothing left to deliver to
            pass


def post_or_fail(post, what: str, source: str = "ds_chimera", peer: str = "the peer rank"):
    """Post a non-blocking operation; a dead peer at posting time becomes the same clear error."""
    try:
        return post()
    except Exception as exc:
        raise PeerTimeout(f"{source}: {what} could not be posted: {peer} died or is stuck. Cause: {exc}") from exc


def encode_header(tensors) -> torch.Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0] = len(tensors)
    pos = 1
    for t in tensors:
        if t.dim() > MAX_DIMS:
            raise ValueError(f"pipeline tensors may have at most {MAX_DIMS} dims, got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"unsupported pipeline tensor dtype {t.dtype}; allowed: {DTYPES}")
        fields = [DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
        if pos + len(fields) > HEADER:
            raise ValueError(f"too many tensors in one pipeline message ({len(tensors)})")
        header[pos:pos + len(fields)] = torch.tensor(fields, dtype=torch.int64)
        pos += len(fields)
    return header


def _shapes(meta) -> list:
    """A message's (dtype, requires_grad, shape) entries, shapes as lists, for an error message."""
    return [(dtype, requires_grad, list(shape)) for dtype, requires_grad, shape in meta]


def decode_header(header: torch.Tensor) -> list:
    values = header.tolist()
    out, pos = [], 1
    for _ in range(values[0]):
        dtype, requires_grad, ndim = values[pos:pos + 3]
        shape = values[pos + 3:pos + 3 + ndim]
        out.append((DTYPES[dtype], bool(requires_grad), shape))
        pos += 3 + ndim
    return out


class P2P:
    """Sends and receives :class:`~ds_chimera.schedules.actions.Message` payloads."""

    def __init__(self, to_global_rank, device, num_chunks: int, timeout_s: float, groups=None,
                 dynamic_shapes: bool = False, default_group=None):
        self.to_global = to_global_rank      # pipeline rank -> global rank
        self.device = device
        self.num_chunks = num_chunks
        self.timeout_s = timeout_s
        self.groups = groups or {}            # (src_chunk, dst_chunk, kind) -> group (NCCL only)
        self.default_group = default_group    # every other message's (gloo: the engine's own world group)
        self.pending_sends: deque = deque()     # oldest first
        self.max_pending = PENDING_PER_CHUNK * num_chunks + 8
        self.header_on_device = dist.get_backend() != "gloo"
        # Static shapes (DeepSpeed's default): an edge's header goes once, with its first message;
        # both sides remember it. dynamic_shapes=True sends one with every message.
        self.dynamic_shapes = dynamic_shapes
        self.shape_hint = "build the PipelineModule with dynamic_shape=True"     # how a user allows changes
        self.sent_meta: dict = {}
        self.recv_meta: dict = {}
        self.preposted: dict = {}     # message key -> (buffers, works): receives posted ahead of need
        # NCCL receives are already stream-ordered and asynchronous; gloo's need the early post
        self.can_prepost = not self.header_on_device
        self.early_receives = 0       # receives that were posted ahead of need (a count, for tests and tuning)
        self.preposted_bytes = 0      # the buffers of receives posted ahead and not yet taken
        self.endpoints: dict = {}     # (message's group, pipeline rank) -> (process group, the peer's rank in it)

    def _tag(self, msg, part: int) -> int:
        kind_bit = 0 if msg.kind == "act" else 1
        return (((msg.mb * self.num_chunks + msg.src) * self.num_chunks + msg.dst) * 2 + kind_bit) * 16 + part

    def _group(self, msg):
        return self.groups.get((msg.src, msg.dst, msg.kind), self.default_group)

    @staticmethod
    def _edge(msg):
        return (msg.kind, msg.src, msg.dst)

    def _prune(self) -> None:
        """Forget old sends, so their tensors can be freed and the list stays short.

        Completed sends at the front are dropped. gloo reports a send complete only once it
        has been waited for, so beyond ``max_pending`` (a few per chunk) the oldest is waited
        for: its receiver took it long ago. This bounds the list, and the tensors it keeps
        alive, when a pipeline stays full across calls.
        """
        pending = self.pending_sends
        while pending and all(work.is_completed() for work in pending[0][0]):
            pending.popleft()
        while len(pending) > self.max_pending:
            for work in pending.popleft()[0]:
                self._wait(work, "an earlier send")

    def post(self, post, what: str):
        return post_or_fail(post, what)

    def _endpoint(self, msg, pipe_rank: int) -> tuple:
        """(process group, the peer's rank in it) of a message to or from pipeline rank ``pipe_rank``: the
        group's own send/recv, which ``dist.isend``/``irecv`` call after their checks, looked up once per peer."""
        group = self._group(msg)
        found = self.endpoints.get((group, pipe_rank))
        if found is None:
            pg = group if group is not None else dist.group.WORLD
            found = self.endpoints[(group, pipe_rank)] = (pg, dist.get_group_rank(pg, self.to_global(pipe_rank)))
        return found

    def send(self, msg, dst_rank: int, tensors) -> None:
        self._prune()
        tensors = [t.detach().contiguous() for t in as_tuple(tensors)]
        pg, peer = self._endpoint(msg, dst_rank)
        edge, header = self._edge(msg), None
        meta = [(t.dtype, t.requires_grad, t.shape) for t in tensors]
        if self.dynamic_shapes or edge not in self.sent_meta:
            header = encode_header(tensors)
            if self.header_on_device:
                header = header.to(self.device)
        elif self.sent_meta[edge] != meta:
            raise RuntimeError(f"pipeline tensor shapes changed on {msg.kind} {msg.src}->{msg.dst} "
                               f"({_shapes(self.sent_meta[edge])} -> {_shapes(meta)}); {self.shape_hint}")
        tag = self._tag(msg, 0)
        parts = ([header] if header is not None else []) + tensors
        first = 0 if header is not None else 1
        works = self.post(lambda: [pg.send([t], peer, tag + first + i) for i, t in enumerate(parts)],
                          f"the send of {msg.kind} {msg.src}->{msg.dst} micro-batch {msg.mb}")
        self.sent_meta[edge] = meta          # the header is on its way: later messages of the edge go without
        self.pending_sends.append((works, header, tensors))

    def _wait(self, work, what: str) -> None:
        wait_or_fail(work, self.timeout_s, what)

    @staticmethod
    def _key(msg):
        return (msg.kind, msg.src, msg.dst, msg.mb)

    def prepost(self, msg, src_rank: int, what: str) -> bool:
        """Post the receive of ``msg`` now, before it is needed, where its shapes are known. Returns whether it
        is posted (now or before).

        Only static-shape edges whose header has arrived qualify; anything else is received
        the ordinary way by :meth:`recv`.
        """
        if self._key(msg) in self.preposted:
            return True
        if not self.can_prepost or self.dynamic_shapes:
            return False
        meta = self.recv_meta.get(self._edge(msg))
        if meta is None:
            return False
        out, works = self.preposted[self._key(msg)] = self._post_payload(msg, src_rank, meta, what)
        self.preposted_bytes += sum(t.numel() * t.element_size() for t in out)
        return True

    def _post_payload(self, msg, src_rank: int, meta, what: str):
        pg, peer = self._endpoint(msg, src_rank)
        out = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in meta]
        tag = self._tag(msg, 1)
        works = self.post(lambda: [pg.recv([buf], peer, tag + i) for i, buf in enumerate(out)], what)
        return out, works

    def recv(self, msg, src_rank: int, what: str):
        early = self.preposted.pop(self._key(msg), None)
        if early is not None:
            self.early_receives += 1
            out, works = early
            self.preposted_bytes -= sum(t.numel() * t.element_size() for t in out)
        else:
            out, works = self._post_payload(msg, src_rank, self._meta(msg, src_rank, what), what)
        for work in works:
            self._wait(work, what)
        return out

    def _meta(self, msg, src_rank: int, what: str) -> list:
        """The shapes of ``msg``'s tensors: remembered for a static edge, else read from its header."""
        meta = None if self.dynamic_shapes else self.recv_meta.get(self._edge(msg))
        if meta is None:
            pg, peer = self._endpoint(msg, src_rank)
            header = torch.zeros(HEADER, dtype=torch.int64, device=self.device if self.header_on_device else "cpu")
            self._wait(lambda: pg.recv([header], peer, self._tag(msg, 0)), what)
            meta = decode_header(header.cpu())
            self.recv_meta[self._edge(msg)] = meta
        return meta

    def flush(self) -> None:
        """Wait for every posted send (end of step): their buffers may then be freed."""
        if self.preposted:
            raise RuntimeError(f"internal error: receives posted but never taken: {sorted(self.preposted)[:5]}")
        for works, _, _ in self.pending_sends:
            for work in works:
                self._wait(work, "a send")
        self.pending_sends.clear()
