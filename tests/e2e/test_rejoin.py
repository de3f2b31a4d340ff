"""Kill, then rejoin: chameleon-launch --max-restarts starts the killed worker again under a new
rank; the job reroutes around the loss, admits the newcomer at an iteration boundary, hands it
its layers and Adam moments from the replicas, and goes back to the failure-free plan, on the
failure-free loss trajectory."""

import re
import time

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import ModelShape
from tests.launch import SMALL_MODEL, assert_close, last_losses, run_chameleon, run_job
from tests.profiles import synthetic_profile

pytestmark = pytest.mark.slow
ITERS = 80  # the restarted worker needs a few seconds to start: the job must outlast them


def common(data: str) -> list[str]:
    return SMALL_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                          "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS),
                          "--data-path", data, "--split", "100,0,0", "--log-interval", "20"]


@pytest.fixture(scope="module")
def ref(small_data, tmp_path_factory):
    run = run_job(4, common(small_data), tmp_path_factory.mktemp("ref"), name="ref")
    assert run.returncode == 0, run.stderr[-3000:]
    return run


# The distributed optimizer with buddy copies: rank 3's shard of stage 1 survives in its buddy,
# rank 1, which holds stage 1 whole after the reroute; the rejoin cuts it in two again and the
# newcomer's buddy copy is set up anew.
SHARDED = ["--use-distributed-optimizer", "--chameleon-shard-redundancy", "buddy"]


# Started ahead (--start-ahead), the replacement waits out of the job for its repair time
# (--restart-delay) and then joins: 6 s, about as long as a start-up here.
AHEAD = ["--restart-delay", "6", "--start-ahead", "6"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("extra,launch", [([], AHEAD), (SHARDED, [])],
                         ids=["replicated-started-ahead", "sharded-buddy"])
def test_a_restarted_worker_rejoins_and_the_plan_returns_to_failure_free(small_data, tmp_path,
                                                                         ref, extra, launch):
    run = run_chameleon(4, common(small_data) + extra + [
        "--chameleon", "--chameleon-strategy", "reroute",
        "--chameleon-inject", "kill:rank=3,iter=5,phase=backward"], tmp_path, name="rejoin",
        launcher_args=["--max-restarts", "1", *launch], timeout=300)
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
    if launch:                                   # not before its repair time
        failure = next(e for e in events if e["event"] == "failure")
        assert rejoin[0]["time"] - failure["time"] >= 6.0
    plan = ExecutionPlan.from_dict(rejoin[0]["plan"])
    plan.generation = 0
    assert plan == ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16)
    after = [iters[i] for i in sorted(iters) if i > rejoin[0]["iteration"]]
    assert after and all(e["world"] == 4 and e["generation"] == 2 for e in after)
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]


