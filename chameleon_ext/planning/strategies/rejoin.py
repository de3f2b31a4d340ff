"""Rejoin: ranks that come back (a worker restarted by its agent, a new node) are admitted at an
iteration boundary, and the job goes back to its failure-free layout.

The failure-free plan is laid over the new world so that every rank that stays keeps as many of
the layers it holds as it can (its state does not move) and the newcomers take the rest, whose
state comes from the replicas. With fewer ranks than the failure-free plan has, the positions
nobody takes are handed to the planner as lost, like a failure of the failure-free plan.

The unit is a tensor-parallel group: the ranks of a stage that stay take a stage of the target
together, each on its own shard; newcomers complete the groups partly taken first, then whole
ones. So the positions left over fill whole groups but at most one, and the planner, which
removes every group with a lost position, retires no more ranks than the count forces: the
members placed in that one group leave the plan (spares for a later rejoin).
"""

from __future__ import annotations

from chameleon_ext.plan.execution_plan import ExecutionPlan


def overlay(target: ExecutionPlan, current: ExecutionPlan,
            members: list[int | None]) -> tuple[ExecutionPlan, set[int]]:
    """`target` (a plan every stage of which has ranks) with its ranks relabelled for the new
    world: members[i] is the rank new rank i had in `current` (None: a newcomer). Positions
    left over get the ranks len(members).. and are returned as lost."""
    if target.tensor_parallel != current.tensor_parallel:
        raise ValueError(f"target plan has tensor parallel size {target.tensor_parallel}, the "
                         f"current one {current.tensor_parallel}")
    slots = [st for p in target.pipelines for st in p.stages]  # one group each
    if len(members) > sum(len(st.ranks) for st in slots):
        raise ValueError(f"{len(members)} ranks for a plan of "
                         f"{sum(len(st.ranks) for st in slots)}")
    # The stayers by the stage they hold now: each such unit takes one slot together.
    units: dict[tuple[int, int], list[int]] = {}
    for i, old in enumerate(members):
        if old is not None:
            pos = current.position(old)
            units.setdefault((pos.pipeline, pos.stage), []).append(i)

    def held(unit: list[int], slot: int) -> int:
        st, was = slots[slot], current.stage_of(members[unit[0]])
        return max(0, min(st.layer_end, was.layer_end) - max(st.layer_start, was.layer_start))

    # Greedy by layers kept: the best overlaps first; ties keep the old order.
    found = list(units.values())
    choices = sorted(((held(u, k), -u[0], -k, n) for n, u in enumerate(found)
                      for k in range(len(slots))), reverse=True)
    label: dict[tuple[int, int], int] = {}  # (slot, tp rank) -> new rank
    taken: set[int] = set()
    placed: set[int] = set()
    for _, _, neg_k, n in choices:
        k, unit = -neg_k, found[n]
        if k not in taken and n not in placed:
            taken.add(k)
            placed.add(n)
            label.update(((k, current.position(members[i]).tp_rank), i) for i in unit)
    # Newcomers complete the slots partly taken, then whole free ones, in order.
    free = sorted(((k not in taken, k, t) for k, st in enumerate(slots)
                   for t in range(len(st.ranks)) if (k, t) not in label))
    newcomers = [i for i, old in enumerate(members) if old is None]
    for (_, k, t), i in zip(free, newcomers):
        label[k, t] = i
    lost = set()
    for n, (_, k, t) in enumerate(free[len(newcomers):], len(members)):
        label[k, t] = n
        lost.add(n)
    mapping = {r: label[k, t] for k, st in enumerate(slots) for t, r in enumerate(st.ranks)}
    return target.relabelled(mapping, current.generation + 1), lost
