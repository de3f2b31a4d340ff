"""Every recovery strategy, forced with --chameleon-strategy, on the same failure: a worker killed
in the backward of iteration 5. The job keeps the failure-free loss trajectory, consumes the same
samples, and every copy of every parameter stays bit-identical. (`reroute` on this failure is
tests/e2e/test_reroute_recovery.py's, in every phase of a step; `auto`, which takes one of them,
is tests/e2e/test_strategy_selection.py's, and every random-instant kill's.)"""

import re

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.planning.perf_model import ModelShape
from tests.launch import (SMALL_MODEL, assert_close, assert_memory_within_estimates, failure_free,
                          last_losses, run_chameleon)
from tests.profiles import synthetic_profile

pytestmark = pytest.mark.slow
ITERS = 10


def common(data: str, pp: int) -> list[str]:
    return SMALL_MODEL + ["--pipeline-model-parallel-size", str(pp), "--global-batch-size", "16",
                          "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS),
                          "--lr", "3e-3", "--data-path", data, "--split", "100,0,0",
                          "--log-interval", "5"]


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory) -> list[float]:
    """The failure-free losses: every layout's here (tests.launch.failure_free)."""
    return failure_free(common(small_data, 2), tmp_path_factory)


# pipeline depth, killed rank: pp2 x dp2 loses pipeline 1's last stage; pp4 x dp2 (one layer a
# stage) loses pipeline 1's third stage, whose neighbours are a middle and the last stage.
LAYOUTS = {"pp2xdp2": (2, 3), "pp4xdp2": (4, 5)}
# PP 4 x DP 2 (a middle stage lost) for takeover only, whose neighbours are on both sides
# reroute on this failure is tests/e2e/test_reroute_recovery.py's, in every phase of a step
CASES = [(s, "pp2xdp2") for s in ("takeover", "reparallelize", "restart")] + \
        [("takeover", "pp4xdp2")]


@pytest.mark.parametrize("strategy,layout", CASES, ids=[f"{s}-{lay}" for s, lay in CASES])
def test_each_strategy_keeps_the_loss_trajectory(reference, small_data, tmp_path, strategy,
                                                 layout):
    pp, victim = LAYOUTS[layout]
    run = run_chameleon(2 * pp, common(small_data, pp) + [
        "--chameleon", "--chameleon-strategy", strategy, "--save", str(tmp_path / "ckpt"),
        "--save-interval", "3",
        "--chameleon-inject", f"kill:rank={victim},iter=5,phase=backward"], tmp_path, name=strategy)
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert_close(last_losses(events), reference)
    iters = {e["iteration"]: e for e in events if e["event"] == "iteration"}
    assert sorted(iters) == list(range(1, ITERS + 1))
    assert [iters[i]["consumed_samples"] for i in sorted(iters)] == \
        [16 * i for i in range(1, ITERS + 1)]
    rec = [e for e in events if e["event"] == "recovery"]
    assert len(rec) == 1 and rec[0]["strategy"] == strategy
    if rec[0]["strategy"] == "takeover":
        assert rec[0]["moved_bytes"] > 0  # the absorbed layers' weights and Adam moments
        assert f"now {pp - 1} stage(s)" in run.stdout
    if rec[0]["strategy"] == "reparallelize":
        # every survivor, or fewer where a smaller homogeneous layout is predicted faster
        assert rec[0]["moved_bytes"] > 0 and 0 < rec[0]["world"] <= 2 * pp - 1
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]
    assert_memory_within_estimates(events)


def test_the_hybrid_reroutes_then_restarts_onto_the_replanned_layout(reference, small_data,
                                                                     tmp_path):
    """reroute+restart: the kill at iteration 5 is rerouted; after the checkpoint of iteration
    6 every rank leaves that world and the plan the planner found best for the survivors
    starts from it, one generation up (a survivor it does not use leaves the job)."""
    run = run_chameleon(4, common(small_data, 2) + [
        "--chameleon", "--chameleon-strategy", "reroute+restart", "--chameleon-mtbf", "1000",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "6",
        "--chameleon-inject", "kill:rank=3,iter=5,phase=backward"], tmp_path, name="hybrid")
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert_close(last_losses(events), reference)
    rec = next(e for e in events if e["event"] == "recovery")
    assert rec["strategy"] == "reroute+restart" and rec["switch"]["at_iteration"] == 6
    switch = next(e for e in events if e["event"] == "switch")
    assert switch["iteration"] == 6 and switch["generation"] == 2
    iters = [e for e in events if e["event"] == "iteration"]
    assert [e["generation"] for e in iters] == [0] * 4 + [1] * 2 + [2] * 4
    assert "> switched at iteration 6 to the restart plan" in run.stdout
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]


