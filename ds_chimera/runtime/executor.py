"""Execute one rank's lowered program, the whole step: the only place where ops run.

The executor keeps per-(chunk, micro-batch) state (inputs, outputs, pending input-grads,
deferred weight-grads), because schedules other than 1F1B reorder backwards freely; the
stock engine's single ``self.loss`` / ``self.grad_layer`` cannot express that. Everything
host-specific (the chunk call, data, loss, syncs, clipping, the optimizer) goes through
the :class:`~.context.ExecutionContext`. Adding an op kind: a tuple in
``schedules/actions.py``, its place in ``lowering.py``, one handler in the simulator's table
(``sim/simulator.py: _Simulation.handlers``) and one in :class:`StepRun`'s.
"""
from __future__ import annotations

import torch

from ..schedules.actions import (ACT, BACKWARD, BACKWARD_KINDS, FORWARD, GRAD, GRADIENT_KINDS, STAGE_STEP, WEIGHT_GRAD,
                                 Action, Clip, Comm, Gather, SyncStart, Step, Release, SyncWait)
from .. import autograd_calls
from .context import ExecutionContext
from .tensors import as_leaves, as_tuple, pack, versions
from .tracing import StepTrace, profiler_range, profiler_running


current_action = None   # the action being executed on this process, for instrumentation and debugging
MB_TAG_SPACE = 1 << 16  # messages carry global micro-batch ids modulo this (tags stay small)
# Receives are posted ahead of need (gloo: see p2p.P2P.prepost), as far ahead as the program goes while the
# buffers of posted, untaken receives hold under PREPOST_BYTES, and always the next RECV_LOOKAHEAD batches:
# a message whose receive is posted lands while the rank computes, instead of costing a round trip when it is
# needed (docs/investigations/zero-bubble-host-time.md: zbv's host time fell 8-12% from two batches ahead)
RECV_LOOKAHEAD = 2
PREPOST_BYTES = 64 << 20
CARRY_TABLES = ("inputs", "outputs", "input_grads", "deferred", "received", "blocks")


def new_carry() -> dict:
    """Empty per-micro-batch executor state."""
    return {name: {} for name in CARRY_TABLES}


def shift_carry(carry: dict, by: int) -> None:
    """Relabel carried state for the next call: call-local id ``mb`` becomes ``mb - by``."""
    for name, table in carry.items():
        moved = {}
        for key, value in table.items():
            mb = key[-1]
            if mb < by:
                raise RuntimeError(f"internal error: {name} of micro-batch {mb} left over from the last call")
            moved[key[:-1] + (mb - by,)] = value
        carry[name] = moved


def _global(msg, mb_base: int):
    return msg if not mb_base else msg._replace(mb=(msg.mb + mb_base) % MB_TAG_SPACE)


class StepExecutor:
    """Runs the ops of one rank on an :class:`~.context.ExecutionContext`."""

    def __init__(self, ctx: ExecutionContext):
        self.ctx = ctx
        self.records: list = []          # (rank, kind, chunk, mb, start, end) of the last traced call
        self.recv_lookahead = RECV_LOOKAHEAD
        self.prepost_bytes = PREPOST_BYTES

    def run(self, ops, train: bool, scale: float, trace: bool = False, carry: dict | None = None,
            mb_base: int = 0, flush: bool = True, on_losses=None, device="cpu"):
        """Execute ``ops``, the rank's whole step. Returns (sum of this rank's micro-batch losses, their count).

        ``carry``: per-micro-batch state that outlives the call (a pipeline kept full across
        calls); ``mb_base`` turns the program's call-local micro-batch ids into the global ids
        that label messages, so a message sent in one call is received in the next.
        ``on_losses(loss_sum)`` is called once, as soon as this rank's last loss of the call is
        known (at the start on a rank that computes none), so the loss all-reduce can run
        during the rest of the program instead of after it. ``trace`` times each compute
        action (device events on an accelerator ``device``) into :attr:`records`.
        """
        step = self.start(ops, train, scale, trace, carry, mb_base, on_losses, device)
        for op in ops:
            step.execute(op)
        return step.finish(flush)

    def start(self, ops, train: bool, scale: float, trace: bool = False, carry: dict | None = None,
              mb_base: int = 0, on_losses=None, device="cpu") -> "StepRun":
        """A run of ``ops`` whose ops the caller executes one by one (the local reference interleaves ranks)."""
        self.records = []
        return StepRun(self, ops, train, scale, trace, carry, mb_base, on_losses, device)


