"""The planner's objective over the failure-repair cycle (planner's module docstring): the
window until the repair or the next failure, the move back when the slot returns, the cost of
the next failure; the cases where the horizon-only rule (repair_hours=None) chose wrong; the
rejoin decision; and chameleon-plan's --repair-minutes."""

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from chameleon_ext.control.launch_config import LaunchConfig
from chameleon_ext.control.workers import Workers
from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.cli import main
from chameleon_ext.planning.perf_model import MIB, ModelShape, predict_plan, stage_params, \
    switch_ms
from chameleon_ext.planning.planner import (STATE_BYTES_PER_PARAM, Situation, candidates, choose,
                                            fatal_share, horizon_iterations, moved_state_bytes,
                                            rejoin_choice, window)
from chameleon_ext.planning.strategies import REGISTRY, Context
from chameleon_ext.planning.strategies.rejoin import overlay
from megatron.training.arguments import parse_config
from megatron.training.config import CheckpointConfig
from megatron.training import planning as job_planning
from megatron.training.planning import JobClock
from tests.profiles import synthetic_profile

# Layers of 12.6 M parameters (150 MiB of state to move) behind 128 KiB activations: moving a
# layer's state costs seconds (100 ms/MiB), a pipeline message about 12 ms.
SHAPE = ModelShape(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=32,
                   micro_batch_size=1, vocab_size=512)
PROFILE = synthetic_profile(
    SHAPE, layer_fwd_ms=10.0, layer_bwd_input_ms=10.0, layer_bwd_weight_ms=10.0,
    p2p_alpha_ms=0.01, p2p_ms_per_mib=100.0, allreduce_alpha_ms=0.01, detect_ms=50.0,
    rebuild_ms=400.0, load_ms_per_mib=1.0)


def pp2_dp4() -> ExecutionPlan:
    return ExecutionPlan.failure_free(8, 1, 2, 8, 1, 32)


def pp4_dp2() -> ExecutionPlan:
    return ExecutionPlan.failure_free(8, 1, 4, 8, 1, 32)


def ranked_both(plan, lost, situation, strategies=None):
    """The candidates under the cycle's objective and under the horizon-only rule."""
    kw = {} if strategies is None else {"strategies": strategies}
    return (candidates(plan, lost, PROFILE, situation, **kw),
            candidates(plan, lost, PROFILE, dataclasses.replace(situation, repair_hours=None),
                       **kw))


def totals(ranked) -> dict[str, float]:
    return {c.strategy: round(c.total_ms, 1) for c in ranked}


# ---- the window ---------------------------------------------------------------------------------
def test_without_a_repair_time_the_window_is_the_horizon():
    s = Situation(iteration=10, checkpoint_iteration=0, remaining_iterations=1000,
                  mtbf_hours=1e-3, failure_free_ms=100.0)
    assert window(s, 100.0) == dataclasses.replace(window(s, 100.0), repair_first=0.0,
                                                   failure_first=0.0)
    assert window(s, 100.0).iterations == horizon_iterations(s, 100.0) == 36.0


def test_the_window_is_the_expected_time_to_the_repair_or_the_next_failure():
    mtbf_ms, repair_ms, pace = 3.6e6, 1.8e6, 1000.0
    s = Situation(iteration=10, checkpoint_iteration=0, remaining_iterations=10 ** 6,
                  mtbf_hours=1.0, failure_free_ms=pace, repair_hours=0.5)
    w = window(s, pace)
    assert w.iterations == pytest.approx(mtbf_ms * (1 - math.exp(-repair_ms / mtbf_ms)) / pace)
    assert w.repair_first == pytest.approx(math.exp(-0.5))
    assert w.repair_first + w.failure_first == pytest.approx(1.0)
    # the end of training first: no move back, the window ends there
    end = window(dataclasses.replace(s, remaining_iterations=600), pace)
    assert end.repair_first == 0.0
    assert end.iterations == pytest.approx(mtbf_ms * (1 - math.exp(-6e5 / mtbf_ms)) / pace)
    # never repaired, no failures expected: the rest of the job
    never = window(dataclasses.replace(s, mtbf_hours=None, repair_hours=math.inf), pace)
    assert (never.iterations, never.repair_first, never.failure_first) == (10 ** 6, 0.0, 0.0)



