"""Restart plans: the homogeneous plan over the survivors that keeps the global batch."""

import pytest

from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.strategies.restart import restart_plan


def shape(plan: ExecutionPlan) -> tuple[int, int, list[int]]:
    stages = plan.pipelines[0].stages
    return len(stages), len(plan.pipelines), [s.num_layers for s in stages]


@pytest.mark.parametrize("survivors, expect", [(3, (3, 1, [1, 2, 1])), (2, (2, 1, [2, 2])),
                                               (1, (1, 1, [4]))])
def test_pipeline_4_shrinks_to_the_survivors(survivors, expect):
    plan = ExecutionPlan.failure_free(4, 1, 4, 4, 2, 16)
    new = restart_plan(plan, survivors)
    assert shape(new) == expect
    assert new.global_batch_size == 16 and new.generation == 1
    assert new.ranks == list(range(survivors))


def test_keeps_the_depth_when_it_can_and_leaves_ranks_idle_when_it_must():
    plan = ExecutionPlan.failure_free(6, 1, 2, 4, 1, 12)  # pipeline 2 x data 3
    new = restart_plan(plan, 5)
    assert shape(new) == (2, 2, [2, 2]) and new.world_size == 4
    # 8 micro-batches cannot split over 3 pipelines: 2 of 3 survivors are used
    two_layer = ExecutionPlan.failure_free(4, 1, 2, 2, 2, 16)
    assert shape(restart_plan(two_layer, 3)) == (2, 1, [1, 1])


def test_tensor_parallel_needs_whole_groups():
    plan = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 8)
    assert restart_plan(plan, 1) is None
    new = restart_plan(plan, 7)
    assert new.tensor_parallel == 2 and new.world_size == 6
