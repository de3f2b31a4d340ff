"""Schedule IR: ops, serialisation and the 1F1B generator."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.schedule.ir import Op, OpKind, Schedule, one_f_one_b

from tests.ops import END, B, F, RB, RF, SB, SF

K = OpKind


def test_1f1b_two_stages_four_micro_batches_by_hand():
    plan = ExecutionPlan.failure_free(2, 1, 2, num_layers=4, micro_batch_size=1,
                                      global_batch_size=4)
    sched = one_f_one_b(plan)
    # Stage 0 warms up with p - s - 1 = 1 forward, then alternates, then drains the backwards.
    assert sched.ops[0] == [
        F(0), SF(0, 1),
        F(1), SF(1, 1), RB(0, 1), B(0),
        F(2), SF(2, 1), RB(1, 1), B(1),
        F(3), SF(3, 1), RB(2, 1), B(2),
        RB(3, 1), B(3),
    ] + END
    # The last stage has no warm-up: every forward is followed by its own backward.
    assert sched.ops[1] == [
        RF(0, 0), F(0), B(0), SB(0, 0),
        RF(1, 0), F(1), B(1), SB(1, 0),
        RF(2, 0), F(2), B(2), SB(2, 0),
        RF(3, 0), F(3), B(3), SB(3, 0),
    ] + END
    counts = {r: Counter(o.kind for o in ops) for r, ops in sched.ops.items()}
    assert counts[0] == Counter({K.FWD: 4, K.BWD: 4, K.SEND_FWD: 4, K.RECV_BWD: 4,
                                 K.REDUCE_GRADS: 1, K.OPT_STEP: 1})
    assert counts[1] == Counter({K.FWD: 4, K.BWD: 4, K.RECV_FWD: 4, K.SEND_BWD: 4,
                                 K.REDUCE_GRADS: 1, K.OPT_STEP: 1})


def test_1f1b_fewer_micro_batches_than_stages():
    plan = ExecutionPlan.failure_free(3, 1, 3, num_layers=3, micro_batch_size=1,
                                      global_batch_size=2)
    sched = one_f_one_b(plan)
    # Stage 0 would warm up with 2 forwards; with only 2 micro-batches it is all warm-up.
    assert sched.ops[0] == [F(0), SF(0, 1), F(1), SF(1, 1), RB(0, 1), B(0), RB(1, 1), B(1)] + END
    assert sched.ops[1] == [RF(0, 0), F(0), SF(0, 2),
                            RF(1, 0), F(1), SF(1, 2), RB(0, 2), B(0), SB(0, 0),
                            RB(1, 2), B(1), SB(1, 0)] + END
    assert sched.ops[2] == [RF(0, 1), F(0), B(0), SB(0, 1), RF(1, 1), F(1), B(1), SB(1, 1)] + END


def test_1f1b_single_stage_is_plain_f_b_per_micro_batch():
    plan = ExecutionPlan.failure_free(2, 1, 1, num_layers=2, micro_batch_size=1,
                                      global_batch_size=4)
    sched = one_f_one_b(plan)
    assert sched.ops[0] == [F(0), B(0), F(1), B(1)] + END
    assert sched.ops[1] == [F(2), B(2), F(3), B(3)] + END


def test_1f1b_uses_each_pipelines_own_micro_batches_and_peers():
    plan = ExecutionPlan.failure_free(4, 1, 2, num_layers=2, micro_batch_size=1,
                                      global_batch_size=4)
    sched = one_f_one_b(plan)
    assert sorted(sched.ops) == [0, 1, 2, 3]
    # pipeline 1 = ranks [1, 3] with micro-batches [2, 3]
    assert sched.ops[1][:2] == [F(2), SF(2, 3)]
    assert sched.ops[3][:3] == [RF(2, 1), F(2), B(2)]
    assert {o.microbatch for o in sched.ops[3] if o.kind is K.FWD} == {2, 3}


def test_op_str_and_tags():
    assert str(Op(K.RECV_FWD, 0, 0)) == "recv_fwd(mb=0, peer=0)"
    assert str(Op(K.BWD, 3)) == "bwd(mb=3)"
    assert str(Op(K.REDUCE_GRADS)) == "reduce_grads"
    tags = {Op(k, mb, 1).message_tag() for k in (K.SEND_FWD, K.SEND_BWD) for mb in range(5)}
    assert len(tags) == 10
    assert Op(K.SEND_FWD, 4, 1).message_tag() == Op(K.RECV_FWD, 4, 0).message_tag()
    assert Op(K.SEND_BWD, 4, 1).message_tag() == Op(K.RECV_BWD, 4, 0).message_tag()
    assert Op(K.SEND_FWD, 4, 1).message_tag() != Op(K.SEND_BWD, 4, 1).message_tag()


def test_schedule_dict_round_trip_through_json():
    plan = ExecutionPlan.failure_free(4, 2, 2, num_layers=4, micro_batch_size=1,
                                      global_batch_size=3)
    sched = one_f_one_b(plan)
    back = Schedule.from_dict(json.loads(json.dumps(sched.to_dict())))
    assert back == sched
    assert back.ops[2][0] == RF(0, 0)


def test_op_from_dict_rejects_unknown_kind():
    with pytest.raises(ValueError):
        Op.from_dict({"kind": "warp"})


def completes(schedule: Schedule) -> bool:
    """The IR's semantics (a send never blocks; a receive waits for the matching send by
    peer and tag): every rank reaches the end of its ops."""
    done = {r: 0 for r in schedule.ops}
    posted: set[tuple[int, int, int]] = set()
    moved = True
    while moved:
        moved = False
        for r, ops in schedule.ops.items():
            while done[r] < len(ops):
                op = ops[done[r]]
                if op.kind in (OpKind.SEND_FWD, OpKind.SEND_BWD):
                    posted.add((r, op.peer, op.message_tag()))
                elif op.kind in (OpKind.RECV_FWD, OpKind.RECV_BWD) and \
                        (op.peer, r, op.message_tag()) not in posted:
                    break
                done[r] += 1
                moved = True
    return all(done[r] == len(ops) for r, ops in schedule.ops.items())


@pytest.mark.parametrize("pp,v,mbs", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (2, 3, 6), (4, 4, 8)])
def test_the_interleaved_1f1b_runs_every_chunk_once_and_completes(pp, v, mbs):
    """Megatron-LM's order: rank p warms up with (P - p - 1) x 2 + (V - 1) x P forwards (at
    most all of them), then alternates; every (micro-batch, stage) goes forward and backward
    once on the rank holding that stage, and the schedule completes under the IR's
    semantics (no rank waits on one that waits on it)."""
    from chameleon_ext.schedule.ir import interleaved_1f1b
    plan = ExecutionPlan.failure_free(pp * 2, 1, pp, pp * v * 2, 1, mbs * 2, virtual_stages=v)
    schedule = interleaved_1f1b(plan)
    assert completes(schedule)
    for rank, ops in schedule.ops.items():
        stages = plan.chunks(rank)
        assert len(stages) == v
        mine = plan.pipeline_of(rank).micro_batches
        for kind in (OpKind.FWD, OpKind.BWD):
            assert sorted((o.microbatch, o.stage) for o in ops if o.kind is kind) == \
                sorted((mb, s) for mb in mine for s in stages)
        first_bwd = next(i for i, o in enumerate(ops) if o.kind is OpKind.BWD)
        warmup = min((pp - stages[0] - 1) * 2 + (v - 1) * pp, mbs * v)
        # the steady state's first forward comes before the first backward
        assert sum(o.kind is OpKind.FWD for o in ops[:first_bwd]) == \
            warmup + (1 if warmup < mbs * v else 0)
        assert ops[-2:] == [Op(OpKind.REDUCE_GRADS), Op(OpKind.OPT_STEP)]
    tags = Counter((r, o.peer, o.message_tag()) for r, ops in schedule.ops.items() for o in ops
                   if o.kind in (OpKind.SEND_FWD, OpKind.SEND_BWD))
    assert set(tags.values()) == {1}      # one message per (peer, tag): none confused


def test_an_interleaved_pipeline_needs_a_multiple_of_its_ranks_in_micro_batches():
    from chameleon_ext.schedule.ir import interleaved_1f1b
    plan = ExecutionPlan.failure_free(2, 1, 2, 4, 1, 3, virtual_stages=2)
    with pytest.raises(ValueError, match="needs a multiple of 2 micro-batches"):
        interleaved_1f1b(plan)


def test_an_interleaved_ops_tag_names_the_stage_boundary_its_message_crosses():
    send = Op(OpKind.SEND_FWD, 3, 1, stage=2)          # stage 2 -> 3
    assert send.message_tag() == Op(OpKind.RECV_FWD, 3, 0, stage=3).message_tag()
    grad = Op(OpKind.SEND_BWD, 3, 0, stage=3)          # stage 3 -> 2
    assert grad.message_tag() == Op(OpKind.RECV_BWD, 3, 1, stage=2).message_tag()
    assert len({send.message_tag(), grad.message_tag(),
                Op(OpKind.SEND_FWD, 3, 1, stage=0).message_tag()}) == 3
    assert Op.from_dict(json.loads(json.dumps(send.to_dict()))) == send
    assert str(send) == "send_fwd(mb=3, stage=2, peer=1)"
