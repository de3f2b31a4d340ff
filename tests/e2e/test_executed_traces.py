"""Table 2's executed traces (`python -m tools.reproduce table2 --quick --executed-ranks 4`):
one kill on 4 emulated ranks (the smallest job whose stages keep a replica after a loss;
tools/bench/traces.py runs 8), run by a real job under auto, ReCycle-like (reroute only) and
Megatron, whose job is relaunched with --load; every run keeps the failure-free losses, and the
table sets auto's measured ratios beside the predicted ones and the paper's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, read_csv
from tools.reproduce.simulate import POLICIES
from tools.reproduce.tables import EXECUTED_QUICK, PAPER_RATIOS

QUICK = [p for p in POLICIES if p.name in EXECUTED_QUICK["policies"]]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("results")
    # Bounds 5 launches of 4 processes (a failure-free run, 2 policies, Megatron's 2) of 9
    # short iterations each on 2 shared cores, about 12 s each; far beyond, a run hangs.
    run = subprocess.run([sys.executable, "-m", "tools.reproduce", "table2", "--quick",
                          "--executed-ranks", "4", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=850, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_every_policy_ran_the_trace_on_the_failure_free_losses(results):
    rows = read_csv(results / "table2_executed.csv")
    assert [r["policy"] for r in rows] == [p.label for p in QUICK]
    for r in rows:
        assert r["kills (launch rank at iteration)"].count("rank") == 1
        assert float(r["loss vs failure-free"]) <= 1e-5, r
        assert float(r["measured samples/s"]) > 0 and float(r["predicted samples/s (model)"]) > 0
        assert 0 <= float(r["overrun %"]) <= 100
    by = {r["policy"]: r for r in rows}
    assert by[QUICK[-1].label]["recoveries"] == "relaunch 1"     # Megatron: relaunched once
    for p in QUICK[:-1]:                                          # the others: in-process
        assert "relaunch" not in by[p.label]["recoveries"] and by[p.label]["recoveries"]
    # each run's metrics file stays beside the report
    assert len(list((results / "runs" / "traces").rglob("*.jsonl"))) >= 1 + len(QUICK)


def test_the_ratios_set_measured_beside_predicted_and_the_paper(results):
    rows = read_csv(results / "table2_executed_ratios.csv")
    assert [r["ratio"] for r in rows] == [f"auto / {p.label}" for p in QUICK[1:]]
    for r in rows:
        assert 0 < float(r["measured"]) < 100 and 0 < float(r["predicted (model)"]) < 100
    paper = {r["ratio"]: r["paper"] for r in rows}
    assert float(paper["auto / " + QUICK[1].label]) == PAPER_RATIOS["recycle"]
    assert paper["auto / " + QUICK[2].label] == ""                  # none for Megatron
    section = (results / "table2.md").read_text()
    assert "**Executed traces (measured):**" in section and "a prediction" in section
