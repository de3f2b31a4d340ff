"""The schedule the executor runs for a plan, chosen by simulation (shared by the runtime, which
executes it, and the planner, which predicts it: the same op lists in both)."""

from __future__ import annotations

from chameleon_ext.list_scheduler import timed_list_schedule
from chameleon_ext.message_fusion import fuse_messages
from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.schedule_ir import Schedule, one_f_one_b
from chameleon_ext.simulator import UniformCosts, check, simulate


def choose_schedule(plan: ExecutionPlan, fuse: bool = True, checked: bool = True) -> Schedule:
    """1F1B where it applies; otherwise the list schedule, with backwards split where that is
    faster (the list scheduler's own timeline under UniformCosts, which is the simulated one)
    and (`fuse`) its sends to one peer packed together where that leaves the simulated timeline
    unchanged: the planner predicts without fusing, which gives the same iteration time. Every
    schedule that runs is checked (simulator.check); `checked=False` is for predictions only
    (both generators are correct by construction, and the check costs seconds at 16k ranks)."""
    if not plan.rerouted:
        schedule = one_f_one_b(plan)
        if checked:
            simulate(plan, schedule, UniformCosts(), timeline=False)
        return schedule
    best, _ = min((timed_list_schedule(plan, UniformCosts(), split_backward=s)
                   for s in (False, True)), key=lambda timed: timed[1])
    if fuse:
        return fuse_messages(plan, best, UniformCosts())  # checked by its simulation
    if checked:
        check(plan, best)
    return best
