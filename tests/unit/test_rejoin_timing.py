"""A rejoin is a decision (issue: the cycle's objective): under `auto` the leader admits the
ranks that came back at the next boundary, at the next periodic checkpoint's (everyone reading
that checkpoint, no state between peers) or as spares, the plan kept, as planner.rejoin_choice
prefers; a forced strategy admits into the plan at once. A joiner whose leader says nothing for
the join timeout gives up."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_ext.control.keys import key_admit
from chameleon_ext.control.membership import Membership
from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.decider import Decider, Planning
from chameleon_ext.planning.planner import Situation
from chameleon_ext.planning.strategies import REGISTRY, Context
from megatron.training.config import CheckpointConfig
from megatron.training.planning import JobClock
from tests.unit.test_cycle_objective import PROFILE, pp2_dp4

JOINER = 8     # rank 7's slot, restarted under the next launch rank


def decider(strategy: str = "auto", **situation) -> Decider:
    def outlook(iteration: int) -> Situation:
        return Situation(**{"iteration": iteration, "checkpoint_iteration": 0,
                            "remaining_iterations": 10_000, "mtbf_hours": 6.0,
                            "failure_free_ms": 1180.0, **situation})
    return Decider(strategy, planning=Planning(lambda plan, ranks: PROFILE, outlook, outlook),
                   target=pp2_dp4())


def rerouted() -> ExecutionPlan:
    """Pipeline 2 x data 4 rerouted around the loss of rank 7: launch ranks 0-6."""
    return REGISTRY["reroute"].propose(pp2_dp4(), {7}, Context(PROFILE)).plan


def test_mid_run_the_joiner_is_admitted_at_the_next_boundary():
    at = decider().admission_time(rerouted(), list(range(7)), [JOINER], 499)
    assert (at.after, at.action) == (500, "now") and at.costs["now"] < at.costs["stay"]


def test_a_near_checkpoint_is_waited_for_and_then_read_by_everyone():
    """The save of iteration 600 is 20 iterations away (tests/unit/test_cycle_objective.py:
    entering from it beats moving 600 MiB between peers now)."""
    d = decider(save_interval=600)
    at = d.admission_time(rerouted(), list(range(7)), [JOINER], 579)
    assert (at.after, at.action) == (600, "checkpoint")
    verdict = d.for_admission(rerouted(), list(range(7)), [*range(7), JOINER], 600, at.action)
    assert verdict.decision.strategy == "restart" and verdict.decision.restarts
    assert verdict.decision.plan.ranks == pp2_dp4().ranks
    assert verdict.decision.members == [*range(7), JOINER]
    assert verdict.decision.joined == [JOINER]


def test_near_the_end_the_joiner_stands_by_as_a_spare():
    """Moving its state would not pay for itself in 10 iterations: the plan is kept and the
    joiner is admitted at the next boundary as a spare (nothing moved), warm for a loss."""
    d = decider(remaining_iterations=10)
    at = d.admission_time(rerouted(), list(range(7)), [JOINER], 499)
    assert (at.after, at.action) == (500, "spare") and at.costs["stay"] < at.costs["now"]
    verdict = d.for_admission(rerouted(), list(range(7)), [*range(7), JOINER], 500, at.action)
    assert verdict.decision.plan.ranks == rerouted().ranks
    assert verdict.decision.plan.pipelines == rerouted().pipelines
    assert verdict.decision.members == list(range(7)) and verdict.decision.joined == []


def re_laid_out() -> ExecutionPlan:
    """Pipeline 2 x data 4 re-parallelized over launch ranks 0, 1 and 3-6 after losing 2 and
    7: 2 pipelines of 3 stages."""
    return REGISTRY["reparallelize"].propose(pp2_dp4(), {2, 7}, Context(PROFILE)).plan


def test_a_joiner_that_cannot_fill_the_plan_moves_state_or_waits_by_the_same_objective():
    """6 ranks and one joiner cannot fill the 8 places: mid-run the plan that absorbs the
    empty place (re-parallelized over all 7) is worth its state move now; near the end it is
    not, and the joiner stands by as a spare (it used to be admitted into an absorbing plan at
    once, whatever the move cost). Such an admission is never made at a checkpoint, and never
    restarts from one."""
    launch = [0, 1, 3, 4, 5, 6]
    mid = decider(save_interval=100).admission_time(re_laid_out(), launch, [JOINER], 499)
    assert (mid.after, mid.action) == (500, "now") and mid.costs["now"] < mid.costs["stay"]
    assert "checkpoint" not in mid.costs
    verdict = decider(save_interval=100).for_admission(re_laid_out(), launch,
                                                       [*launch, JOINER], 499)
    assert not verdict.decision.restarts and verdict.decision.joined == [JOINER]
    late = decider(remaining_iterations=10).admission_time(re_laid_out(), launch, [JOINER], 499)
    assert (late.after, late.action) == (500, "spare")
    assert late.costs["stay"] < late.costs["now"]


def test_a_forced_strategy_admits_at_once():
    at = decider("reroute", remaining_iterations=10).admission_time(
        rerouted(), list(range(7)), [JOINER], 499)
    assert (at.after, at.action, at.costs) == (500, "now", {})


def test_the_outlook_counts_no_failure_and_sees_saves_only_with_somewhere_to_save():
    clock = JobClock(CheckpointConfig(save_interval=10), 100, None, False)
    assert clock.outlook(5).save_interval == 0            # no --save
    clock.outlook(6)
    assert clock.failures == 0
    clock.situation(7)      # a decision at a failure: the loss is recorded after it
    assert clock.failures == 0
    clock.lost(2.0)
    assert clock.failures == 1


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30),
                           wait_for_workers=False)
    yield server


@pytest.mark.timeout(60)
def test_a_joiner_waits_for_its_admission_and_gives_up_when_the_leader_goes_silent(store):
    joiner = Membership(store, JOINER, 8, heartbeat_timeout=30)
    joiner.admissions.request_join()
    began = time.monotonic()
    assert joiner.admissions.admitted_to(0.3) is None
    assert time.monotonic() - began < 5
    def leader():
        time.sleep(0.2)
        store.set(key_admit(JOINER), '{"generation": 3, "candidates": [0, 8], "admission": 0}')
    thread = threading.Thread(target=leader)
    thread.start()
    got = joiner.admissions.admitted_to(5.0)
    thread.join()
    assert got == {"generation": 3, "candidates": [0, 8], "admission": 0}
