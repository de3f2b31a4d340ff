"""`python -m tools.reproduce`: the analytical tables (1, 2 without its executed traces, 4) in
their --quick form, the trace simulation's accounting, and one-line errors for bad input. The
tables that launch CPU runs are in tests/e2e/test_reproduce_runs.py and
tests/e2e/test_executed_traces.py."""

import dataclasses
import importlib
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import MIB, predict_plan, stage_params, switch_ms
from chameleon_ext.planning.planner import (STATE_BYTES_PER_PARAM, Situation, candidates, choose,
                                            fatal_share, replan)
from tests.launch import REPO, read_csv
from tools.reproduce import cluster, executed, simulate, traces
from tools.reproduce.__main__ import main
from tools.reproduce.tables import (AUTO_TOLERANCE, BEST_FIXED, FIXED_KIND, PAPER_RATIOS,
                                    TRACE_MODEL, Options, trace_outcomes,
                                    trace_set)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("results")
    assert main(["table1", "table2", "table4", "--quick", "--executed-ranks", "0", "--out",
                 str(out)]) == 0
    return out


def test_every_csv_and_png_the_report_names_exists(results):
    report = (results / "REPORT.md").read_text()
    named = re.findall(r"\]\(([\w.]+\.(?:csv|png))\)", report)
    assert {n.split(".")[0] for n in named} >= {"table1", "table1_summary", "table2",
                                                 "table2_ratios", "table4"}
    assert any(n.endswith(".png") for n in named)
    for name in named:
        assert (results / name).stat().st_size > 0, name


def test_each_section_starts_with_its_command_and_profile(results):
    report = (results / "REPORT.md").read_text()
    sections = re.split(r"^## ", report, flags=re.M)[1:]
    assert [s.split(":")[0] for s in sections] == ["Table 1", "Table 2", "Table 4"]
    for s in sections:
        lines = s.splitlines()
        assert lines[2].startswith("Command: `") and "-m tools.reproduce table1 table2 " \
            "table4 --quick --executed-ranks 0 --out" in lines[2]
        assert lines[3].startswith("Profile: `analytical`")


def test_post_recovery_ratios_are_within_the_physically_sane(results):
    rows = read_csv(results / "table1.csv")
    assert {r["strategy"] for r in rows} == {"reroute", "takeover", "reparallelize",
                                             "restart", "auto"}
    # at tensor parallelism 2 too, every strategy has a plan for every failure
    assert {r["tp"] for r in rows} == {"1", "2"}
    assert all(r["status"] != "no plan" for r in rows if r["tp"] == "2")
    for r in rows:
        if r["status"] != "ok":
            assert r["post/ff"] == ""
            continue
        ratio, limit = float(r["post/ff"]), float(r["limit (N-f)/N"])
        assert 0 < ratio <= 1.05, r
        assert math.isclose(float(r["post/ff / limit"]), ratio / limit)
    assert all(r["status"] == "ok" for r in rows if r["strategy"] == "auto")


# The quick traces' names up to their seed: Oobleck's and Poisson (random), then the designed.
RANDOM_TRACES = ("every 1 h", "every 10 min", "Poisson, MTBF 1 h")
# each designed trace, and the policy it makes wrong (auto beats it by 5% at least)
DESIGNED = {"one stage's replicas lost for 3 h": "reroute only (ReCycle-like)",
            "hourly, alternating stages, 5 min repair": "checkpoint-restart (Megatron default)",
            "around checkpoints": "checkpoint-restart (Megatron default)"}


def test_auto_is_at_least_every_fixed_policy_on_every_random_trace(results):
    """On the 6 quick traces, for the trace model at tp 1 and a model at its typical tp. On the
    designed traces auto beats the policy each is designed against; elsewhere its greedy
    choices may trail (the summary's min shows by how much)."""
    rows = read_csv(results / "table2.csv")
    by_trace: dict[tuple[str, str, str], dict[str, float]] = {}
    for r in rows:
        by_trace.setdefault((r["model"], r["tp"], r["trace"].rsplit(", seed ", 1)[0]), {})[
            r["policy"]] = float(r["samples/s"])
    assert len(by_trace) == 12 and {tp for _, tp, _ in by_trace} == {"1", "2"}
    assert {t for _, _, t in by_trace} == {*RANDOM_TRACES, *DESIGNED}
    for (model, tp, trace), tput in by_trace.items():
        auto = tput.pop("auto (Chameleon)")
        assert len(tput) == 4
        if trace in DESIGNED:
            assert auto > 1.05 * tput[DESIGNED[trace]], (model, tp, trace, auto, tput)
            continue
        for policy, value in tput.items():
            assert auto >= value * (1 - AUTO_TOLERANCE), (trace, policy, auto, value)
    ratios = read_csv(results / "table2_ratios.csv")
    for r in ratios:
        if not r["trace"].startswith(RANDOM_TRACES):
            continue
        for key in ("auto / Oobleck-like", "auto / ReCycle-like"):
            assert 1 - AUTO_TOLERANCE <= float(r[key]) < 100, r
        assert float(r["paper: auto / Oobleck"]) == PAPER_RATIOS["oobleck"]
        assert float(r["paper: auto / ReCycle"]) == PAPER_RATIOS["recycle"]


