"""Restart plans: the homogeneous plan over the survivors that keeps the global batch, made of
whole tensor-parallel groups."""

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.strategies.restart import homogeneous, restart_plan


def shape(plan: ExecutionPlan) -> tuple[int, int, list[int]]:
    stages = plan.pipelines[0].stages
    return len(stages), len(plan.pipelines), [s.num_layers for s in stages]


@pytest.mark.parametrize("lost, expect", [({3}, (3, 1, [1, 2, 1])), ({0, 2}, (2, 1, [2, 2])),
                                          ({0, 1, 3}, (1, 1, [4]))])
def test_pipeline_4_shrinks_to_the_survivors(lost, expect):
    plan = ExecutionPlan.failure_free(4, 1, 4, 4, 2, 16)
    new = restart_plan(plan, lost)
    assert shape(new) == expect
    assert new.global_batch_size == 16 and new.generation == 1
    assert new.ranks == list(range(4 - len(lost)))


def test_keeps_the_depth_when_it_can_and_leaves_ranks_idle_when_it_must():
    plan = ExecutionPlan.failure_free(6, 1, 2, 4, 1, 12)  # pipeline 2 x data 3
    new = restart_plan(plan, {5})
    assert shape(new) == (2, 2, [2, 2]) and new.world_size == 4
    # 8 micro-batches cannot split over 3 pipelines: 2 of 3 survivors are used
    two_layer = ExecutionPlan.failure_free(4, 1, 2, 2, 2, 16)
    assert shape(restart_plan(two_layer, {3})) == (2, 1, [1, 1])


def test_tensor_parallel_needs_whole_groups():
    plan = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 8)  # groups (0 1) (2 3) (4 5) (6 7)
    assert restart_plan(plan, {0, 2, 4, 6}) is None       # a rank of every group lost
    new = restart_plan(plan, {5})
    assert new.tensor_parallel == 2 and new.world_size == 6
    # the new groups are the old ones that survive, whole: (0 1) (2 3) (6 7) renumbered
    assert sorted(plan.survivors({5})) == [0, 1, 2, 3, 6, 7]
    assert sorted(tuple(st.ranks) for p in new.pipelines for st in p.stages) == \
        [(0, 1), (2, 3), (4, 5)]


def test_groups_that_are_not_consecutive_ranks_stay_whole():
    """After a rejoin a group's ranks need not be consecutive: the restart keeps each group
    together and numbers the ranks it uses densely in their old order."""
    plan = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 8).relabelled(
        {0: 0, 1: 2, 2: 1, 3: 3, 4: 4, 5: 6, 6: 5, 7: 7})  # groups (0 2) (1 3) (4 6) (5 7)
    new = homogeneous(plan, 1, 2, lost={5})                # the first two surviving groups
    assert plan.survivors({5}, new.world_size) == [0, 1, 2, 3]
    assert [p.stages[0].ranks for p in new.pipelines] == [[0, 2], [1, 3]]
