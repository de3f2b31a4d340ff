"""Simulator: static schedule checks, deadlock detection and hand-checked timings."""

from __future__ import annotations

import re

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.schedule.ir import Op, OpKind, Schedule, one_f_one_b
from chameleon_ext.schedule.simulator import (CostModel, ScheduleError, SimResult, UniformCosts, check,
                                     simulate)

from tests.ops import END, OPT, RED, B, BI, BW, F, RB, RF, SB, SF

K = OpKind


def pipeline_plan(p: int, m: int, dp: int = 1, tp: int = 1) -> ExecutionPlan:
    """Megatron layout with p stages of one layer each, m micro-batches per pipeline."""
    return ExecutionPlan.failure_free(tp * p * dp, tp, p, num_layers=p, micro_batch_size=1,
                                      global_batch_size=m * dp)


def schedule_1f1b(plan: ExecutionPlan) -> dict[int, list[Op]]:
    return {r: list(ops) for r, ops in one_f_one_b(plan).ops.items()}


def rejected(plan, ops) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        check(plan, Schedule(ops))
    err = info.value
    # simulate() runs the same checks first
    with pytest.raises(ScheduleError, match=re.escape(str(err))):
        simulate(plan, Schedule(ops), UniformCosts())
    return err


# ---- valid schedules pass ----------------------------------------------------------------------
@pytest.mark.parametrize("p, m, dp, tp", [(1, 1, 1, 1), (2, 4, 1, 1), (4, 2, 2, 1), (3, 5, 2, 2),
                                          (8, 3, 1, 1)])
def test_1f1b_passes_check(p, m, dp, tp):
    plan = pipeline_plan(p, m, dp, tp)
    check(plan, one_f_one_b(plan))


def test_consistently_rerouted_schedule_passes_and_times_by_hand():
    # world 4, pp 2, dp 2: pipeline 0 = ranks [0, 2] owns mbs 0, 1; pipeline 1 = [1, 3] owns 2, 3.
    # Micro-batch 1 is rerouted: rank 0 runs its first stage, rank 3 (pipeline 1) its second.
    plan = ExecutionPlan.failure_free(4, 1, 2, num_layers=4, micro_batch_size=1,
                                      global_batch_size=4)
    ops = {
        0: [F(0), SF(0, 2), F(1), SF(1, 3), RB(0, 2), B(0), RB(1, 3), B(1)] + END,
        2: [RF(0, 0), F(0), B(0), SB(0, 0)] + END,
        1: [F(2), SF(2, 3), F(3), SF(3, 3), RB(2, 3), B(2), RB(3, 3), B(3)] + END,
        3: [RF(2, 1), F(2), B(2), SB(2, 1), RF(1, 0), F(1), B(1), SB(1, 0),
            RF(3, 1), F(3), B(3), SB(3, 1)] + END,
    }
    res = simulate(plan, Schedule(ops), UniformCosts())
    # fwd 1, bwd 2, no latency:
    #   r0: F0 [0,1] F1 [1,2] | r1: F2 [0,1] F3 [1,2] | r2: F0 [1,2] B0 [2,4]
    #   r3: F2 [1,2] B2 [2,4] F1 [4,5] B1 [5,7] F3 [7,8] B3 [8,10]
    #   r0: B0 [4,6] B1 [7,9] | r1: B2 [4,6] B3 [10,12]
    #   reduce (0,1) at max(9,12) = 12; reduce (2,3) at max(4,10) = 10.
    assert res.rank_finish == {0: 12.0, 1: 12.0, 2: 10.0, 3: 10.0}
    assert res.iteration_time == 12.0
    assert res.busy == {0: 6.0, 1: 6.0, 2: 3.0, 3: 9.0}
    assert res.bubble_fraction == pytest.approx(1 - 24 / (4 * 12))
    assert res.peak_inflight == {0: 2, 1: 2, 2: 1, 3: 1}
    assert res.timeline[2][-2] == (RED, 4.0, 10.0)
    assert res.timeline[3][-2] == (RED, 10.0, 10.0)


