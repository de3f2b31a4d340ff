"""Candidate plans after a failure and the choice among them, on synthetic profiles."""

import dataclasses

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import (ModelShape, Profile, predict, predict_homogeneous,
                                      predict_plan, switch_ms, transition_ms)
from chameleon_ext.planning.planner import Situation, candidates, choose, next_repair, replan
from chameleon_ext.planning.strategies.base import (balanced_layers, balanced_layers_by_depth,
                                           stage_cost_ms, with_layers)
from chameleon_ext.planning.strategies.restart import _iteration_bound
from chameleon_ext.planning.strategies.restart import homogeneous, restart_plan
from chameleon_ext.schedule.choice import choose_schedule
from chameleon_ext.schedule.ir import one_f_one_b
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
        iteration=100, checkpoint_iteration=50, remaining_iterations=20, failure_free_ms=60.0),
        ("reroute", "restart"))
    assert [c.strategy for c in ranked] == ["reroute", "restart"]
    assert choose(ranked).strategy == "reroute"


def pp4_dp2() -> ExecutionPlan:
    return ExecutionPlan.failure_free(8, 1, 4, 8, 1, 32)


def test_restart_when_the_checkpoint_is_fresh_and_the_horizon_long():
    """Pipeline 4 x data 2 losing a middle stage: its replica would do twice the work; the
    re-planned 2 x 3 layout over 6 of the 7 survivors is faster."""
    ranked = candidates(pp4_dp2(), {5}, synthetic(), Situation(
        iteration=100, checkpoint_iteration=99, remaining_iterations=100_000,
        failure_free_ms=60.0), ("reroute", "restart"))
    best = choose(ranked)
    assert best.strategy == "restart" and best.plan.world_size == 6
    reroute = next(c for c in ranked if c.strategy == "reroute")
    assert best.iteration_ms < reroute.iteration_ms


def test_the_horizon_from_the_mtbf_decides_between_them():
    """An old checkpoint (50 iterations of lost work) pays off over a long horizon only."""
    long = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=100_000,
                     failure_free_ms=60.0)
    pair = ("reroute", "restart")
    assert choose(candidates(pp4_dp2(), {5}, synthetic(), long, pair)).strategy == "restart"
    short = dataclasses.replace(long, mtbf_hours=1e-4)  # 0.36 s: a few iterations
    assert choose(candidates(pp4_dp2(), {5}, synthetic(), short, pair)).strategy == "reroute"


def test_re_parallelizing_every_survivor_wins_a_long_horizon_without_a_fresh_checkpoint():
    """Over 7 survivors, pipelines of different depths (the micro-batches split by their
    speed) lose no iteration and leave no survivor idle: faster than the restart onto 6,
    cheaper than the restart's lost work, and than rerouting's doubled replica."""
    situation = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=100_000,
                          failure_free_ms=60.0)
    ranked = candidates(pp4_dp2(), {5}, synthetic(), situation)
    by = {c.strategy: c for c in ranked}
    best = choose(ranked)
    assert best.strategy == "reparallelize" and best.plan.world_size == 7
    assert len({len(p.stages) for p in best.plan.pipelines}) > 1  # heterogeneous
    assert sorted(mb for p in best.plan.pipelines for mb in p.micro_batches) == list(range(32))
    assert best.iteration_ms < min(by["reroute"].iteration_ms, by["restart"].iteration_ms)
    whole = whole_prediction(best.plan, synthetic())
    assert best.iteration_ms == whole.iteration_ms


