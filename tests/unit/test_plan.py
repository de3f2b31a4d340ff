"""ExecutionPlan: Megatron's failure-free layout, validation messages, JSON round-trip."""

from __future__ import annotations

import json
import re

import pytest

from chameleon_ext.plan.execution_plan import (ExecutionPlan, Pipeline, PlanError, RankPosition,
                                              Stage, stage_bounds)


def _layout(plan: ExecutionPlan) -> list[list[list[int]]]:
    return [[st.ranks for st in p.stages] for p in plan.pipelines]


def _two_pipelines(**overrides) -> ExecutionPlan:
    """2 pipelines x 2 stages, tp 1, 4 layers, 4 micro-batches; fields replaced by `overrides`."""
    fields = dict(
        num_layers=4, tensor_parallel=1, micro_batch_size=2, num_micro_batches=4,
        pipelines=[Pipeline([Stage(0, 2, [0]), Stage(2, 4, [2])], [0, 1]),
                   Pipeline([Stage(0, 2, [1]), Stage(2, 4, [3])], [2, 3])])
    fields.update(overrides)
    return ExecutionPlan(**fields)


# ---- failure-free layout -----------------------------------------------------------------------
def test_failure_free_tp1_pp2_megatron_rank_order():
    plan = ExecutionPlan.failure_free(8, 1, 2, num_layers=4, micro_batch_size=1,
                                      global_batch_size=8)
    # dp = 4: pipeline d holds ranks d (stage 0) and d + 4 (stage 1).
    assert _layout(plan) == [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]
    assert [(st.layer_start, st.layer_end) for st in plan.pipelines[0].stages] == [(0, 2), (2, 4)]
    assert [p.micro_batches for p in plan.pipelines] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.num_micro_batches == 8 and plan.global_batch_size == 8
    assert plan.world_size == 8 and plan.ranks == list(range(8))


def test_failure_free_tp2_pp2_groups_match_megatron():
    plan = ExecutionPlan.failure_free(8, 2, 2, num_layers=4, micro_batch_size=1,
                                      global_batch_size=4)
    # Megatron: tp groups [0,1] [2,3] [4,5] [6,7]; pp groups [0,4] [1,5] [2,6] [3,7];
    # dp groups [0,2] [1,3] [4,6] [5,7].
    assert _layout(plan) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert plan.position(5) == RankPosition(pipeline=0, stage=1, tp_rank=1)
    assert plan.next_rank(1) == 5 and plan.prev_rank(5) == 1
    assert plan.next_rank(5) is None and plan.prev_rank(1) is None
    assert plan.is_first_stage(2) and not plan.is_last_stage(2) and plan.is_last_stage(6)
    assert plan.replicas(0) == [0, 2] and plan.replicas(5) == [5, 7]
    assert plan.stage_of(6).layer_start == 2 and plan.pipeline_of(6) is plan.pipelines[1]


def test_failure_free_with_megatrons_uneven_first_and_last_stages():
    """--decoder-first/last-pipeline-num-layers: those stages hold that many layers, the
    stages between split the rest evenly; anything else is a one-line PlanError."""
    plan = ExecutionPlan.failure_free(8, 1, 4, num_layers=10, micro_batch_size=1,
                                      global_batch_size=2, first_stage_layers=1,
                                      last_stage_layers=3)
    assert [[(st.layer_start, st.layer_end) for st in p.stages] for p in plan.pipelines] == \
        [[(0, 1), (1, 4), (4, 7), (7, 10)]] * 2
    assert _layout(plan) == _layout(ExecutionPlan.failure_free(8, 1, 4, 8, 1, 2))
    assert stage_bounds(6, 2, last=4) == [0, 2, 6]
    assert stage_bounds(8, 4, 1, 1) == [0, 1, 4, 7, 8]
    for args, message in [((4, 2, 4), "4 layers do not fill 2 stages with 4 on the first stage"),
                          ((9, 4, 1, 1), "the other 2 stage(s) cannot split the 7 layers"),
                          ((8, 1, 8), "need a pipeline of at least 2 stages"),
                          ((8, 2, 0), "must be at least 1"),
                          ((7, 2), "number of layers 7 is not divisible by pipeline parallel")]:
        with pytest.raises(PlanError, match=re.escape(message)):
            stage_bounds(*args)


def test_position_of_unknown_rank():
    plan = ExecutionPlan.failure_free(2, 1, 1, 2, 1, 2)
    with pytest.raises(PlanError, match="rank 7 has no place in the plan"):
        plan.position(7)


