"""Pipelines that split the layers at different points (misaligned stages, as after a stage
takeover or an Oobleck-style re-parallelization) give the losses of one process, and every copy
of every parameter (layer segments held by several ranks, the embeddings, the tied output
weight's copies) stays bit-identical: gradients are summed per segment of layers
(megatron.elastic.grad_reduction)."""

import json
import re

import pytest
import torch

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from megatron.elastic import grad_reduction, parallel_state
from megatron.elastic.parallel_state import ReductionGroup
from tests.launch import SMALL_MODEL, assert_close, run_chameleon, reference_run, run_job

ITERS = 4


def common(data: str) -> list[str]:
    return SMALL_MODEL + ["--global-batch-size", "16", "--train-iters", str(ITERS),
                          "--lr-decay-iters", str(ITERS), "--lr", "3e-3", "--lr-warmup-iters", "0",
                          "--clip-grad", "1.0", "--data-path", data, "--split", "100,0,0",
                          "--log-interval", "1"]


def plan_file(path, pipelines: list[tuple[list[tuple[int, int, int]], list[int]]]):
    """pipelines: ([(layer_start, layer_end, rank), ...], micro-batches) each."""
    plan = {"num_layers": 4, "tensor_parallel": 1, "micro_batch_size": 2, "num_micro_batches": 8,
            "pipelines": [{"stages": [{"layer_start": a, "layer_end": b, "ranks": [r]}
                                      for a, b, r in stages], "micro_batches": mbs}
                          for stages, mbs in pipelines]}
    path.write_text(json.dumps(plan))
    return path


# Pipeline 0 in two stages beside pipeline 1 in one; and two pipelines cut at 1 and at 3.
PLANS = {
    "two-stages-and-one": (3, [([(0, 2, 0), (2, 4, 1)], [0, 1, 2, 3, 4]),
                               ([(0, 4, 2)], [5, 6, 7])]),
    "cut-at-1-and-3": (4, [([(0, 1, 0), (1, 4, 1)], [0, 1, 2, 3, 4, 5]),
                           ([(0, 3, 2), (3, 4, 3)], [6, 7])]),
}


def grad_norms(run) -> list[float]:
    return [float(x) for x in re.findall(r"grad norm: ([0-9.]+)", run.stdout)]


def assert_same_grad_norms(run, single) -> None:
    """Each parameter counts once in the world's gradient norm (the shared flags)."""
    mine, ref = grad_norms(run), grad_norms(single)
    assert len(mine) == len(ref) == ITERS, (mine, ref)
    assert all(abs(a - b) <= 1.5e-3 for a, b in zip(mine, ref)), (mine, ref)


@pytest.fixture(scope="module")
def single(small_data, tmp_path_factory):
    return reference_run(1, common(small_data), tmp_path_factory.mktemp("single"), ITERS, "single")


# The distributed optimizer on a misaligned plan (as a takeover leaves one): each rank is its
# own replica group, so it holds its state whole and the segments' sums reach its shard.
CASES = [(name, []) for name in PLANS] + [("cut-at-1-and-3", ["--use-distributed-optimizer"])]


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", CASES,
                         ids=[name + "".join(extra) for name, extra in CASES])
def test_misaligned_plan_matches_single_process_and_keeps_copies_identical(
        single, small_data, tmp_path, name, extra):
    world, pipelines = PLANS[name]
    path = plan_file(tmp_path / "plan.json", pipelines)
    # chameleon-launch with --chameleon: the job ends by comparing every parameter's digest
    # over all ranks (its "replicas" event).
    run = run_chameleon(world, common(small_data) + ["--chameleon-plan", str(path),
                                                     "--chameleon", *extra], tmp_path, name=name)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), single.losses())
    assert_same_grad_norms(run, single)
    replicas = [e for e in run.metrics if e["event"] == "replicas"]
    assert len(replicas) == 1 and replicas[0]["identical"], replicas
    # 4 layers x 12 + embeddings (2) + final norm (2): the tied output copies share the
    # word embedding's name, so they are compared with it.
    assert replicas[0]["parameters"] == 4 * 12 + 4, replicas


