"""`python -m tools.reproduce`: the analytical tables (1, 2 without its executed traces, 4) in
their --quick form, the trace simulation's accounting, and one-line errors for bad input. The
tables that launch CPU runs are in tests/e2e/test_reproduce_runs.py and
tests/e2e/test_executed_traces.py."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import MIB, stage_params, switch_ms
from chameleon_ext.planning.planner import STATE_BYTES_PER_PARAM
from tests.launch import REPO, read_csv
from tools.reproduce import cluster, executed, simulate, traces
from tools.reproduce.__main__ import main
from tools.reproduce.tables import AUTO_TOLERANCE, PAPER_RATIOS, TRACE_MODEL


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


def test_auto_is_at_least_every_fixed_policy_on_every_trace(results):
    """On the 3 quick traces, for the trace model at tp 1 and a model at its typical tp."""
    rows = read_csv(results / "table2.csv")
    by_trace: dict[tuple[str, str, str], dict[str, float]] = {}
    for r in rows:
        by_trace.setdefault((r["model"], r["tp"], r["trace"]), {})[r["policy"]] = \
            float(r["samples/s"])
    assert len(by_trace) == 6 and {tp for _, tp, _ in by_trace} == {"1", "2"}
    for trace, tput in by_trace.items():
        auto = tput.pop("auto (Chameleon)")
        assert len(tput) == 4
        for policy, value in tput.items():
            assert auto >= value * (1 - AUTO_TOLERANCE), (trace, policy, auto, value)
    ratios = read_csv(results / "table2_ratios.csv")
    for r in ratios:
        for key in ("auto / Oobleck-like", "auto / ReCycle-like"):
            assert 1 - AUTO_TOLERANCE <= float(r[key]) < 100, r
        assert float(r["paper: auto / Oobleck"]) == PAPER_RATIOS["oobleck"]
        assert float(r["paper: auto / ReCycle"]) == PAPER_RATIOS["recycle"]


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
    down: dict[int, float] = {}
    for e in t.events:
        if e.kind == "fail":
            assert e.gpu not in down
            down[e.gpu] = e.hour
        else:
            assert math.isclose(e.hour - down.pop(e.gpu), 1.0)
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