# ---- static rejections -------------------------------------------------------------------------
def test_missing_backward_names_the_rank_that_should_run_it():
    plan = pipeline_plan(2, 2)
    ops = schedule_1f1b(plan)
    ops[1] = [o for o in ops[1] if not (o.kind in (K.BWD, K.SEND_BWD) and o.microbatch == 1)]
    err = rejected(plan, ops)
    assert err.rank == 1 and err.op == B(1) and err.op_index is None
    assert str(err).startswith("rank 1, missing bwd(mb=1): no rank runs the backward of "
                               "micro-batch 1 through layers [1, 2)")


def test_missing_backward_on_first_stage():
    plan = pipeline_plan(3, 2)
    ops = schedule_1f1b(plan)
    ops[0] = [o for o in ops[0] if not (o.kind in (K.BWD, K.RECV_BWD) and o.microbatch == 0)]
    err = rejected(plan, ops)
    assert (err.rank, err.op) == (0, B(0))
    assert "rank 0, missing bwd(mb=0)" in str(err) and "layers [0, 1)" in str(err)


def test_missing_forward_of_whole_micro_batch_names_owner_pipeline():
    plan = pipeline_plan(2, 2, dp=2)  # pipeline 1 = ranks [1, 3] owns mbs 2, 3
    ops = schedule_1f1b(plan)
    for r in (1, 3):
        ops[r] = [o for o in ops[r] if o.microbatch != 3]
    err = rejected(plan, ops)
    assert (err.rank, err.op) == (1, F(3))
    assert "no rank runs the forward of micro-batch 3 through layers [0, 2)" in str(err)


def test_duplicated_forward_on_the_same_rank():
    plan = pipeline_plan(2, 2)
    ops = schedule_1f1b(plan)
    ops[0].insert(1, F(0))
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (0, 1, F(0))
    assert str(err) == "rank 0, op 1 fwd(mb=0): duplicates op 0 fwd(mb=0) on this rank"


def test_duplicated_forward_on_a_replica():
    plan = pipeline_plan(2, 2, dp=2)  # rank 1 holds the same layers as rank 0
    ops = schedule_1f1b(plan)
    ops[1] = [F(0)] + ops[1]
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (1, 0, F(0))
    assert str(err).startswith("rank 1, op 0 fwd(mb=0): repeats the forward of micro-batch 0 "
                               "through layers [0, 1) (tp rank 0), already run by rank 0 (op 0")


def test_duplicated_forward_through_overlapping_stages():
    # A heterogeneous plan: pipeline 1 splits the 4 layers 3 + 1. Rank 2 runs mb 0 through [0, 3)
    # although pipeline 0 already ran it through [0, 2) on rank 0: layers [0, 2) twice.
    plan = ExecutionPlan(4, 1, 1, 2, [Pipeline([Stage(0, 2, [0]), Stage(2, 4, [1])], [0]),
                                      Pipeline([Stage(0, 3, [2]), Stage(3, 4, [3])], [1])])
    ops = {r: list(o) for r, o in one_f_one_b(plan).ops.items()}
    ops[2] = [F(0), B(0)] + ops[2]
    err = rejected(plan, ops)
    assert (err.rank, err.op_index) == (2, 0)
    assert "repeats the forward of micro-batch 0 through layers [0, 2)" in str(err)


def test_backward_before_forward_on_a_rank():
    plan = pipeline_plan(1, 2)
    ops = {0: [B(0), F(0), F(1), B(1)] + END}
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (0, 0, B(0))
    assert "runs before fwd(mb=0) (op 1)" in str(err)


def test_forward_and_backward_on_different_replicas():
    plan = pipeline_plan(1, 1, dp=2)  # ranks 0 and 1 hold the same layers; mb 0 is rank 0's
    ops = {0: [F(0)] + END, 1: [F(1), B(1), B(0)] + END}
    err = rejected(plan, ops)
    assert (err.rank, err.op_index) == (0, 0)
    assert "has no bwd(mb=0) on this rank" in str(err)