def test_a_record_of_losses_never_outrun_by_the_next_one_shrinks_the_failure_first_chance():
    """Losses at fixed hourly intervals, each back after 1 h: none came before its repair,
    where the exponential law says 1 - exp(-1) of them should. The law's chance counts as one
    loss beside the record; the window keeps the law's mean time to a failure within it."""
    pace = 1000.0
    s = Situation(iteration=10, checkpoint_iteration=0, remaining_iterations=10 ** 6,
                  mtbf_hours=1.0, failure_free_ms=pace, repair_hours=1.0)
    law = window(s, pace)
    assert window(dataclasses.replace(s, failure_record=(0, 0)), pace) == law
    never = window(dataclasses.replace(s, failure_record=(0, 4)), pace)
    assert never.failure_first == pytest.approx(law.failure_first / 5)
    assert never.repair_first == pytest.approx(1 - never.failure_first)
    before = (law.iterations - 3600 * math.exp(-1.0)) / law.failure_first
    assert never.iterations == pytest.approx(
        (1 - never.failure_first) * 3600 + never.failure_first * before)
    assert law.iterations < never.iterations < 3600
    always = window(dataclasses.replace(s, failure_record=(4, 4)), pace)
    assert always.failure_first > law.failure_first and always.iterations < law.iterations
    # the end of training first: the record (of losses before their repair) does not apply
    end = dataclasses.replace(s, remaining_iterations=600)
    assert window(dataclasses.replace(end, failure_record=(0, 4)), pace) == window(end, pace)

def test_each_candidate_costs_its_transition_window_move_back_and_next_failure():
    s = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=100_000,
                  mtbf_hours=6.0, failure_free_ms=1000.0, repair_hours=0.5)
    w = window(s, 1000.0)
    for c in candidates(pp2_dp4(), {7}, PROFILE, s):
        assert c.total_ms == pytest.approx(
            c.transition_ms + w.iterations * c.iteration_ms + w.repair_first * c.move_back_ms
            + w.failure_first * c.next_failure_ms)


# ---- the terms ----------------------------------------------------------------------------------
def test_rerouting_moves_back_the_returning_rank_s_stage_only():
    plan = pp2_dp4()
    reroute = next(c for c in candidates(pp2_dp4(), {7}, PROFILE, Situation(
        iteration=10, checkpoint_iteration=0, remaining_iterations=100, repair_hours=1.0),
        ("reroute",)))
    assert reroute.move_back_ms == pytest.approx(
        switch_ms(PROFILE) + PROFILE.p2p_ms_per_mib * STATE_BYTES_PER_PARAM *
        stage_params(plan, 7, SHAPE) / MIB)


def test_moving_a_plan_onto_itself_moves_nothing_and_a_newcomer_gets_its_whole_stage():
    plan = pp2_dp4()
    stay = {r: r for r in plan.ranks}
    assert moved_state_bytes(plan, plan, stay, SHAPE) == 0
    del stay[7]  # the last stage: its layers, the final norm and the output layer, once
    assert moved_state_bytes(plan, plan, stay, SHAPE) == \
        STATE_BYTES_PER_PARAM * stage_params(plan, 7, SHAPE)


def test_a_stage_down_to_one_replica_makes_its_loss_fatal():
    plan = pp2_dp4()
    assert fatal_share(plan, False) == 0.0
    once = REGISTRY["reroute"].propose(pp4_dp2(), {5}, Context(PROFILE)).plan
    assert fatal_share(once, False) == 1 / 7   # stage 1 lives on rank 1 alone
    # eager shadows keep a copy of it on its neighbour: no loss is fatal
    assert fatal_share(pp4_dp2(), True) == 0.0
    assert fatal_share(ExecutionPlan.failure_free(4, 1, 4, 8, 1, 8), False) == 1.0
    assert fatal_share(ExecutionPlan.failure_free(4, 1, 4, 8, 1, 8), True) == 0.0