def test_a_rerouted_plan_re_parallelizes_at_its_next_loss(reference, small_data, tmp_path):
    """The job starts on the plan an earlier loss of pipeline 1's last stage left (its
    micro-batches hosted by rank 1, pipeline 0's last stage) and then loses rank 0: both
    pipelines now lack a stage, so reparallelize builds a plan over the two survivors (rank 2
    holding the first stage's layers, rank 1 the last stage's) on the failure-free losses."""
    rerouted = ExecutionPlan(num_layers=4, tensor_parallel=1, micro_batch_size=2,
                             num_micro_batches=8, pipelines=[
                                 Pipeline([Stage(0, 2, [0]), Stage(2, 4, [1])], [0, 1, 2, 3]),
                                 Pipeline([Stage(0, 2, [2]),
                                           Stage(2, 4, [], {mb: [1] for mb in range(4, 8)})],
                                          [4, 5, 6, 7])])
    path = tmp_path / "rerouted.json"
    rerouted.save(path)
    run = run_chameleon(3, common(small_data, 2) + [
        "--chameleon", "--chameleon-plan", str(path), "--chameleon-strategy", "reparallelize",
        "--chameleon-inject", "kill:rank=0,iter=5,phase=backward"], tmp_path, name="rerouted")
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert_close(last_losses(events), reference)
    iters = {e["iteration"]: e for e in events if e["event"] == "iteration"}
    assert [iters[i]["consumed_samples"] for i in sorted(iters)] == \
        [16 * i for i in range(1, ITERS + 1)]
    [rec] = [e for e in events if e["event"] == "recovery"]
    assert (rec["strategy"], rec["world"]) == ("reparallelize", 2)
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]


def test_eager_redundancy_takeover_moves_no_state(reference, small_data, tmp_path):
    """--chameleon-redundancy eager: the lost last stage of pipeline 1 is absorbed by the
    stage that held its shadow copy, so no parameter or optimizer state moves, and the shadow
    it took over was exactly the lost stage's state (losses and replicas still match)."""
    run = run_chameleon(4, common(small_data, 2) + [
        "--chameleon", "--chameleon-strategy", "takeover", "--chameleon-redundancy", "eager",
        "--chameleon-inject", "kill:rank=3,iter=5,phase=backward"], tmp_path, name="eager")
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert_close(last_losses(events), reference)
    rec = next(e for e in events if e["event"] == "recovery")
    assert rec["strategy"] == "takeover" and rec["moved_bytes"] == 0
    assert "now 1 stage(s)" in run.stdout
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]
    assert_memory_within_estimates(events)


@pytest.mark.parametrize("strategy,extra", [("reroute", []), ("takeover", ["--sequence-parallel"])],
                         ids=["reroute", "takeover-sequence-parallel"])
def test_a_lost_tensor_parallel_rank_takes_its_group_out(reference, small_data, tmp_path,
                                                         strategy, extra):
    """TP 2 x PP 2 x DP 2 loses rank 3, one shard of pipeline 1's first stage: the group is
    the unit, so its healthy sibling, rank 2, leaves the plan with it (a spare until the end,
    then exit 0; the new world is not a prefix of the survivors: rank 7 stays) and the job
    recovers in-process on the other six, no restart: rerouted to pipeline 0's first-stage
    group, or taken over by pipeline 1's last-stage group (each of its ranks receiving its own
    shard's weights and Adam moments). The losses are
    those of TP 1 (initialisation and dropout do not depend on the TP size), with sequence
    parallelism too (the takeover's: its neighbour's TP group then runs a misaligned plan)."""
    # 8 workers on 2 cores: a recovering rank may go 5 s without progress while the others
    # build their groups (seen once as a false hang); 15 s is still far below the agreement's
    run = run_chameleon(8, common(small_data, 2) + [
        "--tensor-model-parallel-size", "2", "--chameleon", "--chameleon-strategy", strategy,
        "--chameleon-inject", "kill:rank=3,iter=5,phase=backward",
        "--chameleon-progress-timeout", "15", *extra], tmp_path, name=f"tp-{strategy}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("sequence parallel" in run.stdout) == bool(extra)
    events = run.metrics
    assert_close(last_losses(events), reference)
    rec = next(e for e in events if e["event"] == "recovery")
    assert (rec["strategy"], rec["world"]) == (strategy, 6)
    if strategy == "takeover":
        assert rec["moved_bytes"] > 0 and "layers [0, 4) on rank(s) [4, 5]" in run.stdout
    assert "launch rank 2 stands by as a spare" in run.stdout
    assert re.search(r"worker rank 2 \(pid \d+\) exited 0", run.stderr), run.stderr[-3000:]
    replicas = [e for e in events if e["event"] == "replicas"]
    assert [e["identical"] for e in replicas] == [True] and replicas[0]["parameters"] == 2 * 52


def spare_profile(tmp_path) -> str:
    """A profile under which the restart after one loss of pipeline 2 x data 2 runs on 2 of the
    3 survivors (data parallel 2 predicted fastest): the third stands by."""
    profile = tmp_path / "profile.json"
    synthetic_profile(ModelShape(4, 64, 4, 32, 2, 384), layer_fwd_ms=5.0,
                      layer_bwd_input_ms=5.0, layer_bwd_weight_ms=5.0, head_fwd_ms=2.0,
                      head_bwd_ms=2.0, p2p_alpha_ms=0.05, p2p_ms_per_mib=0.5,
                      allreduce_alpha_ms=0.1, allreduce_ms_per_mib=1.0).save(profile)
    return str(profile)


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer",
                                       "--num-distributed-optimizer-instances", "2"]],
                         ids=["replicated", "sharded-2-instances"])