# ---- validation --------------------------------------------------------------------------------
def test_world_not_divisible_by_tp_times_pp():
    with pytest.raises(PlanError, match=r"world size 6 is not divisible by tensor parallel size 2"
                                        r" x pipeline parallel size 2"):
        ExecutionPlan.failure_free(6, 2, 2, 4, 1, 8)


def test_global_batch_not_divisible_by_mbs_times_dp():
    with pytest.raises(PlanError, match=r"global batch size 6 is not divisible by micro batch "
                                        r"size 2 x data parallel size 2"):
        ExecutionPlan.failure_free(4, 1, 2, 4, 2, 6)


def test_layers_not_divisible_by_pp():
    with pytest.raises(PlanError, match="number of layers 5 is not divisible"):
        ExecutionPlan.failure_free(4, 1, 2, 5, 1, 4)


@pytest.mark.parametrize("world, mbs", [(0, 1), (4, 0)])
def test_zero_world_or_micro_batch_size_is_a_plan_error(world, mbs):
    with pytest.raises(PlanError, match="must be at least 1"):
        ExecutionPlan.failure_free(world, 1, 2, 4, mbs, 4)


def test_valid_hand_written_plan_passes():
    _two_pipelines().validate()


def test_overlapping_ranks():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0]), Stage(2, 4, [2])], [0, 1]),
        Pipeline([Stage(0, 2, [2]), Stage(2, 4, [3])], [2, 3])])
    with pytest.raises(PlanError, match="rank 2 appears in pipeline 0 stage 1 and pipeline 1 "
                                        "stage 0"):
        plan.validate()


def test_gap_in_layers():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0]), Stage(3, 4, [2])], [0, 1]),
        Pipeline([Stage(0, 2, [1]), Stage(2, 4, [3])], [2, 3])])
    with pytest.raises(PlanError, match="pipeline 0 stage 1 starts at layer 3, expected 2"):
        plan.validate()


def test_layers_short_of_the_model():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0]), Stage(2, 3, [2])], [0, 1]),
        Pipeline([Stage(0, 2, [1]), Stage(2, 4, [3])], [2, 3])])
    with pytest.raises(PlanError, match=r"pipeline 0 covers layers \[0, 3\), the model has 4"):
        plan.validate()


def test_wrong_number_of_tp_ranks():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0, 5]), Stage(2, 4, [2])], [0, 1]),
        Pipeline([Stage(0, 2, [1]), Stage(2, 4, [3])], [2, 3])])
    with pytest.raises(PlanError,
                       match="pipeline 0 stage 0 has 2 ranks, tensor parallel size is 1"):
        plan.validate()


def test_micro_batch_owned_twice():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0]), Stage(2, 4, [2])], [0, 1, 2]),
        Pipeline([Stage(0, 2, [1]), Stage(2, 4, [3])], [2, 3])])
    with pytest.raises(PlanError, match="micro-batch 2 is owned by pipelines 0 and 1"):
        plan.validate()


def test_micro_batch_owned_by_none():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0]), Stage(2, 4, [2])], [0]),
        Pipeline([Stage(0, 2, [1]), Stage(2, 4, [3])], [3])])
    with pytest.raises(PlanError, match=r"micro-batches \[1, 2\] are owned by no pipeline"):
        plan.validate()


def test_micro_batch_out_of_range():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0]), Stage(2, 4, [2])], [0, 1]),
        Pipeline([Stage(0, 2, [1]), Stage(2, 4, [3])], [2, 3, 4])])
    with pytest.raises(PlanError, match=r"pipeline 1 owns micro-batch 4, outside \[0, 4\)"):
        plan.validate()


# ---- JSON --------------------------------------------------------------------------------------
def test_json_round_trip_equality():
    plan = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 4)
    plan.generation = 3
    text = plan.to_json()
    back = ExecutionPlan.from_json(text)
    assert back == plan
    assert back.generation == 3
    assert back.to_json() == text
    assert _layout(back) == _layout(plan) and back.replicas(1) == [1, 3]


def test_json_round_trip_of_heterogeneous_plan(tmp_path):
    plan = ExecutionPlan(num_layers=6, tensor_parallel=1, micro_batch_size=1, num_micro_batches=5,
                         pipelines=[Pipeline([Stage(0, 2, [0]), Stage(2, 6, [1])], [0, 2, 4]),
                                    Pipeline([Stage(0, 3, [2]), Stage(3, 5, [3]),
                                              Stage(5, 6, [4])], [1, 3])],
                         generation=1)
    plan.validate()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert ExecutionPlan.load(path) == plan
    assert not (tmp_path / "plan.json.tmp").exists()