def test_table2_ends_with_auto_over_the_best_fixed_policy_from_its_summary(results):
    summary = read_csv(results / "table2_summary.csv")
    kinds = {r["trace kind"] for r in summary}
    assert kinds == {FIXED_KIND, "Poisson, MTBF 1 h", *DESIGNED, "all traces"}
    assert all(len([r for r in summary if r["trace kind"] == k]) == 5 for k in kinds)
    for r in summary:
        assert float(r["min"]) <= float(r["median"]) <= float(r["max"]), r
    [best] = [r for r in summary if r["trace kind"] == "all traces" and r["ratio"] == BEST_FIXED]
    assert best["traces"] == "12"
    last = (results / "table2.md").read_text().rstrip().splitlines()[-1]
    m = re.fullmatch(r"- auto vs the best fixed policy: min (\d+\.\d{3}), median (\d+\.\d{3}) "
                     r"over (\d+) traces \(simulated\)", last)
    assert m, last
    assert m.groups() == (f"{float(best['min']):.3f}", f"{float(best['median']):.3f}", "12")


def _options(seeds: int, span_h: float = 48.0) -> Options:
    return Options(Path("."), False, "", span_h, 1.0, 1.0, 30.0, 5.0, 0, 0, seeds)


def test_traces_simulated_in_several_processes_have_the_outcomes_of_one():
    setups = [cluster.setup(TRACE_MODEL)]
    one = trace_outcomes(_options(1, span_h=1.0), setups)
    two = trace_outcomes(dataclasses.replace(_options(1, span_h=1.0), jobs=2), setups)
    assert one == two and len(one[1]) == len(one[0][setups[0].label]) * len(simulate.POLICIES)


def test_the_full_trace_set_has_every_kind_at_each_seed_under_distinct_names():
    s = cluster.setup(TRACE_MODEL)
    ks = trace_set(_options(3), s)
    per_seed = len(traces.FIXED_INTERVALS_H) + 1 + len(DESIGNED)
    assert len(ks) == 3 * per_seed and len({k.trace.name for k in ks}) == len(ks)
    assert [k.seed for k in ks] == [seed for seed in range(3) for _ in range(per_seed)]
    assert {k.kind for k in ks} == {FIXED_KIND, "Poisson, MTBF 1 h", *DESIGNED}
    assert all(k.trace.span_h == 48.0 for k in ks)


@pytest.mark.parametrize("model,tp", [(TRACE_MODEL, 1), ("6.7B", 2), ("13B", 4)])
def test_a_stage_outage_loses_three_replicas_of_one_stage_within_minutes_for_3_h(model, tp):
    stages = traces.stage_groups(cluster.setup(model, tp).plan)
    for seed in range(5):
        t = traces.stage_outage(stages, 48.0, seed)
        fails = [e for e in t.events if e.kind == "fail"]
        [stage] = [j for j, groups in enumerate(stages)
                   if {e.gpu for e in fails} <= {g for grp in groups for g in grp}]
        groups = {i for i, grp in enumerate(stages[stage]) for e in fails if e.gpu in grp}
        assert len(fails) == 3 and len({e.gpu for e in fails}) == 3
        assert len(groups) == min(3, len(stages[stage]))  # distinct replicas where there are 3
        assert 2 / 60 <= fails[-1].hour - fails[0].hour <= 10 / 60
        back = {e.gpu: e.hour for e in t.events if e.kind == "rejoin"}
        assert all(math.isclose(back[e.gpu] - e.hour, 3.0) for e in fails)
        assert t.repair_h == 3.0