# ---- where the horizon-only rule chose wrong ----------------------------------------------------
def test_a_short_repair_makes_rerouting_win():
    """Pipeline 2 x data 4 loses rank 7; the slot is back in 3 minutes, a failure comes every
    6 hours. The horizon rule costs 18,303 iterations (6 h) and re-parallelizes: its 59 s
    state move pays off over hours. The slot is back after 152 iterations: rerouting (no
    state moved, 1.4 s an iteration against 1.3 s) is cheapest. Every candidate's move back
    lasts as long (59 s: the ranks receive beside each other, and the slowest receives a
    whole stage either way)."""
    plan = pp2_dp4()
    s = Situation(iteration=100, checkpoint_iteration=50, remaining_iterations=100_000,
                  mtbf_hours=6.0, failure_free_ms=predict_plan(plan, PROFILE).iteration_ms,
                  repair_hours=0.05)
    cycle, horizon = ranked_both(plan, {7}, s)
    assert choose(cycle).strategy == "reroute"
    assert choose(horizon).strategy == "reparallelize"
    by = {c.strategy: c for c in cycle}
    assert by["reroute"].transition_ms < by["reparallelize"].transition_ms / 30
    assert by["reroute"].move_back_ms == by["reparallelize"].move_back_ms
    assert totals(cycle) == {"reroute": 276523.2, "reparallelize": 318915.7,
                             "takeover": 409875.2, "restart": 425701.6}
    assert totals(horizon) == {"reparallelize": 24314822.8, "reroute": 26084990.6,
                               "restart": 33315242.7, "takeover": 35203820.8}


def test_a_long_repair_after_three_losses_in_one_stage_makes_re_planning_win():
    """Pipeline 2 x data 4 has lost two replicas of stage 0 (both rerouted); now the third.
    Rerouting again leaves one rank holding stage 0 for every pipeline (4.3 s an iteration);
    a restart onto 4 ranks re-plans (1.9 s) but loses the 1000 iterations since the
    checkpoint. The horizon rule (a failure every 0.3 h: 469 iterations) reroutes. The slot
    is back only after 6 h: the next failure comes first, and one time in five it takes the
    last holder of stage 0: a restart then that also loses the window's work. Re-planning
    now is cheaper. Where re-parallelization is among the candidates it re-plans the five
    survivors with their state (1.7 s, nothing trained again): chosen by either rule."""
    plan = pp2_dp4()
    for lost in ({1}, {2}):   # stage 0's ranks, as renumbered after each recovery
        plan = REGISTRY["reroute"].propose(plan, lost, Context(PROFILE)).plan
    s = Situation(iteration=1000, checkpoint_iteration=0, remaining_iterations=100_000,
                  mtbf_hours=0.3, failure_free_ms=predict_plan(plan, PROFILE).iteration_ms,
                  repair_hours=6.0)
    every = ranked_both(plan, {1}, s)
    assert [choose(ranked).strategy for ranked in every] == ["reparallelize"] * 2
    assert not choose(every[0]).plan.rerouted and choose(every[0]).plan.world_size == 5
    cycle, horizon = ranked_both(plan, {1}, s, ("reroute", "restart"))
    assert choose(cycle).strategy == "restart"
    assert choose(horizon).strategy == "reroute"
    reroute = next(c for c in cycle if c.strategy == "reroute")
    assert fatal_share(reroute.plan, False) == 1 / 5
    assert window(s, s.failure_free_ms).failure_first > 0.99
    assert totals(cycle) == {"restart": 2823985.8, "reroute": 3271250.7}
    assert totals(horizon) == {"reroute": 2010085.9, "restart": 2821615.8}


