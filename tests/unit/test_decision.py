"""The leader's published verdict round-trips through JSON, a plan whose layers no survivor
holds is never chosen for a strategy that carries the ranks' state, and under the spread
placement a restart takes survivors from every node and keeps each stage's replicas apart."""

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.plan.placement import place
from chameleon_ext.planning.decider import Decider
from chameleon_ext.planning.decision import Decision, Switch, Verdict
from chameleon_ext.planning.strategies.base import state_survives


def test_a_verdict_round_trips_through_json():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)
    later = ExecutionPlan.failure_free(2, 1, 2, 4, 2, 16)
    d = Decision("reroute+restart", plan, 12.5, Switch("restart", 6, later, 10.0),
                 [{"strategy": "reroute", "predicted_iter_ms": 12.5}], "measured",
                 {"num_steps": 64}, 96, [4], [0, 2, 3])
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


def test_a_restart_under_spread_takes_survivors_from_every_node():
    # pipeline 2 x data 3 on 2 nodes of 3 workers (launch ranks 0-2 on node 0, 3-5 on node 1),
    # spread: stage 0 on 0, 3, 1; stage 1 on 4, 2, 5. Rank 5 lost, forced restart: 4 of the 5
    # survivors, 2 from each node, each stage on both nodes.
    node_of = {r: r // 3 for r in range(6)}
    plan = place("spread", node_of, ExecutionPlan.failure_free(len(node_of), 1, 2, 4, 2, 12))
    decider = Decider("restart", placement="spread",
                      nodes=lambda ranks: {r: node_of[r] for r in ranks})
    d = decider.after_failure(plan, list(range(6)), {5}, 5).decision
    assert d.strategy == "restart" and d.plan.world_size == 4
    assert d.members == [0, 1, 3, 4]
    for p_ in d.plan.pipelines:
        assert {node_of[d.members[r]] for st in p_.stages for r in st.ranks} \
            in ({0}, {1})                          # each pipeline inside one node
    stages = {(st.layer_start, st.layer_end): set() for st in d.plan.pipelines[0].stages}
    for p_ in d.plan.pipelines:
        for st in p_.stages:
            stages[(st.layer_start, st.layer_end)].update(node_of[d.members[r]]
                                                          for r in st.ranks)
    assert all(nodes == {0, 1} for nodes in stages.values())
    # Megatron's placement: the first 4 survivors, in Megatron's order (today's layout)
    d = Decider("restart", nodes=lambda ranks: {r: node_of[r] for r in ranks}).after_failure(
        plan, list(range(6)), {5}, 5).decision
    assert d.members == [0, 1, 2, 3] and d.plan.to_dict()["pipelines"] == \
        ExecutionPlan.failure_free(4, 1, 2, 4, 2, 12).to_dict()["pipelines"]
