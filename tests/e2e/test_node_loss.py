"""Nodes as failure domains: several chameleon-launch agents on this host as the nodes of one job,
2 workers each. A node's agent and workers SIGKILLed at once (tools/inject_failure.py --node)
give ONE failure event (cause "node", every rank of the node) and one recovery, under each
strategy; the job keeps the loss trajectory of a single process, every copy of every parameter
stays bit-identical, and the surviving agents exit 0. The spread placement keeps each stage's
replicas on different nodes; under Megatron's placement a node holds every replica of a stage,
and its loss falls back to a restart from the latest checkpoint. On an etcd store the job
survives the loss of node 0 (whose agent would otherwise host the store) and does not notice the
loss of the etcd leader."""

from __future__ import annotations

import threading
import time

import pytest

from chameleon_ext.control.membership import Membership
from chameleon_ext.control.store import connect_store
from tests.etcd_cluster import EtcdCluster
from tests.launch import (SMALL_MODEL, LateKill, assert_close, free_port, last_losses, run_job,
                          run_nodes)

pytestmark = pytest.mark.slow
# Long enough for the kills after iteration 3-4 to land in training: the tool sees a worker's
# progress as published with its heartbeat (every 0.5 s at most), up to 5 iterations late here.
ITERS = 16
# A lost node's ranks are known once its agent's heartbeat is this old (seconds): above the
# scheduling hiccups of a loaded 2-core host, below what makes the tests slow.
NODE_LOSS = ["--heartbeat-timeout", "3"]


def common(data: str, pp: int) -> list[str]:
    """6 layers (pipelines of 2 and 3 stages), 6 micro-batches of 2 per iteration."""
    return SMALL_MODEL + ["--num-layers", "6", "--pipeline-model-parallel-size", str(pp),
                          "--global-batch-size", "12", "--train-iters", str(ITERS), "--lr",
                          "3e-3", "--data-path", data, "--split", "100,0,0", "--log-interval",
                          "1"]


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory) -> list[float]:
    """The failure-free losses of one process under torchrun (a placement only renames ranks)."""
    run = run_job(1, common(small_data, 1), tmp_path_factory.mktemp("ref"), name="ref")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.losses()


def assert_one_node_loss(run, reference: list[float], nnodes: int, victim: int) -> dict:
    """One failure (the node's ranks, cause "node"), one recovery, the failure-free losses,
    identical replicas, every surviving agent done with 0; returns the recovery event."""
    for node, agent in enumerate(run.agents):
        if node != victim:
            assert agent.returncode == 0, f"node {node}:\n{agent.stderr[-3000:]}"
    assert run.agents[victim].returncode == -9          # its agent was SIGKILLed
    assert_close(last_losses(run.metrics), reference)
    assert [(f["ranks"], f["cause"]) for f in run.events("failure")] == \
        [([2 * victim, 2 * victim + 1], "node")]
    assert len(run.events("recovery")) == 1
    assert [e["identical"] for e in run.events("replicas")] == [True]
    assert f"placement spread: {2 * nnodes} ranks on {nnodes} node(s); every stage has " \
        "replicas on 2 or more nodes" in run.stdout
    return run.events("recovery")[0]


# strategy, nodes, pipeline depth, lost node. With as many replicas as nodes each pipeline
# stays inside a node (its loss takes a whole pipeline: reroute); pipeline 3 x data 2 on 3
# nodes puts a stage of each pipeline on every node (takeover in both pipelines). The other
# strategies take a node's ranks as any set of lost ranks (tests/e2e/test_strategies.py).
CASES = [("reroute", 2, 2, 1), ("takeover", 3, 3, 2)]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy,nnodes,pp,victim", CASES,
                         ids=[f"{c[0]}-{c[1]}nodes" for c in CASES])
def test_a_lost_node_is_one_failure_and_one_recovery(reference, small_data, tmp_path, strategy,
                                                     nnodes, pp, victim):
    port = free_port()
    kill = LateKill(port, victim, 3, 100, node=True).start()
    run = run_nodes(nnodes, 2, common(small_data, pp) + [
        "--chameleon", "--chameleon-strategy", strategy], tmp_path, port=port,
        launcher_args=NODE_LOSS)
    kill.join()
    assert kill.returncode == 0, kill.stderr
    rec = assert_one_node_loss(run, reference, nnodes, victim)
    assert (rec["strategy"], rec["world"]) == (strategy, 2 * (nnodes - 1))
    if strategy == "takeover":
        assert rec["moved_bytes"] > 0       # the absorbed layers, from their replicas


