"""Fused messages: their timing in the simulator, their checks, and which sends get fused."""

import json

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.strategies.reroute import reroute
from chameleon_ext.schedule.ir import FusedMessage, Op, OpKind, Schedule, one_f_one_b
from chameleon_ext.schedule.list_scheduler import list_schedule
from chameleon_ext.schedule.message_fusion import fuse_messages, message_count
from chameleon_ext.schedule.simulator import ScheduleError, UniformCosts, check, simulate

K = OpKind


def two_stage() -> tuple[ExecutionPlan, Schedule]:
    plan = ExecutionPlan.failure_free(2, 1, 2, 4, 1, 2)
    return plan, one_f_one_b(plan)


def test_a_fused_message_leaves_with_its_last_member():
    """1F1B on 2 stages, 2 micro-batches, fwd 1, bwd 2: stage 1 starts at 1 and the iteration
    takes 9. With both activations in one message stage 1 starts only at 2 (after the second
    forward), and everything after it moves by 1: 10."""
    plan, sched = two_stage()
    costs = UniformCosts()
    assert simulate(plan, sched, costs).iteration_time == 9
    fused = Schedule(sched.ops, [FusedMessage(0, 1, (Op(K.SEND_FWD, 0, 1), Op(K.SEND_FWD, 1, 1)))])
    res = simulate(plan, fused, costs)
    assert res.iteration_time == 10
    assert [(str(op), start) for op, start, _ in res.timeline[1][:2]] == [
        ("recv_fwd(mb=0, peer=0)", 0.0), ("fwd(mb=0)", 2.0)]


def test_the_fusion_pass_leaves_sends_alone_when_fusing_would_cost_time():
    plan, sched = two_stage()
    assert fuse_messages(plan, sched, UniformCosts()).fused == []


@pytest.mark.parametrize("world, pp, mbs, lost", [(4, 2, 8, {3}), (6, 2, 12, {5}),
                                                  (8, 4, 16, {5}), (8, 2, 16, {7})])
@pytest.mark.parametrize("split", [False, True])
def test_rerouted_schedules_send_fewer_messages_in_the_same_time(world, pp, mbs, lost, split):
    plan = reroute(ExecutionPlan.failure_free(world, 1, pp, 4, 1, mbs), lost)
    costs = UniformCosts()
    sched = list_schedule(plan, costs, split_backward=split)
    fused = fuse_messages(plan, sched, costs)
    before, _ = message_count(sched)
    after, packed = message_count(fused)
    assert packed > 0 and after < before
    assert simulate(plan, fused, costs).iteration_time == simulate(plan, sched, costs).iteration_time
    for m in fused.fused:
        assert len(m.members) >= 2 and all(op.peer == m.dst for op in m.members)


def test_schedule_with_fused_messages_round_trips_through_json():
    plan = reroute(ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8), {3})
    fused = fuse_messages(plan, list_schedule(plan, UniformCosts()), UniformCosts())
    back = Schedule.from_dict(json.loads(json.dumps(fused.to_dict())))
    assert back == fused and back.fused


@pytest.mark.parametrize("members, error", [
    ((Op(K.SEND_FWD, 0, 1),), "at least 2 members"),
    ((Op(K.SEND_FWD, 0, 1), Op(K.RECV_BWD, 0, 1)), "must be sends of this rank to that peer"),
    ((Op(K.SEND_FWD, 0, 1), Op(K.SEND_FWD, 1, 0)), "must be sends of this rank to that peer"),
    ((Op(K.SEND_FWD, 1, 1), Op(K.SEND_FWD, 0, 1)), "out of this rank's order"),
])
def test_check_rejects_malformed_fused_messages(members, error):
    plan, sched = two_stage()
    with pytest.raises(ScheduleError, match=error):
        check(plan, Schedule(sched.ops, [FusedMessage(0, 1, members)]))


def test_check_rejects_a_send_in_two_messages():
    plan = ExecutionPlan.failure_free(2, 1, 2, 4, 1, 3)
    sched = one_f_one_b(plan)
    a, b, c = (Op(K.SEND_FWD, mb, 1) for mb in range(3))
    with pytest.raises(ScheduleError, match="is in fused messages 0 and 1"):
        check(plan, Schedule(sched.ops, [FusedMessage(0, 1, (a, b)), FusedMessage(0, 1, (b, c))]))
