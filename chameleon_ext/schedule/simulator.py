"""Static checks and a discrete-event run of a schedule on its plan.

`check(plan, schedule)` proves, without running anything, that a schedule is complete and wired
consistently: every micro-batch passes forward and backward through every layer and tensor-parallel
shard exactly once, each rank's ops come in a usable order, every send has exactly one receive on a
peer that holds the adjacent layers, and each rank reduces its gradients once and steps last.

`simulate(plan, schedule, costs)` then times the schedule with the semantics of schedule_ir:

- each rank runs its ops strictly in order, with its own clock starting at 0;
- FWD, BWD and OPT_STEP advance the clock by ``costs.compute(rank, op)``;
- a send never blocks and costs its sender nothing: it is posted at the sender's clock; the
  members of a fused message are all posted when the sender reaches the last of them, with the
  latency of that last one;
- a receive completes at ``max(own clock, post time of the matching send + costs.p2p(src, dst,
  send_op))``: message latency is paid on the receive side, and only if the receiver is not late;
- REDUCE_GRADS is a collective over ``plan.replicas(rank)``: every member must reach it, and all of
  them leave it at ``max(arrival clocks) + costs.reduce(group)``.

If no rank can make progress while some still have ops left, the schedule deadlocks and
`simulate` raises ScheduleError naming every blocked rank and the op it waits on.

Both functions are linear in the number of ops (plus sorting the layer spans of each
micro-batch): the planner calls them thousands of times on schedules with ~16k ranks.
This module imports only the standard library and chameleon_ext: never torch or megatron.
"""

from __future__ import annotations

import gc
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, NoReturn, Protocol, runtime_checkable

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.schedule.ir import Op, OpKind, Schedule

__all__ = ["ScheduleError", "CostModel", "UniformCosts", "SimResult", "check", "simulate"]

_FWD = OpKind.FWD
_BWD = OpKind.BWD
_BIN = OpKind.BWD_INPUT
_BWT = OpKind.BWD_WEIGHT
_OPT = OpKind.OPT_STEP
_RED = OpKind.REDUCE_GRADS
_SEND_FWD = OpKind.SEND_FWD
_SEND_BWD = OpKind.SEND_BWD
_RECV_FWD = OpKind.RECV_FWD
_RECV_BWD = OpKind.RECV_BWD
_PEERED = (_SEND_FWD, _RECV_FWD, _SEND_BWD, _RECV_BWD)
_COUNTERPART = {_SEND_FWD: _RECV_FWD, _RECV_FWD: _SEND_FWD,
                _SEND_BWD: _RECV_BWD, _RECV_BWD: _SEND_BWD}
# Column of each per-micro-batch op kind in a rank's index table (see _scan). A split
# backward's input half stands for the backward (column 1); its weight half has its own column.
_COL = {_FWD: 0, _BWD: 1, _BIN: 1, _SEND_FWD: 2, _RECV_FWD: 3, _SEND_BWD: 4, _RECV_BWD: 5,
        _BWT: 6}


