"""A schedule for any plan: greedy list scheduling of forwards and backwards under a cost model.

1F1B is a fixed pattern for homogeneous pipelines. Rerouted, taken-over or heterogeneous plans
give some ranks more work than others; this generator places each rank's work by simulated time:
repeatedly the (rank, op) that can start earliest runs next, a backward before a forward on a tie,
and a forward only while the rank holds fewer in-flight micro-batches than 1F1B would at its
position (the number of stages from it to the end of the path), so activation memory stays
1F1B's. Extra work of a host rank thus lands in its own bubbles. On a homogeneous plan this is
1F1B's timing.

With `split_backward`, each backward is split into its input half (which the previous stage waits
for) and its weight half, which waits on the rank until it has nothing else to start: a weight
half runs in a bubble (while the rank's next forward or input half is not ready yet), or when the
micro-batches it still holds reach the in-flight limit, or at the end of the iteration.

Because every op is placed after the ops it depends on in a feasible timeline, the emitted op
lists cannot deadlock under the IR's semantics (non-blocking sends, blocking receives); the
simulator checks every generated schedule anyway.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.schedule_ir import Op, OpKind, Schedule
from chameleon_ext.simulator import CostModel


@dataclass
class _Unit:
    """One tensor-parallel group of ranks: they run identical op sequences."""

    ranks: tuple[int, ...]
    forwards: list[tuple[int, int]] = field(default_factory=list)  # (mb, position), in order
    next_fwd: int = 0
    pending_bwd: list[tuple[int, int]] = field(default_factory=list)  # forwarded, not backwarded
    pending_w: list[tuple[int, int]] = field(default_factory=list)  # input half done, weight not
    clock: float = 0.0
    limit: int = 1
    ops: list[tuple[OpKind, int, int]] = field(default_factory=list)  # (kind, mb, position)


def list_schedule(plan: ExecutionPlan, costs: CostModel, split_backward: bool = False) -> Schedule:
    paths = {mb: [tuple(g) for g in plan.path(mb)] for mb in range(plan.num_micro_batches)}
    units: dict[tuple[int, ...], _Unit] = {}
    for mb in range(plan.num_micro_batches):
        for k, group in enumerate(paths[mb]):
            u = units.setdefault(group, _Unit(group))
            u.forwards.append((mb, k))
            u.limit = max(u.limit, len(paths[mb]) - k)
    for u in units.values():
        u.forwards.sort(key=lambda f: (plan_order(plan, f[0]), f[0]))

    fwd_done: dict[tuple[int, int], float] = {}
    bwd_done: dict[tuple[int, int], float] = {}

    def lead(u: _Unit) -> int:
        return u.ranks[0]

    def message(src: tuple[int, ...], dst: tuple[int, ...], kind: OpKind, mb: int) -> float:
        return costs.p2p(src[0], dst[0], Op(kind, mb, dst[0]))

    def fwd_ready(u: _Unit) -> float | None:
        if u.next_fwd >= len(u.forwards) or len(u.pending_bwd) + len(u.pending_w) >= u.limit:
            return None
        mb, k = u.forwards[u.next_fwd]
        if k == 0:
            return u.clock
        prev = fwd_done.get((mb, k - 1))
        if prev is None:
            return None
        return max(u.clock, prev + message(paths[mb][k - 1], u.ranks, OpKind.SEND_FWD, mb))

    def bwd_ready(u: _Unit) -> float | None:
        if not u.pending_bwd:
            return None
        mb, k = u.pending_bwd[0]
        last = len(paths[mb]) - 1
        if k == last:
            return u.clock
        nxt = bwd_done.get((mb, k + 1))
        if nxt is None:
            return None
        return max(u.clock, nxt + message(paths[mb][k + 1], u.ranks, OpKind.SEND_BWD, mb))

    def w_ready(u: _Unit, bwd: float | None, fwd: float | None) -> float | None:
        """A weight half may start now if it delays nothing known: it ends before the rank's
        next input half or forward could start, or those wait on work not placed yet."""
        if not u.pending_w:
            return None
        if len(u.pending_bwd) + len(u.pending_w) >= u.limit and bwd is None:
            return u.clock  # at the in-flight limit: the held inputs must be freed first
        nxt = min((t for t in (bwd, fwd) if t is not None), default=None)
        mb, _ = u.pending_w[0]
        if nxt is None or u.clock + costs.compute(lead(u), Op(OpKind.BWD_WEIGHT, mb)) <= nxt:
            return u.clock
        return None

    per_mb = 3 if split_backward else 2
    remaining = sum(per_mb * len(u.forwards) for u in units.values())
    order = sorted(units)
    bwd_kind = OpKind.BWD_INPUT if split_backward else OpKind.BWD
    while remaining:
        best: tuple[float, int, int, tuple[int, ...]] | None = None
        for key in order:
            u = units[key]
            b, f = bwd_ready(u), fwd_ready(u)
            for prio, ready in ((0, b), (1, f), (2, w_ready(u, b, f) if split_backward else None)):
                if ready is not None:
                    cand = (ready, prio, lead(u), key)
                    if best is None or cand < best:
                        best = cand
        if best is None:
            # Only weight halves are left that would delay work not placed yet: run the oldest.
            key = min((k for k in order if units[k].pending_w), default=None,
                      key=lambda k: (units[k].clock, lead(units[k])))
            if key is None:
                raise RuntimeError("list scheduler is stuck: the plan's paths are inconsistent")
            best = (units[key].clock, 2, lead(units[key]), key)
        start, prio, _, key = best
        u = units[key]
        if prio == 2:
            mb, k = u.pending_w.pop(0)
            u.clock = start + costs.compute(lead(u), Op(OpKind.BWD_WEIGHT, mb))
            u.ops.append((OpKind.BWD_WEIGHT, mb, k))
        elif prio == 0:
            mb, k = u.pending_bwd.pop(0)
            u.clock = start + costs.compute(lead(u), Op(bwd_kind, mb))
            bwd_done[(mb, k)] = u.clock
            u.ops.append((bwd_kind, mb, k))
            if split_backward:
                u.pending_w.append((mb, k))
        else:
            mb, k = u.forwards[u.next_fwd]
            u.next_fwd += 1
            u.clock = start + costs.compute(lead(u), Op(OpKind.FWD, mb))
            fwd_done[(mb, k)] = u.clock
            u.pending_bwd.append((mb, k))
            u.ops.append((OpKind.FWD, mb, k))
        remaining -= 1

    out: dict[int, list[Op]] = {}
    for u in units.values():
        for t, rank in enumerate(u.ranks):
            out[rank] = _emit(u.ops, paths, t)
    return Schedule(out)


def plan_order(plan: ExecutionPlan, mb: int) -> int:
    """Position of `mb` in its owning pipeline's list: hosts interleave their own and hosted
    micro-batches by it, so each pipeline's work flows in its own order."""
    for p in plan.pipelines:
        if mb in p.micro_batches:
            return p.micro_batches.index(mb)
    return mb


def _emit(unit_ops: list[tuple[OpKind, int, int]], paths: dict[int, list[tuple[int, ...]]],
          t: int) -> list[Op]:
    ops: list[Op] = []
    for kind, mb, k in unit_ops:
        path = paths[mb]
        prev = path[k - 1][t] if k > 0 else None
        nxt = path[k + 1][t] if k + 1 < len(path) else None
        if kind is OpKind.FWD:
            if prev is not None:
                ops.append(Op(OpKind.RECV_FWD, mb, prev))
            ops.append(Op(OpKind.FWD, mb))
            if nxt is not None:
                ops.append(Op(OpKind.SEND_FWD, mb, nxt))
        elif kind is OpKind.BWD_WEIGHT:
            ops.append(Op(kind, mb))
        else:
            if nxt is not None:
                ops.append(Op(OpKind.RECV_BWD, mb, nxt))
            ops.append(Op(kind, mb))
            if prev is not None:
                ops.append(Op(OpKind.SEND_BWD, mb, prev))
    ops.append(Op(OpKind.REDUCE_GRADS))
    ops.append(Op(OpKind.OPT_STEP))
    return ops
