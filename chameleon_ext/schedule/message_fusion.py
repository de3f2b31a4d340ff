"""Choose which sends of a schedule travel together as one packed message.

A rank that hosts rerouted micro-batches sends many small tensors to few peers. Packing several
sends to one peer into one message (chameleon_ext.comm.packed) pays the per-message latency once, but a
fused message leaves only when its last member is ready, which may hold up the receiver. The
choice is made on the simulated timeline (schedule_ir: fused messages): for every (sender,
receiver) pair, the sends are walked in the sender's order and the current message grows by the
next send as long as every member would still arrive before its receive ends in the timeline, i.e.
as long as no receive completes later than unfused. The timeline, and so the iteration, is then
exactly unchanged (and no deadlock can appear), and one simulation decides every fusion.
"""

from __future__ import annotations

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.schedule.ir import RECV_OF, SENDS, FusedMessage, Op, Schedule
from chameleon_ext.schedule.simulator import CostModel, simulate


def fuse_messages(plan: ExecutionPlan, schedule: Schedule, costs: CostModel) -> Schedule:
    """`schedule` with the fused messages that leave its simulated timeline under `costs`
    unchanged (the ops are unchanged). The result is checked like any schedule."""
    timeline = simulate(plan, schedule, costs).timeline
    posted: dict[tuple[int, Op], float] = {}
    recv_end: dict[tuple[int, Op], float] = {}
    for rank, line in timeline.items():
        for op, _, end in line:
            if op.kind in SENDS:
                posted[rank, op] = end
            elif op.kind in RECV_OF.values():
                recv_end[rank, op] = end
    fused: list[FusedMessage] = []
    for src in sorted(schedule.ops):
        by_peer: dict[int, list[Op]] = {}
        for op in schedule.ops[src]:
            if op.kind in SENDS:
                by_peer.setdefault(op.peer, []).append(op)
        for dst, sends in sorted(by_peer.items()):
            def deadline(op: Op) -> float:
                return recv_end[dst, Op(RECV_OF[op.kind], op.microbatch, src)]

            current, due = [sends[0]], deadline(sends[0])
            for op in sends[1:]:
                due_with = min(due, deadline(op))
                if posted[src, op] + costs.p2p(src, dst, op) <= due_with:
                    current.append(op)
                    due = due_with
                    continue
                if len(current) > 1:
                    fused.append(FusedMessage(src, dst, tuple(current)))
                current, due = [op], deadline(op)
            if len(current) > 1:
                fused.append(FusedMessage(src, dst, tuple(current)))
    out = Schedule(schedule.ops, fused)
    simulate(plan, out, costs, timeline=False)
    return out


def message_count(schedule: Schedule) -> tuple[int, int]:
    """(point-to-point messages per iteration, of which fused) of `schedule`."""
    sends = sum(op.kind in SENDS for ops in schedule.ops.values() for op in ops)
    members = sum(len(m.members) for m in schedule.fused)
    return sends - members + len(schedule.fused), len(schedule.fused)