def test_a_spare_stands_by_and_substitutes_for_the_next_loss(reference, small_data, tmp_path,
                                                             extra):
    """Warm spares: the restart after rank 3's loss at iteration 2 runs on 2 of the 3 survivors
    (data parallel 2, as the given profile predicts fastest), and launch rank 2 stands by,
    heartbeating, out of the world. Rank 1's loss in the checkpoint save of iteration 6 is
    absorbed by the spare taking its place (substitute: the layout kept, the state from rank 0,
    its replica), which then saves that checkpoint with rank 0 (the action the failure
    interrupted), and the job ends with every surviving worker exiting 0, on the failure-free
    losses. With the distributed optimizer in 2 instances each rank of data parallel 2 holds
    its stage's moments whole (an instance each), and the spare's come from rank 0 the same
    way."""
    run = run_chameleon(4, common(small_data, 2) + extra + [
        "--chameleon", "--chameleon-strategy", "restart", "--chameleon-profile",
        spare_profile(tmp_path),
        "--save", str(tmp_path / "ckpt"), "--save-interval", "3",
        "--chameleon-inject", "kill:rank=3,iter=2,phase=backward",
        "--chameleon-inject", "kill:rank=1,iter=6,phase=checkpoint"], tmp_path, name="spare")
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert_close(last_losses(events), reference)
    first, second = [e for e in events if e["event"] == "recovery"]
    assert (first["strategy"], first["world"], first["spares"]) == ("restart", 2, 1)
    assert (second["strategy"], second["world"], second["spares"]) == ("substitute", 2, 0)
    assert second["moved_bytes"] > 0           # the whole model's state, from rank 0
    assert [e["during"] for e in events if e["event"] == "failure"] == ["step", "checkpoint"]
    assert (tmp_path / "ckpt" / "iter_0000006" / "meta.json").is_file()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
    assert "launch rank 2 stands by as a spare" in run.stdout
    assert "launch rank 2 left the spares for the substitute plan" in run.stdout
    for rank in (0, 2):
        assert re.search(rf"worker rank {rank} \(pid \d+\) exited 0", run.stderr), \
            run.stderr[-3000:]
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]


def test_when_every_member_is_lost_the_spare_restarts_from_the_checkpoint(reference, small_data,
                                                                         tmp_path):
    """After the restart onto 2 ranks (launch rank 2 a spare), both members die in iteration
    6: nobody holds the state, so the spare restarts alone from the checkpoint of iteration 3
    and trains to the end on the failure-free losses."""
    run = run_chameleon(4, common(small_data, 2) + [
        "--chameleon", "--chameleon-strategy", "restart", "--chameleon-profile",
        spare_profile(tmp_path), "--save", str(tmp_path / "ckpt"), "--save-interval", "3",
        "--chameleon-inject", "kill:rank=3,iter=2,phase=backward",
        "--chameleon-inject", "kill:rank=0,iter=6,phase=backward",
        "--chameleon-inject", "kill:rank=1,iter=6,phase=backward"], tmp_path, name="spares")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(last_losses(run.metrics), reference)
    assert re.search(r"launch rank 2 left the spares for the restart plan after iteration 3: "
                     r"rank 0 of 1, generation \d+ \(every rank of the plan was lost; the "
                     r"spares read the checkpoint\)", run.stdout), run.stdout[-3000:]
    assert re.search(r"worker rank 2 \(pid \d+\) exited 0", run.stderr), run.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
