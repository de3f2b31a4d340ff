"""Kill, then rejoin: chameleon-launch --max-restarts starts the killed worker again under a new
rank; the job reroutes around the loss, admits the newcomer at an iteration boundary, hands it
its layers and Adam moments from the replicas, and goes back to the failure-free plan, on the
failure-free loss trajectory."""

import pytest

from chameleon_ext.plan import ExecutionPlan
from tests.launch import SMALL_MODEL, assert_close, last_losses, run_chameleon, run_job

pytestmark = pytest.mark.slow
ITERS = 80  # the restarted worker needs a few seconds to start: the job must outlast them


@pytest.mark.timeout(400)
def test_a_restarted_worker_rejoins_and_the_plan_returns_to_failure_free(small_data, tmp_path):
    common = SMALL_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                            "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS),
                            "--data-path", small_data, "--split", "100,0,0",
                            "--log-interval", "20"]
    ref = run_job(4, common, tmp_path, name="ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = run_chameleon(4, common + [
        "--chameleon", "--chameleon-strategy", "reroute",
        "--chameleon-inject", "kill:rank=3,iter=5,phase=backward"], tmp_path, name="rejoin",
        launcher_args=["--max-restarts", "1"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restarted worker rank 3 as rank 4" in run.stderr
    events = run.metrics
    assert_close(last_losses(events), ref.losses())
    iters = {e["iteration"]: e for e in events if e["event"] == "iteration"}
    assert [iters[i]["consumed_samples"] for i in sorted(iters)] == \
        [16 * i for i in range(1, ITERS + 1)]
    rejoin = [e for e in events if e["event"] == "rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["joined"] == [4] and rejoin[0]["world"] == 4
    assert rejoin[0]["moved_bytes"] > 0          # the newcomer's whole stage, from a replica
    plan = ExecutionPlan.from_dict(rejoin[0]["plan"])
    plan.generation = 0
    assert plan == ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)
    after = [iters[i] for i in sorted(iters) if i > rejoin[0]["iteration"]]
    assert after and all(e["world"] == 4 and e["generation"] == 2 for e in after)
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]
