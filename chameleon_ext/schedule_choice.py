"""The schedule the executor runs for a plan, chosen by simulation (shared by the runtime, which
executes it, and the planner, which predicts it: the same op lists in both)."""

from __future__ import annotations

from chameleon_ext.list_scheduler import list_schedule
from chameleon_ext.message_fusion import fuse_messages
from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.schedule_ir import Schedule, one_f_one_b
from chameleon_ext.simulator import UniformCosts, simulate


def choose_schedule(plan: ExecutionPlan, fuse: bool = True) -> Schedule:
    """1F1B where it applies; otherwise the list schedule, with backwards split where the
    simulator says that is faster and (`fuse`) its sends to one peer packed together where that
    leaves the simulated timeline unchanged: the planner predicts without fusing, which gives
    the same iteration time. Every schedule is checked before it runs."""
    if not plan.rerouted:
        schedule = one_f_one_b(plan)
        simulate(plan, schedule, UniformCosts(), timeline=False)
        return schedule
    candidates = [list_schedule(plan, UniformCosts(), split_backward=s) for s in (False, True)]
    best = min(candidates, key=lambda c: simulate(plan, c, UniformCosts(),
                                                  timeline=False).iteration_time)
    return fuse_messages(plan, best, UniformCosts()) if fuse else best
