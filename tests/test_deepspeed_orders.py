"""Our 1f1b and dualpipev orders equal DeepSpeed 0.19.8's TrainSchedule and DualPipeVSchedule."""
import pytest

from ds_chimera.schedules import build

schedule_mod = pytest.importorskip("deepspeed.runtime.pipe.schedule")


def deepspeed_compute(cls, n, d, rank, phase_chunks=None):
    out, counters = [], {}
    for step in cls(micro_batches=n, stages=d, stage_id=rank).steps():
        for cmd in step:
            kind = {"ForwardPass": "F", "BackwardPass": "B"}.get(type(cmd).__name__)
            if kind is None:
                continue
            phase = getattr(cmd, "phase", 0) or 0
            if phase_chunks is None:
                out.append((kind, rank, cmd.buffer_id))
            else:
                out.append((kind, phase_chunks[phase], cmd.buffer_id - phase * n))
    return out


@pytest.mark.parametrize("d,n", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 3), (8, 16)])
def test_1f1b_matches_deepspeed_train_schedule(d, n):
    ours = build("1f1b", d, n)
    for rank in range(d):
        theirs = deepspeed_compute(schedule_mod.TrainSchedule, n, d, rank)
        mine = [(a.kind, a.chunk, a.mb) for a in ours.orders[rank]]
        # DeepSpeed names buffers, not micro-batches: compare kinds and the buffer cycle
        buffers = schedule_mod.TrainSchedule(micro_batches=n, stages=d, stage_id=rank).num_pipe_buffers()
        assert [(k, c, mb % buffers) for k, c, mb in mine] == theirs


@pytest.mark.parametrize("d,n", [(2, 4), (4, 8), (4, 11), (8, 16)])
def test_dualpipev_matches_deepspeed(d, n):
    ours = build("dualpipev", d, n)
    for rank in range(d):
        theirs = deepspeed_compute(schedule_mod.DualPipeVSchedule, n, d, rank, (rank, 2 * d - 1 - rank))
        assert [(a.kind, a.chunk, a.mb) for a in ours.orders[rank]] == theirs