def test_a_failure_just_after_a_checkpoint_makes_restart_win():
    """Pipeline 4 x data 2 loses rank 5 one iteration after a checkpoint; the slot is back in
    under 4 minutes, a failure comes every 2 hours. The horizon rule (2 h: 4831 iterations)
    re-parallelizes over all 7 survivors: 1.3 s an iteration, but 89 s of state moved in.
    Over the 149 iterations until the repair the restart onto 6 (the checkpoint is fresh:
    2.9 s to enter, 1.8 s an iteration) is cheaper than every other; with an old checkpoint
    it is not."""
    plan = pp4_dp2()
    s = Situation(iteration=1001, checkpoint_iteration=1000, remaining_iterations=100_000,
                  mtbf_hours=2.0, failure_free_ms=predict_plan(plan, PROFILE).iteration_ms,
                  repair_hours=0.0625)
    cycle, horizon = ranked_both(plan, {5}, s)
    assert choose(cycle).strategy == "restart"
    assert choose(horizon).strategy == "reparallelize"
    assert totals(cycle) == {"restart": 301648.9, "reparallelize": 314272.8,
                             "takeover": 365214.3, "reroute": 400158.5}
    assert totals(horizon) == {"reparallelize": 6491362.7, "restart": 8772520.4,
                               "takeover": 9959924.4, "reroute": 11937924.1}
    old = dataclasses.replace(s, checkpoint_iteration=500)
    assert choose(candidates(plan, {5}, PROFILE, old)).strategy != "restart"


def test_a_restart_trains_its_lost_iterations_again_at_its_own_pace():
    """Pipeline 2 x data 4 has lost two replicas of stage 0 (rerouted: 2.3 s an iteration);
    now the third, 1000 iterations after the checkpoint, a failure expected every 0.576 h
    (900 iterations). Rerouting again runs 4.3 s an iteration; a restart onto 4 ranks 1.9 s,
    after training the 1000 lost iterations again on those 4 ranks: 1920 s. Priced at the
    pace they ran at before the failure (2305 s, as the planner did), the restart cost 140.2 ms
    a sample against rerouting's 133.9, and rerouting was chosen; at the pace the job trains
    them again it costs 126.8 ms a sample: the restart. (Between these two: a
    re-parallelization keeps the state and is cheaper than both, as in the test above.)"""
    plan = pp2_dp4()
    for lost in ({1}, {2}):
        plan = REGISTRY["reroute"].propose(plan, lost, Context(PROFILE)).plan
    pace = predict_plan(plan, PROFILE).iteration_ms
    s = Situation(iteration=1001, checkpoint_iteration=1, remaining_iterations=100_000,
                  mtbf_hours=0.576, failure_free_ms=pace)
    ranked = candidates(plan, {1}, PROFILE, s, strategies=("reroute", "restart"))
    by = {c.strategy: c for c in ranked}
    restart, reroute = by["restart"], by["reroute"]
    assert choose(ranked) is restart
    assert (restart.lost_iterations, reroute.lost_iterations) == (1000, 1)
    assert restart.redo_ms == pytest.approx(1000 * restart.iteration_ms)
    samples = horizon_iterations(s, pace) * plan.global_batch_size

    def per_sample(total_ms: float) -> float:
        return round(total_ms / samples, 1)

    assert (round(pace), round(restart.iteration_ms), round(reroute.iteration_ms)) == \
        (2305, 1920, 4280)
    assert (per_sample(restart.total_ms), per_sample(reroute.total_ms)) == (126.8, 133.9)
    at_old_pace = restart.total_ms + restart.lost_iterations * (pace - restart.iteration_ms)
    assert per_sample(at_old_pace) == 140.2

# ---- a rejoin -----------------------------------------------------------------------------------
def rejoin_case(**situation):
    """Pipeline 2 x data 4 rerouted after losing rank 7; rank 7 is back."""
    target = pp2_dp4()
    current = REGISTRY["reroute"].propose(target, {7}, Context(PROFILE)).plan
    members = [*range(7), None]
    new, lost = overlay(target, current, members)
    assert not lost
    s = Situation(**{"iteration": 500, "checkpoint_iteration": 400, "remaining_iterations":
                     10_000, "mtbf_hours": 6.0, "failure_free_ms": 1180.0, **situation})
    return rejoin_choice(current, predict_plan(current, PROFILE).iteration_ms, new,
                         predict_plan(new, PROFILE).iteration_ms,
                         {i: m for i, m in enumerate(members) if m is not None}, PROFILE, s)


def test_a_rejoin_mid_run_is_admitted_now():
    choice = rejoin_case()
    assert choice.action == "now" and choice.at_iteration is None
    assert set(choice.costs) == {"now", "stay"}    # no periodic saves: no checkpoint option


