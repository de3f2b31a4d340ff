"""Candidate plans after a failure and the choice among them, on synthetic profiles."""

import dataclasses

import pytest

from chameleon_ext.perf_model import ModelShape, Profile, predict, predict_homogeneous
from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.planner import (Situation, balanced_layers, candidates, choose, replan,
                                   stage_cost_ms)
from chameleon_ext.schedule_ir import one_f_one_b
from chameleon_ext.strategies.restart import homogeneous, restart_plan
from tests.profiles import synthetic_profile

SHAPE = ModelShape(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                   micro_batch_size=1, vocab_size=512)


def synthetic(**kw) -> Profile:
    return synthetic_profile(SHAPE, **{
        "layer_fwd_ms": 1.0, "layer_bwd_input_ms": 1.0, "layer_bwd_weight_ms": 1.0,
        "p2p_alpha_ms": 0.01, "allreduce_alpha_ms": 0.01, "allreduce_ms_per_mib": 0.1,
        "detect_ms": 50.0, "rebuild_ms": 400.0, "load_ms_per_mib": 1.0, **kw})


def pp2_dp4() -> ExecutionPlan:
    return ExecutionPlan.failure_free(8, 1, 2, 8, 1, 32)


def test_reroute_when_the_checkpoint_is_old_and_the_horizon_short():
    ranked = candidates(pp2_dp4(), {7}, synthetic(), Situation(
        iteration=100, checkpoint_iteration=50, remaining_iterations=20, failure_free_ms=60.0))
    assert [c.strategy for c in ranked] == ["reroute", "restart"]
    assert choose(ranked).strategy == "reroute"


def pp4_dp2() -> ExecutionPlan:
    return ExecutionPlan.failure_free(8, 1, 4, 8, 1, 32)


def test_restart_when_the_checkpoint_is_fresh_and_the_horizon_long():
    """Pipeline 4 x data 2 losing a middle stage: its replica would do twice the work; the
    re-planned 2 x 3 layout over 6 of the 7 survivors is faster."""
    ranked = candidates(pp4_dp2(), {5}, synthetic(), Situation(
        iteration=100, checkpoint_iteration=99, remaining_iterations=100_000,
        failure_free_ms=60.0))
    best = choose(ranked)
    assert best.strategy == "restart" and best.plan.world_size == 6
    reroute = next(c for c in ranked if c.strategy == "reroute")
    assert best.iteration_ms < reroute.iteration_ms


def test_the_horizon_from_the_mtbf_decides_between_them():
    """An old checkpoint (50 iterations of lost work) pays off over a long horizon only."""
    long = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=100_000,
                     failure_free_ms=60.0)
    assert choose(candidates(pp4_dp2(), {5}, synthetic(), long)).strategy == "restart"
    short = dataclasses.replace(long, mtbf_hours=1e-4)  # 0.36 s: a few iterations
    assert choose(candidates(pp4_dp2(), {5}, synthetic(), short)).strategy == "reroute"


def test_a_plan_over_the_memory_limit_is_never_chosen():
    plan, prof = pp2_dp4(), synthetic()
    situation = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=20,
                          failure_free_ms=60.0)
    ranked = candidates(plan, {7}, prof, situation)
    reroute = next(c for c in ranked if c.strategy == "reroute")
    restart = next(c for c in ranked if c.strategy == "restart")
    assert reroute.memory_bytes > restart.memory_bytes  # hosts keep more activations in flight
    tight = dataclasses.replace(prof, device_memory_bytes=restart.memory_bytes)
    ranked = candidates(plan, {7}, tight, situation)
    assert [(c.strategy, c.feasible) for c in ranked] == [("restart", True), ("reroute", False)]
    assert choose(ranked).strategy == "restart"
    none_fits = dataclasses.replace(prof, device_memory_bytes=1)
    assert choose(candidates(plan, {7}, none_fits, situation)) is None


def test_balanced_layers_give_the_costly_last_stage_fewer_layers():
    prof = synthetic(head_fwd_ms=3.0, head_bwd_ms=3.0)  # the output layer costs 2 layers
    assert balanced_layers(8, 2, prof) == [5, 3]
    assert balanced_layers(8, 4, synthetic()) == [2, 2, 2, 2]
    def worst(sizes):
        return max(stage_cost_ms(prof, n, i == 0, i == len(sizes) - 1)
                   for i, n in enumerate(sizes))
    every = [(a, b, 8 - a - b) for a in range(1, 7) for b in range(1, 8 - a)]
    assert worst(balanced_layers(8, 3, prof)) == min(worst(s) for s in every) == 12.0


def test_homogeneous_prediction_equals_the_whole_plans():
    prof = synthetic(cores=4.0, allreduce_ms_per_mib=0.5)
    for depth, dp in ((2, 4), (4, 2), (1, 8), (8, 1)):
        plan = homogeneous(pp2_dp4(), depth, dp)
        whole = predict(plan, one_f_one_b(plan), prof)
        assert predict_homogeneous(plan, prof).iteration_ms == pytest.approx(whole.iteration_ms)
        assert predict_homogeneous(plan, prof).peak_memory_bytes == whole.peak_memory_bytes


def test_replan_finds_the_fastest_layout():
    plan, prof = pp2_dp4(), synthetic(allreduce_ms_per_mib=0.5)
    best = replan(plan, 7, prof)
    t_best = predict_homogeneous(best, prof).iteration_ms
    for depth in range(1, 9):
        for dp in range(1, 7 // depth + 1):
            if 32 % dp == 0:
                assert t_best <= predict_homogeneous(homogeneous(plan, depth, dp),
                                                     prof).iteration_ms + 1e-9
    assert t_best <= predict_homogeneous(restart_plan(plan, 7), prof).iteration_ms
    assert replan(plan, 0, prof) is None


def test_chameleon_plan_prints_the_ranked_candidates_as_json(capsys):
    import json

    from chameleon_ext.plan_cli import main
    args = ["--device", "A100", "--num-layers", "8", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "1",
            "--vocab-size", "1024", "--world-size", "8", "--pipeline-parallel", "2",
            "--global-batch-size", "32", "--fail", "7", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"]["source"] == "analytical"
    assert {c["strategy"] for c in out["candidates"]} == {"reroute", "restart"}
    assert out["chosen"] == out["candidates"][0] and out["plan"]["num_layers"] == 8


def test_chameleon_plan_rejects_bad_input_in_one_line(capsys, tmp_path):
    from chameleon_ext.plan_cli import main
    base = ["--device", "A100", "--num-layers", "8", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "1",
            "--vocab-size", "1024", "--world-size", "8", "--global-batch-size", "32"]
    assert main(base + ["--fail", "9"]) == 2
    assert "ranks [9] are not in the 8-rank plan" in capsys.readouterr().err
    assert main(["--profile", str(tmp_path / "none.json"), "--world-size", "8",
                 "--global-batch-size", "32", "--fail", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read profile" in err
