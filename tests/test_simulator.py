"""The simulator catches broken programs: deadlock, missing, duplicated and out-of-order work."""
import pytest

from ds_chimera.schedules import Action, Comm, Message, Step, Placement, Program, build, lower
from ds_chimera.schedules.actions import BACKWARD, FORWARD
from ds_chimera.sim import Costs, simulate


def two_stage(orders):
    placement = Placement(2, 2, [[0, 1]], [0, 0])
    return lower("test", placement, orders)


F, B = FORWARD, BACKWARD


def test_a_good_program_is_valid():
    program = two_stage([[Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1)],
                         [Action(F, 1, 0), Action(B, 1, 0), Action(F, 1, 1), Action(B, 1, 1)]])
    assert simulate(program).valid


def test_deadlock_is_reported_with_what_each_rank_waits_for():
    # rank 0 wants micro-batch 1's gradient before it has sent micro-batch 1's activation
    program = two_stage([[Action(F, 0, 0), Action(B, 0, 1), Action(F, 0, 1), Action(B, 0, 0)],
                         [Action(F, 1, 1), Action(B, 1, 1), Action(F, 1, 0), Action(B, 1, 0)]])
    result = simulate(program)
    assert not result.valid
    assert set(result.deadlock) == {0, 1}
    assert "waits for grad of micro-batch 1 from chunk 1 on rank 1" in result.deadlock[0]
    assert "waits for act of micro-batch 1 from chunk 0 on rank 0" in result.deadlock[1]


def test_missing_work_is_reported():
    program = two_stage([[Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0)],
                         [Action(F, 1, 0), Action(B, 1, 0), Action(F, 1, 1), Action(B, 1, 1)]])
    result = simulate(program)
    assert "micro-batch 1 never completes its backward on chunk 0" in result.errors


def test_duplicated_work_is_reported():
    placement = Placement(1, 1, [[0]], [0])
    program = lower("dup", placement, [[Action(F, 0, 0), Action(F, 0, 0), Action(B, 0, 0)]])
    assert any("runs twice" in e for e in simulate(program).errors)


def test_out_of_order_work_is_reported():
    placement = Placement(1, 2, [[0, 0]], [0])
    program = lower("ooo", placement, [[Action(F, 1, 0), Action(F, 0, 0), Action(B, 1, 0), Action(B, 0, 0)]])
    errors = simulate(program).errors
    assert any("1F0 runs before the forward of chunk 0" in e for e in errors)


def test_work_on_the_wrong_rank_and_unreceived_data_are_reported():
    placement = Placement(2, 2, [[0, 1]], [0])
    ops = [[Action(F, 0, 0), Action(B, 0, 0), Step((0,))],
           [Action(F, 1, 0), Action(B, 1, 0), Step((1,))]]
    errors = simulate(Program("raw", placement, ops)).errors
    assert any("runs without receiving its activation" in e for e in errors)
    assert any("0B0 runs before the backward of chunk 1" in e or "0B0 runs without receiving" in e
               for e in errors)
    errors = simulate(Program("raw", placement, [[Action(F, 1, 0)], []])).errors
    assert any("runs 1F0 but chunk 1 lives on rank 1" in e for e in errors)
    ops = [[Comm((Message("act", 0, 1, 0),), ()), Action(F, 0, 0)], []]
    errors = simulate(Program("raw", placement, ops)).errors
    assert any("before computing it" in e for e in errors)


def test_reports_busy_time_makespan_and_trace_records():
    result = simulate(build("1f1b", 4, 8).lower(), Costs(1, 2, 1))
    assert result.busy == [24.0] * 4
    assert result.makespan == 33.0
    assert len(result.records) == 2 * 8 * 4
    assert all(end > start for (_, _, _, _, start, end) in result.records)


def test_messages_received_out_of_send_order_are_reported():
    # rank 1 runs micro-batch 1 before 0: fine with gloo tags, wrong with NCCL's in-order matching
    program = two_stage([[Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1)],
                         [Action(F, 1, 1), Action(B, 1, 1), Action(F, 1, 0), Action(B, 1, 0)]])
    errors = simulate(program).errors
    assert any("received in another order than sent" in e for e in errors)


def test_gradient_sync_before_the_last_backward_is_reported():
    from ds_chimera.schedules import SyncStart
    program = build("chimera", 2, 2).lower()
    ops = program.ops[0]
    sync = next(i for i, op in enumerate(ops) if isinstance(op, SyncStart))
    ops.insert(0, ops.pop(sync))          # post a sync at the very start of rank 0's program
    errors = simulate(program).errors
    assert any("posts the gradient sync of stage" in e and "before the backward" in e for e in errors)


def test_missing_gradient_sync_of_a_replicated_stage_is_reported():
    from ds_chimera.schedules import SyncStart
    program = build("chimera", 2, 2).lower()
    for ops in program.ops:
        ops[:] = [op for op in ops if not isinstance(op, SyncStart)]
    errors = simulate(program).errors
    assert any("never posts the gradient sync of replicated stage" in e for e in errors)


def test_gradient_sync_costs_lengthen_the_step():
    # chimera, D = N = 2 (unit costs: F 1, B 2): each rank posts stage 1's sync after its first
    # backward and stage 0's after its last, at 4 and 6; the optimizer step waits for both
    program = build("chimera", 2, 2).lower()
    assert simulate(program, Costs()).makespan == 6.0
    assert simulate(program, Costs(allreduce=0.5)).makespan == 6.5      # the last sync is done 0.5 after its post
    posted = simulate(program, Costs(sync_post=0.25))                    # each post holds its rank 0.25
    assert sorted(post for (_, _, post, _) in posted.sync_records) == [4.25, 4.25, 6.5, 6.5]
    assert posted.makespan == 6.5
    assert simulate(program, Costs(allreduce=0.5, sync_post=0.25)).makespan == 7.0


def test_a_negative_sync_post_cost_is_refused():
    with pytest.raises(ValueError, match="sync_post must be a finite number >= 0, got -0.1"):
        Costs(sync_post=-0.1)