def test_the_executed_stage_outage_is_table_2s_at_every_iterations_an_hour(tmp_path):
    """tools/bench/traces.py --stage-outage executes table 2's designed trace, not one of its
    own: the same GPUs of one stage in the same order, an iteration apart at least, each back
    after 3 hours of iterations. There the model has auto leave the reroute that piles three
    replicas' micro-batches on the stage's last one for hours."""
    c = executed.Config(8, 2, 33.0, executed.default_profile(tmp_path / "device.json"), "", 12)
    pace = predict_plan(c.plan, c.device).iteration_ms
    for seed in range(3):
        t = executed.stage_outage(48, 12, c.plan, seed)
        hours = traces.stage_outage(traces.stage_groups(c.plan), 4.0, seed)
        assert [k.rank for k in t.kills] == [e.gpu for e in hours.events if e.kind == "fail"]
        at = [k.iteration for k in t.kills]
        assert executed.FIRST_KILL <= at[0] and all(b > a for a, b in zip(at, at[1:]))
        assert t.repair == 36 and at[-1] - at[0] <= 3
        sps = {p.name: executed.predicted(t, c, p, pace, c.device, 0.0).samples_per_s(
            c.global_batch) for p in simulate.POLICIES if p.name in ("auto", "recycle")}
        assert sps["auto"] > 1.1 * sps["recycle"]