class StepRun:
    """The state of one call: per-micro-batch tables, losses, early receives. One method per op type."""

    def __init__(self, executor: StepExecutor, ops, train: bool, scale: float, trace: bool, carry, mb_base: int,
                 on_losses, device):
        ctx = executor.ctx
        self.executor, self.ctx, self.placement = executor, ctx, ctx.placement
        self.train, self.scale, self.mb_base = train, scale, mb_base
        self.carry = carry if carry is not None else new_carry()
        c = self.carry
        self.inputs, self.outputs, self.input_grads = c["inputs"], c["outputs"], c["input_grads"]
        self.deferred, self.received, self.blocks = c["deferred"], c["received"], c["blocks"]
        self.loss_sum, self.loss_count = None, 0
        self.trace = StepTrace(ctx.pipe_rank, device) if trace else None
        self.recv_batches = [op for op in ops if type(op) is Comm and op.recvs]
        self.next_recv_batch = 0     # index into recv_batches of the next batch this run reaches
        self.posted_upto = 0         # recv_batches[:posted_upto] have had their receives posted early
        self.lookahead, self.prepost_bytes = executor.recv_lookahead, executor.prepost_bytes
        self.on_losses = on_losses
        placement = self.placement
        self.losses_left = sum(1 for op in ops if type(op) is Action and op.kind == FORWARD
                               and placement.next_chunk(op.chunk) is None) if on_losses is not None else -1
        self.handlers = {Action: self._action, Comm: self._comm, SyncStart: self._grad_sync,
                         SyncWait: self._sync_wait, Clip: self._clip, Step: self._step,
                         Gather: self._gather, Release: self._release}
        self.sharded = any(type(op) is Gather for op in ops)    # compute then waits for its chunk's weights
        self.profiled = profiler_running()      # each op a profiler range (a step starts inside a profile or not)
        self._post_ahead(self.lookahead)
        if self.losses_left == 0:
            on_losses(None)

    def execute(self, op) -> None:
        handler = self.handlers.get(type(op))
        if handler is None:
            raise RuntimeError(f"the executor has no handler for op {op!r}")
        if self.profiled:
            with profiler_range(op):
                handler(op)
        else:
            handler(op)

    def finish(self, flush: bool = True):
        """End the call: check nothing is left behind, wait for the sends. Returns (loss sum, count)."""
        if self.train and flush:
            leftovers = {k for d in (self.outputs, self.deferred, self.blocks) for k in d}
            if leftovers:
                raise RuntimeError(f"internal error: work left after the step: {sorted(leftovers)[:5]}")
        if flush:
            self.ctx.transport.flush()
        if self.trace is not None:
            self.executor.records = self.trace.records()
        return self.loss_sum, self.loss_count

    # ---- compute ------------------------------------------------------------------------------
    def _action(self, op) -> None:
        global current_action
        current_action = op
        trace = self.trace
        if self.sharded:
            self.ctx.wait_weights(op.chunk)        # a wait, not the action's work: outside its traced span
        start = trace.clock.mark() if trace is not None else None
        if self.sharded and op.kind in GRADIENT_KINDS:
            # the chunk's gradient buffer (once a step): part of the backward's work, as autograd's
            # own .grad allocation is in an unsharded run
            self.ctx.prepare_grads(op.chunk)
        kind = op.kind
        if kind == FORWARD:
            self._forward(op)
        elif kind in BACKWARD_KINDS:
            self._backward(op)
        elif kind == WEIGHT_GRAD:
            for outs, out_grads, params in self.deferred.pop((op.chunk, op.mb)):
                autograd_calls.backward(outs, out_grads, inputs=params)
        elif kind == STAGE_STEP:
            self.ctx.optimizer_step((op.chunk,))
        else:
            raise RuntimeError(f"the runtime cannot execute action {op}")
        if trace is not None:
            trace.add(kind, op.chunk, op.mb, start, trace.clock.mark())

    def _forward(self, op) -> None:
        ctx, placement, train = self.ctx, self.placement, self.train
        c, mb = op.chunk, op.mb
        prev = placement.prev_chunk(c)
        if prev is None:
            x = ctx.load_input(c, mb)
            self.inputs[(c, mb)] = list(as_tuple(x))
        else:
            if placement.rank_of(prev) == ctx.pipe_rank:
                # training keeps the producer's output for its backward; eval frees it
                src = as_tuple(self.outputs[(prev, mb)] if train else self.outputs.pop((prev, mb)))
            else:
                src = self.received.pop((ACT, prev, c, mb))
            leaves = self.inputs[(c, mb)] = as_leaves(src, train)
            # the chunk computes on copies, as DeepSpeed's engine does: a first layer that works in
            # place (ReLU(inplace=True)) may not write into a leaf; the leaves collect the input grads
            x = pack([t.clone() if t.requires_grad else t for t in leaves])
        capture = [] if train and c in ctx.split_chunks else None
        with torch.set_grad_enabled(train):
            out = ctx.forward(c, mb, x, capture, train)
        if capture is not None:
            self.blocks[(c, mb)] = capture
        last = placement.next_chunk(c) is None
        if last:
            out = ctx.loss(out, c, mb)
            if isinstance(out, torch.Tensor) and out.numel() == 1:   # not e.g. logits collected in eval
                value = out.detach().float()
                self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
                self.loss_count += 1
            self.losses_left -= 1
            if self.losses_left == 0:
                self.on_losses(self.loss_sum)
        if train or not last:
            self.outputs[(c, mb)] = out

    def _backward(self, op) -> None:
        ctx, placement = self.ctx, self.placement
        kind, c, mb = op.kind, op.chunk, op.mb
        out = self.outputs.pop((c, mb))
        nxt = placement.next_chunk(c)
        if nxt is None:
            tensors, grads = [out * self.scale], None
        else:
            if placement.rank_of(nxt) == ctx.pipe_rank:
                grads = self.input_grads.pop((nxt, mb))
            else:
                grads = self.received.pop((GRAD, nxt, c, mb))
            tensors = [t for t in as_tuple(out) if t.requires_grad]
            if len(tensors) != len(grads):
                raise RuntimeError(f"chunk {c} micro-batch {mb}: {len(tensors)} outputs need grads "
                                   f"but {len(grads)} gradients arrived")
        leaves = [t for t in self.inputs.pop((c, mb), []) if t.requires_grad]
        if kind == BACKWARD:
            self.blocks.pop((c, mb), None)
            autograd_calls.backward(tensors, grads)
        else:
            self.deferred[(c, mb)] = split_input_grad(tensors, grads, leaves, self.blocks.pop((c, mb)))
        if placement.prev_chunk(c) is not None:
            self.input_grads[(c, mb)] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        ctx.backward_done(c, mb)

    # ---- communication --------------------------------------------------------------------------
    def _post_ahead(self, upto: int) -> None:
        """Post the receives of the comm batches before index ``upto``, and of later ones while the posted,
        untaken receives' buffers hold under ``prepost_bytes`` (the transport counts them)."""
        transport, placement, batches = self.ctx.transport, self.placement, self.recv_batches
        while self.posted_upto < len(batches):
            within = self.posted_upto < upto
            if not within and getattr(transport, "preposted_bytes", 0) >= self.prepost_bytes:
                break
            posted = [transport.prepost(_global(msg, self.mb_base), placement.rank_of(msg.src), self.describe(msg))
                      for msg in batches[self.posted_upto].recvs]
            if not within and not all(posted):
                break         # an edge whose shapes are not known yet (its first message): a later call posts it
            self.posted_upto += 1

    def _comm(self, op) -> None:
        self.post_sends(op)
        self.take_receives(op)

    def post_sends(self, op) -> None:
        """The sends of a comm batch (they never block)."""
        transport, placement, mb_base = self.ctx.transport, self.placement, self.mb_base
        for msg in op.sends:
            if msg.kind == ACT:
                key = (msg.src, msg.mb)
                payload = self.outputs[key] if self.train else self.outputs.pop(key)
            else:
                payload = self.input_grads.pop((msg.src, msg.mb))
            transport.send(_global(msg, mb_base), placement.rank_of(msg.dst), payload)

    def take_receives(self, op) -> None:
        """The receives of a comm batch, awaited (after every send of the batch is posted)."""
        transport, placement, mb_base = self.ctx.transport, self.placement, self.mb_base
        if op.recvs:
            # the next batches' receives go out before this one's wait, so their data
            # can arrive while this rank computes
            self._post_ahead(self.next_recv_batch + 1 + self.lookahead)
            self.next_recv_batch += 1
        for msg in op.recvs:
            self.received[(msg.kind, msg.src, msg.dst, msg.mb)] = transport.recv(
                _global(msg, mb_base), placement.rank_of(msg.src), self.describe(msg))

    def describe(self, msg) -> str:
        """A message's description for timeout errors."""
        return (f"{'activation' if msg.kind == ACT else 'gradient'} of micro-batch {msg.mb + self.mb_base} "
                f"from rank {self.placement.rank_of(msg.src)} (chunk {msg.src} -> {msg.dst})")

    # ---- the step's end: syncs, clipping, the optimizer ----------------------------------------
    def _grad_sync(self, op) -> None:
        if self.train:
            self.ctx.start_grad_sync(op.stage)

    def _sync_wait(self, op) -> None:
        if self.train:
            self.ctx.wait_grad_syncs(op.stages)

    def _clip(self, op) -> None:
        if self.train:
            self.ctx.clip_gradients(op.scope, op.stage)

    def _step(self, op) -> None:
        if self.train:
            self.ctx.optimizer_step(op.chunks)

    # ---- sharded data parallelism: a chunk's weights gathered where the program says --------------
    def _gather(self, op) -> None:
        self.ctx.gather_weights(op.chunk)

    def _release(self, op) -> None:
        self.ctx.release_weights(op.chunk)


