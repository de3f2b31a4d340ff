"""ReCycle's staggered optimizer, simulated: each rank steps on its own and starts its next
iteration when its inputs arrive, against the synchronous commit the executor runs."""

from __future__ import annotations

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import (ModelShape, ProfileCosts, analytical_profile,
                                               planned_schedule)
from chameleon_ext.planning.strategies.reroute import reroute
from chameleon_ext.schedule.ir import Op, OpKind, one_f_one_b
from chameleon_ext.schedule.simulator import UniformCosts, simulate
from chameleon_ext.schedule.staggered import staggered_period, unrolled


class _LastStageStepsLong(UniformCosts):
    """fwd 1, bwd 2; the last stage's optimizer step 4, the others' free."""

    def __init__(self, last: set[int]) -> None:
        super().__init__()
        self.last = last

    def compute(self, rank: int, op: Op) -> float:
        if op.kind is OpKind.OPT_STEP:
            return 4.0 if rank in self.last else 0.0
        return super().compute(rank, op)


def test_a_pipeline_whose_first_stage_finishes_last_gains_nothing():
    """1F1B: the first stage does the last backward and the next iteration's first forward, so
    stepping it early cannot start the next iteration any sooner."""
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8)
    schedule = one_f_one_b(plan)
    costs = UniformCosts(optimizer=1.0, reduction=0.5)
    assert staggered_period(plan, schedule, costs) == pytest.approx(
        simulate(plan, schedule, costs).iteration_time)


def test_a_long_step_on_the_last_stage_overlaps_the_next_iterations_start():
    """Pipeline 2, 4 micro-batches: the last stage's backwards end at 13 and its step at 17,
    after the first stage's end (15). Stepping on its own, the first stage starts the next
    iteration at 15, so the period drops below 17 but not below the last stage's busy time
    (4 x 3 + 4 = 16)."""
    plan = ExecutionPlan.failure_free(2, 1, 2, 4, 1, 4)
    schedule = one_f_one_b(plan)
    costs = _LastStageStepsLong({r for r in plan.ranks if plan.is_last_stage(r)})
    assert simulate(plan, schedule, costs).iteration_time == 17.0
    assert 16.0 <= staggered_period(plan, schedule, costs) < 17.0


def test_a_rerouted_schedule_never_gets_slower_and_gains_where_the_last_stage_ends_last():
    """The analytical 1.3B profile, pipeline 2 x data 4 (tools/bench/staggered_optimizer.py):
    losing two first-stage GPUs leaves the last stage (with the output layer) last to finish,
    so staggering gains; losing two last-stage GPUs leaves the first stage last."""
    shape = ModelShape(24, 2048, 16, 2048, 1, 50304)
    profile = analytical_profile(shape, "H200")
    ff = ExecutionPlan.failure_free(8, 1, 2, 24, 1, 16)
    gains = {}
    for stage in (0, 1):
        plan = reroute(ff, {ff.pipelines[p].stages[stage].ranks[0] for p in (1, 2)})
        schedule, costs = planned_schedule(plan), ProfileCosts(plan, profile)
        sync = simulate(plan, schedule, costs, validate=False).iteration_time
        gains[stage] = sync / staggered_period(plan, schedule, costs) - 1
    assert gains[0] > 0.01
    assert gains[1] == pytest.approx(0.0, abs=1e-12)


def test_copies_keep_a_tag_of_their_own_and_two_make_no_deadlock():
    plan = reroute(ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8), {1})
    schedule = planned_schedule(plan)
    twice = unrolled(plan, schedule, 2)
    for r, ops in twice.ops.items():
        sends = [(o.kind, o.microbatch, o.peer) for o in ops if o.kind is OpKind.SEND_FWD]
        assert len(sends) == len(set(sends)) == 2 * sum(
            o.kind is OpKind.SEND_FWD for o in schedule.ops[r])
    with pytest.raises(ValueError, match="at least 2"):
        staggered_period(plan, schedule, UniformCosts(), iterations=1)