@pytest.mark.parametrize("argv, says", [
    (["--skip-fixed"], "--skip-fixed leaves no trace"),
    (["--skip-fixed", "--stage-outage", "--iters", "9"], "leave no room for the stage outage"),
])
def test_executed_traces_that_cannot_be_placed_are_one_line_and_exit_2(argv, says, tmp_path,
                                                                         capsys):
    bench = importlib.import_module("tools.bench.traces")
    assert bench.main(argv + ["--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.strip().count("\n") == 0


def test_hourly_losses_alternate_between_two_stages_and_are_back_in_5_minutes():
    stages = traces.stage_groups(cluster.setup(TRACE_MODEL).plan)
    stage_of = {g: j for j, groups in enumerate(stages) for grp in groups for g in grp}
    for seed in range(5):
        t = traces.alternating_stages(stages, 12.0, seed)
        fails = [e for e in t.events if e.kind == "fail"]
        assert [e.hour for e in fails] == [float(k) for k in range(1, 12)]
        visited = [stage_of[e.gpu] for e in fails]
        assert visited[0] != visited[1] and visited == visited[:2] * 5 + visited[:1]
        back = {(e.gpu, round(e.hour - 5 / 60, 9)) for e in t.events if e.kind == "rejoin"}
        assert back == {(e.gpu, round(e.hour, 9)) for e in fails}


def assert_up_when_failed_and_back_after(t: traces.Trace, repair_h: float) -> None:
    """Each failure hits a GPU that is up, and that GPU is back `repair_h` later."""
    down: dict[int, float] = {}
    for e in t.events:
        if e.kind == "fail":
            assert e.gpu not in down
            down[e.gpu] = e.hour
        else:
            assert math.isclose(e.hour - down.pop(e.gpu), repair_h)


@pytest.mark.parametrize("checkpoint_min", [30.0, 60.0, 20.0])
def test_losses_fall_just_after_then_just_before_a_checkpoint(checkpoint_min):
    every = checkpoint_min / 60
    t = traces.around_checkpoints(cluster.GPUS, 48.0, every, 1.0, seed=1)
    fails = [e for e in t.events if e.kind == "fail"]
    assert len(fails) >= 48 / 2 - 1  # one every 1.5 h, or every 2 h with hourly checkpoints
    offsets = [e.hour - round(e.hour / every) * every for e in fails]
    assert all(math.isclose(x, 2 / 60 if i % 2 == 0 else -2 / 60, abs_tol=1e-9)
               for i, x in enumerate(offsets))
    assert_up_when_failed_and_back_after(t, 1.0)


def test_memory_estimates_are_positive_and_flag_what_does_not_fit(results):
    for r in read_csv(results / "table4.csv"):
        device = float(r["device GiB"])
        assert 0 < float(r["failure-free GiB"]) < device
        over = [s for s in cluster.FIXED if r[f"{s} GiB"] and float(r[f"{s} GiB"]) > device]
        assert r["over device memory"] == (", ".join(over) or "none")


def test_without_failures_every_policy_trains_at_its_failure_free_speed():
    s = cluster.setup(TRACE_MODEL)
    quiet = traces.Trace("none", 2.0, 1.0, 1.0, ())
    for policy in simulate.POLICIES:
        out = simulate.simulate(s, policy, quiet, simulate.Costs(30, 5))
        expected = 2.0 * 3.6e6 / simulate.failure_free_ms(s, policy)
        assert math.isclose(out.iterations, expected)
        assert out.transition_h == out.stalled_h == 0.0
    assert simulate.failure_free_ms(s, simulate.POLICIES[3]) > s.iteration_ms  # Bamboo's upkeep


def test_a_trace_fails_only_gpus_that_are_up_and_brings_each_back_after_its_repair():
    t = traces.fixed_interval(1 / 12, 4, 6.0, 1.0)
    assert_up_when_failed_and_back_after(t, 1.0)
    assert t.failures < 6 * 12  # with all 4 GPUs down, a failure has nothing to hit
    assert traces.poisson(1.0, 32, 24.0, 1.0) == traces.poisson(1.0, 32, 24.0, 1.0)


def test_a_poisson_trace_is_the_same_for_an_integer_or_a_float_mean():
    """table 2 passes its Poisson mean as an int, tools/bench/traces.py's --poisson as a
    float: both draw the same trace."""
    assert traces.poisson(12, 32, 24.0, 1.0) == traces.poisson(12.0, 32, 24.0, 1.0)
    plan = ExecutionPlan.failure_free(8, 1, 2, 8, 1, 32)
    assert executed.poisson(48, 12, plan, 12) == executed.poisson(48, 12.0, plan, 12)
    assert executed.poisson(48, 12, plan, 12) != executed.poisson(48, 12.5, plan, 12)


def test_a_planned_move_charges_only_the_state_a_gpu_lacks():
    """Onto the same plan on the same GPUs nothing moves (the output layer stays on the last
    stage's GPUs); a new GPU on the last stage receives its whole stage, the output layer
    once."""
    s = cluster.setup(TRACE_MODEL)
    job = simulate._Job(s, simulate.POLICIES[0], traces.Trace("none", 1.0, 1.0, 1.0, ()),
                        simulate.Costs(30, 5))
    gpus = list(range(s.plan.world_size))
    assert job._move_ms(s.plan, gpus) == switch_ms(s.profile)
    last = s.plan.pipelines[0].stages[-1].ranks[0]
    gpus[last] = s.plan.world_size          # a GPU the running plan does not use
    assert job._move_ms(s.plan, gpus) == pytest.approx(
        switch_ms(s.profile) + s.profile.p2p_ms_per_mib * STATE_BYTES_PER_PARAM *
        stage_params(s.plan, last, s.profile.shape) / MIB)



def test_the_work_a_restart_lost_stays_lost_when_an_event_comes_during_its_redo():
    """A restart at 0.45 h loses every iteration since the checkpoint (at 0); the GPU is back
    at 0.5 h, while the job still trains them again. The rejoin moves the job, but the lost
    iterations are still to train again: the job ends at most at the failure-free count less
    them. (Charged as a wait that the rejoin cut short, they were given back: the job ended
    0.45 h of work ahead of that bound.)"""
    s = cluster.setup(TRACE_MODEL)
    restart = simulate.Policy("restart", "restart only", ("restart",))
    gpu = s.plan.pipelines[0].stages[1].ranks[0]
    trace = traces.Trace("a loss, back during the redo", 1.0, 1.0, 0.05,
                         (traces.Event(0.45, "fail", gpu), traces.Event(0.5, "rejoin", gpu)))
    out = simulate.simulate(s, restart, trace, simulate.Costs(30, 5))
    failure_free = 3.6e6 / s.iteration_ms
    lost = int(0.45 * failure_free) + 1        # the interrupted iteration included
    assert lost < round(30 * 6e4 / s.iteration_ms)   # no checkpoint written yet
    assert out.recoveries == {"restart": 1} and out.replans == 1
    assert out.iterations <= failure_free - lost


def _job_losing_two_stages(policy: str) -> tuple[simulate._Job, int, int]:
    """A simulated job of TRACE_MODEL under `policy` (an hour's span, 1 h MTBF, 0.1 h repair)
    and two GPUs of different stages and pipelines to lose."""
    s = cluster.setup(TRACE_MODEL)
    job = simulate._Job(s, next(p for p in simulate.POLICIES if p.name == policy),
                        traces.Trace("two losses", 1.0, 1.0, 0.1, ()), simulate.Costs(30, 5))
    return job, s.plan.pipelines[0].stages[1].ranks[0], s.plan.pipelines[1].stages[0].ranks[0]


def test_megatron_takes_a_gpu_back_at_its_next_relaunch_not_before():
    """Megatron loses GPU a at 0.2 h and relaunches onto the others; a is back at 0.3 h and
    the job runs on without it (a running Megatron job cannot grow: no move, no relaunch
    paid); b is lost at 0.6 h and that relaunch plans over every GPU up, a included, as the
    executed traces' Megatron does."""
    job, a, b = _job_losing_two_stages("megatron")
    job.advance(0.2 * 3.6e6)
    job.fail(a)
    assert a not in job.gpus
    after_a = (list(job.gpus), job.resume)
    job.advance(0.3 * 3.6e6)
    job.rejoin(a)
    assert (job.gpus, job.resume) == after_a and job.out.replans == 0
    job.advance(0.6 * 3.6e6)
    job.fail(b)
    assert a in job.gpus and b not in job.gpus
    assert job.out.recoveries == {"restart": 2}
    assert job.resume - 0.6 * 3.6e6 >= 5 * 6e4       # the relaunch paid again


@pytest.mark.parametrize("policy", ["recycle", "megatron"])
def test_the_time_to_train_a_set_number_of_iterations_is_where_the_throughput_reaches_it(
        policy):
    """An executed job trains a set number of iterations, however long it takes: the
    prediction is the time the simulated job takes to train them. Without events, exactly
    the failure-free time; under a loss (and with Megatron, the work since the checkpoint
    trained again), later, and the simulated span of that length trains exactly that many
    (the events after the failure-free span included)."""
    s = cluster.setup(TRACE_MODEL)
    p = next(q for q in simulate.POLICIES if q.name == policy)
    costs = simulate.Costs(30, 5)
    n = 3.6e6 / s.iteration_ms                 # a failure-free hour
    none = traces.Trace("none", 1.0, 1.0, 1.0, ())
    assert simulate.train_until(s, p, none, costs, n).span_h == pytest.approx(1.0)
    gpu = s.plan.pipelines[0].stages[1].ranks[0]
    trace = traces.Trace("a loss", 1.0, 1.0, 0.1,
                         (traces.Event(0.5, "fail", gpu), traces.Event(0.6, "rejoin", gpu)))
    trained = simulate.train_until(s, p, trace, costs, n)
    took = trained.span_h
    assert took > 1.0 and trained.samples_per_s(s.global_batch) == pytest.approx(
        n * s.global_batch / (took * 3600))
    assert sum(trained.recoveries.values()) == 1
    out = simulate.simulate(s, p, dataclasses.replace(trace, span_h=took), costs)
    assert out.iterations == pytest.approx(n)


def test_a_loss_is_filled_from_the_gpus_the_plan_left_out():
    """1.3B on 32 GPUs (8 x 4) loses GPU 18: auto re-parallelizes onto 4 pipelines of 7
    stages, leaving 3 healthy GPUs out. At the next loss those wait as spares, as the job's
    do, and auto substitutes one: the 4 x 7 layout kept, 2.24 ms a sample, where the best plan
    over the survivors alone (what the simulation offered before) runs 2.62 ms a sample."""
    s = cluster.setup("1.3B")
    auto = simulate.POLICIES[0]
    job = simulate._Job(s, auto, traces.Trace("two losses", 1.5, 0.5, 3.0, ()),
                        simulate.Costs(30, 5))
    job.advance(0.5 * 3.6e6)
    job.fail(18)
    assert cluster.layout(job.plan) == "4 x 7"
    spares = job._spares()
    assert sorted(spares) == sorted(set(range(32)) - set(job.gpus) - {18})
    assert len(spares) == 3
    kept_ms = job.iteration_ms
    job.advance(1.0 * 3.6e6)
    lost = {job.gpus.index(10)}
    alone = choose(candidates(job.plan, lost, s.profile, job.situation(), auto.strategies))
    job.fail(10)
    assert job.out.recoveries == {"reparallelize": 1, "substitute": 1}
    assert 10 not in job.gpus and len(job.gpus) == 28 and spares[0] in job.gpus
    assert cluster.layout(job.plan) == "4 x 7" and job.iteration_ms == kept_ms

    def per_sample(ms: float) -> float:
        return round(ms / s.global_batch, 2)

    assert (per_sample(job.iteration_ms), per_sample(alone.iteration_ms)) == (2.24, 2.62)


def test_the_simulated_job_tells_the_planner_when_an_earlier_loss_is_back():
    """As the job's clock does (planning.JobClock): a GPU lost 24 minutes ago, with a 1 h
    repair, is back in 36 minutes, before a failure now would be repaired; once it has
    rejoined, a failure's own hour is left."""
    s = cluster.setup("1.3B")
    job = simulate._Job(s, simulate.POLICIES[0], traces.Trace("losses", 3.0, 1.0, 1.0, ()),
                        simulate.Costs(30, 5))
    job.advance(0.5 * 3.6e6)
    job.fail(18)
    assert job.situation().repair_hours == pytest.approx(1.0)   # at its own failure
    job.advance(0.9 * 3.6e6)
    assert job.situation().repair_hours == pytest.approx(0.6)
    job.rejoin(18)
    assert job.situation().repair_hours == pytest.approx(1.0)


def hourly_loss_of_13b() -> tuple[cluster.Setup, set[int], Situation]:
    """13B at tp 4 (2 pipelines x 4 stages) loses GPU 15 mid-interval; failures every hour
    on average, each GPU back after 1 h."""
    s = cluster.setup("13B", 4)
    every = round(30 * 6e4 / s.iteration_ms)
    return s, {15}, Situation(iteration=every + every // 2, checkpoint_iteration=every,
                              remaining_iterations=20 * every, mtbf_hours=1.0,
                              failure_free_ms=s.iteration_ms, save_interval=every,
                              repair_hours=1.0)


def test_auto_re_parallelizes_onto_a_replicated_layout_where_the_fastest_is_fragile():
    """The fastest plan over the 7 surviving groups is one pipeline of 7 stages: any next loss
    leaves a layer without a holder and forces a restart, half a save interval lost, with a
    1 - exp(-1) chance before the repair. Auto used to take each strategy's fastest layout
    (Oobleck's rule) and only then weigh that risk, so it took this one although its own
    objective rates a slower replicated layout cheaper; in the Poisson trace (13B tp 4, seed
    0) 13 of its 41 recoveries were such restarts, and auto trailed Oobleck by 1.1%."""
    s, lost, situation = hourly_loss_of_13b()
    fastest = candidates(s.plan, lost, s.profile, situation, ("reparallelize",),
                         by_objective=False)[0]
    weighed = candidates(s.plan, lost, s.profile, situation, ("reparallelize",))[0]
    assert cluster.layout(fastest.plan) == "1 x 7 (tp 4)" and fatal_share(fastest.plan, False) == 1.0
    assert fatal_share(weighed.plan, False) == 0.0
    assert weighed.iteration_ms > fastest.iteration_ms and weighed.total_ms < fastest.total_ms
    # without an MTBF the window's cost is its iterations alone: the fastest layout again
    calm = dataclasses.replace(situation, mtbf_hours=None)
    assert candidates(s.plan, lost, s.profile, calm, ("reparallelize",))[0].plan == \
        fastest.plan


def test_losses_at_fixed_hourly_intervals_teach_auto_that_none_comes_before_its_repair():
    """Oobleck's hourly trace, each GPU back after 1 h: the next loss never comes before the
    repair. After the first loss (no record yet: the exponential law, a replicated layout)
    the job's record says so, and auto takes the fastest layout, as Oobleck does, where the
    replicated one paid 11% a degraded hour for a restart that never came (auto trailed
    Oobleck by 10% with the law alone)."""
    s, lost, situation = hourly_loss_of_13b()
    known = candidates(s.plan, lost, s.profile, dataclasses.replace(
        situation, failure_record=(0, 3)), ("reparallelize",))[0]
    assert cluster.layout(known.plan) == "1 x 7 (tp 4)"
    auto = simulate.POLICIES[0]
    trace = traces.fixed_interval(1.0, cluster.GPUS, 12.0, 1.0)
    job = simulate._Job(s, auto, trace, simulate.Costs(30, 5))
    layouts = []
    for event in trace.events[:5]:     # the first three losses and two rejoins
        job.until(event.hour * 3.6e6)
        (job.fail if event.kind == "fail" else job.rejoin)(event.gpu)
        if event.kind == "fail":
            layouts.append((job.failure_record(), fatal_share(job.plan, False)))
    assert layouts == [((0, 0), 0.0), ((0, 1), 1.0), ((0, 2), 1.0)]

def test_a_bad_table_name_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "tools.reproduce", "table9"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "unknown table 'table9'" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("argv,says", [
    (["table1", "--span-h", "-1"], "must be above 0"),
    (["table2", "--repair-h", "soon"], "is not a number"),
    (["all", "--seed", "x"], "invalid int value"),
    (["table2", "--executed-ranks", "3"], "--executed-ranks 3: 0, or an even number"),
    (["table2", "--seeds", "0"], "--seeds 0: at least 1"),
    (["table2", "--jobs", "0"], "--jobs 0: at least 1"),
    ([], "the following arguments are required"),
])
def test_bad_flag_values_are_one_line_and_exit_2(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and says in err


def test_an_out_path_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["table1", "--out", str(f)])
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_the_host_time_is_fitted_so_the_failure_free_plan_takes_its_measured_time(tmp_path):
    """The emulation pads each op to the device's time but not the executor's own work
    between ops: the failure-free run measured 2.0% above its prediction. The device the
    prediction decides on keeps it as the job's calibration does, a per-iteration overhead;
    the clock the plans' iterations are timed on, as a host time per forward or backward op.
    Both bring the failure-free prediction to the run's pace (its wall time an iteration,
    checkpoint saves included: the predicted throughput is the measured one); the clock
    charges more on a plan that runs more ops a rank (a 2 x 3 restart plan of 16
    micro-batches a pipeline measured 3412 ms, predicted 3227 ms without it). A run faster than
    predicted fits no op time and a negative overhead."""
    c = executed.Config(8, 2, 33.0, executed.default_profile(tmp_path / "device.json"), "", 12)
    predicted = predict_plan(c.plan, c.device).iteration_ms

    def fitted(pace_ms: float) -> executed.Comparison:
        ff = executed.Measured("failure-free", "none", 48, 47 * pace_ms / 1e3,
                               47 * c.global_batch / (47 * pace_ms / 1e3), [],
                               median_iteration_ms=0.99 * pace_ms)
        return executed.Comparison(c, [], [], failure_free=[ff])

    cmp = fitted(1.02 * predicted)
    assert cmp.op_overhead_ms > 0
    device, clock = cmp.device("a trace", "auto"), cmp.clock("a trace", "auto")
    assert device.iteration_overhead_ms == pytest.approx(0.02 * predicted)
    for d in (device, clock):
        assert predict_plan(c.plan, d).iteration_ms == pytest.approx(1.02 * predicted)
    assert cmp.predicted_failure_free == pytest.approx(cmp.failure_free_samples_per_s)
    restart = replan(c.plan, {3}, c.device)
    assert predict_plan(restart, clock).iteration_ms - \
        predict_plan(restart, device).iteration_ms > 0.01 * predicted
    slower = fitted(0.99 * predicted)
    assert slower.op_overhead_ms == 0.0 and slower.iteration_overhead_ms < 0


def test_the_clock_times_the_plans_the_job_decides_on(tmp_path):
    """A prediction with a clock (Comparison.clock) makes the decisions it makes without one,
    the same recoveries and moves; only the time each plan's iterations take is the
    clock's."""
    c = executed.Config(8, 2, 33.0, executed.default_profile(tmp_path / "device.json"), "", 12)
    trace = executed.trace_set(48, 12, 12.0, c.plan, 12, 0)[0]
    policy = next(p for p in simulate.POLICIES if p.name == "oobleck")
    pace = predict_plan(c.plan, c.device).iteration_ms
    plain = executed.predicted(trace, c, policy, pace, c.device, 0.0)
    clock = dataclasses.replace(c.device, op_overhead_ms=20.0)
    timed = executed.predicted(trace, c, policy, pace, c.device, 0.0, clock=clock)
    assert (timed.recoveries, timed.replans) == (plain.recoveries, plain.replans)
    assert plain.recoveries["reparallelize"] >= 1
    assert timed.samples_per_s(c.global_batch) < plain.samples_per_s(c.global_batch)


def test_executed_runs_saved_and_loaded_are_predicted_alike(tmp_path):
    """tools/bench/traces.py --save-runs keeps what the predictions are made from (each run's
    measurements, the device, the traces); --from-runs predicts them again without running."""
    c = executed.Config(8, 2, 33.0, executed.default_profile(tmp_path / "device.json"), "", 12)
    trs = executed.trace_set(48, 12, 12.0, c.plan, 12, 0)
    policies = [p for p in simulate.POLICIES if p.name in ("auto", "megatron")]
    ff = executed.Measured("failure-free", "none", 48, 47 * 2.8, 47 * c.global_batch / (47 * 2.8),
                           [4.0, 3.9], median_iteration_ms=2790.0)
    cmp = executed.Comparison(c, trs, policies, [ff])
    for t in trs:
        cmp.runs[t.name, "auto"] = [executed.Measured(
            "auto", t.name, 48, 160.0, 9.6, [4.0, 3.9], recoveries=Counter(reroute=3),
            rejoins=3, recovery_ms=[900.0, 1100.0, 1000.0], median_iteration_ms=2800.0)]
        cmp.runs[t.name, "megatron"] = [executed.Measured(
            "megatron", t.name, 48, 210.0, 7.3, [4.0, 3.9], recoveries=Counter(relaunch=3),
            relaunch_s=[9.5, 10.1], median_iteration_ms=2790.0)]
    cmp.predict()
    (tmp_path / "load").mkdir()
    back = executed.Comparison.from_json(cmp.to_json(), tmp_path / "load")
    back.predict()
    assert back.runs == cmp.runs and back.failure_free == cmp.failure_free
    assert back.traces == cmp.traces and back.policies == cmp.policies
    for key in cmp.predicted:
        assert back.predicted_samples_per_s(*key) == cmp.predicted_samples_per_s(*key) > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"config": {}}')
    run = subprocess.run([sys.executable, "tools/bench/traces.py", "--from-runs", str(bad)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0
    assert "not a file --save-runs wrote" in run.stderr and "Traceback" not in run.stderr


def test_a_fixed_policy_admits_at_once_and_a_waiting_joiner_takes_the_next_lost_place():
    """As the job's forced strategies do (decider.Decider): a GPU back ("up") waits for its
    admission, a spare meanwhile, and a loss before it is admitted is absorbed by it taking
    the lost place (substitute, the layout kept); a rejoin with another GPU still down is
    admitted at once (the strategy absorbing the empty place), where auto may stay."""
    s = cluster.setup(TRACE_MODEL)
    oobleck = next(p for p in simulate.POLICIES if p.name == "oobleck")
    a, b, c = (s.plan.pipelines[0].stages[1].ranks[0], s.plan.pipelines[1].stages[0].ranks[0],
               s.plan.pipelines[2].stages[2].ranks[0])
    job = simulate._Job(s, oobleck, traces.Trace("losses", 1.0, 1.0, 0.1, ()),
                        simulate.Costs(30, 5))

    def then(hour: float, kind: str, gpu: int) -> None:
        job.advance(hour * 3.6e6)
        job.event(traces.Event(hour, kind, gpu))

    then(0.1, "fail", a)
    assert job.out.recoveries == {"reparallelize": 1} and a not in job.gpus
    then(0.2, "up", a)
    then(0.21, "fail", b)
    assert job.out.recoveries["substitute"] == 1 and a in job.gpus and b not in job.gpus
    then(0.22, "rejoin", a)                # admitted already, as the substitute
    assert job.out.replans == 0
    then(0.3, "fail", c)
    then(0.4, "up", b)
    then(0.41, "rejoin", b)                # c still down: admitted at once all the same
    assert job.out.replans == 1 and b in job.gpus and c not in job.gpus


def test_a_joiner_is_admitted_at_a_boundary_and_a_loss_during_its_admission_loses_nothing():
    """As the leader admits (decider.Decider.admission_time): a GPU that asks during an
    iteration is admitted at the end of the next one, an iteration boundary, and a loss
    during that admission's move starts its recovery from the boundary: no iteration lost
    (the executed every-12 trace met this in 5 of 6 runs; placed 1.5 failure-free iterations
    after the ask, at no boundary, the admission lost work the job never lost)."""
    job, a, b = _job_losing_two_stages("recycle")
    job.until(0.1 * 3.6e6)
    job.fail(a)
    job.until(0.2 * 3.6e6)
    job.asks(a)
    asked = job.out.iterations
    boundary = math.floor(asked) + 2
    at = max(job.t, job.resume) + (boundary - asked) * job.iteration_ms
    job.until(at - 1.0)
    assert job.out.replans == 0 and a not in job.gpus and a in job._spares()
    job.until(at + 1.0)
    assert job.out.replans == 1 and a in job.gpus and job.out.iterations == boundary
    assert job.resume > job.t                  # the admission's move is under way
    job.fail(b)
    assert job.out.recoveries == {"reroute": 2} and job.out.iterations == boundary


@pytest.mark.parametrize("repair,recoveries", [(12, {"reroute": 2}),
                                               (11, {"reroute": 1, "substitute": 1})])
def test_an_executed_joiner_waits_for_its_admission_as_a_spare(tmp_path, repair, recoveries):
    """The prediction of an executed trace: a killed slot's worker asks to join at its repair
    time and is admitted at the end of the next iteration; a kill at the repair instant comes
    first (the repair counts from the kill as signalled), one within the wait is absorbed by
    the joiner taking the lost place."""
    c = executed.Config(8, 2, 33.0, executed.default_profile(tmp_path / "device.json"), "", 12)
    stages = {c.plan.position(r).stage: r for r in c.plan.ranks}
    trace = executed.ExecutedTrace("two kills", 36, 12, repair, (
        executed.Kill(12, stages[0]), executed.Kill(24, stages[1])))
    recycle = next(p for p in simulate.POLICIES if p.name == "recycle")
    out = executed.predicted(trace, c, recycle, 2800.0, c.device, 0.0)
    assert out.recoveries == recoveries and out.span_h < math.inf