# ---- errors ------------------------------------------------------------------------------------
class ScheduleError(ValueError):
    """A schedule that cannot run on its plan.

    `rank` is the rank at fault (for a missing op: the rank that should have had it), `op_index`
    the position of the offending op in that rank's list (None when the op is missing or the fault
    is the list as a whole) and `op` the op itself (for a missing op: the op that is missing).
    The message always starts with the rank and the op, e.g.
    ``rank 1, op 3 recv_fwd(mb=0, peer=0): no matching send_fwd on rank 0``.
    For a deadlock, `blocked` maps every blocked rank to (op_index, op) it waits on, and
    rank/op_index/op describe the lowest blocked rank.
    """

    def __init__(self, message: str, *, rank: int | None = None, op_index: int | None = None,
                 op: Op | None = None, blocked: dict[int, tuple[int, Op]] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.op_index = op_index
        self.op = op
        self.blocked = blocked or {}


def _where(rank: int, op_index: int | None, op: object | None) -> str:
    if op is None:
        return f"rank {rank}"
    if op_index is None:
        return f"rank {rank}, missing {op}"
    return f"rank {rank}, op {op_index} {op}"


def _fail(rank: int, op_index: int | None, op: Op | None, detail: str) -> NoReturn:
    raise ScheduleError(f"{_where(rank, op_index, op)}: {detail}",
                        rank=rank, op_index=op_index, op=op)


# ---- costs -------------------------------------------------------------------------------------
@runtime_checkable
class CostModel(Protocol):
    """Durations in any time unit (the simulator only adds and compares them)."""

    def compute(self, rank: int, op: Op) -> float:
        """Duration of a FWD, BWD, BWD_INPUT, BWD_WEIGHT or OPT_STEP op on `rank`."""
        ...

    def p2p(self, src: int, dst: int, op: Op) -> float:
        """Latency of the message `op` (the SEND_FWD / SEND_BWD posted by `src`) to `dst`;
        added on the receive side."""
        ...

    def reduce(self, ranks: tuple[int, ...]) -> float:
        """Duration of the REDUCE_GRADS collective over `ranks` (sorted), from the last arrival."""
        ...


@dataclass
class UniformCosts:
    """The same cost for every rank: `fwd` / `bwd` / `optimizer` per op, `message` per
    point-to-point message, `reduction` per gradient reduction; a split backward costs
    `bwd_input` + `bwd_weight` (by default half of `bwd` each). Implements CostModel."""

    fwd: float = 1.0
    bwd: float = 2.0
    message: float = 0.0
    reduction: float = 0.0
    optimizer: float = 0.0
    bwd_input: float | None = None
    bwd_weight: float | None = None

    def p2p(self, src: int, dst: int, op: Op) -> float:
        return self.message

    def reduce(self, ranks: tuple[int, ...]) -> float:
        return self.reduction

    def compute(self, rank: int, op: Op) -> float:
        kind = op.kind
        if kind is _FWD:
            return self.fwd
        if kind is _BWD:
            return self.bwd
        if kind is _BIN:
            return self.bwd / 2 if self.bwd_input is None else self.bwd_input
        if kind is _BWT:
            return self.bwd / 2 if self.bwd_weight is None else self.bwd_weight
        if kind is _OPT:
            return self.optimizer
        raise ValueError(f"rank {rank}, {op}: compute() is only defined for fwd, bwd, "
                         "bwd_input, bwd_weight and optimizer_step")


# ---- result ------------------------------------------------------------------------------------
@dataclass
class SimResult:
    """Outcome of one simulated iteration.

    iteration_time: when the last rank finishes its last op.
    rank_finish: per rank, when it finishes its last op.
    busy: per rank, total compute time (FWD, BWD and its halves, OPT_STEP).
    bubble_fraction: idle fraction of the ranks over the compute window, i.e.
        ``1 - sum over ranks of FWD+BWD time / (n_ranks * T)``, where T is the end of the last
        FWD or BWD (or half of one) on any rank (0.0 when there is none). Gradient reduction and the
        optimizer step after the window are not counted, so for 1F1B with zero p2p costs it is
        exactly the pipeline bubble (p-1)/(m+p-1) (p stages, m micro-batches per pipeline);
        communication waits and imbalance between pipelines or stages count as idle.
    peak_inflight: per rank, the most micro-batches whose FWD has run and whose BWD (for a
        split backward: BWD_WEIGHT, which still needs the layers' inputs) has not (the
        activations it holds at once).
    timeline: per rank, (op, start, end) for each op in order; start is when the rank reached
        the op, end when it completed (sends: end == start; receives and REDUCE_GRADS include
        the wait). Empty when simulate(..., timeline=False).
    """

    iteration_time: float
    rank_finish: dict[int, float]
    busy: dict[int, float]
    bubble_fraction: float
    peak_inflight: dict[int, int]
    timeline: dict[int, list[tuple[Op, float, float]]] = field(default_factory=dict)


# ---- plan geometry -----------------------------------------------------------------------------
def _places(plan: ExecutionPlan) -> dict[int, tuple[int, int, int, int, int]]:
    """rank -> (pipeline, stage, tp_rank, layer_start, layer_end), read straight from the plan."""
    out: dict[int, tuple[int, int, int, int, int]] = {}
    for pi, p in enumerate(plan.pipelines):
        for si, st in enumerate(p.stages):
            for t, r in enumerate(st.ranks):
                out[r] = (pi, si, t, st.layer_start, st.layer_end)
    return out


def _replica_groups(plan: ExecutionPlan) -> dict[int, tuple[int, ...]]:
    """rank -> sorted ranks holding the same layers and tp shard (== plan.replicas, in O(ranks));
    in a plan whose pipelines split the layers differently, the ranks its gradient all-reduces
    (one per segment of layers) chain together: they finish when the last of them does."""
    if plan.misaligned_stages() is not None:
        return reduction_components(plan)
    by_key: dict[tuple[int, int, int], list[int]] = {}
    for p in plan.pipelines:
        for st in p.stages:
            for t, r in enumerate(st.ranks):
                by_key.setdefault((st.layer_start, st.layer_end, t), []).append(r)
    out: dict[int, tuple[int, ...]] = {}
    for members in by_key.values():
        group = tuple(sorted(members))
        for r in group:
            out[r] = group
    return out


def reduction_components(plan: ExecutionPlan) -> dict[int, tuple[int, ...]]:
    """rank -> the sorted ranks linked to it by sharing a segment of layers (same tp shard)."""
    parent = {r: r for r in plan.ranks}

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for t in range(plan.tensor_parallel):
        for a, b in plan.segments():
            members = plan.segment_ranks(a, b, t)
            for r in members[1:]:
                parent[root(r)] = root(members[0])
    groups: dict[int, list[int]] = {}
    for r in plan.ranks:
        groups.setdefault(root(r), []).append(r)
    return {r: group for g in groups.values() for group in (tuple(sorted(g)),) for r in group}


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: the hot loops allocate millions of small acyclic
    tuples, and the collection passes they trigger would otherwise double the run time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ---- static checks -----------------------------------------------------------------------------
def check(plan: ExecutionPlan, schedule: Schedule) -> None:
    """Raise ScheduleError for the first reason `schedule` cannot run on `plan` (PlanError if the
    plan itself is invalid). See the module docstring for what is checked."""
    with _gc_paused():
        _check(plan, schedule)


def _check(plan: ExecutionPlan, schedule: Schedule) -> None:
    plan.validate()
    if plan.interleaved:
        raise ScheduleError("the static checks know one stage per rank; an interleaved plan's "
                            "schedule is checked by its simulated run (simulate(..., "
                            "validate=False) stops at a deadlock)")
    places = _places(plan)
    all_ops = schedule.ops
    num_layers = plan.num_layers
    nmb = plan.num_micro_batches

    for r in sorted(all_ops):
        if r not in places:
            _fail(r, None, None, "has an op list but no place in the plan")
    ranks = sorted(places)
    for r in ranks:
        if r not in all_ops:
            pi, si, _, ls, le = places[r]
            _fail(r, None, None, f"has no op list (it holds layers [{ls}, {le}) of pipeline {pi} "
                                 f"stage {si})")

    # 1. per-rank scan: well-formed ops, no duplicates on a rank; index of every op by (kind, mb).
    tables: dict[int, tuple[dict[int, int], ...]] = {}
    reduce_at: dict[int, int] = {}
    opt_at: dict[int, int] = {}
    for r in ranks:
        ops = all_ops[r]
        cols: tuple[dict[int, int], ...] = ({}, {}, {}, {}, {}, {}, {})
        red = opt = -1
        for i, op in enumerate(ops):
            if not isinstance(op, Op) or not isinstance(op.kind, OpKind):
                _fail(r, i, op, "is not an Op of a known kind")  # type: ignore[arg-type]
            kind = op.kind
            if kind is _RED:
                if red >= 0:
                    _fail(r, i, op, f"second reduce_grads on this rank (the first is op {red})")
                red = i
                continue
            if kind is _OPT:
                if opt >= 0:
                    _fail(r, i, op, f"second optimizer_step on this rank (the first is op {opt})")
                opt = i
                continue
            mb = op.microbatch
            if not isinstance(mb, int) or not 0 <= mb < nmb:
                _fail(r, i, op, f"micro-batch {mb} is outside [0, {nmb})")
            col = cols[_COL[kind]]
            if mb in col:
                _fail(r, i, op, f"duplicates op {col[mb]} {ops[col[mb]]} on this rank")
            col[mb] = i
            if kind in _PEERED:
                peer = op.peer
                if peer == r:
                    _fail(r, i, op, "its peer is the rank itself")
                if peer not in places:
                    _fail(r, i, op, f"peer {peer} has no place in the plan")
        if opt >= 0 and opt != len(ops) - 1:
            _fail(r, opt, ops[opt], f"optimizer_step must be the last op, but {len(ops) - 1 - opt}"
                                    f" op(s) follow it (op {opt + 1} {ops[opt + 1]})")
        tables[r] = cols
        reduce_at[r] = red
        opt_at[r] = opt

    # 2. coverage: each (micro-batch, tp rank) goes forward and backward through every layer once.
    owner: dict[int, int] = {}
    for pi, p in enumerate(plan.pipelines):
        for mb in p.micro_batches:
            owner[mb] = pi
    tp_size = plan.tensor_parallel
    for kind, col_no, name in ((_FWD, 0, "forward"), (_BWD, 1, "backward")):
        spans: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        for r in ranks:
            _, _, t, ls, le = places[r]
            for mb, i in tables[r][col_no].items():
                key = (mb, t)
                lst = spans.get(key)
                if lst is None:
                    spans[key] = [(ls, le, r, i)]
                else:
                    lst.append((ls, le, r, i))
        for mb in range(nmb):
            for t in range(tp_size):
                lst = spans.get((mb, t), [])
                lst.sort()
                expect = 0
                prev_r = prev_i = -1
                for ls, le, r, i in lst:
                    if ls > expect:
                        _missing(plan, places, owner, kind, name, mb, t, expect, ls)
                    if ls < expect:
                        _fail(r, i, all_ops[r][i],
                              f"repeats the {name} of micro-batch {mb} through layers "
                              f"[{ls}, {min(le, expect)}) (tp rank {t}), already run by rank "
                              f"{prev_r} (op {prev_i} {all_ops[prev_r][prev_i]})")
                    expect = le
                    prev_r, prev_i = r, i
                if expect < num_layers:
                    _missing(plan, places, owner, kind, name, mb, t, expect, num_layers)

    # 3. order on each rank: activations arrive before and leave after the FWD that uses them,
    #    gradients likewise around the BWD, and BWD(mb) follows FWD(mb) on the same rank.
    for r in ranks:
        ops = all_ops[r]
        _, _, _, ls, le = places[r]
        fwd, bwd, sf, rf, sb, rb, wgt = tables[r]
        first, last = ls == 0, le == num_layers
        for mb, i in fwd.items():
            j = bwd.get(mb)
            if j is None:
                _fail(r, i, ops[i], f"has no bwd(mb={mb}) on this rank to consume its activations")
            if j < i:
                _fail(r, j, ops[j], f"runs before fwd(mb={mb}) (op {i})")
            if not first:
                _before(r, ops, rf.get(mb), i, _RECV_FWD, mb, f"the stage starts at layer {ls}")
            if not last:
                _after(r, ops, sf.get(mb), i, _SEND_FWD, mb,
                       f"the stage ends at layer {le} of {num_layers}")
            if not last:
                _before(r, ops, rb.get(mb), j, _RECV_BWD, mb,
                        f"the stage ends at layer {le} of {num_layers}")
            if not first:
                _after(r, ops, sb.get(mb), j, _SEND_BWD, mb, f"the stage starts at layer {ls}")
        for mb, j in bwd.items():
            if mb not in fwd:
                _fail(r, j, ops[j], f"has no fwd(mb={mb}) before it on this rank")
            k = wgt.get(mb)
            if ops[j].kind is _BIN and k is None:
                _fail(r, j, ops[j], f"has no bwd_weight(mb={mb}) after it on this rank: the "
                                    "weight gradients of a split backward would be lost")
        for mb, k in wgt.items():
            j = bwd.get(mb)
            if j is None or ops[j].kind is not _BIN:
                _fail(r, k, ops[k], f"needs a bwd_input(mb={mb}) before it on this rank")
            if k < j:
                _fail(r, k, ops[k], f"runs before bwd_input(mb={mb}) (op {j})")
        for col, uses, what in ((rf, fwd, "fwd"), (sf, fwd, "fwd"), (rb, bwd, "bwd"),
                                (sb, bwd, "bwd")):
            for mb, k in col.items():
                if mb not in uses:
                    _fail(r, k, ops[k], f"no {what}(mb={mb}) on this rank goes with it")
                if col is rf or col is rb:
                    if k > uses[mb]:
                        _fail(r, k, ops[k], f"comes after the {what}(mb={mb}) it feeds "
                                            f"(op {uses[mb]})")
                elif k < uses[mb]:
                    _fail(r, k, ops[k], f"comes before the {what}(mb={mb}) that produces it "
                                        f"(op {uses[mb]})")

    # 4. wiring: every send/receive pairs with exactly one counterpart on an adjacent-layer peer.
    for r in ranks:
        ops = all_ops[r]
        _, _, t, ls, le = places[r]
        cols = tables[r]
        for col_no in (2, 3, 4, 5):
            for mb, i in cols[col_no].items():
                op = ops[i]
                kind = op.kind
                q = op.peer
                _, _, qt, qs, qe = places[q]
                # forward data flows to higher layers, gradients to lower ones.
                to_next = kind is _SEND_FWD or kind is _RECV_BWD
                want = le if to_next else ls
                got = qs if to_next else qe
                if qt != t or got != want:
                    side = "start" if to_next else "end"
                    _fail(r, i, op, f"peer {q} holds layers [{qs}, {qe}) with tp rank {qt}, but "
                                    f"this rank's layers [{ls}, {le}) (tp rank {t}) need a peer "
                                    f"whose layers {side} at {want} with tp rank {t}")
                other = _COUNTERPART[kind]
                j = tables[q][_COL[other]].get(mb)
                if j is not None and all_ops[q][j].peer == r:
                    continue
                if kind is _SEND_FWD or kind is _SEND_BWD:
                    detail = f"no matching {other.value}(mb={mb}, peer={r}) on rank {q}"
                else:
                    detail = f"no matching {other.value} on rank {q}"
                if j is not None:
                    detail += f" (its op {j} {all_ops[q][j]} names another peer)"
                _fail(r, i, op, detail)

    # 5. one gradient reduction after all backwards; one optimizer step, last.
    for r in ranks:
        ops = all_ops[r]
        red = reduce_at[r]
        if red < 0:
            _fail(r, None, Op(_RED), "every rank reduces its gradients once, after its last bwd")
        backwards = [*tables[r][1].values(), *tables[r][6].values()]
        if backwards:
            last_bwd = max(backwards)
            if last_bwd > red:
                _fail(r, red, ops[red], f"comes before op {last_bwd} {ops[last_bwd]}: gradients "
                                        "are reduced after the last bwd")
        if opt_at[r] < 0:
            _fail(r, None, Op(_OPT), "every rank ends its op list with one optimizer_step")

    # 6. fused messages: two or more sends of one rank to one peer, each in one message only.
    fused_at: dict[tuple[int, int], int] = {}
    for n, msg in enumerate(schedule.fused):
        src = msg.src
        if src not in tables or len(msg.members) < 2:
            _fail(src, None, None, f"fused message {n} needs a rank of the plan as its sender "
                                   f"and at least 2 members, not {len(msg.members)}")
        last = -1
        for op in msg.members:
            i = tables[src][_COL[op.kind]].get(op.microbatch) if op.kind in _COL else None
            if op.kind not in (_SEND_FWD, _SEND_BWD) or i is None or all_ops[src][i] != op \
                    or op.peer != msg.dst:
                _fail(src, i, op, f"fused message {n} to rank {msg.dst} lists it, but its "
                                  "members must be sends of this rank to that peer")
            if (src, i) in fused_at:
                _fail(src, i, op, f"is in fused messages {fused_at[src, i]} and {n}")
            if i < last:
                _fail(src, i, op, f"fused message {n} lists its members out of this rank's order")
            fused_at[src, i] = n
            last = i


def _missing(plan: ExecutionPlan, places: dict, owner: dict[int, int], kind: OpKind, name: str,
             mb: int, tp: int, lo: int, hi: int) -> NoReturn:
    """Raise for layers [lo, hi) of (mb, tp) that no rank runs, naming the rank that should:
    the one in mb's owning pipeline that holds layer `lo`."""
    rank = None
    pi = owner.get(mb)
    if pi is not None:
        for st in plan.pipelines[pi].stages:
            if st.layer_start <= lo < st.layer_end:
                rank = st.ranks[tp]
                break
    if rank is None:  # unreachable for a validated plan; fall back to any holder of the layer
        rank = min(r for r, (_, _, t, ls, le) in places.items() if t == tp and ls <= lo < le)
    pi_, si, _, ls, le = places[rank]
    _fail(rank, None, Op(kind, mb),
          f"no rank runs the {name} of micro-batch {mb} through layers [{lo}, {hi}) (tp rank "
          f"{tp}); it belongs on rank {rank} (pipeline {pi_} stage {si}, layers [{ls}, {le}), "
          f"which owns micro-batch {mb})")


def _before(r: int, ops: list[Op], k: int | None, i: int, kind: OpKind, mb: int,
            why: str) -> None:
    if k is None:
        _fail(r, i, ops[i], f"needs a {kind.value}(mb={mb}) before it: {why}")
    if k > i:
        _fail(r, k, ops[k], f"comes after the op it feeds (op {i} {ops[i]})")


def _after(r: int, ops: list[Op], k: int | None, i: int, kind: OpKind, mb: int, why: str) -> None:
    if k is None:
        _fail(r, i, ops[i], f"needs a {kind.value}(mb={mb}) after it: {why}")
    if k < i:
        _fail(r, k, ops[k], f"comes before the op that produces it (op {i} {ops[i]})")


# ---- discrete-event run ------------------------------------------------------------------------
def simulate(plan: ExecutionPlan, schedule: Schedule, costs: CostModel, *, validate: bool = True,
             timeline: bool = True, start: dict[int, float] | None = None) -> SimResult:
    """Time one iteration of `schedule` on `plan` under `costs` (see the module docstring).

    validate=False skips check() (for a planner re-timing a schedule it has already checked);
    timeline=False skips recording per-op start/end times (SimResult.timeline is then empty);
    `start`: when a rank may begin its first op (work of its own before the schedule, such as
    eager redundancy's refresh; absent ranks: at 0), the iteration still counted from 0.
    Raises ScheduleError on an invalid schedule or a deadlock. An interleaved plan's schedule
    is not checked statically (_check knows one stage per rank): only its run."""
    with _gc_paused():
        if validate and not plan.interleaved:
            _check(plan, schedule)
        return _simulate(plan, schedule, costs, timeline, start or {})


def _simulate(plan: ExecutionPlan, schedule: Schedule, costs: CostModel,
              timeline: bool, start: dict[int, float]) -> SimResult:
    all_ops = schedule.ops
    ranks = sorted(all_ops)
    group_of = _replica_groups(plan)
    compute = costs.compute
    p2p = costs.p2p
    reduce_cost = costs.reduce

    pc = dict.fromkeys(ranks, 0)
    clock = {r: start.get(r, 0.0) for r in ranks}
    busy = dict.fromkeys(ranks, 0.0)
    inflight = dict.fromkeys(ranks, 0)
    peak = dict.fromkeys(ranks, 0)
    lines: dict[int, list[tuple[Op, float, float]]] = {r: [] for r in ranks}
    posted: dict[tuple[int, int, bool, int], tuple[float, Op]] = {}
    waiting: dict[tuple[int, int, bool, int], int] = {}
    arrived: dict[tuple[int, ...], list[tuple[int, float]]] = {}
    fb_busy = 0.0
    fb_end = 0.0
    members = [tuple((m.src, m.dst, op.kind is _SEND_BWD, _link(op)) for op in m.members)
               for m in schedule.fused]
    message_of = {key: g for g, keys in enumerate(members) for key in keys}
    left = [len(keys) for keys in members]

    ready = deque(ranks)
    while ready:
        r = ready.popleft()
        ops = all_ops[r]
        n = len(ops)
        i = pc[r]
        now = clock[r]
        tl = lines[r]
        fl = inflight[r]
        pk = peak[r]
        b = busy[r]
        while i < n:
            op = ops[i]
            kind = op.kind
            if kind is _FWD or kind is _BWD or kind is _BIN or kind is _BWT or kind is _OPT:
                d = compute(r, op)
                end = now + d
                if timeline:
                    tl.append((op, now, end))
                b += d
                if kind is not _OPT:
                    fb_busy += d
                    if end > fb_end:
                        fb_end = end
                    if kind is _FWD:
                        fl += 1
                        if fl > pk:
                            pk = fl
                    elif kind is not _BIN:
                        fl -= 1
                now = end
            elif kind is _SEND_FWD or kind is _SEND_BWD:
                key = (r, op.peer, kind is _SEND_BWD, _link(op))
                g = message_of.get(key)
                if g is None:
                    keys = (key,)
                else:  # a fused message leaves with its last member
                    left[g] -= 1
                    keys = members[g] if left[g] == 0 else ()
                for key in keys:
                    posted[key] = (now, op)
                    w = waiting.pop(key, None)
                    if w is not None:
                        ready.append(w)
                if timeline:
                    tl.append((op, now, now))
            elif kind is _RECV_FWD or kind is _RECV_BWD:
                key = (op.peer, r, kind is _RECV_BWD, _link(op))
                msg = posted.pop(key, None)
                if msg is None:
                    waiting[key] = r
                    break
                end = msg[0] + p2p(op.peer, r, msg[1])
                if end < now:
                    end = now
                if timeline:
                    tl.append((op, now, end))
                now = end
            elif kind is _RED:
                group = group_of.get(r, (r,))
                if len(group) == 1:
                    end = now + reduce_cost(group)
                else:
                    here = arrived.get(group)
                    if here is None:
                        here = arrived[group] = []
                    here.append((r, now))
                    if len(here) < len(group):
                        break  # parked at the collective; the last arrival releases everyone
                    del arrived[group]
                    end = max(c for _, c in here) + reduce_cost(group)
                    for q, c in here:
                        if q != r:
                            if timeline:
                                lines[q].append((all_ops[q][pc[q]], c, end))
                            clock[q] = end
                            pc[q] += 1
                            ready.append(q)
                if timeline:
                    tl.append((op, now, end))
                now = end
            i += 1
        pc[r] = i
        clock[r] = now
        inflight[r] = fl
        peak[r] = pk
        busy[r] = b

    blocked = {r: (pc[r], all_ops[r][pc[r]]) for r in ranks if pc[r] < len(all_ops[r])}
    if blocked:
        _deadlock(blocked, group_of, pc, all_ops)

    iteration_time = max(clock.values(), default=0.0)
    bubble = 1.0 - fb_busy / (len(ranks) * fb_end) if fb_end > 0 else 0.0
    return SimResult(iteration_time=iteration_time, rank_finish=clock, busy=busy,
                     bubble_fraction=bubble, peak_inflight=peak,
                     timeline=lines if timeline else {})


def _link(op: Op) -> int:
    """What pairs a send with its receive between two ranks besides the direction: the
    micro-batch, or in an interleaved plan the message's tag (the micro-batch and the stage
    boundary it crosses)."""
    return op.microbatch if op.stage < 0 else op.message_tag()


def _deadlock(blocked: dict[int, tuple[int, Op]], group_of: dict[int, tuple[int, ...]],
              pc: dict[int, int], all_ops: dict[int, list[Op]]) -> NoReturn:
    parts = []
    for r, (i, op) in blocked.items():
        if op.kind is _RED:
            group = group_of.get(r, (r,))
            parked = {q for q in group
                      if q in pc and pc[q] < len(all_ops[q]) and all_ops[q][pc[q]].kind is _RED}
            absent = [q for q in group if q not in parked]
            parts.append(f"rank {r}, op {i} {op} waits for replicas {absent} to reach "
                         f"reduce_grads")
        else:
            want = _COUNTERPART[op.kind].value
            parts.append(f"rank {r}, op {i} {op} waits for {want}(mb={op.microbatch}) from rank "
                         f"{op.peer}")
    r0 = min(blocked)
    i0, op0 = blocked[r0]
    raise ScheduleError(f"deadlock: no rank can progress; {len(blocked)} blocked: "
                        + "; ".join(parts), rank=r0, op_index=i0, op=op0, blocked=blocked)