def split_input_grad(tensors, grads, leaves, blocks):
    """I: gradients for the chunk's inputs and for every block output, in one pass.

    Returns the deferred W work: (block outputs, their gradients, block params) per
    block, so W differentiates each block locally instead of re-running this pass.
    A block is (output, params) or (output, params, versions of the output at capture).
    A block without an output, or whose output was later modified in place (Megatron's
    cross-entropy overwrites the logits), cannot be differentiated again: its parameters
    get their gradients in this pass.
    """
    now, kept = [], []
    for block in blocks:
        out, params = block[0], block[1]
        if out is None or (len(block) > 2 and versions(out) != block[2]):
            now += params
        elif params:
            kept.append((out, params))
    now = list({id(p): p for p in now}.values())
    seen, shared = {id(p) for p in now}, False
    for _, params in kept:
        ids = {id(p) for p in params}
        shared |= bool(seen & ids)
        seen |= ids
    if shared:
        # A parameter used by two blocks (a tie inside the chunk): per-block W would count the
        # earlier use twice, so W differentiates the whole chunk once instead.
        if leaves:
            got = autograd_calls.grad(tensors, leaves, grads, retain_graph=True, allow_unused=True)
            for leaf, g in zip(leaves, got):
                leaf.grad = g if g is not None else torch.zeros_like(leaf)
        params = list({id(p): p for block in blocks for p in block[1]}.values())
        return [(tensors, grads, params)]
    outs = [[t for t in as_tuple(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            for out, _ in kept]
    flat = [t for group in outs for t in group]
    if now:
        # backward(inputs=...), not grad(): the parameters' own accumulation hooks must run
        # (Megatron DDP copies .grad into main_grad there)
        for t in flat:
            t.retain_grad()
        autograd_calls.backward(tensors, grads, inputs=leaves + flat + now, retain_graph=bool(flat))
        for leaf in leaves:
            if leaf.grad is None:
                leaf.grad = torch.zeros_like(leaf)
        got = [t.grad for t in flat]
        for t in flat:
            if t.grad_fn is not None:       # the block outputs' .grad were only a way to read them
                t.grad = None
    else:
        wanted = leaves + flat
        got = autograd_calls.grad(tensors, wanted, grads, retain_graph=bool(flat), allow_unused=True) if wanted else []
        for leaf, g in zip(leaves, got[:len(leaves)]):
            leaf.grad = g if g is not None else torch.zeros_like(leaf)
        got = got[len(leaves):]
    block_grads = iter(got)
    work = []
    for group, (_, params) in zip(outs, kept):
        gs = [next(block_grads) for _ in group]
        keep = [(t, g) for t, g in zip(group, gs) if g is not None]
        if keep:
            work.append(([t for t, _ in keep], [g for _, g in keep], params))
    return work
