"""The leader's published verdict round-trips through JSON, and a plan whose layers no survivor
holds is never chosen for a strategy that carries the ranks' state."""

import pytest

from chameleon_ext.decision import Decision, Switch, Verdict
from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.strategies.base import state_survives
from megatron.elastic.deciding import Decider


def test_a_verdict_round_trips_through_json():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)
    later = ExecutionPlan.failure_free(2, 1, 2, 4, 2, 16)
    d = Decision("reroute+restart", plan, 12.5, Switch("restart", 6, later, 10.0),
                 [{"strategy": "reroute", "predicted_iter_ms": 12.5}], "measured",
                 {"num_steps": 64}, 96, [4])
    back = Verdict.from_json(Verdict(d).to_json()).decision
    assert back.to_dict() == d.to_dict()
    assert back.switch.plan.to_dict() == later.to_dict() and not back.restarts
    none = Verdict.from_json(Verdict(unrecoverable="no plan fits").to_json())
    assert none.decision is None and none.unrecoverable == "no plan fits"
    with pytest.raises(ValueError):
        Verdict()


def test_state_survives_only_while_every_layer_has_a_holder():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)   # stage 0: ranks 0, 1; stage 1: 2, 3
    assert state_survives(plan, {3}, eager=False)
    assert not state_survives(plan, {2, 3}, eager=False)    # both replicas of stage 1
    # eager redundancy: stage 0's ranks hold stage 1's shadow copies
    assert state_survives(plan, {2, 3}, eager=True)


def test_a_lost_stage_without_holders_falls_back_to_restart():
    plan = ExecutionPlan.failure_free(4, 1, 4, 4, 2, 16)    # pipeline 4 x data 1
    for strategy in ("reroute", "takeover", "reparallelize", "auto"):
        verdict = Decider(strategy).after_failure(plan, [0, 1, 2, 3], {2}, 5)
        assert verdict.decision.strategy == "restart", strategy
        assert verdict.decision.plan.world_size <= 3