def test_receive_after_the_forward_it_feeds():
    plan = pipeline_plan(2, 1)
    ops = schedule_1f1b(plan)
    assert ops[1][:2] == [RF(0, 0), F(0)]
    ops[1][0], ops[1][1] = ops[1][1], ops[1][0]
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (1, 1, RF(0, 0))
    assert "comes after the op it feeds (op 0 fwd(mb=0))" in str(err)


def test_missing_receive_before_forward():
    plan = pipeline_plan(2, 1)
    ops = schedule_1f1b(plan)
    ops[1].remove(RF(0, 0))
    err = rejected(plan, ops)
    assert (err.rank, err.op) == (1, F(0))
    assert "needs a recv_fwd(mb=0) before it: the stage starts at layer 1" in str(err)


def test_missing_send_after_backward():
    plan = pipeline_plan(2, 1)
    ops = schedule_1f1b(plan)
    ops[1].remove(SB(0, 0))
    err = rejected(plan, ops)
    assert (err.rank, err.op) == (1, B(0))
    assert "needs a send_bwd(mb=0) after it" in str(err)


def test_crossed_wires_between_pipelines():
    plan = pipeline_plan(2, 2, dp=2)  # pipelines [0, 2] (mbs 0, 1) and [1, 3] (mbs 2, 3)
    ops = schedule_1f1b(plan)
    i = ops[0].index(SF(0, 2))
    ops[0][i] = SF(0, 3)  # rank 3 does hold the next layers, but expects nothing from rank 0
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (0, i, SF(0, 3))
    assert str(err) == f"rank 0, op {i} send_fwd(mb=0, peer=3): no matching " \
                       "recv_fwd(mb=0, peer=0) on rank 3"


def test_receive_naming_the_wrong_peer():
    plan = pipeline_plan(2, 2, dp=2)
    ops = schedule_1f1b(plan)
    j = ops[2].index(RF(0, 0))
    ops[2][j] = RF(0, 1)
    err = rejected(plan, ops)
    assert err.rank == 0 and err.op == SF(0, 2)
    assert f"no matching recv_fwd(mb=0, peer=0) on rank 2 (its op {j} recv_fwd(mb=0, peer=1) " \
           "names another peer)" in str(err)


def test_missing_send_after_forward():
    plan = pipeline_plan(2, 1)
    ops = schedule_1f1b(plan)
    ops[0].remove(SF(0, 1))
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (0, 0, F(0))
    assert "needs a send_fwd(mb=0) after it: the stage ends at layer 1 of 2" in str(err)


def test_receive_whose_sender_sends_elsewhere():
    # pipelines [0, 2] (mbs 0, 1) and [1, 3] (mbs 2, 3); rank 3 sends mb 2's input gradient to
    # rank 0 (which does hold the layers below) while rank 1 waits for it.
    plan = pipeline_plan(2, 2, dp=2)
    ops = schedule_1f1b(plan)
    j = ops[3].index(SB(2, 1))
    ops[3][j] = SB(2, 0)
    k = ops[1].index(RB(2, 3))
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (1, k, RB(2, 3))
    assert str(err) == (f"rank 1, op {k} recv_bwd(mb=2, peer=3): no matching send_bwd on rank 3 "
                        f"(its op {j} send_bwd(mb=2, peer=0) names another peer)")


def test_send_labels_swapped():
    # rank 0 labels its first activation as mb 1's and its second as mb 0's.
    plan = pipeline_plan(2, 2, dp=1)
    ops = schedule_1f1b(plan)
    # rank 0: swap the micro-batch labels of its two send_fwds
    a, b = ops[0].index(SF(0, 1)), ops[0].index(SF(1, 1))
    ops[0][a], ops[0][b] = SF(1, 1), SF(0, 1)
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (0, a, SF(1, 1))
    assert "comes before the op that produces it (op 2 fwd(mb=1))" in str(err)


def test_send_skipping_a_stage():
    plan = pipeline_plan(3, 1)  # ranks 0, 1, 2, one layer each
    ops = schedule_1f1b(plan)
    ops[0] = [SF(0, 2) if o == SF(0, 1) else o for o in ops[0]]
    err = rejected(plan, ops)
    assert (err.rank, err.op) == (0, SF(0, 2))
    assert "peer 2 holds layers [2, 3) with tp rank 0, but this rank's layers [0, 1) " \
           "(tp rank 0) need a peer whose layers start at 1 with tp rank 0" in str(err)