@pytest.mark.timeout(400)
def test_a_kill_during_the_admission(small_data, tmp_path, ref):
    """Rank 1 dies while the admission of the restarted rank 4 builds its world: the
    survivors and the joiner agree again without it, and the places nobody holds are rerouted;
    the job goes on with 3 ranks on the failure-free losses."""
    run = run_chameleon(4, common(small_data) + [
        "--chameleon", "--chameleon-strategy", "reroute",
        "--chameleon-inject", "kill:rank=3,iter=5,phase=backward",
        "--chameleon-inject", "kill:rank=1,iter=6,phase=rebuild"], tmp_path, name="admission",
        launcher_args=["--max-restarts", "1"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert_close(last_losses(events), ref.losses())
    fails = [e for e in events if e["event"] == "failure"]
    assert [(f["ranks"], f["during"]) for f in fails] == [([3], "step"), ([1], "admission")]
    rejoin = [e for e in events if e["event"] == "rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["joined"] == [4] and rejoin[0]["world"] == 3
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]


@pytest.mark.timeout(400)
def test_a_rejoin_after_a_takeover_from_eager_shadows_hands_over_current_state(small_data,
                                                                             tmp_path, ref):
    """Stage 0 of pipeline 0 is taken over from its eager shadow; at the admission (an
    iteration boundary, after the step) the shadows are one step old and must not be the
    newcomer's source: every replica ends bit-identical (a stale source had left the
    embedding and its Adam step count one step behind)."""
    run = run_chameleon(4, common(small_data) + [
        "--chameleon", "--chameleon-strategy", "takeover", "--chameleon-redundancy", "eager",
        "--chameleon-inject", "kill:rank=0,iter=5,phase=backward"], tmp_path, name="eager",
        launcher_args=["--max-restarts", "1"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    rejoin = [e for e in events if e["event"] == "rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["joined"] == [4] and rejoin[0]["world"] == 4
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]
    iters = {e["iteration"]: e for e in events if e["event"] == "iteration"}
    assert [iters[i]["consumed_samples"] for i in sorted(iters)] == \
        [16 * i for i in range(1, ITERS + 1)]
    # A takeover's pipeline of one stage sums in another order than two stages: differences
    # of 1e-8 that training amplifies past 1e-5 after some 30 iterations (measured), so the
    # losses are compared over the first 20.
    assert_close(last_losses(events)[:20], ref.losses()[:20])


def _short_job(data: str) -> list[str]:
    return SMALL_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                          "--train-iters", "12", "--data-path", data, "--split", "100,0,0",
                          "--log-interval", "12", "--chameleon",
                          "--chameleon-inject", "kill:rank=3,iter=5,phase=backward"]


# Each bounds a 4-process job of 12 short iterations plus a restarted worker's start-up on a
# loaded 2-core host (about 20 s); a newcomer that waited for an admission that cannot come
# would wait --chameleon-join-timeout (600 s).
@pytest.mark.timeout(200)
def test_a_worker_restarted_too_late_to_join_leaves_cleanly(small_data, tmp_path):
    """The worker is lost in the job's last iteration: the restarted one asks to join when
    no iteration boundary is left to admit it at, finds the job trained and leaves with exit
    0, and so does the job."""
    job = [a.replace("iter=5", "iter=12") for a in _short_job(small_data)]
    run = run_chameleon(4, job, tmp_path, name="late", timeout=150,
                        launcher_args=["--max-restarts", "1"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restarted worker rank 3 as rank 4" in run.stderr
    assert "the job trained its last iteration before this rank was admitted" in run.stdout
    assert not [e for e in run.metrics if e["event"] == "rejoin"]
    assert max(e["iteration"] for e in run.metrics if e["event"] == "iteration") == 12


@pytest.mark.timeout(200)
def test_a_restart_delay_keeps_the_slot_empty(small_data, tmp_path):
    """--restart-delay 60 outlasts the job: the failed slot is never started again."""
    run = run_chameleon(4, _short_job(small_data), tmp_path, name="delayed", timeout=150,
                        launcher_args=["--max-restarts", "1", "--restart-delay", "60"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restarted worker" not in run.stderr
    assert "1 restart(s) still due when the node's last worker ended: dropped" in run.stderr
    assert max(e["iteration"] for e in run.metrics if e["event"] == "iteration") == 12


@pytest.mark.timeout(400)
def test_under_auto_a_rejoin_that_moving_state_would_not_pay_for_waits(small_data, tmp_path,
                                                                         ref):
    """The given profile prices moving state between peers at 2 s per MiB and reading a
    checkpoint at 1 ms per MiB: after rank 3's loss, admitting its restarted slot now (its
    stage's state from a replica) costs more than it saves, so the leader does not: it admits
    it at the next periodic save, where every rank reads that checkpoint (a `restart` onto the
    failure-free plan, nothing moved between peers), or, if the rest of the job is too short
    to pay even for that, as a spare (the plan kept; it stands by until the end and leaves
    with exit 0). Either way the leader says why in one line, and the job keeps the
    failure-free losses."""
    profile = tmp_path / "profile.json"
    synthetic_profile(ModelShape(4, 64, 4, 32, 2, 384), layer_fwd_ms=5.0,
                      layer_bwd_input_ms=5.0, layer_bwd_weight_ms=5.0, head_fwd_ms=2.0,
                      head_bwd_ms=2.0, p2p_alpha_ms=0.05, p2p_ms_per_mib=2000.0,
                      allreduce_alpha_ms=0.1, allreduce_ms_per_mib=1.0,
                      load_ms_per_mib=1.0).save(profile)
    run = run_chameleon(4, common(small_data) + [
        "--chameleon", "--chameleon-profile", str(profile), "--save", str(tmp_path / "ckpt"),
        "--save-interval", "20", "--chameleon-inject", "kill:rank=3,iter=5,phase=backward"],
        tmp_path, name="waits", launcher_args=["--max-restarts", "1"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restarted worker rank 3 as rank 4" in run.stderr
    said = re.findall(r"\[chameleon\] rejoin after iteration \d+: (\w+)[^\n]*; predicted over "
                      r"the window: [^\n]*now [\d.]+ s, stay [\d.]+ s", run.stdout)
    assert said and "now" not in said, run.stdout[-3000:]
    events = run.metrics
    assert_close(last_losses(events), ref.losses())
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]
    [rejoin] = [e for e in events if e["event"] == "rejoin"]
    if said[-1] == "checkpoint":
        assert rejoin["iteration"] % 20 == 0 and rejoin["strategy"] == "restart"
        # the restarted rank, and the spares auto's recovery left out (a restart onto fewer
        # ranks, depending on the calibration) take their places too
        spares = next(e for e in events if e["event"] == "recovery")["spares"]
        assert 4 in rejoin["joined"] and len(rejoin["joined"]) == 1 + spares
        assert rejoin["moved_bytes"] == 0
        assert ExecutionPlan.from_dict(rejoin["plan"]).world_size == 4
    else:
        assert said[-1] == "spare"
        recovered = [e for e in events if e["event"] == "recovery"][-1]
        assert rejoin["joined"] == [] and rejoin["moved_bytes"] == 0
        assert rejoin["world"] == recovered["world"]      # the plan kept
        assert "launch rank 4 stands by as a spare" in run.stdout
        assert re.search(r"worker rank 4 \(pid \d+\) exited 0", run.stderr), run.stderr[-3000:]


@pytest.mark.timeout(200)
def test_a_worker_started_ahead_of_its_repair_waits_for_it_and_leaves_when_the_job_ends(
        small_data, tmp_path):
    """--start-ahead 60 with --restart-delay 60: the replacement starts at once, out of the
    job, and would ask to join only after the 60 s repair; the job's 12 iterations end first,
    so it leaves with exit 0 as soon as they do (the job does not wait for the repair)."""
    t0 = time.monotonic()
    run = run_chameleon(4, _short_job(small_data), tmp_path, name="ahead", timeout=150,
                        launcher_args=["--max-restarts", "1", "--restart-delay", "60",
                                       "--start-ahead", "60"])
    took_s = time.monotonic() - t0
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restarted worker rank 3 as rank 4" in run.stderr
    assert "the job trained its last iteration before this rank's repair time" in run.stdout
    assert not [e for e in run.metrics if e["event"] == "rejoin"]
    assert took_s < 60
