"""--use-distributed-optimizer through a worker's loss under --chameleon. With 2 instances
(--num-distributed-optimizer-instances 2) the lost rank's shard of the Adam moments is taken from
its copy in the other instance, and the state is re-partitioned over the new plan's replicas,
for each strategy that carries the state over; with 1 instance and buddy copies
(--chameleon-shard-redundancy buddy) from its buddy; with 1 instance alone the shard has no
copy, and the recovery line says so and restarts from the checkpoint. Each run keeps the
failure-free losses (1e-5, against a plain single-process run) and every copy bit-identical
(the buddy copies against their owners' shards included). The loss is per token
(--calculate-per-token-loss): the gradients, the buddies' copies included, are divided by the
batch's tokens after the commit."""

import random

import pytest

from tests.launch import (SMALL_MODEL, LateKill, assert_close, failure_free, free_port, last_losses,
                          run_chameleon)

pytestmark = pytest.mark.slow
ITERS = 8


def common(data: str) -> list[str]:
    return SMALL_MODEL + ["--global-batch-size", "16", "--train-iters", str(ITERS),
                          "--lr-decay-iters", str(ITERS), "--lr", "3e-3", "--data-path", data,
                          "--split", "100,0,0", "--log-interval", "4",
                          "--calculate-per-token-loss"]


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory) -> list[float]:
    return failure_free(common(small_data), tmp_path_factory)


# (pipeline depth, instances, strategy, the kills in iteration 5 as rank:phase): rank 3 is a
# replica of the last stage in each layout. Between iterations the survivors' whole parameters
# are a step behind (the stepped shards are gathered at the next iteration's start): only the
# slices count. In the commit the lost rank voted and died: the others apply the step, its
# shard's included (its buddy steps the copy). With pipeline 2 the buddy case overlaps both
# collectives: its gradients are reduced in buckets (--overlap-grad-reduce: the tied
# embedding's its own), each bucket's messages to the buddies sent once it is reduced, the
# embedding's after its sum over the two stages; and the stepped shards are gathered in the
# first forward's hooks (--overlap-param-gather). There rank 1 (stage 0) dies before its
# forward: rank 3, the next stage of its pipeline, never gets an input, and takes part in its
# replica's gathers from the drain rather than leave rank 2 waiting in a hook until the
# communication timeout (5 s; the recovery takes a fraction of a second). In the buddy
# reroute rank 1 dies too, while the new world (data 3) sets its buddy copies up: that
# attempt is abandoned and the next starts from the state carried in, the old world's copies
# included (rank 3's shard on rank 2, rank 1's on rank 0), so no shard is lost.
CASES = [(1, 2, "none", "reroute", ("3:backward",)),
         (1, 2, "none", "reparallelize", ("3:between-iterations",)),
         (2, 2, "none", "takeover", ("3:backward",)),
         # data 3 or pipeline 3, as the measured profile rates them: either re-partitions the
         # lost shard from its buddy's copy (auto with buddy copies: the random kills below)
         (1, 1, "buddy", "reparallelize", ("3:commit",)),
         (2, 1, "buddy", "takeover", ("1:forward",)),
         # a reroute: data 3 whatever the host's load (a re-parallelization may take pipeline 3,
         # which has no replicas to hold copies, when the measured profile rates it faster)
         (1, 1, "buddy", "reroute", ("3:between-iterations", "1:copies")),
         (1, 1, "none", "auto", ("3:backward",))]
COMM_TIMEOUT_MS = 5000.0    # --chameleon-comm-timeout's default


@pytest.mark.parametrize("pp,instances,buddy,strategy,kills", CASES, ids=[
    f"pp{pp}-{i}-instance(s)-{b}-{s}-" + "-".join(k.split(":")[1] for k in kills)
    for pp, i, b, s, kills in CASES])
