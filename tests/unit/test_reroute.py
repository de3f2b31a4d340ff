"""Rerouted plans and the list scheduler that runs them."""

import json

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError
from chameleon_ext.planning.strategies.reroute import reroute
from chameleon_ext.schedule.ir import OpKind, one_f_one_b
from chameleon_ext.schedule.list_scheduler import list_schedule, timed_list_schedule
from chameleon_ext.schedule.message_fusion import fuse_messages
from chameleon_ext.schedule.simulator import UniformCosts, simulate

COSTS = UniformCosts(fwd=1.0, bwd=2.0, message=0.1)


@pytest.mark.parametrize("world, pp, mbs", [(4, 2, 8), (8, 4, 16), (6, 2, 12), (8, 2, 4),
                                            (2, 2, 1), (4, 4, 6)])
def test_list_schedule_is_1f1b_on_homogeneous_plans(world, pp, mbs):
    plan = ExecutionPlan.failure_free(world, 1, pp, 4, 1, mbs)
    ref = simulate(plan, one_f_one_b(plan), COSTS)
    got = simulate(plan, list_schedule(plan, COSTS), COSTS)
    assert got.iteration_time == pytest.approx(ref.iteration_time)
    assert got.peak_inflight == ref.peak_inflight


def test_reroute_hosts_the_lost_stage_on_its_replica():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8)  # pipelines [0, 2] and [1, 3]
    new = reroute(plan, {3})
    assert new.generation == 1 and new.world_size == 3
    lost = new.pipelines[1].stages[1]
    assert lost.ranks == [] and lost.hosts == {mb: [2] for mb in range(4, 8)}
    assert new.pipelines[1].stages[0].ranks == [1]
    assert new.replicas(2) == [2] and new.replicas(0) == [0, 1]
    assert ExecutionPlan.from_json(new.to_json()) == new


def test_rerouted_work_is_spread_over_all_surviving_replicas():
    plan = ExecutionPlan.failure_free(6, 1, 2, 4, 1, 12)  # 3 pipelines of 4 micro-batches
    new = reroute(plan, {4})  # pipeline 1, stage 1
    hosts = new.pipelines[1].stages[1].hosts
    assert sorted(hosts) == [4, 5, 6, 7]
    assert sorted(tuple(r) for r in hosts.values()) == [(3,), (3,), (4,), (4,)]


def test_rerouted_schedule_is_valid_and_bounded():
    plan = ExecutionPlan.failure_free(6, 1, 2, 4, 1, 12)
    base = simulate(plan, one_f_one_b(plan), COSTS)
    new = reroute(plan, {5})
    res = simulate(new, list_schedule(new, COSTS), COSTS)  # check() runs inside
    # 3 pipelines -> 2 carry the work of 3 at stage 1: no better than 1.5x, and the hosts'
    # extra work fits with at most one stage's worth of additional fill.
    assert 1.3 * base.iteration_time < res.iteration_time < 1.6 * base.iteration_time
    assert max(res.peak_inflight.values()) <= 2


def test_second_failure_in_another_pipeline_rehosts():
    plan = ExecutionPlan.failure_free(6, 1, 2, 4, 1, 12)
    once = reroute(plan, {5})           # old ranks 0..4 -> 0..4
    twice = reroute(once, {3})          # pipeline 0 stage 1 (old rank 3) now lost too
    assert twice.world_size == 4 and twice.generation == 2
    lost = [st for p in twice.pipelines for st in p.stages if not st.ranks]
    assert len(lost) == 2
    assert {tuple(r) for st in lost for r in st.hosts.values()} == {(3,)}
    simulate(twice, list_schedule(twice, COSTS), COSTS)


def test_no_surviving_replica_means_reroute_cannot_absorb():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8)
    assert reroute(plan, {2, 3}) is None
    assert reroute(ExecutionPlan.failure_free(4, 1, 4, 4, 1, 4), {1}) is None


def test_hosts_must_be_replicas_and_cover_the_pipeline():
    d = json.loads(reroute(ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8), {3}).to_json())
    d["pipelines"][1]["stages"][1]["hosts"]["4"] = [0]
    with pytest.raises(PlanError, match="micro-batch 4 is hosted by ranks \\[0\\]"):
        ExecutionPlan.from_dict(d)
    del d["pipelines"][1]["stages"][1]["hosts"]["4"]
    with pytest.raises(PlanError, match="needs a host"):
        ExecutionPlan.from_dict(d)


def test_host_ops_name_the_failed_pipelines_neighbours():
    new = reroute(ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8), {3})
    ops = list_schedule(new, COSTS).ops
    host_recvs = {(o.microbatch, o.peer) for o in ops[2] if o.kind is OpKind.RECV_FWD}
    assert host_recvs == {(mb, 0) for mb in range(4)} | {(mb, 1) for mb in range(4, 8)}


@pytest.mark.parametrize("world, pp, gbs, failed", [(4, 2, 8, 3), (8, 4, 16, 2), (8, 2, 16, 1),
                                                    (16, 4, 32, 5)])
