"""The schedule the executor runs for a plan, chosen by simulation (shared by the runtime, which
executes it, and the planner, which predicts it: the same op lists in both)."""

from __future__ import annotations

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.schedule.ir import Schedule, interleaved_1f1b, one_f_one_b
from chameleon_ext.schedule.list_scheduler import timed_list_schedule, whole_backward_bound
from chameleon_ext.schedule.message_fusion import fuse_messages
from chameleon_ext.schedule.simulator import UniformCosts, check, simulate


def choose_schedule(plan: ExecutionPlan, fuse: bool = True, checked: bool = True,
                    whole_backwards: bool = False) -> Schedule:
    """1F1B where it applies; otherwise the list schedule, with backwards split where that is
    faster (the list scheduler's own timeline under UniformCosts, which is the simulated one;
    whole backwards on a tie, or always with `whole_backwards`: --overlap-grad-reduce launches
    the reduction from DDP's backward hooks, which a deferred weight gradient bypasses) and
    (`fuse`) its sends to one peer packed together where that
    leaves the simulated timeline unchanged: the planner predicts without fusing, which gives
    the same iteration time. Every schedule that runs is checked (simulator.check);
    `checked=False` is for predictions only (both generators are correct by construction, and
    the check costs seconds at 16k ranks). An interleaved plan runs Megatron-LM's interleaved
    1F1B, whose run the simulator times (a deadlock would stop it) but whose static checks
    know one stage per rank."""
    if plan.interleaved:
        schedule = interleaved_1f1b(plan)
        if checked:
            simulate(plan, schedule, UniformCosts(), timeline=False)
        return schedule
    if not plan.rerouted:
        schedule = one_f_one_b(plan)
        if checked:
            simulate(plan, schedule, UniformCosts(), timeline=False)
        return schedule
    costs = UniformCosts()
    if whole_backwards:
        best = timed_list_schedule(plan, costs)[0]
    else:
        best, split_ms = timed_list_schedule(plan, costs, split_backward=True)
        # Whole backwards are scheduled only where they could be as fast: the same choice,
        # and at thousands of ranks one list schedule instead of two. (The margin keeps a
        # bound that rounds above an equal makespan from deciding.)
        if whole_backward_bound(plan, costs) <= split_ms * (1 + 1e-9):
            whole, whole_ms = timed_list_schedule(plan, costs)
            if whole_ms <= split_ms:
                best = whole
    if fuse:
        return fuse_messages(plan, best, UniformCosts())  # checked by its simulation
    if checked:
        check(plan, best)
    return best