def test_forward_sent_backwards_up_the_pipeline():
    # rank 1 (last stage) sends its output "forward" to rank 0, which receives it: a matched pair,
    # but activations only flow to higher layers.
    plan = pipeline_plan(2, 1)
    ops = {0: [RF(0, 1), F(0), SF(0, 1), RB(0, 1), B(0)] + END,
           1: [RF(0, 0), F(0), SF(0, 0), B(0), SB(0, 0)] + END}
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (0, 0, RF(0, 1))
    assert str(err) == ("rank 0, op 0 recv_fwd(mb=0, peer=1): peer 1 holds layers [1, 2) with "
                        "tp rank 0, but this rank's layers [0, 1) (tp rank 0) need a peer whose "
                        "layers end at 0 with tp rank 0")


def test_tensor_parallel_ranks_crossed():
    plan = pipeline_plan(2, 1, tp=2)  # stage 0 = [0, 1], stage 1 = [2, 3]
    ops = schedule_1f1b(plan)
    ops[0] = [SF(0, 3) if o == SF(0, 2) else o for o in ops[0]]
    ops[3] = [RF(0, 0) if o == RF(0, 1) else o for o in ops[3]]
    err = rejected(plan, ops)
    assert (err.rank, err.op) == (0, SF(0, 3))
    assert "peer 3 holds layers [1, 2) with tp rank 1" in str(err)


def test_peer_is_self_or_unknown():
    plan = pipeline_plan(2, 1)
    ops = schedule_1f1b(plan)
    ops[0] = [SF(0, 0) if o == SF(0, 1) else o for o in ops[0]]
    assert "its peer is the rank itself" in str(rejected(plan, ops))
    ops = schedule_1f1b(plan)
    ops[0] = [SF(0, 9) if o == SF(0, 1) else o for o in ops[0]]
    err = rejected(plan, ops)
    assert (err.rank, err.op) == (0, SF(0, 9)) and "peer 9 has no place in the plan" in str(err)


def test_micro_batch_out_of_range():
    plan = pipeline_plan(1, 2)
    ops = {0: [F(0), B(0), F(1), B(1), F(2), B(2)] + END}
    err = rejected(plan, ops)
    assert (err.rank, err.op_index, err.op) == (0, 4, F(2))
    assert "micro-batch 2 is outside [0, 2)" in str(err)


def test_unknown_and_missing_ranks():
    plan = pipeline_plan(2, 1)
    ops = schedule_1f1b(plan)
    ops[5] = list(END)
    err = rejected(plan, ops)
    assert err.rank == 5 and "has an op list but no place in the plan" in str(err)
    ops = schedule_1f1b(plan)
    del ops[1]
    err = rejected(plan, ops)
    assert err.rank == 1 and str(err).startswith("rank 1: has no op list")


def test_reduce_grads_rules():
    plan = pipeline_plan(1, 2)
    err = rejected(plan, {0: [F(0), B(0), F(1), B(1), OPT]})
    assert (err.rank, err.op, err.op_index) == (0, RED, None)
    assert str(err).startswith("rank 0, missing reduce_grads")
    err = rejected(plan, {0: [F(0), B(0), RED, F(1), B(1), OPT]})
    assert (err.rank, err.op_index, err.op) == (0, 2, RED)
    assert "comes before op 4 bwd(mb=1)" in str(err)
    err = rejected(plan, {0: [F(0), B(0), F(1), B(1), RED, RED, OPT]})
    assert (err.rank, err.op_index) == (0, 5) and "second reduce_grads" in str(err)


