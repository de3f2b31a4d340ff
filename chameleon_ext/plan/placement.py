"""Placement: which rank takes which place of the failure-free plan, given each rank's node.

A node (its agent and all its workers) fails as a unit. Megatron's rank order (tensor-parallel
fastest, then data-parallel, then pipeline) fills a node with consecutive places: with 2 workers
per node, pipeline 2 x data 2 puts both replicas of stage 1 on node 1, whose loss then loses every
copy of those layers and forces a restart from a checkpoint. Two placements:

- ``megatron``: Megatron's rank order, whatever the nodes (today's layout).
- ``spread``: tensor-parallel groups are cut inside a node (consecutive ranks of one node); the
  groups are then dealt to the nodes in turn (the node with the most groups left first), and the
  places are filled in Megatron's order from that sequence. Consecutive places of a stage (its
  data-parallel replicas) come from different nodes wherever the counts allow, and with as many
  replicas as nodes (or a multiple) each pipeline stays inside one node, so pipeline traffic stays
  local and only the gradient reduction crosses nodes.

A placement only renames ranks: the pipelines, their layer ranges and their micro-batches are those
of ExecutionPlan.failure_free, so the losses are those of any other layout.

The node of each rank comes from the launcher's records on the store (``chameleon/worker/{rank}``
holds "node"; ``chameleon_ext.control.store.nodes_from_store``).

A restart after a failure builds a fresh homogeneous plan in Megatron's order over fewer ranks;
``spread_over`` chooses which survivors take it (as many nodes as possible, as evenly as
possible) and places it the same way. The other strategies keep every survivor in its place.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError

PlacementKind = Literal["spread", "megatron"]
PLACEMENTS: tuple[PlacementKind, ...] = ("spread", "megatron")


def place(kind: PlacementKind, nodes: dict[int, int], plan: ExecutionPlan) -> ExecutionPlan:
    """`plan`, a failure-free plan in Megatron's rank order, over the ranks of `nodes`
    (rank -> node), placed by `kind`."""
    if kind not in PLACEMENTS:
        raise PlanError(f"unknown placement {kind!r} (one of {', '.join(PLACEMENTS)})")
    world = len(nodes)
    if sorted(nodes) != list(range(world)) or plan.world_size != world:
        raise PlanError(f"placement needs the node of every rank 0..{plan.world_size - 1}; "
                        f"got ranks {sorted(nodes)}")
    return plan if kind == "megatron" else _spread(plan, nodes)


def spread_over(plan: ExecutionPlan, groups: list[list[int]], nodes: dict[int, int]
                ) -> tuple[ExecutionPlan, list[int]]:
    """A fresh plan in Megatron's order (every stage with its ranks, place r held by rank r:
    a restart's) over plan.world_size // tensor_parallel of `groups` (tensor-parallel groups
    of launch ranks, rank m on node nodes[m]): the groups dealt from the nodes in turn (so from
    as many nodes as there are, the node with the most left first), then placed the spread way
    among themselves. Returns the placed plan, whose rank i is the i-th chosen launch rank, and
    the chosen launch ranks (sorted)."""
    queues: dict[int, list[list[int]]] = defaultdict(list)
    for g in groups:
        queues[nodes[min(g)]].append(sorted(g))
    chosen = sorted(r for g in _deal(queues)[:plan.world_size // plan.tensor_parallel]
                    for r in g)
    if len(chosen) != plan.world_size:
        raise PlanError(f"a plan of {plan.world_size} ranks over groups of "
                        f"{sum(map(len, groups))} ranks")
    return _spread(plan, {i: nodes[m] for i, m in enumerate(chosen)}), chosen


def _spread(plan: ExecutionPlan, nodes: dict[int, int]) -> ExecutionPlan:
    """`plan` (in Megatron's order) with its places dealt over `nodes` (rank -> node)."""
    order = [r for group in _dealt_groups(nodes, plan.tensor_parallel) for r in group]
    # Megatron's rank r sits at place r; `order` says who takes each place.
    return plan.relabelled({r: order[r] for r in plan.ranks})


def _dealt_groups(nodes: dict[int, int], tensor_parallel: int) -> list[list[int]]:
    """Tensor-parallel groups cut inside each node, dealt to the nodes in turn."""
    by_node: dict[int, list[int]] = defaultdict(list)
    for rank in sorted(nodes):
        by_node[nodes[rank]].append(rank)
    queues: dict[int, list[list[int]]] = {}
    leftover: list[int] = []        # ranks that fill no whole group on their node
    for node, ranks in sorted(by_node.items()):
        whole = len(ranks) - len(ranks) % tensor_parallel
        queues[node] = [ranks[i:i + tensor_parallel] for i in range(0, whole, tensor_parallel)]
        leftover += ranks[whole:]
    spanning = [leftover[i:i + tensor_parallel] for i in range(0, len(leftover), tensor_parallel)]
    return _deal(queues) + spanning


def _deal(queues: dict[int, list[list[int]]]) -> list[list[int]]:
    """The groups of every node's queue, dealt to the nodes in turn (each round, the node with
    the most groups left first). Empties the queues."""
    dealt: list[list[int]] = []
    while any(queues.values()):
        for node in sorted(queues, key=lambda n: (-len(queues[n]), n)):
            if queues[node]:
                dealt.append(queues[node].pop(0))
    return dealt


def single_node_stages(plan: ExecutionPlan, nodes: dict[int, int]) -> list[tuple[int, int, int]]:
    """(layer_start, layer_end, node) for each stage whose every replica is on one node."""
    replicas: dict[tuple[int, int], set[int]] = defaultdict(set)
    for p in plan.pipelines:
        for st in p.stages:
            replicas[(st.layer_start, st.layer_end)].update(nodes[r] for r in st.ranks)
    return [(a, b, next(iter(ns))) for (a, b), ns in sorted(replicas.items()) if len(ns) == 1]


def spanning_tp_groups(plan: ExecutionPlan, nodes: dict[int, int]) -> list[list[int]]:
    """Tensor-parallel groups whose ranks are on more than one node."""
    return [st.ranks for p in plan.pipelines for st in p.stages
            if len({nodes[r] for r in st.ranks}) > 1]


def describe(kind: PlacementKind, plan: ExecutionPlan, nodes: dict[int, int]) -> str:
    """One line for the plan's log line: the placement and what a node's loss would take."""
    count = len({nodes[r] for r in plan.ranks})
    line = f"placement {kind}: {plan.world_size} ranks on {count} node(s)"
    if count == 1:
        return line
    exposed = single_node_stages(plan, nodes)
    if exposed:
        line += "; every replica of " + ", ".join(
            f"layers {a}-{b - 1} on node {n}" for a, b, n in exposed)
    else:
        line += "; every stage has replicas on 2 or more nodes"
    if plan.tensor_parallel > 1:
        spans = spanning_tp_groups(plan, nodes)
        line += (f"; {len(spans)} tensor-parallel group(s) across nodes" if spans
                 else "; tensor-parallel groups within a node")
    return line