def test_a_rejoin_near_the_end_of_training_stays():
    """Ten iterations left: the 59 s state move costs more than they would save."""
    choice = rejoin_case(remaining_iterations=10)
    assert choice.action == "stay"
    assert choice.costs["stay"] < choice.costs["now"]


def test_a_rejoin_waits_for_a_near_checkpoint_when_moving_state_costs_more():
    """A save in 20 iterations: entering from that fresh checkpoint (a rebuild and a read of
    under a second) beats moving 600 MiB between peers now, and 20 rerouted iterations cost
    less than the difference. A save 400 iterations away: admitted now."""
    near = rejoin_case(iteration=581, save_interval=600)
    assert near.action == "checkpoint" and near.at_iteration == 600
    assert near.costs["checkpoint"] < near.costs["now"] < near.costs["stay"]
    far = rejoin_case(iteration=201, save_interval=600)
    assert far.action == "now"


def test_a_rejoin_waits_for_a_save_only_while_no_failure_is_likely_before_it():
    """A save 219 iterations away: waiting for it saves a few seconds when failures are 6 h
    apart. Those seconds do not depend on the MTBF (the window's work is the same for both);
    with failures an hour apart, one that comes before the save (an 8% chance over its 5 min)
    meets the rerouted plan and the admission moves the state after all: admitted now."""
    rare = rejoin_case(iteration=381, save_interval=600, mtbf_hours=6.0)
    assert rare.action == "checkpoint" and rare.at_iteration == 600
    frequent = rejoin_case(iteration=381, save_interval=600, mtbf_hours=1.0)
    assert frequent.action == "now"
    assert frequent.costs["now"] < frequent.costs["checkpoint"] < frequent.costs["stay"]


# ---- the job's clock ----------------------------------------------------------------------------
@pytest.fixture
def now(monkeypatch) -> list[float]:
    """The job clock's monotonic time, set by the test."""
    t = [10_000.0]
    monkeypatch.setattr(job_planning.time, "monotonic", lambda: t[0])
    return t


def test_the_job_clock_tells_the_repair_time_given_or_measured(now):
    ckpt = CheckpointConfig()
    assert JobClock(ckpt, 100, 1.0, False, 30.0).situation(5).repair_hours == 0.5
    clock = JobClock(ckpt, 100, 1.0, False)
    assert clock.situation(5).repair_hours is None   # unknown: the horizon rule
    for seconds in (600.0, 1200.0, 7200.0):           # each loss taken back this much later
        clock.lost()
        now[0] += seconds
        clock.rejoined()
    assert clock.repairs_s == [600.0, 1200.0, 7200.0]
    assert clock.situation(6).repair_hours == pytest.approx(1200.0 / 3600)


def test_an_earlier_loss_still_out_ends_the_window_at_its_return(now):
    """--chameleon-repair-minutes 10: a rank lost 8 minutes ago is back in 2, before the slot of
    a failure now; once a joiner took it back (into the plan or as a spare) this failure's 10
    minutes are left; a slot overdue (its joiner waits for its admission) leaves none."""
    clock = JobClock(CheckpointConfig(), 100, 1.0, False, 10.0)
    clock.lost()
    now[0] += 480.0
    assert clock.situation(5).repair_hours == pytest.approx(2 / 60)
    clock.rejoined(1)
    assert clock.situation(6).repair_hours == pytest.approx(10 / 60)
    clock.lost(ranks=2)                  # a tensor-parallel group: two ranks out at once
    now[0] += 700.0
    assert clock.situation(7).repair_hours == 0.0
    clock.rejoined(1)
    assert clock.situation(8).repair_hours == 0.0       # its sibling's slot is out still
    clock.rejoined(5)                    # more joiners than losses: nothing more to repair
    assert clock.repairs_s == [480.0, 700.0, 700.0]
    assert clock.situation(9).repair_hours == pytest.approx(10 / 60)