@pytest.mark.timeout(420)
def test_megatron_placement_loses_a_stage_with_a_node_and_restarts_from_the_checkpoint(
        reference, small_data, tmp_path):
    port = free_port()
    kill = LateKill(port, 1, 3, 100, node=True).start()
    run = run_nodes(2, 2, common(small_data, 2) + [
        "--chameleon", "--chameleon-strategy", "reroute", "--chameleon-placement", "megatron",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2"], tmp_path, port=port,
        launcher_args=NODE_LOSS)
    kill.join()
    assert run.agents[0].returncode == 0, run.agents[0].stderr[-3000:]
    assert "placement megatron: 4 ranks on 2 node(s); every replica of layers 0-2 on node 0, " \
        "layers 3-5 on node 1" in run.stdout
    assert_close(last_losses(run.metrics), reference)
    assert [(f["ranks"], f["cause"]) for f in run.events("failure")] == [([2, 3], "node")]
    rec = run.events("recovery")
    # the restart's layout is the one predicted fastest over the 2 survivors (on 2 busy cores
    # that may be a single rank)
    assert [e["strategy"] for e in rec] == ["restart"] and rec[0]["world"] <= 2
    resumed = rec[0]["resume_iteration"]
    assert resumed % 2 == 1 and f"checkpoint of iteration {resumed - 1} loaded onto" in run.stdout
    assert [e["identical"] for e in run.events("replicas")] == [True]


@pytest.mark.timeout(420)
def test_on_etcd_the_job_survives_the_loss_of_node_0(etcd, reference, small_data, tmp_path):
    url = etcd.url("node0-loss")
    kill = LateKill(0, 0, 4, 100, node=True, store=url).start()
    run = run_nodes(2, 2, common(small_data, 2) + ["--chameleon", "--chameleon-strategy", "auto"],
                    tmp_path, store=url, launcher_args=NODE_LOSS)
    kill.join()
    assert kill.returncode == 0, kill.stderr
    rec = assert_one_node_loss(run, reference, 2, 0)
    feasible = [c for c in rec["candidates"] if c["feasible"]]
    if feasible:       # the planner had a profile: it chose the cheapest candidate
        assert rec["strategy"] == min(feasible, key=lambda c: c["total_ms"])["strategy"]


@pytest.mark.timeout(420)
def test_on_etcd_the_job_does_not_notice_the_loss_of_the_etcd_leader(reference, small_data,
                                                                     tmp_path):
    (tmp_path / "etcd").mkdir()
    cluster = EtcdCluster(tmp_path / "etcd")
    try:
        leader = cluster.leader()
        # The clients talk to the leader first: its loss is the worst case (an election too).
        order = [leader] + [i for i in range(3) if i != leader]
        url = f"etcd://{','.join(cluster.endpoints[i] for i in order)}/leader-loss"
        killed: list[float] = []

        def kill_leader_after_iteration_3() -> None:
            store = connect_store(url, timeout_s=60)
            m = Membership(store, None, 4)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                progress = m.heartbeat.progress_of([0]).get(0)
                if progress is not None and progress.iteration > 3:
                    cluster.kill(leader)
                    killed.append(time.time())
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_leader_after_iteration_3, daemon=True)
        killer.start()
        run = run_nodes(2, 2, common(small_data, 2) + ["--chameleon"], tmp_path, store=url)
        killer.join(30)
    finally:
        cluster.stop()
    assert killed, "the etcd leader was never killed"
    assert [a.returncode for a in run.agents] == [0, 0], run.agents[1].stderr[-3000:]
    assert run.events("failure") == [] and run.events("recovery") == []
    iters = run.events("iteration")
    assert [e["iteration"] for e in iters] == list(range(1, ITERS + 1))
    assert any(e["time"] > killed[0] for e in iters)       # it trained on after the loss
    assert_close(run.losses(), reference)