def test_a_lost_shard_comes_from_its_other_copy_or_the_checkpoint(
        reference, small_data, tmp_path, pp, instances, buddy, strategy, kills):
    overlapped = pp == 2 and buddy == "buddy"
    injects = [a for k in kills for a in (
        "--chameleon-inject", "kill:rank={},iter=5,phase={}".format(*k.split(":")))]
    run = run_chameleon(4, common(small_data) + [
        "--pipeline-model-parallel-size", str(pp), "--use-distributed-optimizer",
        "--num-distributed-optimizer-instances", str(instances),
        "--chameleon-shard-redundancy", buddy,
        "--chameleon", "--chameleon-strategy", strategy, "--save", str(tmp_path / "ckpt"),
        "--save-interval", "3", *injects]
        + ["--overlap-grad-reduce", "--overlap-param-gather"] * overlapped, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    events = run.metrics
    assert_close(last_losses(events), reference)
    rec = [e for e in events if e["event"] == "recovery"]
    assert len(rec) == 1 and rec[0]["attempts"] >= len(kills)
    assert sorted(next(e for e in events if e["event"] == "failure")["ranks"]) == \
        sorted(int(k.split(":")[0]) for k in kills)
    if overlapped:
        assert rec[0]["reconfigure_ms"] < COMM_TIMEOUT_MS
    if instances > 1 or buddy == "buddy":
        assert rec[0]["strategy"] == strategy or strategy == "auto"
        assert rec[0]["why"] is None
        # the lost shard's moments, re-partitioned (with ranks 1 and 3 gone, ranks 0 and 2 hold
        # their new halves already: their own shards and their owners' copies)
        if rec[0]["strategy"] != "restart" and len(kills) == 1:
            assert rec[0]["moved_bytes"] > 0
    else:
        assert rec[0]["strategy"] == "restart" and rec[0]["resume_iteration"] == 4
        assert "the distributed optimizer's shard held by rank(s) [3] is lost" in rec[0]["why"]
        assert "since the distributed optimizer's shard held by rank(s) [3] is lost" in run.stdout
    assert [e["identical"] for e in events if e["event"] == "replicas"] == [True]


@pytest.mark.parametrize("seed", range(2))
def test_a_kill_from_outside_at_a_random_instant_with_overlapped_reduction_and_gather(
        reference, small_data, tmp_path, seed):
    """tools/inject_failure.py SIGKILLs a random rank of data 4 (the distributed optimizer in
    2 instances, or, for the odd seed, in one with buddy copies; --overlap-grad-reduce,
    --overlap-param-gather) a random delay after it works past a random iteration, under auto:
    wherever the kill lands (a bucket's reduce-scatter dispatched from a backward hook, a
    bucket's message to its buddy, the gather of the stepped shards from a forward hook, a
    save), the job ends with the failure-free losses."""
    rng = random.Random(seed)
    rank, after, delay_ms = rng.randrange(4), rng.randint(2, ITERS - 3), rng.randint(0, 300)
    redundancy = ["--chameleon-shard-redundancy", "buddy"] if seed % 2 else \
        ["--num-distributed-optimizer-instances", "2"]
    port = free_port()
    kill = LateKill(port, rank, after, delay_ms).start()
    run = run_chameleon(4, common(small_data) + [
        "--use-distributed-optimizer", *redundancy, "--overlap-grad-reduce",
        "--overlap-param-gather", "--chameleon", "--save", str(tmp_path / "ckpt"),
        "--save-interval", "3"], tmp_path,
        launcher_args=["--master-port", str(port)])
    kill.join()
    assert kill.returncode == 0, kill.stderr
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(last_losses(run.metrics), reference)
    fail = [e["ranks"] for e in run.metrics if e["event"] == "failure"]
    assert fail == [[rank]] or (not fail and kill.signalled_at >= max(
        e["time"] for e in run.metrics)), (rank, after, delay_ms, fail)
    assert [e["identical"] for e in run.metrics if e["event"] == "replicas"] == [True]

