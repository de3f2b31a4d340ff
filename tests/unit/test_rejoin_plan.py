"""The failure-free plan laid over a world with newcomers: stayers keep their layers."""

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.strategies.rejoin import overlay
from chameleon_ext.planning.strategies.reroute import reroute
from chameleon_ext.planning.strategies.takeover import takeover


def stage_layers(plan: ExecutionPlan, rank: int) -> tuple[int, int]:
    st = plan.stage_of(rank)
    return st.layer_start, st.layer_end


def test_the_newcomer_takes_the_lost_place_and_the_plan_is_the_failure_free_one():
    ff = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)
    current = reroute(ff, {3})                       # ranks 0, 1, 2 of the old world stay
    new, lost = overlay(ff, current, [0, 1, 2, None])
    assert lost == set() and new.generation == current.generation + 1
    new.generation = ff.generation
    assert new == ff


def test_stayers_keep_their_layers_after_a_takeover():
    ff = ExecutionPlan.failure_free(8, 1, 4, 8, 1, 8)   # pipeline 4 x data 2
    current = takeover(ff, {1})                          # pipeline 0 folds its stage 1 away
    members = [*range(current.world_size), None]
    new, lost = overlay(ff, current, members)
    assert not lost
    kept = sum(stage_layers(new, i) == stage_layers(current, i) for i in range(7))
    assert kept >= 6                                 # only the one that grew has to shrink
    assert stage_layers(new, 7) == (2, 4)            # the newcomer: the lost stage's layers


def test_fewer_ranks_than_the_plan_leaves_lost_positions():
    ff = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)
    current = ExecutionPlan.failure_free(2, 1, 2, 4, 2, 16)   # a restart onto one pipeline
    new, lost = overlay(ff, current, [0, 1, None])
    assert lost == {3} and new.world_size == 4


def test_more_ranks_than_the_plan_is_an_error():
    ff = ExecutionPlan.failure_free(2, 1, 2, 4, 2, 16)
    with pytest.raises(ValueError, match="3 ranks for a plan of 2"):
        overlay(ff, ff, [0, 1, None])


def test_tensor_parallel_stayers_keep_their_shards_and_newcomers_fill_whole_groups():
    """TP 2 x PP 2 x DP 2 after the group (4 5) was lost and rerouted: the 6 stayers keep
    their stage and shard; two newcomers take the lost group's place."""
    ff = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 16)
    current = reroute(ff, {5})
    new, lost = overlay(ff, current, [0, 1, 2, 3, 4, 5, None, None])
    assert not lost and new.tensor_parallel == 2
    kept = ff.survivors({5})
    for i in range(6):
        assert stage_layers(new, i) == stage_layers(current, i)
        assert new.position(i).tp_rank == current.position(i).tp_rank
    assert new.stage_of(6).ranks == [6, 7] and stage_layers(new, 6) == stage_layers(ff, 4)
    assert kept == [0, 1, 2, 3, 6, 7]


def test_an_odd_rank_count_leaves_whole_groups_over_but_one():
    """7 ranks for 4 groups of 2: the stayers' two groups, one newcomer group, and one group
    with a single rank, whose other position is handed over as lost (the planner then
    retires that rank with it)."""
    ff = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 16)
    current = ExecutionPlan.failure_free(4, 2, 2, 4, 1, 16)    # a restart onto one pipeline
    new, lost = overlay(ff, current, [0, 1, 2, 3, None, None, None])
    assert lost == {7} and new.world_size == 8
    groups = new.tp_groups()
    assert [g for g in groups if set(g) & lost] == [[6, 7]]
    assert len(new.survivors(lost)) == 6
