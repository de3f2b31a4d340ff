"""Kill a worker mid-iteration under chameleon-launch: the survivors reroute its micro-batches
(or, where no replica survives, restart from the checkpoint on a plan that fits them) and finish
every iteration with the failure-free losses."""

import pytest

from tests.launch import (SMALL_MODEL, TimedKills, assert_close, assert_memory_within_estimates,
                          failure_free_losses, free_port, last_losses, run_chameleon, run_job)

pytestmark = pytest.mark.slow
REROUTE = ["--chameleon", "--chameleon-strategy", "reroute"]  # not the default, auto


def common(data: str, dp: int = 2) -> list[str]:
    return SMALL_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", str(8 * dp),
                          "--train-iters", "8", "--lr-decay-iters", "8", "--lr", "3e-3",
                          "--data-path", data, "--split", "100,0,0", "--log-interval", "1"]


@pytest.fixture(scope="module")
def references(small_data, tmp_path_factory):
    """Failure-free losses of pipeline 2 x data dp, by dp (each run once)."""
    return failure_free_losses(lambda dp: common(small_data, dp), tmp_path_factory)


@pytest.fixture(scope="module")
def reference(references):
    return references(2)


PHASES = ["forward", "backward", "grad-reduce", "optimizer", "between-iterations"]


# Pipeline 2 x data 2 loses the last stage of pipeline 1 in each phase of a step (pipeline 2 x
# data 3, whose lost micro-batches go to two surviving replicas, is rerouted in
# tests/e2e/test_failures_anywhere.py: its second-kill case and its random instants).
@pytest.mark.parametrize("dp,victim,phase", [(2, 3, p) for p in PHASES],
                         ids=[f"{p}-pp2xdp2" for p in PHASES])
def test_kill_at_iteration_5_keeps_the_loss_trajectory(references, small_data, tmp_path, phase,
                                                        dp, victim):
    world, gbs = 2 * dp, 8 * dp
    run = run_chameleon(world, common(small_data, dp) + [
        *REROUTE, "--chameleon-inject", f"kill:rank={victim},iter=5,phase={phase}"],
        tmp_path, name=phase)
    assert run.returncode == 0, run.stderr[-3000:]
    events, out = run.metrics, run.stdout
    iters = [e for e in events if e["event"] == "iteration"]
    assert [e["iteration"] for e in iters] == list(range(1, 9))
    assert_close([e["loss"] for e in iters], references(dp))
    assert [e["consumed_samples"] for e in iters] == [gbs * i for i in range(1, 9)]
    assert [e["world"] for e in iters] == [world] * 4 + [world - 1] * 4
    failure = [e for e in events if e["event"] == "failure"]
    recovery = [e for e in events if e["event"] == "recovery"]
    assert len(failure) == 1 and failure[0]["ranks"] == [victim]
    assert failure[0]["cause"] == "signal"
    assert len(recovery) == 1 and recovery[0]["strategy"] == "reroute"
    assert recovery[0]["generation"] == 1 and recovery[0]["lost_iterations"] == 1
    assert f"> recovery at iteration 5: lost launch rank(s) [{victim}]" in out
    replicas = [e for e in events if e["event"] == "replicas"]
    assert replicas and replicas[0]["identical"] and replicas[0]["parameters"] > 10
    assert_memory_within_estimates(events)   # the rerouted micro-batches' activations too
    # detection within the issue's 1 s; reconfiguration far below the training groups' 5 s
    # timeout (a survivor left waiting on a collective would show here)
    assert failure[0]["detect_ms"] < 1000 and recovery[0]["reconfigure_ms"] < 2500


def test_without_a_surviving_replica_the_job_restarts_from_its_checkpoint(small_data, tmp_path):
    """Pipeline 4 x data 1 loses stage 2 at iteration 5: no replica to reroute to, so the
    survivors reload the checkpoint of iteration 3 onto the homogeneous plan over them that the
    calibrated model predicts fastest (on 2 shared cores, often fewer ranks) and go on."""
    args = SMALL_MODEL + ["--pipeline-model-parallel-size", "4", "--global-batch-size", "8",
                          "--train-iters", "8", "--lr-decay-iters", "8", "--data-path",
                          small_data, "--split", "100,0,0", "--log-interval", "1"]
    ref = run_job(4, args, tmp_path, name="ref-pp4")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = run_chameleon(4, args + [*REROUTE, "--chameleon-inject", "kill:rank=2,iter=5",
                                   "--save", str(tmp_path / "ckpt"), "--save-interval", "3"],
                        tmp_path, name="pp4")
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert [e["iteration"] for e in events if e["event"] == "iteration"] == [1, 2, 3, 4, 4, 5, 6,
                                                                             7, 8]
    assert_close(last_losses(events), ref.losses())
    recovery = [e for e in events if e["event"] == "recovery"]
    assert [(e["strategy"], e["lost_iterations"], e["resume_iteration"])
            for e in recovery] == [("restart", 2, 4)]
    assert 1 <= recovery[0]["world"] <= 3
    assert "strategy restart: checkpoint of iteration 3 loaded onto pipeline " in run.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "8"


