"""Stage takeover as a plan transform: the failed pipeline runs one stage fewer, its neighbour
holding the lost layers; the other pipelines and every micro-batch assignment are unchanged."""

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.strategies.reroute import reroute
from chameleon_ext.planning.strategies.takeover import takeover


def layers(plan: ExecutionPlan) -> list[list[tuple[int, int, list[int]]]]:
    return [[(st.layer_start, st.layer_end, st.ranks) for st in p.stages] for p in plan.pipelines]


def test_the_last_stage_is_absorbed_by_its_predecessor():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)  # pipeline 2 x data 2
    new = takeover(plan, {plan.pipelines[1].stages[1].ranks[0]})
    assert new.world_size == 3 and new.generation == 1
    assert layers(new)[1] == [(0, 4, [plan.pipelines[1].stages[0].ranks[0]])]
    assert layers(new)[0] == layers(plan)[0]
    assert [p.micro_batches for p in new.pipelines] == [p.micro_batches for p in plan.pipelines]


def test_a_middle_stage_goes_to_the_neighbour_that_ends_up_cheaper():
    plan = ExecutionPlan.failure_free(4, 1, 4, 8, 1, 8)  # one pipeline of 4 stages, 2 layers each
    lost = plan.pipelines[0].stages[1].ranks[0]
    # default cost: layers; a costly last stage makes the second neighbour the dearer one
    new = takeover(plan, {lost}, stage_cost=lambda n, first, last: n + 10 * first)
    assert [(a, b) for a, b, _ in layers(new)[0]] == [(0, 2), (2, 6), (6, 8)]
    new = takeover(plan, {lost})
    assert [(a, b) for a, b, _ in layers(new)[0]] == [(0, 4), (4, 6), (6, 8)]


def test_two_adjacent_lost_stages_fold_into_the_survivors():
    plan = ExecutionPlan.failure_free(4, 1, 4, 8, 1, 8)
    new = takeover(plan, {plan.pipelines[0].stages[1].ranks[0],
                          plan.pipelines[0].stages[2].ranks[0]})
    assert [(a, b) for a, b, _ in layers(new)[0]] in ([(0, 6), (6, 8)], [(0, 4), (4, 8)])
    assert new.world_size == 2


def test_no_takeover_when_a_pipeline_loses_every_stage_or_from_a_rerouted_plan():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)
    assert takeover(plan, set(plan.pipelines[0].stages[0].ranks + plan.pipelines[0].stages[1].ranks)) is None
    rerouted = reroute(plan, {3})
    assert takeover(rerouted, {0}) is None


def test_a_neighbouring_group_takes_over_a_lost_shards_stage():
    """TP 4 x PP 4 x DP 2 losing one shard of pipeline 0's stage 2: that pipeline's stage 1
    or 3 group takes its layers shard by shard; the lost group's 3 healthy ranks leave."""
    plan = ExecutionPlan.failure_free(32, 4, 4, 8, 1, 8)
    lost = plan.pipelines[0].stages[2].ranks[1]
    new = takeover(plan, {lost})
    assert new.world_size == 28 and new.tensor_parallel == 4
    kept = plan.survivors({lost})
    host = next(st for st in new.pipelines[0].stages if st.num_layers == 4)
    assert [kept[r] for r in host.ranks] in (plan.pipelines[0].stages[1].ranks,
                                             plan.pipelines[0].stages[3].ranks)
    assert [[kept[r] for r in st.ranks] for st in new.pipelines[1].stages] == \
        [st.ranks for st in plan.pipelines[1].stages]