def test_optimizer_step_rules():
    plan = pipeline_plan(1, 1)
    err = rejected(plan, {0: [F(0), B(0), RED]})
    assert (err.rank, err.op) == (0, OPT) and str(err).startswith("rank 0, missing optimizer_step")
    err = rejected(plan, {0: [F(0), B(0), OPT, RED]})
    assert (err.rank, err.op_index, err.op) == (0, 2, OPT)
    assert "must be the last op" in str(err)
    err = rejected(plan, {0: [F(0), B(0), RED, OPT, OPT]})
    assert (err.rank, err.op_index) == (0, 4)


def test_not_an_op():
    plan = pipeline_plan(1, 1)
    err = rejected(plan, {0: [F(0), "bwd", RED, OPT]})
    assert (err.rank, err.op_index) == (0, 1) and "is not an Op" in str(err)


# ---- deadlocks ---------------------------------------------------------------------------------
def test_deadlock_two_ranks_receive_before_sending():
    plan = pipeline_plan(2, 1)
    # Statically fine: each receive precedes the op it feeds, every send is matched.
    ops = {0: [RB(0, 1), F(0), SF(0, 1), B(0)] + END,
           1: [RF(0, 0), F(0), B(0), SB(0, 0)] + END}
    check(plan, Schedule(ops))
    with pytest.raises(ScheduleError) as info:
        simulate(plan, Schedule(ops), UniformCosts())
    err = info.value
    msg = str(err)
    assert msg.startswith("deadlock")
    assert "rank 0, op 0 recv_bwd(mb=0, peer=1) waits for send_bwd(mb=0) from rank 1" in msg
    assert "rank 1, op 0 recv_fwd(mb=0, peer=0) waits for send_fwd(mb=0) from rank 0" in msg
    assert err.blocked == {0: (0, RB(0, 1)), 1: (0, RF(0, 0))}
    assert (err.rank, err.op_index, err.op) == (0, 0, RB(0, 1))


def test_deadlock_leaves_replicas_waiting_at_the_reduction():
    plan = pipeline_plan(2, 1, dp=2)  # pipelines [0, 2] and [1, 3]; replicas (0, 1) and (2, 3)
    ops = schedule_1f1b(plan)
    ops[1] = [RB(1, 3), F(1), SF(1, 3), B(1)] + END  # pipeline 1 deadlocks as above
    ops[3] = [RF(1, 1), F(1), B(1), SB(1, 1)] + END
    with pytest.raises(ScheduleError) as info:
        simulate(plan, Schedule(ops), UniformCosts())
    msg = str(info.value)
    assert "4 blocked" in msg
    assert "rank 0, op 4 reduce_grads waits for replicas [1] to reach reduce_grads" in msg
    assert "rank 2, op 4 reduce_grads waits for replicas [3] to reach reduce_grads" in msg
    assert "rank 1, op 0 recv_bwd(mb=1, peer=3)" in msg
    assert "rank 3, op 0 recv_fwd(mb=1, peer=1)" in msg
    assert set(info.value.blocked) == {0, 1, 2, 3}


# ---- timing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, m", [(1, 1), (1, 4), (2, 1), (2, 2), (2, 8), (3, 2), (4, 1), (4, 3),
                                  (4, 4), (4, 16), (8, 5), (6, 20)])
def test_1f1b_bubble_fraction(p, m):
    plan = pipeline_plan(p, m)
    res = simulate(plan, one_f_one_b(plan), UniformCosts())
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-15)
    assert res.iteration_time == (m + p - 1) * 3.0
    assert all(b == m * 3.0 for b in res.busy.values())


@pytest.mark.parametrize("fwd, bwd", [(1.0, 1.0), (0.5, 3.0), (2.0, 1.0)])
def test_1f1b_bubble_fraction_other_costs_tp_and_dp(fwd, bwd):
    p, m = 3, 4
    plan = pipeline_plan(p, m, dp=2, tp=2)
    res = simulate(plan, one_f_one_b(plan), UniformCosts(fwd=fwd, bwd=bwd))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert res.iteration_time == pytest.approx((m + p - 1) * (fwd + bwd))
    assert len(res.rank_finish) == 12


def test_bubble_grows_with_latency():
    plan = pipeline_plan(4, 4)
    free = simulate(plan, one_f_one_b(plan), UniformCosts())
    slow = simulate(plan, one_f_one_b(plan), UniformCosts(message=0.5))
    assert slow.bubble_fraction > free.bubble_fraction
    assert slow.iteration_time > free.iteration_time