def test_the_launchers_restart_delay_is_the_repair_time_until_a_rejoin_is_measured(monkeypatch,
                                                                                  now):
    """chameleon-launch --max-restarts 1 --restart-delay 90: its workers' planner weighs a
    90 s repair from the first failure on (the horizon rule would ignore the slot's return);
    a measured rejoin, which counts the admission too, then takes over, and the flag above
    both. A launcher that restarts nothing says nothing."""
    def env(**launch) -> dict[str, str]:
        w = Workers(LaunchConfig("pretrain_gpt.py", nproc_per_node=2, **launch),
                    SimpleNamespace(addr="127.0.0.1:1", host=None, port=None), None, None)
        return w._envs()[1]

    assert "CHAMELEON_RESTART_DELAY" not in env(restart_delay_s=90.0)   # no restarts
    assert "CHAMELEON_RESTART_DELAY" not in env(max_restarts=1)         # no delay
    for k, v in env(max_restarts=1, restart_delay_s=90.0).items():
        monkeypatch.setenv(k, v)
    elastic = parse_config(["--num-layers", "4", "--mock-data", "--chameleon"],
                           world_size=1).elastic
    assert elastic.restart_delay_s == 90.0
    clock = JobClock(CheckpointConfig(), 100, 1.0, False, elastic.repair_minutes,
                     elastic.restart_delay_s)
    assert clock.situation(5).repair_hours == pytest.approx(90.0 / 3600)
    clock.lost()
    now[0] += 120.0
    clock.rejoined()
    assert clock.situation(6).repair_hours == pytest.approx(120.0 / 3600)
    assert JobClock(CheckpointConfig(), 100, 1.0, False, 30.0, 90.0).situation(5).repair_hours \
        == 0.5


# ---- chameleon-plan -----------------------------------------------------------------------------
ARGS = ["--device", "A100", "--num-layers", "8", "--hidden-size", "256",
        "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "1",
        "--vocab-size", "1024", "--world-size", "8", "--pipeline-parallel", "2",
        "--global-batch-size", "32", "--fail", "7", "--mtbf", "6", "--train-iters", "10000000"]


def test_chameleon_plan_prints_each_candidate_s_window_and_move_back_costs(capsys):
    assert main(ARGS + ["--repair-minutes", "30"]) == 0
    out = capsys.readouterr().out
    assert "move back ms" in out and "window cost s" in out and "next failure ms" in out
    assert "the repair first" in out
    assert main(ARGS + ["--repair-minutes", "30", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert 0 < got["window"]["repair_first"] < 1
    assert all(c["move_back_ms"] > 0 and c["next_failure_ms"] > 0 for c in got["candidates"])


@pytest.mark.parametrize("value, says", [("-5", "is not positive"), ("0", "is not positive"),
                                         ("nan", "is not positive"),
                                         ("soon", "is not a number")])
def test_chameleon_plan_rejects_a_bad_repair_time_in_one_line(capsys, value, says):
    with pytest.raises(SystemExit) as e:
        main(ARGS + ["--repair-minutes", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--repair-minutes" in err and says in err



def test_the_job_keeps_the_record_of_its_own_losses(monkeypatch):
    """The job's clock records each loss's time (after its transition; a decision counts the
    loss it is made for without recording it, so a retried one counts it once). With a
    one-hour repair, at the third loss: the first was followed half an hour later by the second
    (the next loss came first), the second's hour passed with no loss (known, repaired first),
    the third's outcome is not known yet. With no repair time there is no record."""
    from megatron.training import planning
    from megatron.training.config import CheckpointConfig
    now = [10_000.0]
    monkeypatch.setattr(planning.time, "monotonic", lambda: now[0])
    clock = planning.JobClock(CheckpointConfig(), 100, None, False, 60.0)
    records = []
    for at in (0.0, 1800.0, 9000.0):
        now[0] = 10_000.0 + at
        records.append(clock.situation(1).failure_record)
        assert clock.situation(1).failure_record == records[-1]   # a retried decision
        clock.lost()
    assert records == [(0, 0), (1, 1), (1, 2)]
    now[0] += 3600.0
    assert clock.outlook(1).failure_record == (1, 3)
    assert planning.JobClock(CheckpointConfig(), 100, None, False).situation(1).failure_record \
        == (0, 0)
