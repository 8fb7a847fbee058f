"""Execute one rank's lowered program for one step: the only place compute actions run.

The executor keeps per-(chunk, micro-batch) state (inputs, outputs, pending input-grads,
deferred weight-grads), because schedules other than 1F1B reorder backwards freely; the
stock engine's single ``self.loss`` / ``self.grad_layer`` cannot express that.
"""
from __future__ import annotations

import time

import torch

from ..schedules.actions import (BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, Action, CommBatch,
                                 GradSync, OptimizerStep)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _pack(tensors):
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _to_device(x, device):
    """``x`` with its tensors (inside tuples, lists and dicts too) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(t, device) for t in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def _as_leaf(tensors, train: bool):
    """Detached copies that start a new autograd graph and collect this chunk's input grads."""
    out = []
    for t in tensors:
        leaf = t.detach()
        if train and leaf.is_floating_point():
            leaf.requires_grad_(True)
        out.append(leaf)
    return out


current_action = None   # the action being executed on this process, for instrumentation and debugging
MB_TAG_SPACE = 1 << 16  # messages carry global micro-batch ids modulo this (tags stay small)
RECV_LOOKAHEAD = 2      # comm batches ahead whose receives are posted early (gloo: see p2p.P2P.prepost)


def new_carry() -> dict:
    """Empty per-micro-batch executor state."""
    return {name: {} for name in ("inputs", "outputs", "input_grads", "deferred", "received", "blocks")}


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
    """Runs the ops of one rank. ``ctx`` is the engine: chunks, placement, p2p, loss, syncs."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.placement = ctx.placement
        self.records: list = []          # (rank, kind, chunk, mb, start, end) when tracing
        self.recv_lookahead = RECV_LOOKAHEAD

    def run(self, ops, batches: dict, train: bool, scale: float, trace: bool = False, carry: dict | None = None,
            mb_base: int = 0, flush: bool = True, on_losses=None):
        """Execute ``ops``. Returns (sum of this rank's micro-batch losses, their count).

        ``carry``: per-micro-batch state that outlives the call (a pipeline kept full across
        calls); ``mb_base`` turns the program's call-local micro-batch ids into the global ids
        that label messages, so a message sent in one call is received in the next.
        ``on_losses(loss_sum)`` is called once, as soon as this rank's last loss of the call is
        known (at the start on a rank that computes none), so the loss all-reduce can run
        during the rest of the program instead of after it.
        """
        global current_action
        ctx, placement = self.ctx, self.placement
        if carry is None:
            carry = new_carry()
        inputs, outputs, input_grads = carry["inputs"], carry["outputs"], carry["input_grads"]
        deferred, received, blocks = carry["deferred"], carry["received"], carry["blocks"]
        loss_sum, loss_count = None, 0
        versions = getattr(ctx, "weight_versions", None)
        forward_chunk = getattr(ctx, "forward_chunk", None)
        t0 = time.perf_counter()
        self.records = []
        recv_batches = [op for op in ops if type(op) is CommBatch and op.recvs]
        next_recv_batch = 0       # index into recv_batches of the next batch this loop reaches
        posted_upto = 0           # recv_batches[:posted_upto] have had their receives posted early

        def post_ahead(upto: int) -> None:
            nonlocal posted_upto
            for batch in recv_batches[posted_upto:upto]:
                for msg in batch.recvs:
                    ctx.p2p.prepost(_global(msg, mb_base), placement.rank_of(msg.src), self._what(msg, mb_base))
            posted_upto = max(posted_upto, upto)

        post_ahead(self.recv_lookahead)
        losses_left = sum(1 for op in ops if type(op) is Action and op[0] == FORWARD
                          and placement.next_chunk(op[1]) is None) if on_losses is not None else -1
        if losses_left == 0:
            on_losses(None)
        for op in ops:
            if type(op) is Action:
                current_action = op
                start = time.perf_counter()
                kind, c, mb = op
                chunk = ctx.chunk_modules[c]
                if kind == FORWARD:
                    prev = placement.prev_chunk(c)
                    if prev is None:
                        x = batches[mb][0]
                        inputs[(c, mb)] = list(_as_tuple(x))
                    else:
                        if placement.rank_of(prev) == ctx.pipe_rank:
                            # training keeps the producer's output for its backward; eval frees it
                            src = _as_tuple(outputs[(prev, mb)] if train else outputs.pop((prev, mb)))
                        else:
                            src = received.pop(("act", prev, c, mb))
                        inputs[(c, mb)] = _as_leaf(src, train)
                        x = _pack(inputs[(c, mb)])
                    capture = [] if train and c in ctx.split_chunks else None
                    with torch.set_grad_enabled(train):
                        if forward_chunk is not None:   # the engine runs the chunk itself (Megatron's contract)
                            out = forward_chunk(c, mb, x, capture)
                        elif versions is None:
                            out = chunk(x, capture)
                        else:     # asynchronous schedules: the weight version the policy says
                            out = versions[c].forward(mb, (x, capture), ctx.steps_ahead(c, mb) if train else 0,
                                                      record=ctx.record_versions)
                    if capture is not None:
                        blocks[(c, mb)] = capture
                    if placement.next_chunk(c) is None:
                        out = ctx.compute_loss(out, batches[mb][1])
                        if isinstance(out, torch.Tensor) and out.numel() == 1:   # not e.g. logits collected in eval
                            value = out.detach().float()
                            loss_sum = value if loss_sum is None else loss_sum + value
                            loss_count += 1
                        losses_left -= 1
                        if losses_left == 0:
                            on_losses(loss_sum)
                    if train or placement.next_chunk(c) is not None:
                        outputs[(c, mb)] = out
                elif kind in (BACKWARD, INPUT_GRAD):
                    out = outputs.pop((c, mb))
                    nxt = placement.next_chunk(c)
                    if nxt is None:
                        tensors, grads = [out * scale], None
                    else:
                        if placement.rank_of(nxt) == ctx.pipe_rank:
                            grads = input_grads.pop((nxt, mb))
                        else:
                            grads = received.pop(("grad", nxt, c, mb))
                        tensors = [t for t in _as_tuple(out) if t.requires_grad]
                        if len(tensors) != len(grads):
                            raise RuntimeError(f"chunk {c} micro-batch {mb}: {len(tensors)} outputs need grads "
                                               f"but {len(grads)} gradients arrived")
                    leaves = [t for t in inputs.pop((c, mb), []) if t.requires_grad]
                    if kind == BACKWARD:
                        blocks.pop((c, mb), None)
                        torch.autograd.backward(tensors, grad_tensors=grads)
                    else:
                        deferred[(c, mb)] = self._input_grad(tensors, grads, leaves, blocks.pop((c, mb)))
                    if placement.prev_chunk(c) is not None:
                        input_grads[(c, mb)] = [t.grad if t.grad is not None else torch.zeros_like(t)
                                                for t in leaves]
                    if versions is not None:
                        versions[c].backward_done(mb, record=ctx.record_versions)
                elif kind == WEIGHT_GRAD:
                    for outs, out_grads, params in deferred.pop((c, mb)):
                        torch.autograd.backward(outs, grad_tensors=out_grads, inputs=params)
                elif kind == STEP:
                    ctx.step_chunk(c, mb)
                else:
                    raise RuntimeError(f"the runtime cannot execute action {op}")
                if trace:
                    self.records.append((ctx.pipe_rank, kind, c, mb, start - t0, time.perf_counter() - t0))
            elif type(op) is CommBatch:
                for msg in op.sends:
                    if msg.kind == "act":
                        key = (msg.src, msg.mb)
                        payload = outputs[key] if train else outputs.pop(key)
                    else:
                        payload = input_grads.pop((msg.src, msg.mb))
                    ctx.p2p.send(_global(msg, mb_base), placement.rank_of(msg.dst), payload)
                if op.recvs:
                    # the next batches' receives go out before this one's wait, so their data
                    # can arrive while this rank computes
                    post_ahead(next_recv_batch + 1 + self.recv_lookahead)
                    next_recv_batch += 1
                for msg in op.recvs:
                    received[(msg.kind, msg.src, msg.dst, msg.mb)] = ctx.p2p.recv(
                        _global(msg, mb_base), placement.rank_of(msg.src), self._what(msg, mb_base))
            elif type(op) is GradSync:
                if train:
                    ctx.start_grad_sync(op.stage)
            elif type(op) is OptimizerStep:
                pass   # the engine finishes syncs and steps after the program, see engine.train_batch
            else:
                raise RuntimeError(f"unknown op {op!r}")
        if train and flush:
            leftovers = {k for d in (outputs, deferred, blocks) for k in d}
            if leftovers:
                raise RuntimeError(f"internal error: work left after the step: {sorted(leftovers)[:5]}")
        if flush:
            ctx.p2p.flush()
        return loss_sum, loss_count

    def _what(self, msg, mb_base: int) -> str:
        """A message's description for timeout errors."""
        return (f"{'activation' if msg.kind == 'act' else 'gradient'} of micro-batch {msg.mb + mb_base} "
                f"from rank {self.placement.rank_of(msg.src)} (chunk {msg.src} -> {msg.dst})")

    @staticmethod
    def _input_grad(tensors, grads, leaves, blocks):
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
            if out is None or (len(block) > 2 and _versions(out) != block[2]):
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
                got = torch.autograd.grad(tensors, leaves, grad_outputs=grads, retain_graph=True, allow_unused=True)
                for leaf, g in zip(leaves, got):
                    leaf.grad = g if g is not None else torch.zeros_like(leaf)
            params = list({id(p): p for block in blocks for p in block[1]}.values())
            return [(tensors, grads, params)]
        outs = [[t for t in _as_tuple(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                for out, _ in kept]
        flat = [t for group in outs for t in group]
        if now:
            # backward(inputs=...), not grad(): the parameters' own accumulation hooks must run
            # (Megatron DDP copies .grad into main_grad there)
            for t in flat:
                t.retain_grad()
            torch.autograd.backward(tensors, grad_tensors=grads, inputs=leaves + flat + now, retain_graph=bool(flat))
            for leaf in leaves:
                if leaf.grad is None:
                    leaf.grad = torch.zeros_like(leaf)
            got = [t.grad for t in flat]
            for t in flat:
                if t.grad_fn is not None:       # the block outputs' .grad were only a way to read them
                    t.grad = None
        else:
            wanted = leaves + flat
            got = torch.autograd.grad(tensors, wanted, grad_outputs=grads, retain_graph=bool(flat),
                                      allow_unused=True) if wanted else []
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


def _versions(out) -> tuple:
    """In-place modification counters of a block output's tensors."""
    return tuple(t._version for t in _as_tuple(out) if isinstance(t, torch.Tensor))
