"""The executor hands the rank's loss sum over as soon as its last loss is computed.

The DeepSpeed engine posts the loss all-reduce from that callback, so the rendezvous runs
during the program's tail instead of after it. One rank (D = 1) runs the real executor on a
stub engine context: no messages, only the order of events.
"""
import torch
from torch import nn

from ds_chimera.runtime.executor import StepExecutor
from ds_chimera.schedules import build
from ds_chimera.schedules.lowering import lower


class _P2P:
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
    def __init__(self, schedule, events):
        self.placement = schedule.placement
        self.chunk_modules = [_Chunk(events)]
        self.split_chunks = set()
        self.pipe_rank = 0
        self.p2p = _P2P()
        self.events = events

    def start_grad_sync(self, stage):
        self.events.append("sync")

    def compute_loss(self, out, target):
        self.events.append("loss")
        return nn.functional.mse_loss(out, target)


def _run(ops, events, schedule, batches):
    ctx = _Ctx(schedule, events)
    posted = []

    def on_losses(loss_sum):
        events.append("on_losses")
        posted.append(loss_sum)
    loss_sum, count = StepExecutor(ctx).run(ops, batches, train=True, scale=0.25, on_losses=on_losses)
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
    assert events[-2:] == ["backward", "sync"] and events.count("backward") == 4


def test_a_rank_without_losses_hands_over_none_at_the_start():
    schedule = build("1f1b", 1, 4)
    events = []
    posted, loss_sum, count = _run([], events, schedule, {})
    assert posted == [None] and loss_sum is None and count == 0 and events == ["on_losses"]
