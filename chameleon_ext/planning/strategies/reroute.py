"""Data rerouting (ReCycle-style): a lost stage's micro-batches run on the same stage of the
surviving pipelines; nothing moves but activations and gradients.

The unit is a tensor-parallel group: a stage that loses any of its ranks is lost whole (its
other shards cannot run a layer without it), its healthy ranks leave the plan with it, and its
micro-batches go to the stage's surviving groups, each hosted micro-batch to one whole group."""

from __future__ import annotations

import dataclasses

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.planning.strategies.base import Context, Proposal


def reroute(plan: ExecutionPlan, failed: set[int] | list[int],
            slowdown: dict[int, float] | None = None) -> ExecutionPlan | None:
    """The rerouted plan over plan.survivors(failed) (renumbered densely in their old order,
    the generation advanced); None when some layers have no surviving replica (rerouting cannot
    absorb the failure). Every stage without ranks (lost now or before) is hosted anew. Each
    hosted micro-batch goes to the replica group that would finish its work soonest: its
    micro-batches so far times its `slowdown` (rank of `plan` -> factor, 1 when absent; a
    group runs at its slowest rank's pace)."""
    slowdown = slowdown or {}
    failed = set(failed)
    pipelines = [Pipeline([Stage(st.layer_start, st.layer_end,
                                 [] if failed.intersection(st.ranks) else list(st.ranks))
                           for st in p.stages], list(p.micro_batches))
                 for p in plan.pipelines]
    stages = [(pi, st) for pi, p in enumerate(pipelines) for st in p.stages]
    replicas: dict[tuple[int, int], list[tuple[int, Stage]]] = {}
    for pi, st in stages:
        if st.ranks:
            replicas.setdefault((st.layer_start, st.layer_end), []).append((pi, st))
    load = {id(q): len(pipelines[qi].micro_batches) for qi, q in stages if q.ranks}
    speed = {id(q): max(slowdown.get(r, 1.0) for r in q.ranks) for _, q in stages if q.ranks}
    for pi, st in stages:  # every stage without ranks is hosted anew
        if st.ranks:
            continue
        hosts = [q for qi, q in replicas.get((st.layer_start, st.layer_end), []) if qi != pi]
        if not hosts:
            return None
        for mb in pipelines[pi].micro_batches:
            host = min(hosts, key=lambda q: ((load[id(q)] + 1) * speed[id(q)], q.ranks))
            st.hosts[mb] = list(host.ranks)
            load[id(host)] += 1
    return dataclasses.replace(plan, pipelines=pipelines).renumbered()


class Reroute:
    name, restarts = "reroute", False

    def propose(self, plan: ExecutionPlan, lost: set[int], ctx: Context) -> Proposal | None:
        new = reroute(plan, lost, ctx.profile.rank_slowdown if ctx.profile else None)
        return None if new is None else Proposal(new)

    def moved_bytes(self, plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                    ctx: Context) -> int:
        return 0   # only activations and gradients travel
