"""Candidate plans after a failure, their predicted costs, and the choice among them.

Every available strategy proposes its plan over the survivors (chameleon_ext.planning.strategies): reroute
(the lost stage's micro-batches to its replicas), takeover (a neighbour stage of the failed
pipeline absorbs the lost layers, fetched with their optimizer state from a replica),
reparallelize (pipelines of different depths over every survivor, the micro-batches split by
their speed), restart (the latest checkpoint onto the
homogeneous plan over the survivors predicted fastest, among every pipeline depth and width, its
layers split by a dynamic program over contiguous layer ranges so that the stages' predicted
costs are balanced) and the hybrid reroute+restart (reroute now, and at the next periodic
checkpoint save restart from that fresh checkpoint onto the re-planned layout). Each plan is
predicted with the performance model (chameleon_ext.planning.perf_model.predict_plan: the simulator over
the schedule the executor would run, on the fewest pipelines that determine it exactly) and
costed as

    transition + horizon x predicted iteration time

where the horizon is the number of iterations expected before the next event: the job's remaining
iterations, or fewer when `--chameleon-mtbf` says a failure comes sooner. The hybrid, switching
after k iterations (the interrupted one, run again, included), costs

    reroute transition + k x reroute iteration + rebuild and checkpoint read
        + (horizon - k) x re-planned iteration

and is a candidate only when k is within the horizon. A candidate whose predicted memory exceeds
the device's is never chosen. The layouts of the restart search are predicted in the order of a
lower bound on their iteration time, and the search stops at the first bound above the best
prediction so far: the same choice as predicting every layout.

With tensor parallelism the unit of every strategy is a tensor-parallel group: a group with a
lost rank leaves the plan whole (its healthy ranks too), and every candidate runs on whole
surviving groups, its new rank i on plan.survivors(lost, its world size)[i]. The degree stays
the plan's: no candidate re-shards a replica to another degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import (MIB, Prediction, Profile, predict_plan, stage_param_count,
                                      switch_ms, transition_ms)
from chameleon_ext.planning.strategies import REGISTRY, Context
from chameleon_ext.planning.strategies.redundancy import eager_cost
from chameleon_ext.schedule.choice import choose_schedule
from chameleon_ext.schedule.ir import Schedule

STRATEGIES = (*REGISTRY, "reroute+restart")


@dataclass
class Situation:
    """What the planner knows at a failure besides the plan and the profile."""

    iteration: int                     # the interrupted iteration (1-based)
    checkpoint_iteration: int          # of the latest checkpoint (0: none; restart from scratch)
    remaining_iterations: int          # iterations left to train, the interrupted one included
    mtbf_hours: float | None = None
    failure_free_ms: float = 0.0       # iteration time before the failure (for lost work)
    save_interval: int = 0             # a checkpoint after every multiple (0: no periodic saves)
    eager_redundancy: bool = False     # stages hold shadow copies (strategies.redundancy)


class _Scheduled:
    """`schedule`: the one the executor would run for `self.plan`, built on first use (the
    predictions do not need it whole, and at 16k ranks it takes seconds)."""

    plan: ExecutionPlan

    @cached_property
    def schedule(self) -> Schedule:
        return choose_schedule(self.plan, fuse=False)


@dataclass
class Switch(_Scheduled):
    """A hybrid's second step: after iteration `at_iteration` (a periodic checkpoint save) the
    job moves to `plan` by `strategy`, paying `transition_ms`."""

    strategy: str
    plan: ExecutionPlan
    iteration_ms: float
    transition_ms: float
    at_iteration: int


@dataclass
class Candidate(_Scheduled):
    strategy: str
    plan: ExecutionPlan
    iteration_ms: float
    transition_ms: float
    memory_bytes: int                  # the largest per-rank estimate
    feasible: bool
    total_ms: float = math.inf
    switch: Switch | None = None       # a hybrid's second step (plan etc. are the first's)

    def summary(self) -> dict:
        """The metrics file's form (ARCHITECTURE.md: recovery.candidates)."""
        out = {"strategy": self.strategy, "predicted_iter_ms": round(self.iteration_ms, 3),
               "transition_ms": round(self.transition_ms, 1),
               "memory_mib": round(self.memory_bytes / MIB, 1), "feasible": self.feasible,
               "total_ms": round(self.total_ms, 1) if math.isfinite(self.total_ms) else None,
               "world": self.plan.world_size, "layout": _layout(self.plan)}
        if self.switch is not None:
            s = self.switch
            out["switch"] = {"strategy": s.strategy, "at_iteration": s.at_iteration,
                             "predicted_iter_ms": round(s.iteration_ms, 3),
                             "transition_ms": round(s.transition_ms, 1),
                             "layout": _layout(s.plan), "world": s.plan.world_size}
        return out


