"""Eager redundancy as planned: who holds whose shadow, what it costs, and a takeover by the
holder that moves no state."""

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import ModelShape, stage_params
from chameleon_ext.planning.planner import Situation, candidates
from chameleon_ext.planning.strategies.base import moved_bytes
from chameleon_ext.planning.strategies.redundancy import (SHADOW_BYTES_PER_PARAM, eager_cost, holder_stage,
                                                 shadow_pairs)
from chameleon_ext.planning.strategies.reroute import reroute
from chameleon_ext.planning.strategies.takeover import takeover
from tests.profiles import synthetic_profile

SHAPE = ModelShape(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                   micro_batch_size=1, vocab_size=512)


def test_every_stage_is_held_by_an_adjacent_one():
    for depth in range(2, 9):
        for s in range(depth):
            h = holder_stage(depth, s)
            assert h != s and abs(h - s) == 1
    assert holder_stage(1, 0) is None
    assert [holder_stage(3, s) for s in range(3)] == [1, 0, 1]


def test_pairs_per_pipeline_and_none_on_a_rerouted_plan():
    plan = ExecutionPlan.failure_free(4, 1, 2, 8, 1, 8)   # pipeline 2 x data 2
    pairs = shadow_pairs(plan)
    assert sorted(pairs) == sorted((st.ranks[0], p.stages[1 - s].ranks[0])
                                   for p in plan.pipelines for s, st in enumerate(p.stages))
    assert shadow_pairs(reroute(plan, {3})) == []


def test_the_cost_is_the_held_state_and_its_refresh():
    plan = ExecutionPlan.failure_free(3, 1, 3, 6, 1, 6)   # stage 1 holds stages 0 and 2
    profile = synthetic_profile(SHAPE, p2p_alpha_ms=0.1, p2p_ms_per_mib=2.0)
    cost = eager_cost(plan, profile)
    held = (stage_params(plan, 0, SHAPE) + stage_params(plan, 2, SHAPE)) * SHADOW_BYTES_PER_PARAM
    assert cost.memory_bytes == held
    sent = stage_params(plan, 1, SHAPE) * SHADOW_BYTES_PER_PARAM
    assert abs(cost.refresh_ms - (3 * 0.1 + 2.0 * (held + sent) / 2**20)) < 1e-9


def test_a_refresh_every_rank_waits_for_alike_adds_itself_and_a_slower_pipeline_hides_it():
    """Pipeline 2 x data 2: both stages of a pipeline send their state and receive the other's,
    so every rank refreshes as long, starts that much later, and the iteration is that much
    longer. After a takeover one pipeline is a single stage that keeps no shadows: it starts
    at once, and with all 8 layers it runs 96 ms where the others run 60 + their 10.9 ms
    refresh, so the refresh adds nothing (the upkeep charged as the slowest refresh on top of
    the plan's iteration overcharged a measured takeover under eager redundancy by 11%)."""
    profile = synthetic_profile(SHAPE, p2p_alpha_ms=0.1, p2p_ms_per_mib=2.0, layer_fwd_ms=1.0,
                                layer_bwd_input_ms=1.0, layer_bwd_weight_ms=1.0)
    plan = ExecutionPlan.failure_free(4, 1, 2, 8, 1, 8)
    even = eager_cost(plan, profile)
    assert even.sync_ms == pytest.approx(even.refresh_ms) and even.refresh_ms > 10
    merged = takeover(plan, {plan.pipelines[1].stages[0].ranks[0]}, eager=True)
    assert [len(p.stages) for p in merged.pipelines] == [2, 1]
    cost = eager_cost(merged, profile)
    assert cost.refresh_ms == pytest.approx(even.refresh_ms)
    assert cost.sync_ms == pytest.approx(0.0, abs=1e-9)


def test_takeover_goes_to_the_holder_and_moves_nothing():
    plan = ExecutionPlan.failure_free(4, 1, 4, 8, 1, 4)   # one pipeline of 4 stages
    lost = plan.pipelines[0].stages[2].ranks[0]           # held by stage 3
    # by cost alone the first neighbour (stage 1) would take it; the holder is stage 3
    new = takeover(plan, {lost}, stage_cost=lambda n, first, last: n + 10 * last, eager=True)
    assert [(st.layer_start, st.layer_end) for st in new.pipelines[0].stages] == \
        [(0, 2), (2, 4), (4, 8)]
    profile = synthetic_profile(SHAPE)
    assert moved_bytes(plan, new, {lost}, profile, eager=True) == 0
    assert moved_bytes(plan, new, {lost}, profile) > 0
    situation = Situation(iteration=10, checkpoint_iteration=0, remaining_iterations=100,
                          eager_redundancy=True)
    took = next(c for c in candidates(plan, {lost}, profile, situation, ("takeover",)))
    plain = next(c for c in candidates(plan, {lost}, profile, Situation(
        iteration=10, checkpoint_iteration=0, remaining_iterations=100), ("takeover",)))
    # the plan after the takeover keeps shadows too: their upkeep is in its prediction
    assert took.memory_bytes > plain.memory_bytes