@pytest.mark.slow
def test_misaligned_plan_under_torchrun(single, small_data, tmp_path):
    """The same without --chameleon (plain torchrun, no recovery machinery)."""
    world, pipelines = PLANS["two-stages-and-one"]
    path = plan_file(tmp_path / "plan.json", pipelines)
    run = run_job(world, common(small_data) + ["--chameleon-plan", str(path)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), single.losses())
    assert_same_grad_norms(run, single)


# ---- without processes: the groups, the parameters' groups and norm flags, the drain rule ------
def _plan(pipelines: list[list[tuple[int, int, list[int]]]], tp: int = 1) -> ExecutionPlan:
    plan = ExecutionPlan(4, tp, 1, len(pipelines),
                         [Pipeline([Stage(a, b, ranks) for a, b, ranks in p], [i])
                          for i, p in enumerate(pipelines)])
    plan.validate()
    return plan


TWO_AND_ONE = [[(0, 2, [0]), (2, 4, [1])], [(0, 4, [2])]]
CUT_1_AND_3 = [[(0, 1, [0]), (1, 4, [1])], [(0, 3, [2]), (3, 4, [3])]]


def test_reduction_groups_in_global_order():
    assert parallel_state.reduction_groups(_plan(TWO_AND_ONE), 0) == [
        ReductionGroup((0, 2), (("layers", 0, 2), ("embedding",))),
        ReductionGroup((1, 2), (("layers", 2, 4), ("final_norm",))),
        ReductionGroup((0, 1, 2), (("tied",),))]
    assert parallel_state.reduction_groups(_plan(CUT_1_AND_3), 0) == [
        ReductionGroup((0, 2), (("layers", 0, 1), ("embedding",))),
        ReductionGroup((1, 2), (("layers", 1, 3),)),
        ReductionGroup((1, 3), (("layers", 3, 4), ("final_norm",))),
        ReductionGroup((0, 1, 2, 3), (("tied",),))]


def test_reduction_groups_beside_whole_stage_replicas_and_per_tensor_parallel_shard():
    # Two pipelines cut at 2 and one in a single stage, tensor parallel 2.
    plan = _plan([[(0, 2, [0, 1]), (2, 4, [2, 3])], [(0, 2, [4, 5]), (2, 4, [6, 7])],
                  [(0, 4, [8, 9])]], tp=2)
    for t in (0, 1):
        assert parallel_state.reduction_groups(plan, t) == [
            ReductionGroup((t, 4 + t, 8 + t), (("layers", 0, 2), ("embedding",))),
            ReductionGroup((2 + t, 6 + t, 8 + t), (("layers", 2, 4), ("final_norm",))),
            ReductionGroup(tuple(sorted({t, 4 + t, 8 + t, 2 + t, 6 + t})), (("tied",),))]


def test_misaligned_layout_gives_ddp_this_rank_alone_and_no_megatron_embedding_group():
    plan = _plan(TWO_AND_ONE)
    for r in plan.ranks:
        lay = parallel_state._layout(plan, r)
        assert lay["dp"] == [r] and lay["tp_dp"] == [r] and lay["embd"] == []
    groups = parallel_state._group_rank_lists(plan)
    assert len(groups) == len(set(groups))
    assert {(0, 2), (1, 2), (0, 1, 2)} <= set(groups)


def test_aligned_layout_is_unchanged():
    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 1, 4)
    assert parallel_state._layout(plan, 1)["dp"] == plan.replicas(1) == [0, 1]
    assert parallel_state._layout(plan, 1)["embd"] == [1, 3]
    assert parallel_state._group_rank_lists(plan) == [
        (0,), (0, 2), (0, 1, 2, 3), (0, 1), (1,), (1, 3), (2,), (2, 3), (3,)]