def test_two_stages_two_micro_batches_with_latency_by_hand():
    plan = pipeline_plan(2, 2)
    res = simulate(plan, one_f_one_b(plan), UniformCosts(fwd=1.0, bwd=2.0, message=0.5))
    # rank 0: F0 SF0 F1 SF1 RB0 B0 RB1 B1 | rank 1: RF0 F0 B0 SB0 RF1 F1 B1 SB1
    #   r0: F0 [0, 1], posts mb0 at 1; F1 [1, 2], posts mb1 at 2; waits for grad 0
    #   r1: RF0 done at 1 + 0.5 = 1.5; F0 [1.5, 2.5]; B0 [2.5, 4.5], posts grad 0 at 4.5
    #       RF1: posted at 2, arrives 2.5 < 4.5, so done at 4.5; F1 [4.5, 5.5]; B1 [5.5, 7.5]
    #   r0: RB0 done at 4.5 + 0.5 = 5; B0 [5, 7]; RB1: grad 1 posted 7.5, done 8; B1 [8, 10]
    assert res.iteration_time == 10.0
    assert res.rank_finish == {0: 10.0, 1: 7.5}
    assert res.busy == {0: 6.0, 1: 6.0}
    assert res.timeline[1] == [(RF(0, 0), 0.0, 1.5), (F(0), 1.5, 2.5), (B(0), 2.5, 4.5),
                               (SB(0, 0), 4.5, 4.5), (RF(1, 0), 4.5, 4.5), (F(1), 4.5, 5.5),
                               (B(1), 5.5, 7.5), (SB(1, 0), 7.5, 7.5),
                               (RED, 7.5, 7.5), (OPT, 7.5, 7.5)]
    assert [(o, s, e) for o, s, e in res.timeline[0] if o.kind is K.RECV_BWD] == [
        (RB(0, 1), 2.0, 5.0), (RB(1, 1), 7.0, 8.0)]
    # compute window ends at 10 with 12 units of work on 2 ranks
    assert res.bubble_fraction == pytest.approx(1 - 12 / 20)


def test_reduction_and_optimizer_by_hand():
    # Data parallel only, uneven split: rank 0 owns mb 0, rank 1 owns mbs 1 and 2.
    plan = ExecutionPlan(2, 1, 1, 3, [Pipeline([Stage(0, 2, [0])], [0]),
                                      Pipeline([Stage(0, 2, [1])], [1, 2])])
    res = simulate(plan, one_f_one_b(plan), UniformCosts(reduction=0.25, optimizer=0.5))
    # r0: F0 B0 done at 3; r1: F1 B1 F2 B2 done at 6. Reduction over (0, 1) ends at
    # max(3, 6) + 0.25 = 6.25 on both, then the optimizer step: 6.75.
    assert res.rank_finish == {0: 6.75, 1: 6.75}
    assert res.iteration_time == 6.75
    assert res.busy == {0: 3.5, 1: 6.5}
    assert res.timeline[0][-2:] == [(RED, 3.0, 6.25), (OPT, 6.25, 6.75)]
    assert res.timeline[1][-2:] == [(RED, 6.0, 6.25), (OPT, 6.25, 6.75)]
    assert res.bubble_fraction == pytest.approx(1 - 9 / 12)


@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (3, 2), (4, 4), (4, 9), (7, 3)])
def test_1f1b_peak_inflight(p, m):
    plan = pipeline_plan(p, m)
    res = simulate(plan, one_f_one_b(plan), UniformCosts())
    for r in plan.ranks:
        s = plan.position(r).stage
        assert res.peak_inflight[r] == min(p - s, m), (r, s)