def test_plans_differ_when_layout_differs():
    a = ExecutionPlan.failure_free(4, 1, 2, 4, 1, 4)
    b = ExecutionPlan.failure_free(4, 1, 1, 4, 1, 4)
    assert a != b
    assert ExecutionPlan.from_json(a.to_json()) != b


@pytest.mark.parametrize("text, message", [
    ("this is not json", "not valid JSON"),
    ("[1, 2, 3]", "must be an object"),
    ("null", "must be an object"),
    ('{"num_layers": 4}', "malformed plan: KeyError"),
    ('{"num_layers": "four", "tensor_parallel": 1, "micro_batch_size": 1, '
     '"num_micro_batches": 1, "pipelines": []}', "malformed plan: ValueError"),
    ('{"num_layers": Infinity, "tensor_parallel": 1, "micro_batch_size": 1, '
     '"num_micro_batches": 1, "pipelines": []}', "malformed plan: OverflowError"),
    ('{"num_layers": 2, "tensor_parallel": 1, "micro_batch_size": 1, "num_micro_batches": 1, '
     '"pipelines": 7}', "malformed plan: TypeError"),
    ('{"num_layers": 2, "tensor_parallel": 1, "micro_batch_size": 1, "num_micro_batches": 1, '
     '"pipelines": [{"stages": [{"layer_start": 0, "layer_end": 2, "ranks": ["a"]}], '
     '"micro_batches": [0]}]}', "invalid rank 'a'"),
    ('{"num_layers": 2, "tensor_parallel": 1, "micro_batch_size": 1, "num_micro_batches": 1, '
     '"pipelines": []}', "plan has no pipelines"),
])
def test_from_json_of_garbage_raises_plan_error(text, message):
    with pytest.raises(PlanError, match=message):
        ExecutionPlan.from_json(text)


def test_load_missing_file(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan file"):
        ExecutionPlan.load(tmp_path / "nope.json")


def test_to_dict_is_plain_json():
    d = ExecutionPlan.failure_free(2, 1, 2, 2, 1, 1).to_dict()
    assert "_positions" not in d
    assert json.loads(json.dumps(d)) == d
    assert d["pipelines"][0]["stages"][1] == {"layer_start": 1, "layer_end": 2, "ranks": [1]}


def test_misaligned_stages_are_found():
    def plan(splits):
        pipes = []
        r = 0
        for i, cuts in enumerate(splits):
            stages = []
            for a, b in zip(cuts, cuts[1:]):
                stages.append(Stage(a, b, [r]))
                r += 1
            pipes.append(Pipeline(stages, [i]))
        return ExecutionPlan(4, 1, 1, len(splits), pipes)

    assert plan([[0, 2, 4], [0, 2, 4]]).misaligned_stages() is None
    assert plan([[0, 1, 4], [0, 1, 4]]).misaligned_stages() is None
    a, b = plan([[0, 2, 4], [0, 1, 4]]).misaligned_stages()
    assert (a.layer_start, a.layer_end, b.layer_start, b.layer_end) == (0, 1, 0, 2)


def test_segments_of_aligned_plan_are_its_stages():
    plan = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 4)
    assert plan.segments() == [(0, 2), (2, 4)]
    assert plan.segment_ranks(0, 2, 1) == plan.replicas(1) == [1, 3]
    assert plan.first_stage_ranks(0) == [0, 2] and plan.last_stage_ranks(1) == [5, 7]


def test_segments_of_misaligned_plan_cut_at_every_boundary():
    plan = ExecutionPlan(4, 1, 1, 2, [Pipeline([Stage(0, 1, [0]), Stage(1, 4, [1])], [0]),
                                      Pipeline([Stage(0, 3, [2]), Stage(3, 4, [3])], [1])])
    plan.validate()
    assert plan.segments() == [(0, 1), (1, 3), (3, 4)]
    assert [plan.segment_ranks(a, b, 0) for a, b in plan.segments()] == [[0, 2], [1, 2], [1, 3]]
    assert plan.first_stage_ranks(0) == [0, 2] and plan.last_stage_ranks(0) == [1, 3]
    one = ExecutionPlan(4, 1, 1, 2, [Pipeline([Stage(0, 2, [0]), Stage(2, 4, [1])], [0]),
                                     Pipeline([Stage(0, 4, [2])], [1])])
    assert one.segments() == [(0, 2), (2, 4)]
    assert one.segment_ranks(2, 4, 0) == [1, 2]
    assert one.first_stage_ranks(0) == [0, 2] and one.last_stage_ranks(0) == [1, 2]