# A stage model's parameters: two per layer, the embeddings, the final norm, the output layer.
def _stage_params(plan: ExecutionPlan, rank: int, tied: bool
                  ) -> list[tuple[str, torch.nn.Parameter]]:
    stage = plan.stage_of(rank)
    first, last = stage.layer_start == 0, stage.layer_end == plan.num_layers
    names = []
    if first:
        names += ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    for i in range(stage.num_layers):
        names += [f"decoder.layers.{i}.mlp.linear_fc1.weight",
                  f"decoder.layers.{i}.input_layernorm.weight"]
    if last:
        names += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
        if not first or not tied:
            names.append("output_layer.weight")
    out = []
    for n in names:
        p = torch.nn.Parameter(torch.zeros(3))
        p.main_grad = torch.zeros(3)
        out.append((n, p))
    return out


class _Module:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(self.params)


def _global(name: str, plan: ExecutionPlan, rank: int, tied: bool) -> str:
    from megatron.elastic import stage_model
    stage = plan.stage_of(rank)
    if name == "output_layer.weight" and not tied:
        return name
    return stage_model.global_name(name, stage.layer_start, stage.layer_start == 0)


def _build(plan: ExecutionPlan, tied: bool):
    out = {}
    for r in plan.ranks:
        params = _stage_params(plan, r, tied)
        specs = [(s, None) for s in parallel_state.reduction_groups(plan, 0) if r in s.ranks]
        red = grad_reduction.GradReduction.build(plan, r, _Module(params), specs, tied)
        out[r] = (params, red)
    return out


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pipelines", [TWO_AND_ONE, CUT_1_AND_3])
def test_every_parameter_counts_once_in_the_norm_and_is_reduced_with_its_holders(pipelines, tied):
    plan = _plan(pipelines)
    built = _build(plan, tied)
    counted: dict[str, int] = {}
    holders: dict[str, set[int]] = {}
    for r, (params, _) in built.items():
        for n, p in params:
            g = _global(n, plan, r, tied)
            holders.setdefault(g, set()).add(r)
            counted[g] = counted.get(g, 0) + (not p.shared)
    assert all(c == 1 for c in counted.values()), counted
    # Each step sums the same parameters (by global name, in one order) on all its members,
    # and every parameter is summed over exactly the ranks holding it.
    steps: dict[ReductionGroup, dict[int, list[str]]] = {}
    for r, (params, red) in built.items():
        name_of = {id(p): _global(n, plan, r, tied) for n, p in params}
        reduced = sorted(id(p) for s in red.steps for p in s.params)
        assert reduced == sorted(id(p) for _, p in params)  # each parameter in one step
        for s in red.steps:
            steps.setdefault(s.spec, {})[r] = [name_of[id(p)] for p in s.params]
    for spec, by_rank in steps.items():
        assert sorted(by_rank) == list(spec.ranks)
        assert len({tuple(v) for v in by_rank.values()}) == 1, (spec, by_rank)
        for name in next(iter(by_rank.values())):
            assert holders[name] == set(spec.ranks), (name, spec)


def test_drain_joins_only_the_steps_not_over_without_a_lost_member(monkeypatch):
    calls = []
    monkeypatch.setattr(grad_reduction.dist, "all_reduce",
                        lambda t, group=None: calls.append(group))

    def step(ranks, group):
        p = torch.nn.Parameter(torch.zeros(2))
        p.main_grad = torch.zeros(2)
        return grad_reduction.Step(ReductionGroup(ranks, (("layers", 0, 1),)), group, [p])

    red = grad_reduction.GradReduction([step((0, 2), "a"), step((1, 2), "b"), step((0, 1, 2), "c"),
                                        step((2, 3), "d")])
    red.run()
    assert calls == ["a", "b", "c", "d"] and red.position == 4
    calls.clear()
    red.drain({1}, resume=False)  # REDUCE_GRADS not begun: every live group
    assert calls == ["a", "d"]
    calls.clear()
    red.position = 1  # "b" failed on this rank: "a" is over
    red.drain({3}, resume=True)
    assert calls == ["c"]
