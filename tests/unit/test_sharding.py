"""Where the distributed optimizer's shards live, which losses leave one without a copy, and
the decider's answer: state carried over while every shard has a copy, else a restart from the
checkpoint that says which shard is lost."""

import dataclasses

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.plan.sharding import instances_for, lost_shards, shard_holders
from chameleon_ext.planning.decider import Decider
from chameleon_ext.planning.perf_model import ModelShape, sharded_bytes_per_param, stage_params
from chameleon_ext.planning.strategies.base import repartition_bytes
from chameleon_ext.planning.strategies.reroute import reroute
from tests.profiles import synthetic_profile

SHAPE = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                   micro_batch_size=1, vocab_size=512)


def pp2_dp4() -> ExecutionPlan:
    # Megatron's order: stage 0 on ranks 0-3, stage 1 on ranks 4-7
    return ExecutionPlan.failure_free(8, 1, 2, 4, 1, 8)


def test_two_instances_hold_each_shard_at_the_same_place_of_both_chunks():
    assert sorted(shard_holders(pp2_dp4(), 2)) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert sorted(shard_holders(pp2_dp4(), 1)) == [(r,) for r in range(8)]


def test_a_buddy_copy_is_held_by_the_previous_rank_of_the_same_chunk():
    assert sorted(shard_holders(pp2_dp4(), 1, buddy=True)) == \
        [(0, 3), (1, 0), (2, 1), (3, 2), (4, 7), (5, 4), (6, 5), (7, 6)]
    assert sorted(shard_holders(pp2_dp4(), 2, buddy=True)) == \
        [(0, 2, 1, 3), (1, 3, 0, 2), (4, 6, 5, 7), (5, 7, 4, 6)]
    assert lost_shards(pp2_dp4(), {3}, 1, buddy=True) == []
    assert lost_shards(pp2_dp4(), {2, 3}, 1, buddy=True) == [(3, 2)]


def test_a_shard_is_lost_only_with_every_copy():
    plan = pp2_dp4()
    assert lost_shards(plan, {3}, 2) == []
    assert lost_shards(plan, {1, 3}, 2) == [(1, 3)]
    assert lost_shards(plan, {3}, 1) == [(3,)]
    # a stage lost whole takes its layers along: that loss is not the optimizer's to report
    assert lost_shards(plan, {4, 5, 6, 7}, 2) == []


def test_a_plan_keeps_only_the_instances_that_divide_every_replica_group():
    plan = pp2_dp4()
    assert instances_for(plan, 2) == 2 and instances_for(plan, 4) == 4
    rerouted = reroute(plan, {3})       # stage 0 keeps 3 replicas: one instance is left
    assert instances_for(rerouted, 2) == 1


@pytest.mark.parametrize("strategy", ["reroute", "auto"])
def test_with_one_instance_a_lost_shard_restarts_from_the_checkpoint_and_says_why(strategy):
    plan = pp2_dp4()
    d = Decider(strategy, sharded=1).after_failure(plan, list(range(8)), {3}, 5).decision
    assert d.restarts
    assert d.why == ("the distributed optimizer's shard held by rank(s) [3] is lost "
                     "(1 instance(s), no other copy)")
    kept = Decider(strategy, sharded=2).after_failure(plan, list(range(8)), {3}, 5).decision
    if strategy == "reroute":
        assert kept.strategy == "reroute" and kept.why is None



@pytest.mark.parametrize("instances", [1, 2])
def test_re_partitioning_moves_the_parts_of_the_new_shards_the_old_ones_did_not_cover(
        instances):
    """Data 4 -> 3 (rank 3 rerouted): with one instance the survivors' quarters become thirds
    (1/12, 1/6 and 1/4 of the stage's moments arrive); with two, halves become thirds (0, 1/6
    and 1/3). Either way half the stage's sharded state moves in all, as the executed reroute
    measured (904,800 of 1,813,712 bytes of moments, tests/e2e/test_sharded_recovery.py); the
    survivors receive beside each other, so the move lasts what the largest part takes."""
    plan = ExecutionPlan.failure_free(4, 1, 1, 4, 1, 8)
    prof = synthetic_profile(SHAPE, layer_fwd_ms=1.0)
    sharded = dataclasses.replace(prof, optimizer_instances=instances)
    whole = stage_params(plan, 0, SHAPE) * sharded_bytes_per_param(sharded)
    new = reroute(plan, {3})
    assert repartition_bytes(plan, new, {3}, sharded) == round(whole * {1: 1 / 4, 2: 1 / 3}[instances])
    assert repartition_bytes(plan, new, {3}, prof) == 0          # replicated: nothing to cut