def test_forced_restart_keeps_the_survivor_it_cannot_use_as_a_spare_and_reports_its_loss(
        small_data, tmp_path):
    """--chameleon-strategy restart on pipeline 2 x data 2 of a 2-layer model: of 3 survivors
    the new plan (pipeline 2 x data 1) uses 2; the third, launch rank 2, stands by as a spare.
    Killed from outside while the job trains iteration 5 again, it is reported lost (a
    `spare_lost` event, no spare left) and nothing else happens: no recovery, the failure-free
    losses."""
    args = SMALL_MODEL + ["--num-layers", "2", "--pipeline-model-parallel-size", "2",
                          "--global-batch-size", "16", "--train-iters", "12", "--lr-decay-iters",
                          "12", "--data-path", small_data, "--split", "100,0,0"]
    ref = run_job(4, args, tmp_path, name="ref-2l")
    assert ref.returncode == 0, ref.stderr[-3000:]
    port = free_port()
    # rank 0 works past iteration 4 only after the restart (the kill stops it in iteration 4);
    # 7 iterations after that leave the tool's poll and the lead's next boundary time on a
    # loaded machine (at 8 iterations a fresh-clone make test once ended before the report)
    kill = TimedKills(port, tmp_path / "kills.txt", [(0.0, 2)], after=4).start()
    run = run_chameleon(4, args + ["--chameleon", "--chameleon-strategy", "restart",
                                   "--chameleon-inject", "kill:rank=3,iter=4,phase=backward"],
                        tmp_path, name="forced", port=port)
    kill.join()
    assert kill.returncode == 0 and kill.signalled_at, kill.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(last_losses(run.metrics), ref.losses())
    assert "stands by as a spare after iteration 3" in run.stdout
    assert "no checkpoint: back to iteration 0 and the initial weights loaded onto pipeline 2 x " \
        "data 1" in run.stdout
    [lost] = [e for e in run.metrics if e["event"] == "spare_lost"]
    assert (lost["launch_rank"], lost["spares"]) == (2, 0) and lost["iteration"] >= 5
    assert f"> launch rank 2, a spare, was lost after iteration {lost['iteration']}; 0 " \
        "spare(s) left" in run.stdout
    assert len([e for e in run.metrics if e["event"] == "recovery"]) == 1


def test_two_failures_in_different_pipelines_and_a_hang(small_data, tmp_path):
    """Pipeline 2 x data 3: rank 5 killed at iteration 3, rank 4 stops (SIGSTOP) at iteration 6
    and is found by its stale heartbeat; stage 1 ends up on rank 3 alone."""
    args = SMALL_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "12",
                          "--train-iters", "8", "--lr-decay-iters", "8", "--data-path",
                          small_data, "--split", "100,0,0", "--log-interval", "1"]
    ref = run_job(6, args, tmp_path, name="ref6")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = run_chameleon(6, args + [
        *REROUTE, "--chameleon-inject", "kill:rank=5,iter=3,phase=forward",
        "--chameleon-inject", "hang:rank=4,iter=6,phase=backward"], tmp_path, name="two",
        launcher_args=["--heartbeat-timeout", "2"])
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    iters = [e for e in events if e["event"] == "iteration"]
    assert [e["iteration"] for e in iters] == list(range(1, 9))
    assert_close([e["loss"] for e in iters], ref.losses())
    assert [e["world"] for e in iters] == [6, 6, 5, 5, 5, 4, 4, 4]
    fails = [e for e in events if e["event"] == "failure"]
    assert [(f["ranks"], f["cause"]) for f in fails] == [([5], "signal"), ([4], "hang")]
    assert [e["generation"] for e in events if e["event"] == "recovery"] == [1, 2]
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]


def test_a_failure_during_recovery_restarts_the_agreement(reference, small_data, tmp_path):
    """Rank 3 is killed at iteration 4; rank 1 dies while the survivors reconfigure (after they
    agreed, before the new world exists). The others agree again, one generation up, and
    pipeline 0 (ranks 0 and 2) takes all of pipeline 1's micro-batches."""
    run = run_chameleon(4, common(small_data) + [
        *REROUTE, "--chameleon-inject", "kill:rank=3,iter=4,phase=forward",
        "--chameleon-inject", "kill:rank=1,iter=4,phase=recovery"], tmp_path, name="during")
    assert run.returncode == 0, run.stderr[-3000:]
    iters = [e for e in run.metrics if e["event"] == "iteration"]
    assert [e["iteration"] for e in iters] == list(range(1, 9))
    assert_close([e["loss"] for e in iters], reference)
    assert [e["world"] for e in iters] == [4] * 3 + [2] * 5
    recovery = [e for e in run.metrics if e["event"] == "recovery"]
    failure = [e for e in run.metrics if e["event"] == "failure"]
    assert [(e["strategy"], e["generation"]) for e in recovery] == [("reroute", 2)]
    assert failure[0]["ranks"] == [1, 3]
    assert [e["identical"] for e in run.metrics if e["event"] == "replicas"] == [True]