def test_split_backward_fills_bubbles_with_weight_halves(world, pp, gbs, failed):
    """Deferring weight-gradient halves shortens the rerouted iteration without holding more
    micro-batches than 1F1B would."""
    plan = reroute(ExecutionPlan.failure_free(world, 1, pp, 4, 1, gbs), {failed})
    costs = UniformCosts(fwd=1.0, bwd=2.0)
    whole = simulate(plan, list_schedule(plan, costs), costs)
    split = simulate(plan, list_schedule(plan, costs, split_backward=True), costs)
    assert split.iteration_time < whole.iteration_time
    assert max(split.peak_inflight.values()) <= pp


def test_split_backward_on_homogeneous_plan_is_no_slower_than_1f1b():
    plan = ExecutionPlan.failure_free(8, 1, 4, 4, 1, 16)
    costs = UniformCosts()
    split = simulate(plan, list_schedule(plan, costs, split_backward=True), costs)
    assert split.iteration_time <= simulate(plan, one_f_one_b(plan), costs).iteration_time


def test_a_lost_shard_reroutes_its_whole_group_and_its_siblings_leave():
    """TP 2 x PP 2 x DP 3: losing rank 9 (pipeline 1, stage 1, shard 1) loses the group (8 9);
    its micro-batches go to the surviving groups of stage 1, whole, and the other ranks are
    renumbered densely in their old order."""
    plan = ExecutionPlan.failure_free(12, 2, 2, 4, 1, 12)
    assert plan.pipelines[1].stages[1].ranks == [8, 9]
    new = reroute(plan, {9})
    assert new.world_size == 10 and new.tensor_parallel == 2
    assert plan.survivors({9}) == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11]
    lost = new.pipelines[1].stages[1]
    assert lost.ranks == [] and sorted(lost.hosts) == [4, 5, 6, 7]
    assert sorted({tuple(h) for h in lost.hosts.values()}) == [(6, 7), (8, 9)]  # old (6 7) (10 11)
    res = simulate(new, list_schedule(new, COSTS, split_backward=True), COSTS)
    assert res.iteration_time > 0


REROUTED_PLANS = [(8, 1, 2, 16, {3}), (16, 1, 4, 32, {1, 9}), (24, 1, 4, 48, {0, 7, 21}),
                  (16, 2, 2, 16, {5}), (32, 2, 4, 64, {3, 20}), (64, 1, 8, 128, {10})]


@pytest.mark.parametrize("world, tp, pp, gbs, failed", REROUTED_PLANS)
def test_the_list_schedulers_makespan_is_the_simulated_time(world, tp, pp, gbs, failed):
    """Its ops are placed when the simulator starts them; with no reduction or optimizer cost
    its last forward or backward ends the simulated iteration. No schedule with whole
    backwards ends before whole_backward_bound."""
    from chameleon_ext.schedule.list_scheduler import whole_backward_bound
    plan = reroute(ExecutionPlan.failure_free(world, tp, pp, 8, 1, gbs), failed)
    for costs in (UniformCosts(), UniformCosts(fwd=1.0, bwd=2.5, message=0.3)):
        for split in (False, True):
            schedule, makespan = timed_list_schedule(plan, costs, split_backward=split)
            assert makespan == simulate(plan, schedule, costs).iteration_time
        assert whole_backward_bound(plan, costs) <= timed_list_schedule(plan, costs)[1]


@pytest.mark.parametrize("world, tp, pp, gbs, failed", REROUTED_PLANS)
def test_the_executor_runs_the_faster_of_whole_and_split_backwards(world, tp, pp, gbs, failed):
    from chameleon_ext.schedule.choice import choose_schedule
    plan = reroute(ExecutionPlan.failure_free(world, tp, pp, 8, 1, gbs), failed)
    whole, split = (list_schedule(plan, UniformCosts(), split_backward=s) for s in (False, True))
    times = [simulate(plan, s, UniformCosts()).iteration_time for s in (whole, split)]
    chosen = choose_schedule(plan, fuse=False)
    assert chosen.ops == (whole if times[0] <= times[1] else split).ops


@pytest.mark.parametrize("world, tp, pp, gbs, failed", REROUTED_PLANS)
def test_overlapped_gradient_reduction_keeps_backwards_whole(world, tp, pp, gbs, failed):
    """--overlap-grad-reduce: DDP's backward hooks launch the reduction, which a deferred
    weight gradient would bypass, so the schedule keeps every backward whole."""
    from chameleon_ext.schedule.choice import choose_schedule
    plan = reroute(ExecutionPlan.failure_free(world, tp, pp, 8, 1, gbs), failed)
    chosen = choose_schedule(plan, whole_backwards=True)
    assert not any(op.kind is OpKind.BWD_WEIGHT for ops in chosen.ops.values() for op in ops)
    whole = timed_list_schedule(plan, UniformCosts())[0]
    assert chosen.ops == fuse_messages(plan, whole, UniformCosts()).ops
