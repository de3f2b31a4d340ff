"""Data rerouting (ReCycle-style): a lost stage's micro-batches run on the same stage of the
surviving pipelines; nothing moves but activations and gradients."""

from __future__ import annotations

import copy

from chameleon_ext.plan import ExecutionPlan


def reroute(plan: ExecutionPlan, failed: set[int] | list[int],
            slowdown: dict[int, float] | None = None) -> ExecutionPlan | None:
    """The rerouted plan over the survivors, ranks renumbered densely in their old order and the
    generation advanced; None when some layers have no surviving replica (rerouting cannot absorb
    the failure). A stage that loses any tensor-parallel rank is lost whole: its other shards
    cannot run without it, and those ranks get no place in the new plan. Each hosted
    micro-batch goes to the replica that would finish its work soonest: its micro-batches so
    far times its `slowdown` (rank of `plan` -> factor, 1 when absent)."""
    slowdown = slowdown or {}
    failed = set(failed)
    new = copy.deepcopy(plan)
    stages = [(pi, st) for pi, p in enumerate(new.pipelines) for st in p.stages]
    for _, st in stages:
        if failed & set(st.ranks):
            st.ranks = []
    for pi, st in stages:
        if st.ranks:
            continue
        replicas = [(qi, q) for qi, q in stages if q.ranks and qi != pi
                    and (q.layer_start, q.layer_end) == (st.layer_start, st.layer_end)]
        if not replicas:
            return None
        st.hosts = {}
    load = {id(q): len(new.pipelines[qi].micro_batches) for qi, q in stages if q.ranks}
    speed = {id(q): max(slowdown.get(r, 1.0) for r in q.ranks) for _, q in stages if q.ranks}
    for pi, st in stages:
        if st.ranks:
            continue
        replicas = [q for qi, q in stages if q.ranks and qi != pi
                    and (q.layer_start, q.layer_end) == (st.layer_start, st.layer_end)]
        for mb in new.pipelines[pi].micro_batches:
            host = min(replicas, key=lambda q: ((load[id(q)] + 1) * speed[id(q)], q.ranks))
            st.hosts[mb] = list(host.ranks)
            load[id(host)] += 1
    survivors = sorted(r for _, st in stages for r in st.ranks)
    renumber = {old: i for i, old in enumerate(survivors)}
    for _, st in stages:
        st.ranks = [renumber[r] for r in st.ranks]
        st.hosts = {mb: [renumber[r] for r in rs] for mb, rs in st.hosts.items()}
    new.generation = plan.generation + 1
    new._positions = {}
    new.validate()
    return new

