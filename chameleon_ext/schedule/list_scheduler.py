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

Implementation: the scan "least (start time, backward < forward < weight half, unit) over all
units" runs on a heap holding each unit's own least candidate. Placing an op changes the
candidates of only two units: its own (its clock and queues moved) and the neighbour on the
micro-batch's path whose input it produces. Only those two are recomputed; an entry that is no
longer its unit's candidate is skipped when popped (lazy deletion). Start times never decrease,
since every new candidate starts at or after the op just placed. Units that no path connects
(each untouched pipeline, for one) cannot affect each other, so each connected part runs on its
own heap. This is O(ops log units) instead of a scan of every unit per op, with the same choices:
a unit's order among units is its group's sorted order, so ties fall as in the scan. (The cost
model is asked once per op and message, so it must be a pure function of its arguments, as
CostModel's implementations are.)
"""

from __future__ import annotations

import gc
import heapq
import math
from dataclasses import dataclass, field

from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError
from chameleon_ext.schedule.ir import Op, OpKind, Schedule
from chameleon_ext.schedule.simulator import CostModel

_Path = list[tuple[int, ...]]
# One placed op of a unit: its compute op, its position on the path, and the send of its result
# from the unit's lead rank (None: the path ends there).
_Placed = tuple[Op, int, Op | None]


@dataclass(slots=True)
class _Unit:
    """One tensor-parallel group of ranks: they run identical op sequences."""

    ranks: tuple[int, ...]
    forwards: list[tuple[int, int]] = field(default_factory=list)  # (mb, position), in order
    next_fwd: int = 0
    pending_bwd: list[tuple[int, int]] = field(default_factory=list)  # forwarded, not backwarded
    # Input half done, weight half not: (mb, position, the weight half's cost).
    pending_w: list[tuple[int, int, float]] = field(default_factory=list)
    clock: float = 0.0
    limit: int = 1
    ops: list[_Placed] = field(default_factory=list)


def list_schedule(plan: ExecutionPlan, costs: CostModel, split_backward: bool = False) -> Schedule:
    """The list schedule of `plan` under `costs` (see the module docstring)."""
    return timed_list_schedule(plan, costs, split_backward)[0]


def timed_list_schedule(plan: ExecutionPlan, costs: CostModel,
                        split_backward: bool = False) -> tuple[Schedule, float]:
    """list_schedule, and when its last forward or backward ends under `costs`: every op is
    placed at the time the simulator starts it, so where reductions and optimizer steps cost
    nothing this is the simulated iteration time, known without a simulation."""
    # The run allocates millions of small acyclic tuples; the collection passes they would
    # trigger traverse the whole (large) plan each time and can cost more than the scheduling.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _schedule(plan, costs, split_backward)
    finally:
        if was_enabled:
            gc.enable()


def _schedule(plan: ExecutionPlan, costs: CostModel,
              split_backward: bool) -> tuple[Schedule, float]:
    paths, order = _paths_and_order(plan)
    units: dict[tuple[int, ...], _Unit] = {}
    for mb, path in enumerate(paths):
        for k, group in enumerate(path):
            u = units.get(group)
            if u is None:
                u = units[group] = _Unit(group)
            u.forwards.append((mb, k))
            u.limit = max(u.limit, len(path) - k)
    for u in units.values():
        u.forwards.sort(key=lambda f: (order[f[0]], f[0]))

    # A unit's index orders like (lead rank, group), the scan's tie-break.
    by_index = [units[group] for group in sorted(units)]
    index = {u.ranks: i for i, u in enumerate(by_index)}
    path_units = [[index[group] for group in path] for path in paths]
    bwd_kind = OpKind.BWD_INPUT if split_backward else OpKind.BWD
    # Compute ops are the same on every rank of a micro-batch's path: build each once.
    fwd_ops = [Op(OpKind.FWD, mb) for mb in range(len(paths))]
    bwd_ops = [Op(bwd_kind, mb) for mb in range(len(paths))]
    w_ops = [Op(OpKind.BWD_WEIGHT, mb) for mb in range(len(paths))] if split_backward else []
    compute, p2p = costs.compute, costs.p2p

    # When the input of (mb, position) is on its unit (fwd_in[mb][position]): the producer's
    # finish plus the message, None while the producer is not placed. The first stage's
    # activations and the last stage's gradients are there from the start: -inf, so that
    # max(clock, -inf) is the clock, as for the scan.
    fwd_in: list[list[float | None]] = [[-math.inf] + [None] * (len(path) - 1)
                                        for path in paths]
    bwd_in: list[list[float | None]] = [[None] * (len(path) - 1) + [-math.inf]
                                        for path in paths]

    heap: list[tuple[float, int, int]] = []  # (start time, priority, unit index)
    current: list[tuple[float, int, int] | None] = [None] * len(by_index)  # each unit's entry

    def refresh(i: int) -> None:
        """Recompute unit i's least candidate; push it unless it is the entry already there."""
        u = by_index[i]
        clock = u.clock
        held = len(u.pending_bwd) + len(u.pending_w)
        best: float | None = None
        prio = 0
        if u.pending_bwd:
            mb, k = u.pending_bwd[0]
            t = bwd_in[mb][k]
            if t is not None:
                best = t if t > clock else clock
        bwd_ready = best is not None
        if u.next_fwd < len(u.forwards) and held < u.limit:
            mb, k = u.forwards[u.next_fwd]
            t = fwd_in[mb][k]
            if t is not None:
                t = t if t > clock else clock
                if best is None or t < best:  # a backward wins a tie
                    best, prio = t, 1
        # A weight half (ready at the clock) runs if it delays nothing known: it ends before
        # the next input half or forward could start, or those wait on work not placed yet; or
        # the rank is at the in-flight limit with no input half ready, so the held inputs must
        # be freed first. It loses ties with both.
        if u.pending_w and (best is None or clock < best):
            if (held >= u.limit and not bwd_ready) or best is None \
                    or clock + u.pending_w[0][2] <= best:
                best, prio = clock, 2
        entry = None if best is None else (best, prio, i)
        if entry != current[i]:
            current[i] = entry
            if entry is not None:
                heapq.heappush(heap, entry)

    per_mb = 3 if split_backward else 2
    # Units that no micro-batch's path connects never affect each other's candidates, so each
    # connected part is scheduled on its own small heap: the same choices, cheaper heap steps.
    for part in _connected(path_units, len(by_index)):
        heap.clear()  # what the last part left is stale
        for i in part:
            refresh(i)
        remaining = per_mb * sum(len(by_index[i].forwards) for i in part)
        while remaining:
            # A unit holding weight halves always has a candidate, so an empty heap means that
            # forwards and backwards wait on each other.
            while True:
                if not heap:
                    raise RuntimeError("list scheduler is stuck: the plan's paths are "
                                       "inconsistent")
                entry = heapq.heappop(heap)
                if current[entry[2]] == entry:
                    break
            start, prio, i = entry
            current[i] = None  # consumed: refresh pushes the unit's next candidate
            u = by_index[i]
            lead = u.ranks[0]
            if prio == 2:
                mb, k, cost = u.pending_w.pop(0)
                u.clock = start + cost
                u.ops.append((w_ops[mb], k, None))
                refresh(i)
            elif prio == 0:
                mb, k = u.pending_bwd.pop(0)
                u.clock = end = start + compute(lead, bwd_ops[mb])
                if split_backward:
                    u.pending_w.append((mb, k, compute(lead, w_ops[mb])))
                if k > 0:
                    dst = paths[mb][k - 1][0]
                    send = Op(OpKind.SEND_BWD, mb, dst)
                    bwd_in[mb][k - 1] = end + p2p(lead, dst, send)
                    u.ops.append((bwd_ops[mb], k, send))
                    refresh(i)
                    refresh(path_units[mb][k - 1])
                else:
                    u.ops.append((bwd_ops[mb], k, None))
                    refresh(i)
            else:
                mb, k = u.forwards[u.next_fwd]
                u.next_fwd += 1
                u.clock = end = start + compute(lead, fwd_ops[mb])
                u.pending_bwd.append((mb, k))
                if k + 1 < len(paths[mb]):
                    dst = paths[mb][k + 1][0]
                    send = Op(OpKind.SEND_FWD, mb, dst)
                    fwd_in[mb][k + 1] = end + p2p(lead, dst, send)
                    u.ops.append((fwd_ops[mb], k, send))
                    refresh(i)
                    refresh(path_units[mb][k + 1])
                else:
                    u.ops.append((fwd_ops[mb], k, None))
                    refresh(i)
            remaining -= 1

    tail = [Op(OpKind.REDUCE_GRADS), Op(OpKind.OPT_STEP)]
    out: dict[int, list[Op]] = {}
    for u in units.values():
        for t, rank in enumerate(u.ranks):
            out[rank] = _emit(u.ops, paths, t, tail)
    return Schedule(out), max((u.clock for u in units.values()), default=0.0)


def whole_backward_bound(plan: ExecutionPlan, costs: CostModel) -> float:
    """A lower bound on when the last forward or backward ends in any schedule of `plan` whose
    backwards are whole (not split) under `costs`: each unit runs its forwards and backwards
    one after another, its first op starting no earlier than the forwards before it on the
    path of one of its micro-batches take, and its last one, a backward, still has to pass
    the units before it on its micro-batch's path (messages cost at least nothing)."""
    paths, _ = _paths_and_order(plan)
    start: dict[tuple[int, ...], float] = {}
    busy: dict[tuple[int, ...], float] = {}
    drain: dict[tuple[int, ...], float] = {}
    compute = costs.compute
    for mb, path in enumerate(paths):
        fwd, bwd = Op(OpKind.FWD, mb), Op(OpKind.BWD, mb)
        before_fwd = before_bwd = 0.0
        for group in path:
            f, b = compute(group[0], fwd), compute(group[0], bwd)
            busy[group] = busy.get(group, 0.0) + f + b
            start[group] = min(start.get(group, math.inf), before_fwd)
            drain[group] = min(drain.get(group, math.inf), before_bwd)
            before_fwd += f
            before_bwd += b
    return max((start[g] + busy[g] + drain[g] for g in busy), default=0.0)


def _connected(path_units: list[list[int]], n: int) -> list[list[int]]:
    """The units 0..n-1 split into sets that paths connect, each in increasing order. Most
    micro-batches share their path with others, so only the distinct paths are merged."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for path in {tuple(p) for p in path_units}:
        r = root(path[0])
        for i in path[1:]:
            parent[root(i)] = r
    parts: dict[int, list[int]] = {}
    for i in range(n):
        parts.setdefault(root(i), []).append(i)
    return list(parts.values())


def _paths_and_order(plan: ExecutionPlan) -> tuple[list[_Path], list[int]]:
    """Every micro-batch's path (as plan.path gives it) and its position in its owning
    pipeline's list: hosts interleave their own and hosted micro-batches by it, so each
    pipeline's work flows in its own order. One pass over the plan, not one per micro-batch."""
    wanted = range(plan.num_micro_batches)
    paths: dict[int, _Path] = {}
    order: dict[int, int] = {}
    for p in plan.pipelines:
        for pos, mb in enumerate(p.micro_batches):
            if mb in wanted and mb not in paths:  # its first owner, as plan.path finds it
                paths[mb] = [tuple(st.ranks or st.hosts[mb]) for st in p.stages]
                order[mb] = pos
    for mb in wanted:
        if mb not in paths:
            raise PlanError(f"micro-batch {mb} is owned by no pipeline")
    return [paths[mb] for mb in wanted], [order[mb] for mb in wanted]


def _emit(placed: list[_Placed], paths: list[_Path], t: int, tail: list[Op]) -> list[Op]:
    """Tensor-parallel rank t's op list: each placed op with its receive and send."""
    ops: list[Op] = []
    for op, k, send in placed:
        kind, mb = op.kind, op.microbatch
        path = paths[mb]
        if kind is OpKind.FWD:
            if k > 0:
                ops.append(Op(OpKind.RECV_FWD, mb, path[k - 1][t]))
            ops.append(op)
            if send is not None:  # the lead rank's send was built for its message cost
                ops.append(send if t == 0 else Op(OpKind.SEND_FWD, mb, path[k + 1][t]))
        elif kind is OpKind.BWD_WEIGHT:
            ops.append(op)
        else:
            if k + 1 < len(path):
                ops.append(Op(OpKind.RECV_BWD, mb, path[k + 1][t]))
            ops.append(op)
            if send is not None:
                ops.append(send if t == 0 else Op(OpKind.SEND_BWD, mb, path[k - 1][t]))
    ops += tail
    return ops