def test_a_plan_over_the_memory_limit_is_never_chosen():
    plan, prof = pp2_dp4(), synthetic()
    situation = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=20,
                          failure_free_ms=60.0)
    ranked = candidates(plan, {7}, prof, situation, ("reroute", "restart"))
    reroute = next(c for c in ranked if c.strategy == "reroute")
    restart = next(c for c in ranked if c.strategy == "restart")
    assert reroute.memory_bytes > restart.memory_bytes  # hosts keep more activations in flight
    tight = dataclasses.replace(prof, device_memory_bytes=restart.memory_bytes)
    ranked = candidates(plan, {7}, tight, situation, ("reroute", "restart"))
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
    best = replan(plan, {7}, prof)
    t_best = predict_homogeneous(best, prof).iteration_ms
    for depth in range(1, 9):
        for dp in range(1, 7 // depth + 1):
            if 32 % dp == 0:
                assert t_best <= predict_homogeneous(homogeneous(plan, depth, dp),
                                                     prof).iteration_ms + 1e-9
    assert t_best <= predict_homogeneous(restart_plan(plan, {7}), prof).iteration_ms
    assert replan(plan, set(plan.ranks), prof) is None


def test_balanced_layers_for_every_depth_minimise_the_costliest_stage():
    from itertools import combinations
    for prof in (synthetic(), synthetic(head_fwd_ms=3.0, head_bwd_ms=2.0, embedding_fwd_ms=1.5)):
        by_depth = balanced_layers_by_depth(8, 8, prof)
        for depth, sizes in enumerate(by_depth, 1):
            assert sizes == balanced_layers(8, depth, prof) and sum(sizes) == 8
            splits = [[b - a for a, b in zip((0, *cuts), (*cuts, 8))]
                      for cuts in combinations(range(1, 8), depth - 1)]
            assert worst(prof, sizes) == min(worst(prof, s) for s in splits)


def worst(prof: Profile, sizes: list[int]) -> float:
    return max(stage_cost_ms(prof, n, i == 0, i == len(sizes) - 1) for i, n in enumerate(sizes))


def costly() -> Profile:
    return synthetic(head_fwd_ms=2.0, head_bwd_ms=3.0, embedding_fwd_ms=0.5,
                     optimizer_ms_per_mparam=0.5, p2p_ms_per_mib=0.3, allreduce_ms_per_mib=0.5,
                     iteration_overhead_ms=2.0)


def test_the_search_bound_never_exceeds_a_prediction():
    """Beyond rounding (the bound is often the prediction, summed in another order)."""
    plan = ExecutionPlan.failure_free(16, 1, 2, 8, 1, 32)
    for prof in (synthetic(), costly(), synthetic(rank_slowdown={0: 0.5, 3: 2.0})):
        for depth, sizes in enumerate(balanced_layers_by_depth(8, 8, prof), 1):
            for dp in (1, 2, 4, 8, 16):
                if depth * dp <= 16:
                    new = with_layers(homogeneous(plan, depth, dp), sizes)
                    assert _iteration_bound(prof, sizes, dp, 32 // dp, 1) <= \
                        predict_plan(new, prof).iteration_ms * (1 + 1e-12)


def whole_prediction(plan: ExecutionPlan, prof: Profile):
    return predict(plan, choose_schedule(plan, fuse=False), prof)


def exhaustive_replan(plan: ExecutionPlan, lost: set[int], prof: Profile) -> ExecutionPlan:
    """Every layout replan considers, each predicted whole."""
    best = None
    groups = len(plan.surviving_groups(lost))
    prof = prof.at_tensor_parallel(plan.tensor_parallel)
    for depth in range(1, plan.num_layers + 1):
        for dp in range(1, groups // depth + 1):
            if plan.num_micro_batches % dp == 0:
                new = with_layers(homogeneous(plan, depth, dp, lost),
                                  balanced_layers(plan.num_layers, depth, prof))
                pred = whole_prediction(new, prof)
                if prof.device_memory_bytes and \
                        pred.peak_memory_bytes > prof.device_memory_bytes:
                    continue
                key = (pred.iteration_ms,
                       (-depth * dp, abs(depth - len(plan.pipelines[0].stages)), -depth))
                if best is None or key < best[0]:
                    best = (key, new)
    return best[1]


@pytest.mark.parametrize("depth, dp, lost", [
    (2, 3, {1}), (2, 3, {0, 5}), (4, 4, {5}), (4, 4, {15}), (4, 4, {1, 9}),
    (4, 4, {0, 7, 14})])
def test_candidates_are_predicted_as_whole_plans_and_the_search_as_exhaustive(depth, dp, lost):
    """pp 2 x dp 3 and pp 4 x dp 4 (rank d + dp s is pipeline d's stage s: first and last
    stages, two failures in one pipeline, three in three): the fast predictions are the whole
    plans', and the pruned layout search finds what predicting every layout finds."""
    situation = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=1000,
                          failure_free_ms=60.0)
    for batch in (dp, 4 * dp):
        plan = ExecutionPlan.failure_free(depth * dp, 1, depth, 8, 1, batch)
        for prof in (synthetic(), costly()):
            ranked = candidates(plan, lost, prof, situation)
            assert {c.strategy for c in ranked} == {"reroute", "takeover", "reparallelize",
                                                    "restart"}
            for c in ranked:
                whole = whole_prediction(c.plan, prof)
                assert (c.iteration_ms, c.memory_bytes) == (whole.iteration_ms,
                                                            whole.peak_memory_bytes)
            restart = next(c for c in ranked if c.strategy == "restart")
            assert restart.plan == exhaustive_replan(plan, lost, prof)
            assert choose(ranked) is ranked[0]


def pp4_dp2_losing_a_middle_stage(**situation) -> list:
    """Reroute doubles a replica's work; the re-planned 2 x 3 layout is faster."""
    return candidates(pp4_dp2(), {5}, synthetic(), Situation(**{
        "iteration": 103, "checkpoint_iteration": 50, "remaining_iterations": 100_000,
        "failure_free_ms": 60.0, "save_interval": 5, **situation}), WITH_HYBRID)


WITH_HYBRID = ("reroute", "restart", "reroute+restart")


def test_the_hybrid_wins_when_the_checkpoint_is_old_and_the_next_save_near():
    """Restart now loses 53 iterations; the hybrid reroutes for 3 (103 again, 104, 105), then
    restarts from iteration 105's checkpoint with nothing lost."""
    ranked = pp4_dp2_losing_a_middle_stage()
    best = choose(ranked)
    by = {c.strategy: c for c in ranked}
    assert best.strategy == "reroute+restart" and set(by) == {"reroute", "restart",
                                                               "reroute+restart"}
    now, then, prof = by["reroute"], by["restart"], synthetic()
    assert (best.plan, best.iteration_ms, best.transition_ms) == (now.plan, now.iteration_ms,
                                                                   now.transition_ms)
    s = best.switch
    assert (s.strategy, s.at_iteration, s.plan, s.iteration_ms) == ("restart", 105, then.plan,
                                                                     then.iteration_ms)
    assert then.lost_iterations == 53   # trained again on the restart's plan, at its pace
    loaded = then.transition_ms - then.redo_ms - transition_ms(prof)
    assert s.transition_ms == pytest.approx(switch_ms(prof) + loaded)
    assert best.total_ms == pytest.approx(now.transition_ms + 3 * now.iteration_ms +
                                          s.transition_ms + (100_000 - 3) * then.iteration_ms)
    assert best.memory_bytes == max(now.memory_bytes, then.memory_bytes) and best.feasible
    summary = best.summary()
    assert summary["switch"] == {"strategy": "restart", "at_iteration": 105,
                                 "predicted_iter_ms": round(then.iteration_ms, 3),
                                 "transition_ms": round(s.transition_ms, 1),
                                 "layout": "2 pipeline(s) x 3 stage(s)", "world": 6}
    assert summary.keys() - {"switch"} == now.summary().keys()
    assert best.schedule.ops.keys() == set(now.plan.ranks)


def test_no_hybrid_without_periodic_saves_or_past_the_horizon():
    assert {c.strategy for c in pp4_dp2_losing_a_middle_stage(save_interval=0)} == \
        {"reroute", "restart"}
    # the save after iteration 200 comes 98 iterations later, after the job's end
    late = pp4_dp2_losing_a_middle_stage(save_interval=200, remaining_iterations=98)
    assert "reroute+restart" not in {c.strategy for c in late}
    just = pp4_dp2_losing_a_middle_stage(save_interval=200, remaining_iterations=99)
    assert "reroute+restart" in {c.strategy for c in just}


def test_a_slot_due_back_before_the_next_save_rules_out_the_hybrid():
    """With a repair of an hour the hybrid still wins (its switch after 3 iterations of 60 ms
    pays over the window). An earlier loss whose slot is back in 2 iterations ends the window
    then (next_repair): the job moves again before the hybrid's save, so it reroutes now."""
    hour = 3.6e6
    assert choose(pp4_dp2_losing_a_middle_stage(repair_hours=1.0)).strategy == \
        "reroute+restart"
    soon = next_repair(hour, [0.0], hour - 120.0) / hour
    assert soon == pytest.approx(120.0 / hour)
    ranked = pp4_dp2_losing_a_middle_stage(repair_hours=soon)
    assert "reroute+restart" not in {c.strategy for c in ranked}
    assert choose(ranked).strategy == "reroute"
    assert next_repair(hour, [0.0], 2 * hour) == 0.0         # overdue: its joiner is due
    assert next_repair(hour, [], 5.0) == hour                 # none out: this failure's


def test_a_fresh_checkpoint_still_means_restart_now():
    """With the checkpoint one iteration old, restarting now loses less than the hybrid's
    rerouted iterations cost."""
    best = choose(pp4_dp2_losing_a_middle_stage(checkpoint_iteration=102))
    assert best.strategy == "restart"


def test_a_hybrid_needs_both_plans_to_fit():
    ranked = pp4_dp2_losing_a_middle_stage()
    by = {c.strategy: c for c in ranked}
    tight = dataclasses.replace(synthetic(), device_memory_bytes=by["restart"].memory_bytes)
    assert by["reroute"].memory_bytes > by["restart"].memory_bytes
    ranked = candidates(pp4_dp2(), {5}, tight, Situation(
        iteration=103, checkpoint_iteration=50, remaining_iterations=100_000,
        failure_free_ms=60.0, save_interval=5), WITH_HYBRID)
    assert [(c.strategy, c.feasible) for c in ranked][0] == ("restart", True)
    assert not next(c for c in ranked if c.strategy == "reroute+restart").feasible


def test_chameleon_plan_prints_the_ranked_candidates_as_json(capsys):
    import json

    from chameleon_ext.planning.cli import main
    args = ["--device", "A100", "--num-layers", "8", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "1",
            "--vocab-size", "1024", "--world-size", "8", "--pipeline-parallel", "2",
            "--global-batch-size", "32", "--fail", "7", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"]["source"] == "analytical"
    assert {c["strategy"] for c in out["candidates"]} == {"reroute", "takeover",
                                                          "reparallelize", "restart"}
    assert out["chosen"] == out["candidates"][0] and out["plan"]["num_layers"] == 8


def test_chameleon_plan_rejects_bad_input_in_one_line(capsys, tmp_path):
    from chameleon_ext.planning.cli import main
    base = ["--device", "A100", "--num-layers", "8", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "1",
            "--vocab-size", "1024", "--world-size", "8", "--global-batch-size", "32"]
    assert main(base + ["--fail", "9"]) == 2
    assert "ranks [9] are not in the 8-rank plan" in capsys.readouterr().err
    assert main(["--profile", str(tmp_path / "none.json"), "--world-size", "8",
                 "--global-batch-size", "32", "--fail", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read profile" in err


def test_an_mtbf_horizon_counts_the_same_work_for_every_candidate():
    """An hour to the next failure is 60,000 failure-free iterations of 60 ms for every
    candidate: the faster re-planned layout wins although its transition (two iterations
    since the checkpoint lost) costs more (counted in time, each plan would fill the hour and
    only the transitions would differ)."""
    ranked = candidates(pp4_dp2(), {5}, synthetic(), Situation(
        iteration=100, checkpoint_iteration=98, remaining_iterations=10 ** 9, mtbf_hours=1.0,
        failure_free_ms=60.0), ("reroute", "restart"))
    best = choose(ranked)
    reroute = next(c for c in ranked if c.strategy == "reroute")
    assert best.strategy == "restart" and best.transition_ms > reroute.transition_ms
    assert best.total_ms == pytest.approx(best.transition_ms + 60_000 * best.iteration_ms)


def test_no_candidate_when_every_rank_is_lost():
    plan = pp2_dp4()
    assert candidates(plan, set(plan.ranks), synthetic(), Situation(
        iteration=10, checkpoint_iteration=0, remaining_iterations=100)) == []


# ---- tensor parallelism: the group is the recovery unit -----------------------------------
def tp_synthetic(**kw) -> Profile:
    return synthetic(tp_alpha_ms=0.002, tp_ms_per_mib=0.05, **kw)


def old_groups(plan: ExecutionPlan, lost: set[int], new: ExecutionPlan) -> list[list[int]]:
    """`new`'s tensor-parallel groups in the ranks of `plan` (new rank i is
    plan.survivors(lost, its world)[i])."""
    kept = plan.survivors(lost, new.world_size)
    return sorted(sorted(kept[r] for r in g) for g in new.tp_groups())


def test_every_strategy_has_candidates_at_tensor_parallel_8():
    """TP 8 x PP 2 x DP 4 losing one GPU: every strategy's plan removes that GPU's group
    whole, runs on whole groups of the old plan, and predicts as the whole plan does."""
    plan = ExecutionPlan.failure_free(64, 8, 2, 8, 1, 32)
    lost = {13}
    situation = Situation(iteration=103, checkpoint_iteration=50, remaining_iterations=1000,
                          failure_free_ms=60.0, save_interval=5)
    ranked = candidates(plan, lost, tp_synthetic(), situation)
    assert {c.strategy for c in ranked} == {"reroute", "takeover", "reparallelize", "restart",
                                            "reroute+restart"}
    groups = [sorted(g) for g in plan.tp_groups()]
    gone = next(g for g in groups if 13 in g)
    for c in ranked:
        for new in (c.plan, *([c.switch.plan] if c.switch else [])):
            assert new.tensor_parallel == 8 and new.world_size % 8 == 0
            assert all(g in groups and g != gone for g in old_groups(plan, lost, new))
        if c.strategy != "restart":
            assert c.plan.world_size == 56
        whole = whole_prediction(c.plan, tp_synthetic())
        assert (c.iteration_ms, c.memory_bytes) == (pytest.approx(whole.iteration_ms,
                                                                  rel=1e-12),
                                                    whole.peak_memory_bytes)


def test_a_lost_rank_removes_its_whole_group():
    """TP 2 x PP 2 x DP 2 losing rank 5 (the run that found no candidate): its sibling 4
    leaves with it, and every strategy plans over the 6 others."""
    plan = ExecutionPlan.failure_free(8, 2, 2, 8, 1, 16)
    assert plan.survivors({5}) == [0, 1, 2, 3, 6, 7]
    ranked = candidates(plan, {5}, tp_synthetic(), Situation(
        iteration=10, checkpoint_iteration=6, remaining_iterations=100, failure_free_ms=60.0))
    assert {c.strategy for c in ranked} == {"reroute", "takeover", "reparallelize", "restart"}
    for c in ranked:
        assert c.plan.world_size == 6
        assert [4, 5] not in old_groups(plan, {5}, c.plan)


def test_a_slow_rank_slows_its_group_and_is_renumbered_with_the_survivors():
    """Rank 3 of TP 2 x PP 2 x DP 2 is slow; after rank 1 is lost (and its sibling 0) it is
    rank 1, in the group (0 1) that hosts the lost stage: all of it runs 3 times slower."""
    plan = ExecutionPlan.failure_free(8, 2, 2, 8, 1, 16)
    prof = tp_synthetic(rank_slowdown={3: 3.0})
    rerouted = next(c for c in candidates(plan, {1}, prof, Situation(
        iteration=10, checkpoint_iteration=6, remaining_iterations=100, failure_free_ms=60.0),
        ("reroute",)))
    assert rerouted.plan.pipelines[0].stages[0].hosts == {mb: [0, 1] for mb in range(8)}
    renumbered = tp_synthetic(rank_slowdown={1: 3.0})
    assert rerouted.iteration_ms == whole_prediction(rerouted.plan, renumbered).iteration_ms
    assert rerouted.iteration_ms > 2 * whole_prediction(rerouted.plan,
                                                        tp_synthetic()).iteration_ms


def test_memory_feasibility_is_per_tensor_parallel_shard():
    """A model whose state does not fit one GPU's memory at TP 1 fits at TP 4: the planner
    counts each shard's parameters, gradients, optimizer state and activations."""
    situation = Situation(iteration=10, checkpoint_iteration=6, remaining_iterations=100,
                          failure_free_ms=60.0)
    wide = ExecutionPlan.failure_free(16, 4, 2, 8, 1, 16)
    ranked = candidates(wide, {3}, tp_synthetic(), situation)
    largest = max(c.memory_bytes for c in ranked)
    device = dataclasses.replace(tp_synthetic(), device_memory_bytes=largest)
    assert all(c.feasible for c in candidates(wide, {3}, device, situation))
    narrow = ExecutionPlan.failure_free(4, 1, 2, 8, 1, 16)  # the same stages, unsplit
    assert all(c.memory_bytes > largest for c in candidates(narrow, {3}, device, situation))
    assert choose(candidates(narrow, {3}, device, situation)) is None


@pytest.mark.parametrize("tp, lost", [(2, {3}), (4, {5, 30}), (8, {9})])
def test_rerouted_schedules_at_tensor_parallel_pass_the_simulator(tp, lost):
    """Every shard of every micro-batch goes forward and backward through every layer once,
    and the schedule cannot deadlock (simulator.check and a simulated run), with whole and
    split backwards."""
    from chameleon_ext.schedule.list_scheduler import list_schedule
    from chameleon_ext.schedule.simulator import UniformCosts, simulate
    from chameleon_ext.planning.strategies.reroute import reroute
    plan = reroute(ExecutionPlan.failure_free(8 * tp, tp, 4, 8, 1, 16), lost)
    assert plan.rerouted and plan.tensor_parallel == tp
    for split in (False, True):
        schedule = list_schedule(plan, UniformCosts(), split_backward=split)
        assert set(schedule.ops) == set(plan.ranks)
        assert simulate(plan, schedule, UniformCosts()).iteration_time > 0
    simulate(plan, choose_schedule(plan), UniformCosts())  # fused, as the executor runs it


def test_chameleon_plan_plans_tensor_parallel_jobs(capsys):
    import json

    from chameleon_ext.planning.cli import main
    args = ["--device", "H200", "--num-layers", "8", "--hidden-size", "1024",
            "--num-attention-heads", "16", "--seq-length", "1024", "--micro-batch-size", "1",
            "--vocab-size", "32000", "--world-size", "8", "--tensor-parallel", "2",
            "--pipeline-parallel", "2", "--global-batch-size", "16", "--fail", "5", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {c["strategy"] for c in out["candidates"]} == {"reroute", "takeover",
                                                          "reparallelize", "restart"}
    assert out["plan"]["tensor_parallel"] == 2 and out["chosen"]["world"] == 6
    assert out["members"] == [0, 1, 2, 3, 6, 7]


def test_the_planner_and_a_forced_strategy_take_the_same_proposal_from_the_registry():
    """One registry: under auto each candidate's plan is exactly what the forced strategy of
    that name proposes for the same loss and profile."""
    from chameleon_ext.planning.strategies import REGISTRY, Context
    from chameleon_ext.planning.decider import Decider
    plan, lost, prof = pp4_dp2(), {5}, synthetic()
    ranked = candidates(plan, lost, prof, Situation(
        iteration=10, checkpoint_iteration=5, remaining_iterations=100, failure_free_ms=60.0))
    # every strategy but substitute, offered only where spares wait (tests/unit/test_substitute.py)
    assert {c.strategy for c in ranked} >= set(REGISTRY) - {"substitute"}
    for c in ranked:
        if c.strategy in REGISTRY:
            assert c.plan == REGISTRY[c.strategy].propose(plan, lost, Context(prof)).plan
            forced = Decider(c.strategy).after_failure(plan, list(range(8)), lost, 10).decision
            forced_plan = REGISTRY[c.strategy].propose(plan, lost, Context()).plan
            assert forced.strategy == c.strategy and forced.plan == forced_plan


@pytest.mark.parametrize("lost", [{7}, {3}, {0, 5}])
def test_reparallelize_is_never_predicted_slower_than_the_restart_replan(lost):
    """Oobleck-like: pipelines over any subset of the survivors, idle GPUs allowed, so its
    steady state is at least as fast as the homogeneous re-plan a restart would take."""
    ranked = {c.strategy: c for c in candidates(
        pp4_dp2(), lost, synthetic(layer_fwd_ms=3.0, head_fwd_ms=4.0), Situation(
            iteration=10, checkpoint_iteration=5, remaining_iterations=100,
            failure_free_ms=60.0), ("reparallelize", "restart"))}
    assert ranked["reparallelize"].iteration_ms <= ranked["restart"].iteration_ms + 1e-9


def test_a_second_loss_after_a_reroute_re_parallelizes_over_the_survivors():
    """PP 2 x DP 4 rerouted after losing a last stage, then a second last stage lost: the
    stage's work on two ranks again, or a restart that trains again since the checkpoint, lose
    to re-parallelizing the six survivors with their state (a rerouted plan is no dead end)."""
    situation = Situation(iteration=15, checkpoint_iteration=10, remaining_iterations=200,
                          failure_free_ms=60.0)
    first = next(c for c in candidates(pp2_dp4(), {4}, synthetic(), situation, ("reroute",)))
    lost = {first.plan.pipelines[1].stages[1].ranks[0]}
    ranked = {c.strategy: c for c in candidates(first.plan, lost, synthetic(), situation)}
    chosen = choose(list(ranked.values()))
    assert chosen.strategy == "reparallelize"
    assert not chosen.plan.rerouted and chosen.plan.world_size == 6
    assert chosen.iteration_ms < ranked["reroute"].iteration_ms
    assert chosen.total_ms < ranked["restart"].total_ms
