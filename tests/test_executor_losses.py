"""The executor runs the whole step through the context, and hands the loss sum over early.

The DeepSpeed engine posts the loss all-reduce from that callback, so the rendezvous runs
during the program's tail instead of after it. One rank (D = 1) runs the real executor on a
stub context: no messages, only the order of events, the step's tail included.
"""
import time

import torch
from torch import nn

from ds_chimera.runtime.context import ExecutionContext
from ds_chimera.runtime.executor import StepExecutor
from ds_chimera.schedules import build
from ds_chimera.schedules.lowering import lower


class _Transport:
    def prepost(self, *args):
        raise AssertionError("one rank sends nothing")

    def flush(self):
        pass


class _Chunk(nn.Module):
    def __init__(self, events):
        super().__init__()
        self.linear, self.events = nn.Linear(3, 1), events

    def forward(self, x, capture=None):
        out = self.linear(x)
        if out.requires_grad:
            out.register_hook(lambda grad: self.events.append("backward") or grad)
        return out


class _Ctx:
    def __init__(self, schedule, events, batches):
        self.placement = schedule.placement
        self.chunk = _Chunk(events)
        self.split_chunks = set()
        self.pipe_rank = 0
        self.transport = _Transport()
        self.events, self.batches = events, batches

    def load_input(self, chunk, mb):
        return self.batches[mb][0]

    def forward(self, chunk, mb, x, capture, train):
        return self.chunk(x, capture)

    def loss(self, out, chunk, mb):
        self.events.append("loss")
        return nn.functional.mse_loss(out, self.batches[mb][1])

    def backward_done(self, chunk, mb):
        pass

    def start_grad_sync(self, stage):
        self.events.append("sync")

    def wait_grad_syncs(self, stages):
        self.events.append(f"wait {list(stages)}")

    def clip_gradients(self, scope, stage):
        self.events.append(f"clip {scope}")

    def optimizer_step(self, chunks):
        self.events.append(f"step {list(chunks)}")

    def gather_weights(self, chunk):
        raise AssertionError("an unsharded program gathers nothing")

    wait_weights = release_weights = prepare_grads = gather_weights


def _run(ops, events, schedule, batches):
    ctx = _Ctx(schedule, events, batches)
    assert isinstance(ctx, ExecutionContext)
    posted = []

    def on_losses(loss_sum):
        events.append("on_losses")
        posted.append(loss_sum)
    loss_sum, count = StepExecutor(ctx).run(ops, train=True, scale=0.25, on_losses=on_losses)
    return posted, loss_sum, count


def test_losses_are_handed_over_after_the_last_loss_and_before_the_last_backward():
    torch.manual_seed(0)
    schedule = build("1f1b", 1, 4)
    ops = lower(schedule.name, schedule.placement, schedule.orders).ops[0]
    batches = {mb: (torch.randn(2, 3), torch.randn(2, 1)) for mb in range(4)}
    events = []
    posted, loss_sum, count = _run(ops, events, schedule, batches)
    assert count == 4 and len(posted) == 1
    torch.testing.assert_close(posted[0], loss_sum)
    last_loss = max(i for i, e in enumerate(events) if e == "loss")
    assert events.index("on_losses") == last_loss + 1
    # the program is the whole step: the sync after the last backward, then its wait, the clip, the step
    assert events[-5:] == ["backward", "sync", "wait [0]", "clip global", "step [0]"]
    assert events.count("backward") == 4


def test_a_rank_without_losses_hands_over_none_at_the_start():
    schedule = build("1f1b", 1, 4)
    events = []
    posted, loss_sum, count = _run([], events, schedule, {})
    assert posted == [None] and loss_sum is None and count == 0 and events == ["on_losses"]


def test_every_host_implements_the_execution_context():
    """The executor depends on the protocol alone: each host provides all of it."""
    import inspect

    from ds_chimera.megatron.host import MegatronHost
    from ds_chimera.runtime.async_engine import AsyncPipelineHost
    from ds_chimera.runtime.host import PipelineHost
    from ds_chimera.runtime.local import LocalHost
    wanted = {name for name, member in inspect.getmembers(ExecutionContext, inspect.isfunction)
              if not name.startswith("_")}
    assert wanted == {"load_input", "forward", "loss", "backward_done", "start_grad_sync", "wait_grad_syncs",
                      "clip_gradients", "optimizer_step", "gather_weights", "wait_weights", "release_weights",
                      "prepare_grads"}
    for host in (PipelineHost, AsyncPipelineHost, MegatronHost, LocalHost):
        missing = {name for name in wanted if not callable(getattr(host, name, None))}
        assert not missing, (host.__name__, missing)


class _ShardedCtx(_Ctx):
    """A sharded program's host: records when it waits for weights and makes gradient buffers."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def gather_weights(self, chunk):
        pass

    def release_weights(self, chunk):
        pass

    def wait_weights(self, chunk):
        self.calls.append(("wait", chunk, time.perf_counter()))

    def prepare_grads(self, chunk):
        self.calls.append(("grads", chunk, time.perf_counter()))


def test_a_traced_action_spans_its_gradient_buffer_but_not_its_weight_wait():
    """The simulator prices a chunk's weight gather apart (the wait is outside the action's traced
    span) while its gradient buffer is backward work, as autograd's .grad allocation is unsharded
    (inside the span): benchmarks read action costs from these spans."""
    from ds_chimera.schedules.sharding import shard
    torch.manual_seed(0)
    schedule = build("1f1b", 1, 3)
    ops = shard(lower(schedule.name, schedule.placement, schedule.orders), 3).ops[0]
    batches = {mb: (torch.randn(2, 3), torch.randn(2, 1)) for mb in range(3)}
    ctx = _ShardedCtx(schedule, [], batches)
    step = StepExecutor(ctx).start(ops, train=True, scale=1 / 3, trace=True)
    for op in ops:
        step.execute(op)
    step.finish()
    t0 = step.trace.clock.t0
    records = [(kind, start + t0, end + t0) for _, kind, _, _, start, end in step.executor.records]
    actions = [record for record in records if record[0] in "FB"]
    waits = [t for what, _, t in ctx.calls if what == "wait"]
    grads = [t for what, _, t in ctx.calls if what == "grads"]
    assert len(waits) == len(actions) == 6 and len(grads) == 3      # one per action, one per backward
    for (kind, start, end), waited in zip(actions, waits):
        assert waited < start, kind
    for (kind, start, end), made in zip([a for a in actions if a[0] == "B"], grads):
        assert start <= made <= end
