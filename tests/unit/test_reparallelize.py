"""Re-parallelization as a plan transform: every survivor in a pipeline of some depth, layers
balanced per pipeline, the global micro-batches split by the pipelines' speed, and the ranks of
an untouched pipeline left where they were."""

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.strategies.reparallelize import (depth_mixes, pipeline_time, ranked_mixes,
                                                     reparallelize, split_micro_batches)
from chameleon_ext.planning.strategies.reroute import reroute


def cost(layers: int, first: bool, last: bool) -> float:
    return float(layers)


def even(layers: int, depth: int) -> list[int]:
    return [layers // depth + (i < layers % depth) for i in range(depth)]


def test_depth_mixes_use_every_survivor_with_neighbouring_depths():
    for mix in depth_mixes(7, 4):
        assert sum(mix) == 7 and max(mix) - min(mix) <= 1
    assert [4, 3] in depth_mixes(7, 4) and [1] * 7 in depth_mixes(7, 4)


def test_a_slower_pipeline_gets_fewer_micro_batches():
    # a 3-stage pipeline of 8 layers (3, 3, 2) beside a 4-stage one (2 each)
    counts = split_micro_batches([[3, 3, 2], [2, 2, 2, 2]], 32, cost)
    assert sum(counts) == 32 and counts[0] < counts[1]
    times = [pipeline_time(lay, c, cost) for lay, c in zip([[3, 3, 2], [2, 2, 2, 2]], counts)]
    assert max(times) - min(times) <= 3.0  # one more micro-batch through the slowest stage


def test_pp4_dp2_losing_a_middle_stage_keeps_the_untouched_pipeline():
    plan = ExecutionPlan.failure_free(8, 1, 4, 8, 1, 32)
    lost = plan.pipelines[1].stages[2].ranks[0]
    new = reparallelize(plan, {lost}, cost, even, mix=[4, 3])
    assert new.world_size == 7 and new.generation == 1
    survivors = [r for r in plan.ranks if r != lost]
    kept = [survivors.index(st.ranks[0]) for st in plan.pipelines[0].stages]
    assert [st.ranks[0] for st in new.pipelines[0].stages] == kept
    assert [(st.layer_start, st.layer_end) for st in new.pipelines[1].stages] == \
        [(0, 3), (3, 6), (6, 8)]
    assert sorted(mb for p in new.pipelines for mb in p.micro_batches) == list(range(32))
    assert len(new.pipelines[1].micro_batches) < len(new.pipelines[0].micro_batches)
    best = ranked_mixes(plan, 7, cost, even)[0]
    assert sum(best) == 7 and reparallelize(plan, {lost}, cost, even).world_size == 7


def test_a_rerouted_plan_re_parallelizes_over_every_survivor():
    """PP 2 x DP 4 rerouted after losing pipeline 0's first stage, then pipeline 1's: the two
    pipelines with a hole give their surviving last stages to the pool, the two untouched
    pipelines keep their ranks and layers, and every stage of the new plan has ranks."""
    plan = reroute(ExecutionPlan.failure_free(8, 1, 2, 8, 1, 32), {0})
    lost = plan.pipelines[1].stages[0].ranks[0]
    new = reparallelize(plan, {lost}, cost, even, mix=[2, 2, 2])
    survivors = [r for r in plan.ranks if r != lost]
    assert not new.rerouted and new.world_size == 6 == len(survivors)
    assert sorted(mb for p in new.pipelines for mb in p.micro_batches) == list(range(32))
    for old in plan.pipelines[2:]:
        kept = [survivors.index(st.ranks[0]) for st in old.stages]
        assert kept in [[st.ranks[0] for st in p.stages] for p in new.pipelines]
    pooled = [survivors.index(p.stages[1].ranks[0]) for p in plan.pipelines[:2]]
    assert pooled in [[st.ranks[0] for st in p.stages] for p in new.pipelines]


def test_tensor_parallel_groups_are_the_units():
    """TP 2 x PP 4 x DP 2 losing one shard of pipeline 1's stage 2: its sibling leaves with it
    and the 7 surviving groups form pipelines of 4 and 3 stages, each stage a whole old group."""
    plan = ExecutionPlan.failure_free(16, 2, 4, 8, 1, 32)
    lost = plan.pipelines[1].stages[2].ranks[1]
    new = reparallelize(plan, {lost}, cost, even, mix=[4, 3])
    kept = plan.survivors({lost})
    assert new.tensor_parallel == 2 and new.world_size == 14 == len(kept)
    old_groups = {tuple(kept.index(r) for r in g) for g in plan.surviving_groups({lost})}
    assert {tuple(st.ranks) for p in new.pipelines for st in p.stages} == old_groups
    assert [st.ranks for st in new.pipelines[0].stages] == \
        [[kept.index(r) for r in st.ranks] for st in plan.pipelines[0].stages]
    assert sorted(len(p.stages) for p in new.pipelines) == [3, 4]


def one_by_one(layouts: list[list[int]], total: int, stage_cost) -> list[int]:
    """split_micro_batches' rule, literally: each micro-batch after the first of every
    pipeline goes to the pipeline that would finish it first, the lower index on a tie."""
    counts = [1] * len(layouts)
    for _ in range(total - len(layouts)):
        finish = [pipeline_time(lay, c + 1, stage_cost) for lay, c in zip(layouts, counts)]
        counts[finish.index(min(finish))] += 1
    return counts


def test_the_split_level_by_level_is_the_split_micro_batch_by_micro_batch():
    import random
    rng = random.Random(7)
    for _ in range(300):
        layouts = [[rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
                   for _ in range(rng.randint(1, 9))]
        total = len(layouts) + rng.randint(0, 40)
        weight = rng.choice([0.0, 0.25, 1.0])

        def stage_cost(n: int, first: bool, last: bool) -> float:
            return weight * (n + 0.5 * first + 0.75 * last)
        assert split_micro_batches(layouts, total, stage_cost) == \
            one_by_one(layouts, total, stage_cost)