class StragglerCosts:
    """Rank 1 is slow; forward messages take 0.5, backward ones 0.25. Records p2p calls."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, int, Op]] = []
        self.groups: list[tuple[int, ...]] = []

    def compute(self, rank: int, op: Op) -> float:
        if rank == 1:
            return {K.FWD: 3.0, K.BWD: 4.0, K.OPT_STEP: 0.0}[op.kind]
        return {K.FWD: 1.0, K.BWD: 2.0, K.OPT_STEP: 0.0}[op.kind]

    def p2p(self, src: int, dst: int, op: Op) -> float:
        self.messages.append((src, dst, op))
        return 0.5 if op.kind is K.SEND_FWD else 0.25

    def reduce(self, ranks: tuple[int, ...]) -> float:
        self.groups.append(ranks)
        return 1.0


def test_custom_cost_model_by_hand():
    plan = pipeline_plan(2, 1)
    costs = StragglerCosts()
    assert isinstance(costs, CostModel)
    res = simulate(plan, one_f_one_b(plan), costs)
    # r0: F0 [0, 1], posts at 1 | r1: RF0 at 1.5, F0 [1.5, 4.5], B0 [4.5, 8.5], posts grad at 8.5,
    # reduce (1,) [8.5, 9.5] | r0: RB0 at 8.75, B0 [8.75, 10.75], reduce (0,) [10.75, 11.75]
    assert res.rank_finish == {0: 11.75, 1: 9.5}
    assert res.iteration_time == 11.75
    assert costs.messages == [(0, 1, SF(0, 1)), (1, 0, SB(0, 0))]
    assert sorted(costs.groups) == [(0,), (1,)]
    assert res.busy == {0: 3.0, 1: 7.0}


def test_validate_and_timeline_switches_do_not_change_times():
    plan = pipeline_plan(4, 6, dp=2)
    sched = one_f_one_b(plan)
    costs = UniformCosts(message=0.25, reduction=0.5, optimizer=0.125)
    full = simulate(plan, sched, costs)
    fast = simulate(plan, sched, costs, validate=False, timeline=False)
    assert isinstance(fast, SimResult)
    assert fast.timeline == {}
    assert (fast.iteration_time, fast.rank_finish, fast.busy, fast.peak_inflight,
            fast.bubble_fraction) == (full.iteration_time, full.rank_finish, full.busy,
                                      full.peak_inflight, full.bubble_fraction)
    assert all(len(full.timeline[r]) == len(sched.ops[r]) for r in plan.ranks)
    # all members of a reduction group leave it together
    for r in plan.ranks:
        ends = {full.timeline[q][-2][2] for q in plan.replicas(r)}
        assert len(ends) == 1


# ---- costs -------------------------------------------------------------------------------------
def test_uniform_costs_fields_and_protocol():
    c = UniformCosts(fwd=1.5, message=0.5, reduction=2.0)
    assert isinstance(c, CostModel)
    assert c.compute(0, F(0)) == 1.5 and c.compute(0, B(0)) == 2.0 and c.compute(0, OPT) == 0.0
    assert c.p2p(0, 1, SF(0, 1)) == 0.5
    assert c.reduce((0, 1)) == 2.0
    c.message = 0.75
    assert c.p2p(0, 1, SF(0, 1)) == 0.75
    assert c == UniformCosts(fwd=1.5, message=0.75, reduction=2.0)
    with pytest.raises(ValueError, match="only defined for fwd, bwd, bwd_input, bwd_weight and optimizer_step"):
        c.compute(3, SF(0, 1))


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_garbage_collector_state_is_restored_even_on_error():
    import gc

    plan = pipeline_plan(2, 1)
    assert gc.isenabled()
    with pytest.raises(ScheduleError):
        simulate(plan, Schedule({0: list(END), 1: list(END)}), UniformCosts())
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(plan, one_f_one_b(plan), UniformCosts())
        assert not gc.isenabled()  # a caller's choice to keep it off is kept too
    finally:
        gc.enable()


# ---- split backward ----------------------------------------------------------------------------
def two_stage_plan() -> ExecutionPlan:
    return ExecutionPlan.failure_free(2, 1, 2, num_layers=2, micro_batch_size=1,
                                      global_batch_size=2)


def test_split_backward_frees_the_previous_stage_earlier_by_hand():
    # fwd 1, bwd_input 1, bwd_weight 1. Rank 1 sends mb 0's input gradient after its input half
    # (t=3) and runs the weight half later, so rank 0 starts bwd(0) at 3 instead of 4.
    plan = two_stage_plan()
    ops = {
        0: [F(0), SF(0, 1), F(1), SF(1, 1), RB(0, 1), B(0), RB(1, 1), B(1)] + END,
        1: [RF(0, 0), F(0), BI(0), SB(0, 0), RF(1, 0), F(1), BI(1), SB(1, 0), BW(0), BW(1)]
           + END,
    }
    res = simulate(plan, Schedule(ops), UniformCosts())
    ends = {str(op): end for op, _, end in res.timeline[0]}
    assert ends["bwd(mb=0)"] == 5.0   # starts at 3
    assert ends["bwd(mb=1)"] == 7.0   # rank 1: f(1) 3-4, bwd_input(1) 4-5, sent at 5
    assert res.rank_finish[1] == 7.0  # then both weight halves, 5-7
    assert res.iteration_time == 7.0
    assert res.busy[1] == 6.0 and res.peak_inflight[1] == 2


def test_split_backward_without_weight_half_is_rejected():
    plan = two_stage_plan()
    ops = {0: [F(0), SF(0, 1), F(1), SF(1, 1), RB(0, 1), B(0), RB(1, 1), B(1)] + END,
           1: [RF(0, 0), F(0), BI(0), SB(0, 0), RF(1, 0), F(1), B(1), SB(1, 0)] + END}
    err = rejected(plan, ops)
    assert err.rank == 1 and "no bwd_weight(mb=0) after it" in str(err)


def test_weight_half_before_input_half_or_after_reduction_is_rejected():
    plan = two_stage_plan()
    head = [F(0), SF(0, 1), F(1), SF(1, 1), RB(0, 1), B(0), RB(1, 1), B(1)] + END
    early = {0: head, 1: [RF(0, 0), F(0), BW(0), BI(0), SB(0, 0), RF(1, 0), F(1), B(1),
                          SB(1, 0)] + END}
    assert "runs before bwd_input(mb=0)" in str(rejected(plan, early))
    late = {0: head, 1: [RF(0, 0), F(0), BI(0), SB(0, 0), RF(1, 0), F(1), B(1), SB(1, 0), RED,
                         BW(0), OPT]}
    assert "gradients are reduced after the last bwd" in str(rejected(plan, late))
    alone = {0: head, 1: [RF(0, 0), F(0), B(0), SB(0, 0), RF(1, 0), F(1), B(1), SB(1, 0), BW(1)]
             + END}
    assert "needs a bwd_input(mb=1) before it" in str(rejected(plan, alone))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (2, 3, 6)])
def test_interleaving_shrinks_the_bubble_as_megatron_lm_computes_it(p, v, m):
    """Megatron-LM's interleaved 1F1B with each chunk's forward and backward 1/v of a stage's
    and free messages: the bubble is (p - 1) / v stage-steps, a fraction (p - 1) / (v m + p - 1)
    of the window; uninterleaved, (p - 1) / (m + p - 1)."""
    from chameleon_ext.schedule.ir import interleaved_1f1b
    plan = ExecutionPlan.failure_free(p, 1, p, p * v, 1, m, virtual_stages=v)
    res = simulate(plan, interleaved_1f1b(plan), UniformCosts(fwd=1 / v, bwd=2 / v))
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert res.iteration_time == pytest.approx(3 * (m + (p - 1) / v))
    plain = ExecutionPlan.failure_free(p, 1, p, p * v, 1, m)
    assert simulate(plain, one_f_one_b(plain), UniformCosts()).bubble_fraction == \
        pytest.approx((p - 1) / (m + p - 1))


def test_the_static_checks_refuse_an_interleaved_plan_in_one_line():
    from chameleon_ext.schedule.ir import interleaved_1f1b
    plan = ExecutionPlan.failure_free(2, 1, 2, 4, 1, 2, virtual_stages=2)
    with pytest.raises(ScheduleError, match="the static checks know one stage per rank"):
        check(plan, interleaved_1f1b(plan))