def _layout(plan: ExecutionPlan) -> str:
    depths = [len(p.stages) for p in plan.pipelines]
    if len(set(depths)) == 1:
        return f"{len(depths)} pipeline(s) x {depths[0]} stage(s)"
    counts = {d: depths.count(d) for d in sorted(set(depths), reverse=True)}
    return f"{len(depths)} pipelines of " + " + ".join(f"{n} x {d}" for d, n in counts.items()) \
        + " stages"


def horizon_iterations(situation: Situation, iteration_ms: float) -> float:
    """Iterations expected before the next event, at `iteration_ms` each. The candidates are
    compared on one such count (the same work): with a horizon in time instead, every plan
    would fill it exactly and only the transitions would differ."""
    n = float(situation.remaining_iterations)
    if situation.mtbf_hours and iteration_ms > 0:
        n = min(n, situation.mtbf_hours * 3.6e6 / iteration_ms)
    return n


def candidates(plan: ExecutionPlan, lost: set[int], profile: Profile, situation: Situation,
               strategies: tuple[str, ...] = STRATEGIES) -> list[Candidate]:
    """Every strategy's plan over the survivors of `plan` without the ranks `lost` (the
    registry's proposals), predicted, costed over the horizon, cheapest first (infeasible ones
    last). The profile's slow ranks are those of `plan`. The unit is a tensor-parallel group:
    every strategy removes each group with a lost rank whole and numbers the ranks it keeps
    densely in their old order, so a candidate's new rank i is plan.survivors(lost, its world
    size)[i]."""
    if not plan.survivors(lost):
        return []
    lost_ms = situation.failure_free_ms
    hybrid = "reroute+restart" in strategies
    profile = profile.at_tensor_parallel(plan.tensor_parallel)
    ctx = Context(profile, situation.eager_redundancy)
    after = ctx.after(plan, lost)
    proposed: dict[str, Candidate] = {}
    for name, strategy in REGISTRY.items():
        if name not in strategies and not (hybrid and name in ("reroute", "restart")):
            continue
        found = strategy.propose(plan, lost, ctx)
        if found is None:
            continue
        new = found.plan
        proposed[name] = _candidate(name, new, after, transition_ms(
            profile, moved_bytes=strategy.moved_bytes(plan, new, lost, ctx),
            loaded_bytes=_loaded_bytes(new, profile) if strategy.restarts else 0,
            lost_iterations=(situation.iteration - situation.checkpoint_iteration
                             if strategy.restarts else 1), iteration_ms=lost_ms),
            found.prediction)
    out = [c for name, c in proposed.items() if name in strategies]
    if situation.eager_redundancy:
        for c in out:
            if c.strategy != "reroute":   # a rerouted plan has stages without owners
                _add_upkeep(c, after)
    pace = situation.failure_free_ms or min((c.iteration_ms for c in out if c.feasible),
                                            default=0.0)
    horizon = horizon_iterations(situation, pace)
    for c in out:
        if c.feasible:
            c.total_ms = c.transition_ms + horizon * c.iteration_ms
    if hybrid and "reroute" in proposed and "restart" in proposed:
        both = _hybrid(proposed["reroute"], proposed["restart"], profile, situation, horizon)
        if both is not None:
            out.append(both)
    return sorted(out, key=lambda c: (not c.feasible, c.total_ms))


