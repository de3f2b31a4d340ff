"""Placement over nodes: the spread placement puts the data-parallel replicas of every stage on
different nodes wherever the shape allows and keeps tensor-parallel groups inside a node, while
only renaming ranks (the pipelines' layers and micro-batches are those of Megatron's layout, so
the losses are too); Megatron's order loses a whole stage with one node."""

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_ext.control.keys import key_worker
from chameleon_ext.control.store import MembershipError, connect_store, nodes_from_store
from chameleon_ext.plan import placement as pl
from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError


def blocks(n_nodes: int, per_node: int) -> dict[int, int]:
    """The launcher's numbering: node k runs ranks k*per_node .. (k+1)*per_node - 1."""
    return {r: r // per_node for r in range(n_nodes * per_node)}


def shape_of(plan):
    return [([(st.layer_start, st.layer_end) for st in p.stages], p.micro_batches)
            for p in plan.pipelines]


SHAPES = [  # nodes, workers per node, tensor parallel, pipeline parallel
    (2, 2, 1, 2),    # PP2 x DP2 (the measured case)
    (3, 2, 1, 2),    # PP2 x DP3
    (2, 3, 1, 2),    # PP2 x DP3 on 2 nodes of 3
    (3, 2, 1, 3),    # PP3 x DP2
    (2, 2, 2, 1),    # TP2 x DP2
    (3, 2, 2, 1),    # TP2 x DP3
    (2, 4, 2, 2),    # TP2 x PP2 x DP2
    (2, 2, 2, 2),    # TP2 x PP2, one replica per stage
]


def placed(kind: str, nodes: dict[int, int], *shape: int) -> ExecutionPlan:
    """The failure-free plan of `shape` (tp, pp, layers, micro batch, global batch) over the
    ranks of `nodes`, placed by `kind`."""
    return pl.place(kind, nodes, ExecutionPlan.failure_free(len(nodes), *shape))


@pytest.mark.parametrize("n_nodes,per_node,tp,pp", SHAPES)
def test_spread_survives_a_node_and_keeps_tp_inside_one(n_nodes, per_node, tp, pp):
    nodes = blocks(n_nodes, per_node)
    world = len(nodes)
    dp = world // (tp * pp)
    spread = placed("spread", nodes, tp, pp, 4 * pp, 2, 4 * dp)
    megatron = placed("megatron", nodes, tp, pp, 4 * pp, 2, 4 * dp)
    assert spread.ranks == megatron.ranks == list(range(world))
    assert shape_of(spread) == shape_of(megatron)          # only ranks move
    assert pl.spanning_tp_groups(spread, nodes) == []
    exposed = pl.single_node_stages(spread, nodes)
    if dp > 1:
        assert exposed == [], pl.describe("spread", spread, nodes)
    else:
        assert len(exposed) == pp          # one replica per stage: nothing to spread
    if dp % n_nodes == 0:                  # pipelines stay inside a node
        for p in spread.pipelines:
            assert len({nodes[r] for st in p.stages for r in st.ranks}) == 1


def test_megatron_order_loses_a_stage_with_node_1_and_spread_does_not():
    nodes = blocks(2, 2)
    megatron = placed("megatron", nodes, 1, 2, 4, 2, 8)
    spread = placed("spread", nodes, 1, 2, 4, 2, 8)
    assert pl.single_node_stages(megatron, nodes) == [(0, 2, 0), (2, 4, 1)]
    assert pl.describe("megatron", megatron, nodes) == (
        "placement megatron: 4 ranks on 2 node(s); every replica of layers 0-1 on node 0, "
        "layers 2-3 on node 1")
    assert pl.describe("spread", spread, nodes) == (
        "placement spread: 4 ranks on 2 node(s); every stage has replicas on 2 or more nodes")
    # pipeline 0 on node 0 (ranks 0, 1), pipeline 1 on node 1 (ranks 2, 3)
    assert [[st.ranks for st in p.stages] for p in spread.pipelines] == [[[0], [1]], [[2], [3]]]


def test_ranks_numbered_across_nodes_still_get_node_local_tp_groups():
    nodes = {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1, 6: 0, 7: 1}     # round-robin numbering
    megatron = placed("megatron", nodes, 2, 2, 4, 2, 8)
    spread = placed("spread", nodes, 2, 2, 4, 2, 8)
    assert len(pl.spanning_tp_groups(megatron, nodes)) == 4
    assert pl.spanning_tp_groups(spread, nodes) == []
    assert pl.single_node_stages(spread, nodes) == []
    assert pl.describe("spread", spread, nodes).endswith("tensor-parallel groups within a node")


def test_uneven_nodes_leave_only_the_unavoidable_exposed():
    # node 0 has 3 workers, node 1 one: with PP2 x DP2 only one stage can have a node-1 replica
    nodes = {0: 0, 1: 0, 2: 0, 3: 1}
    spread = placed("spread", nodes, 1, 2, 4, 2, 8)
    assert len(pl.single_node_stages(spread, nodes)) == 1
    # TP2 with 3 + 1 workers: one group must span the nodes, the other stays inside node 0
    spread_tp = placed("spread", nodes, 2, 1, 4, 2, 8)
    assert pl.spanning_tp_groups(spread_tp, nodes) == [[2, 3]]


def test_bad_input_names_the_problem():
    with pytest.raises(PlanError, match="unknown placement 'random'"):
        placed("random", blocks(2, 2), 1, 2, 4, 2, 8)
    with pytest.raises(PlanError, match=r"every rank 0..2; got ranks \[0, 1, 3\]"):
        pl.place("spread", {0: 0, 1: 0, 3: 1}, ExecutionPlan.failure_free(3, 1, 1, 4, 2, 6))
    with pytest.raises(PlanError, match="not divisible"):
        placed("spread", blocks(2, 2), 1, 3, 6, 2, 6)


def test_one_node_keeps_megatrons_order():
    for tp, pp in [(1, 2), (2, 2), (2, 1)]:
        nodes = blocks(1, 8)
        assert placed("spread", nodes, tp, pp, 4, 2, 16) == \
            placed("megatron", nodes, tp, pp, 4, 2, 16)


def test_nodes_come_from_the_launchers_worker_records():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                          wait_for_workers=False)
    agents = connect_store(f"127.0.0.1:{store.port}")      # the agents' own connection

    def record(r, n):
        agents.set(key_worker(r), json.dumps({"rank": r, "node": n, "pid": 1, "host": "h"}))
    for r, n in blocks(2, 2).items():
        if r != 3:
            record(r, n)
    threading.Timer(0.3, record, (3, 1)).start()       # node 1's agent, a little late
    assert nodes_from_store(store, 4, timeout_s=10) == blocks(2, 2)
    with pytest.raises(MembershipError, match=r"ranks \[4, 5\] have no worker record .* 0.2 s"):
        nodes_from_store(store, 6, timeout_s=0.2)