def test_segment_ranks_leave_out_a_stage_without_ranks():
    plan = _two_pipelines(pipelines=[
        Pipeline([Stage(0, 2, [0]), Stage(2, 4, [2])], [0, 1]),
        Pipeline([Stage(0, 2, [1]), Stage(2, 4, [], hosts={2: [2], 3: [2]})], [2, 3])])
    plan.validate()
    assert plan.segments() == [(0, 2), (2, 4)]
    assert plan.segment_ranks(2, 4, 0) == [2] and plan.last_stage_ranks(0) == [2]


def test_survivors_are_the_groups_without_a_lost_rank():
    plan = ExecutionPlan.failure_free(8, 2, 2, 4, 1, 8)  # groups (0 1) (2 3) (4 5) (6 7)
    assert plan.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.surviving_groups({2, 7}) == [[0, 1], [4, 5]]
    assert plan.survivors({2, 7}) == [0, 1, 4, 5]
    assert plan.survivors({3}, size=4) == [0, 1, 4, 5]  # the first two groups that survive
    assert plan.survivors(set(plan.ranks)) == []


def test_relabelled_and_renumbered_plans_are_new_and_valid():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 1, 8)
    swapped = plan.relabelled({0: 1, 1: 0, 2: 2, 3: 3})
    assert swapped.position(1) == plan.position(0) and swapped.generation == plan.generation
    assert plan.stage_of(0).ranks == [0]  # the original is untouched
    gaps = plan.relabelled({0: 0, 1: 5, 2: 7, 3: 9})
    dense = gaps.renumbered()
    assert dense.ranks == [0, 1, 2, 3] and dense.generation == plan.generation + 1
    assert [st.ranks for p in dense.pipelines for st in p.stages] == [[0], [2], [1], [3]]
    with pytest.raises(PlanError, match="rank 0 appears"):
        plan.relabelled({0: 0, 1: 0, 2: 2, 3: 3})


def test_an_interleaved_plan_gives_each_rank_its_chunks():
    """Megatron-LM's virtual pipeline stages: 2 x 2 stages of 2 layers per pipeline, stage k
    on the ranks of position k mod 2; the JSON round-trips."""
    plan = ExecutionPlan.failure_free(4, 1, 2, 8, 1, 4, virtual_stages=2)
    assert plan.interleaved and plan.world_size == 4
    assert [(st.layer_start, st.ranks) for st in plan.pipelines[0].stages] == \
        [(0, [0]), (2, [2]), (4, [0]), (6, [2])]
    assert plan.chunks(0) == [0, 2] and plan.chunks(3) == [1, 3]
    assert plan.is_first_stage(0) and not plan.is_last_stage(0)
    assert plan.is_last_stage(2) and not plan.is_first_stage(2)
    assert plan.next_rank(0, 2) == 2 and plan.prev_rank(0, 2) == 2 and plan.next_rank(2, 3) \
        is None
    assert plan.replicas(0) == [0, 1] and plan.tp_groups() == [[0], [1], [2], [3]]
    assert ExecutionPlan.from_json(plan.to_json()).chunks(2) == [1, 3]
    assert not ExecutionPlan.failure_free(4, 1, 2, 8, 1, 4).interleaved


@pytest.mark.parametrize("stages, message", [
    ([[0], [0], [1], [1]], "rank 0 appears in pipeline 0 stage 0 and pipeline 0 stage 1"),
    ([[0], [1], [2], [0]], None),
])
def test_a_rank_holds_several_stages_of_one_pipeline_only_apart(stages, message):
    plan = {"num_layers": 4, "tensor_parallel": 1, "micro_batch_size": 1,
            "num_micro_batches": 2, "pipelines": [{"stages": [
                {"layer_start": i, "layer_end": i + 1, "ranks": r}
                for i, r in enumerate(stages)], "micro_batches": [0, 1]}]}
    if message is None:
        assert ExecutionPlan.from_dict(plan).chunks(0) == [0, 3]
        return
    with pytest.raises(PlanError, match=message):
        ExecutionPlan.from_dict(plan)


def test_an_interleaved_plan_needs_an_even_split_over_two_stages_or_more():
    with pytest.raises(PlanError, match="interleaved pipeline needs at least 2 stages"):
        ExecutionPlan.failure_free(2, 1, 1, 4, 1, 2, virtual_stages=2)
    with pytest.raises(PlanError, match="interleaved pipeline needs at least 2 stages"):
        ExecutionPlan.failure_free(4, 1, 2, 8, 1, 4, first_stage_layers=1, virtual_stages=2)