def replan(plan: ExecutionPlan, lost: set[int], profile: Profile) -> ExecutionPlan | None:
    """The fastest predicted homogeneous plan over at most plan.survivors(lost) that fits in
    memory (strategies.restart's search); None when not even one pipeline fits."""
    found = REGISTRY["restart"].propose(plan, lost, Context(profile))
    return None if found is None else found.plan


def choose(ranked: list[Candidate]) -> Candidate | None:
    return ranked[0] if ranked and ranked[0].feasible else None


def _candidate(strategy: str, plan: ExecutionPlan, profile: Profile, transition: float,
               pred: Prediction | None = None) -> Candidate:
    """`plan` as a candidate, predicted unless `pred` is its prediction already."""
    pred = pred or predict_plan(plan, profile)
    fits = profile.device_memory_bytes <= 0 or pred.peak_memory_bytes <= profile.device_memory_bytes
    return Candidate(strategy, plan, pred.iteration_ms, transition, pred.peak_memory_bytes, fits)


def _add_upkeep(c: Candidate, profile: Profile) -> None:
    """Eager redundancy: a plan that keeps shadow copies pays for them in time and memory."""
    upkeep = eager_cost(c.plan, profile)
    c.iteration_ms += upkeep.sync_ms
    c.memory_bytes += upkeep.memory_bytes
    c.feasible = c.feasible and (profile.device_memory_bytes <= 0 or
                                 c.memory_bytes <= profile.device_memory_bytes)


def _loaded_bytes(plan: ExecutionPlan, profile: Profile) -> int:
    """The checkpoint read of a restart onto `plan`: its largest rank's state."""
    return max(stage_param_count(profile.shape, st.num_layers, s == 0, s == len(p.stages) - 1,
                                 plan.tensor_parallel)
               for p in plan.pipelines for s, st in enumerate(p.stages)) * \
        profile.bytes_per_param


def _hybrid(now: Candidate, then: Candidate, profile: Profile,
            situation: Situation, horizon: float) -> Candidate | None:
    """Reroute now (`now`), and restart onto `then`'s plan from the next periodic checkpoint,
    written after k iterations counted from the interrupted one (run again); None without
    periodic saves or when the switch would come after the `horizon` (iterations). (A
    rerouted plan always differs from a re-planned one: it has a stage without ranks.)"""
    every = situation.save_interval
    if every <= 0:
        return None
    at = -(-situation.iteration // every) * every
    k = at - situation.iteration + 1
    if k >= horizon:
        return None
    switch = Switch("restart", then.plan, then.iteration_ms,
                    switch_ms(profile, loaded_bytes=_loaded_bytes(then.plan, profile)), at)
    both = Candidate("reroute+restart", now.plan, now.iteration_ms, now.transition_ms,
                     max(now.memory_bytes, then.memory_bytes), now.feasible and then.feasible,
                     switch=switch)
    if both.feasible:
        both.total_ms = now.transition_ms + k * now.iteration_ms + switch.transition_ms + \
            (horizon - k) * then.iteration_ms
    return both


def predicted(strategy: str, new: ExecutionPlan, plan: ExecutionPlan, lost: set[int],
              profile: Profile, eager: bool = False) -> Candidate:
    """A forced strategy's plan `new` over the survivors of `plan` without `lost`, predicted
    (its transition cost is what the recovery measures; none is estimated here)."""
    after = profile.for_survivors(set(plan.ranks) - set(plan.survivors(lost)))
    c = _candidate(strategy, new, after, 0.0)
    if eager:
        _add_upkeep(c, after)
    return c
