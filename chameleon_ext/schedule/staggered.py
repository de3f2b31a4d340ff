"""The pace of back-to-back iterations when each rank steps on its own (ReCycle's staggered
optimizer), against the synchronous step the executor runs.

The executor's step waits for the commit: one all-reduce over the world (the loss, the parts of
the gradient norm that clipping needs, the samples) and the vote, so no rank steps before every
rank has finished its backward and its gradient reduction; the simulated iteration time
(simulator.simulate, every rank starting at 0) is that period, the ranks' local steps after the
commit included. ReCycle lets each stage step as soon as its own gradients are reduced over its
replicas, so the first stage, which the next iteration needs first, need not wait for a later
stage that finishes after it (the last one, with the output layer, after a first-stage loss)
and starts the next iteration while that one still finishes.

`staggered_period` measures that by simulation: `iterations` copies of a schedule run back to
back, each rank going on to its next copy right after its own step, coupled to the others only
by its messages and its replica group's reduction; the period is the makespan's growth per
iteration once the first iteration's start-up is past. It is a prediction of what a staggered
step would gain, not of what runs: the executor keeps the synchronous commit.
"""

from __future__ import annotations

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.schedule.ir import FusedMessage, Op, Schedule
from chameleon_ext.schedule.simulator import CostModel, simulate

# Two copies show the overlap of one iteration's end with the next one's start; the third is a
# margin: with 2, 3, 4 and 5 copies the periods agreed to 1e-14 on every case of
# tools/bench/staggered_optimizer.py.
DEFAULT_ITERATIONS = 3


class _Unrolled:
    """The cost model of the copies: micro-batch m of copy k is micro-batch m - k * count of
    the schedule's plan, so costs that depend on the micro-batch read the one they know."""

    def __init__(self, costs: CostModel, count: int) -> None:
        self._costs, self._count = costs, count

    def _original(self, op: Op) -> Op:
        return op if op.microbatch < self._count else \
            Op(op.kind, op.microbatch % self._count, op.peer)

    def compute(self, rank: int, op: Op) -> float:
        return self._costs.compute(rank, self._original(op))

    def p2p(self, src: int, dst: int, op: Op) -> float:
        return self._costs.p2p(src, dst, self._original(op))

    def reduce(self, ranks: tuple[int, ...]) -> float:
        return self._costs.reduce(ranks)


def _shifted(op: Op, by: int) -> Op:
    return op if op.microbatch < 0 else Op(op.kind, op.microbatch + by, op.peer)


def unrolled(plan: ExecutionPlan, schedule: Schedule, iterations: int) -> Schedule:
    """`iterations` copies of `schedule` back to back on every rank; copy k's micro-batches
    are numbered k * plan.num_micro_batches on, so every message keeps a tag of its own."""
    count = plan.num_micro_batches
    ops = {r: [_shifted(op, k * count) for k in range(iterations) for op in lst]
           for r, lst in schedule.ops.items()}
    fused = [FusedMessage(m.src, m.dst, tuple(_shifted(op, k * count) for op in m.members))
             for k in range(iterations) for m in schedule.fused]
    return Schedule(ops, fused)


def staggered_period(plan: ExecutionPlan, schedule: Schedule, costs: CostModel,
                     iterations: int = DEFAULT_ITERATIONS) -> float:
    """The steady period of `schedule` on `plan` under `costs` with each rank stepping on its
    own (the module docstring): the makespan of `iterations` copies less that of one, per
    further copy. At most simulate()'s iteration time; equal where the rank that finishes last
    is also the first one the next iteration needs (the first stage of a 1F1B pipeline)."""
    if iterations < 2:
        raise ValueError(f"iterations must be at least 2, got {iterations}")
    wrapped = _Unrolled(costs, plan.num_micro_batches)
    one = simulate(plan, schedule, costs, validate=False, timeline=False).iteration_time
    many = simulate(plan, unrolled(plan, schedule, iterations), wrapped, validate=False,
                    timeline=False).iteration_time
    return (many - one) / (iterations - 1)
