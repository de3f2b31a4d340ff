"""Rejoin: ranks that come back (a worker restarted by its agent, a new node) are admitted at an
iteration boundary, and the job goes back to its failure-free layout.

The failure-free plan is laid over the new world so that every rank that stays keeps as many of
the layers it holds as it can (its state does not move) and the newcomers take the rest, whose
state comes from the replicas. With fewer ranks than the failure-free plan has, the positions
nobody takes are handed to the planner as lost, like a failure of the failure-free plan.
"""

from __future__ import annotations

import copy

from chameleon_ext.plan import ExecutionPlan


def overlay(target: ExecutionPlan, current: ExecutionPlan,
            members: list[int | None]) -> tuple[ExecutionPlan, set[int]]:
    """`target` (a plan every stage of which has ranks) with its ranks relabelled for the new
    world: members[i] is the rank new rank i had in `current` (None: a newcomer). Positions
    left over get the ranks len(members).. and are returned as lost."""
    positions = [(pi, si, t) for pi, p in enumerate(target.pipelines)
                 for si, st in enumerate(p.stages) for t in range(len(st.ranks))]
    if len(members) > len(positions):
        raise ValueError(f"{len(members)} ranks for a plan of {len(positions)}")

    def held(pos: tuple[int, int, int], old: int) -> int:
        st, was = target.pipelines[pos[0]].stages[pos[1]], current.stage_of(old)
        if current.position(old).tp_rank != pos[2]:
            return 0
        return max(0, min(st.layer_end, was.layer_end) - max(st.layer_start, was.layer_start))

    # Greedy by layers kept: stayers first, the best overlaps first; ties keep the old order.
    choices = sorted(((held(pos, old), -i, -k) for i, old in enumerate(members) if old is not None
                      for k, pos in enumerate(positions)), reverse=True)
    label: dict[int, int] = {}          # position index -> new rank
    placed: set[int] = set()
    for _, neg_i, neg_k in choices:
        i, k = -neg_i, -neg_k
        if k not in label and i not in placed:
            label[k] = i
            placed.add(i)
    free = iter(k for k in range(len(positions)) if k not in label)
    for i in range(len(members)):
        if i not in placed:
            label[next(free)] = i
    lost = set()
    for n, k in enumerate(free, len(members)):
        label[k] = n
        lost.add(n)
    new = copy.deepcopy(target)
    index = {pos: k for k, pos in enumerate(positions)}
    for pi, p in enumerate(new.pipelines):
        for si, st in enumerate(p.stages):
            st.ranks = [label[index[(pi, si, t)]] for t in range(len(st.ranks))]
    new.generation = current.generation + 1
    new._positions = {}
    new.validate()
    return new, lost
