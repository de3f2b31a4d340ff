"""Candidate plans after a failure, their predicted costs, and the choice among them.

Every available strategy proposes its plan over the survivors (chameleon_ext.planning.strategies): reroute
(the lost stage's micro-batches to its replicas), takeover (a neighbour stage of the failed
pipeline absorbs the lost layers, fetched with their optimizer state from a replica),
reparallelize (pipelines of different depths over every survivor, the micro-batches split by
their speed), substitute (where spares wait: they take the lost places, the layout kept, the
state from the replicas), restart (the latest checkpoint onto the
homogeneous plan over the survivors predicted fastest, among every pipeline depth and width, its
layers split by a dynamic program over contiguous layer ranges so that the stages' predicted
costs are balanced) and the hybrid reroute+restart (reroute now, and at the next periodic
checkpoint save restart from that fresh checkpoint onto the re-planned layout). Each plan is
predicted with the performance model (chameleon_ext.planning.perf_model.predict_plan: the simulator over
the schedule the executor would run, on the fewest pipelines that determine it exactly) and
costed over the window until the next event. Its transition is the detection, the rebuild, the
state moved or the checkpoint read, and the lost iterations trained again on its plan, at its
iteration time: the interrupted one, or for a restart every one since the checkpoint (the redo
runs on the new plan, so a restart onto a faster plan redoes faster). Without a repair time
(`Situation.repair_hours` None: nothing known of repair) the rule is the horizon-only one,

    transition + horizon x predicted iteration time

where the horizon is the number of iterations expected before the next event: the job's remaining
iterations, or fewer when `--chameleon-mtbf` says a failure comes sooner. The hybrid, switching
after k iterations (the interrupted one, run again, included), costs

    reroute transition + k x reroute iteration + rebuild and checkpoint read
        + (horizon - k) x re-planned iteration

and is a candidate only when k is within the horizon.

With a repair time R (the lost slot comes back R after the failure; math.inf: not within the
job) the planner weighs the failure-repair cycle. Where an earlier loss's slot is not back yet,
it comes back first, R after that loss (`next_repair`): R is then the time until it (0 where
it is due: its joiner waits for its admission), since whatever the failure's plan, the job
moves again then. Failures are exponential at rate
lambda = 1 / MTBF (0 without one); the repair comes at R; training ends at D = remaining
iterations x pace (the failure-free iteration time). The window ends at the first of the three;
with H = min(R, D):

    W = (1 - exp(-lambda H)) / lambda     (H when lambda = 0)   expected window, ms
    N = W / pace                                                 its work, in iterations
    p = exp(-lambda R) if R < D else 0                           the repair comes first
    q = 1 - exp(-lambda H)                                       the next failure comes first

The exponential law is an assumption about the failures' timing. Where the job has a record of
its own losses (`Situation.failure_record`: of the k losses whose outcome is known, the h whose
next loss came before their repair), q is that record's, the law's q counting as one loss
beside them, q' = (h + q) / (k + 1), when the repair comes before the end; the window is then
H where the repair comes first and the law's mean time to a failure before H where the failure
does, W = (1 - q') H + q' (W - H exp(-lambda H)) / q, and p = 1 - q'. Failures at fixed
intervals at least R apart never come before a repair (q' goes to 0), where the law says
1 - exp(-lambda R): a choice that pays for robustness against the next loss (below) pays for
nothing there.

Every candidate c, doing the same N iterations, costs

    total(c) = transition(c) + N x iteration(c) + p x back(c) + q x next(c)

- back(c), the move back when the slot returns: to the plan before the failure with the lost
  ranks back, a planned move at an iteration boundary as an admission makes it: the rebuild
  plus the state (parameters and Adam moments) the ranks lack there, from their peers, each
  over its own link beside the others (`moved_state_bytes`: the rank that lacks the most). Rerouting moves the returning stage only; a re-laid-out plan moves
  most layers again.
- next(c), absorbing the next failure from c's plan: a rank of it fails uniformly at random;
  with probability f(c) its (tensor-parallel group's) loss leaves a layer that no other rank
  holds (a rerouted stage down to one replica), and only a restart recovers: the detection, the
  rebuild, the checkpoint read and the work since the checkpoint (half a save interval with
  periodic saves, else every iteration since the latest checkpoint and the window's N); else
  the cheapest in-place recovery: the detection, the rebuild and the interrupted iteration.
  The plan after that failure is not costed further (a bound of one step).
- The hybrid's back and next are its re-planned plan's (it holds it for most of the window).

total / (N x global batch) is the expected time per sample over the window, so comparing
totals compares it. The same model decides a rejoin (`rejoin_choice`): when a slot comes back,
admit it now (a state-moving move), at the next periodic checkpoint (a move from that fresh
checkpoint: the rebuild and the read, no state between peers) or stay on the current plan (the
ranks that came back stand by as spares, for the next loss), over the window until the next
failure or the end (no repair pending: p = 0).

A candidate whose predicted memory exceeds the device's is never chosen. The layouts of the
restart search are predicted in the order of a lower bound on their iteration time, and the
search stops at the first bound above the best prediction so far: the same choice as
predicting every layout.

With tensor parallelism the unit of every strategy is a tensor-parallel group: a group with a
lost rank leaves the plan whole (its healthy ranks too), and every candidate runs on whole
surviving groups, its new rank i on plan.survivors(lost, its world size)[i]. The degree stays
the plan's: no candidate re-shards a replica to another degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import (MIB, ModelShape, Prediction, Profile, predict_plan,
                                      stage_param_count, switch_ms, transition_ms)
from chameleon_ext.planning.strategies import REGISTRY, Context
from chameleon_ext.planning.strategies.redundancy import eager_cost, shadow_pairs
from chameleon_ext.planning.strategies.base import Objective, repartition_bytes
from chameleon_ext.schedule.choice import choose_schedule
from chameleon_ext.schedule.ir import Schedule

STRATEGIES = (*REGISTRY, "reroute+restart")
STATE_BYTES_PER_PARAM = 12     # what a move sends: the parameter and two Adam moments


@dataclass
class Situation:
    """What the planner knows at a failure besides the plan and the profile."""

    iteration: int                     # the interrupted iteration (1-based)
    checkpoint_iteration: int          # of the latest checkpoint (0: none; restart from scratch)
    remaining_iterations: int          # iterations left to train, the interrupted one included
    mtbf_hours: float | None = None
    failure_free_ms: float = 0.0       # iteration time before the failure (the window's pace)
    save_interval: int = 0             # a checkpoint after every multiple (0: no periodic saves)
    eager_redundancy: bool = False     # stages hold shadow copies (strategies.redundancy)
    # a lost slot is back this long after the failure, this one's or sooner an earlier loss's
    # (next_repair; math.inf: not within the job); None: unknown, and the horizon-only rule
    # decides (module docstring)
    repair_hours: float | None = None
    # the job's losses so far: (those whose next loss came before their repair, those whose
    # outcome is known); (0, 0): no record, the exponential law's chance alone
    failure_record: tuple[int, int] = (0, 0)


def failure_record(failed_at: list[float], repair: float, now: float) -> tuple[int, int]:
    """Situation.failure_record from the times of the losses so far (`failed_at`, in order),
    the repair time and the time now, in one unit: of the losses whose outcome is known (the
    next loss came, or the repair time passed), those whose next loss came before their
    repair."""
    hits = known = 0
    for at, after in zip(failed_at, [*failed_at[1:], math.inf]):
        hits += after < at + repair
        known += after < at + repair or at + repair <= now
    return hits, known


def next_repair(repair: float, unrepaired: list[float], now: float) -> float:
    """The time from `now` until a lost slot is back, in `repair`'s unit: this failure's after
    `repair`, or sooner the slot of an earlier loss at `unrepaired` that no joiner has taken
    back yet (each back `repair` after it; 0 where that is past: its joiner is due)."""
    return max(0.0, min([repair, *(at + repair - now for at in unrepaired)]))


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
    move_back_ms: float = 0.0          # back(c): to the plan before the failure, slot returned
    next_failure_ms: float = 0.0       # next(c): absorbing the next failure from its plan
    # the iterations whose work the failure lost, trained again on `plan` (part of
    # transition_ms): the interrupted one, or for a restart every one since the checkpoint
    lost_iterations: int = 0

    @property
    def redo_ms(self) -> float:
        """The part of transition_ms that trains the lost iterations again."""
        return self.lost_iterations * self.iteration_ms

    def summary(self) -> dict:
        """The metrics file's form (ARCHITECTURE.md: recovery.candidates)."""
        out = {"strategy": self.strategy, "predicted_iter_ms": round(self.iteration_ms, 3),
               "transition_ms": round(self.transition_ms, 1),
               "memory_mib": round(self.memory_bytes / MIB, 1), "feasible": self.feasible,
               "total_ms": round(self.total_ms, 1) if math.isfinite(self.total_ms) else None,
               "move_back_ms": round(self.move_back_ms, 1),
               "next_failure_ms": round(self.next_failure_ms, 1),
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


@dataclass(frozen=True)
class Window:
    """The span a candidate is costed over (module docstring): `iterations` (N) of work at the
    failure-free pace, and the chances that the repair (p) or the next failure (q) ends it."""

    iterations: float
    repair_first: float = 0.0
    failure_first: float = 0.0


def failure_rate(situation: Situation) -> float:
    """lambda, failures per ms (0 without an MTBF)."""
    return 1 / (situation.mtbf_hours * 3.6e6) if situation.mtbf_hours else 0.0


def window(situation: Situation, pace_ms: float) -> Window:
    """The window until the next event at `pace_ms` an iteration: the horizon without a repair
    time (p = q = 0: the horizon-only rule), else the cycle's expectation."""
    if situation.repair_hours is None or pace_ms <= 0:
        return Window(horizon_iterations(situation, pace_ms))
    end = situation.remaining_iterations * pace_ms
    repair = situation.repair_hours * 3.6e6
    until = min(repair, end)
    rate = failure_rate(situation)
    expected = -math.expm1(-rate * until) / rate if rate else until
    first = -math.expm1(-rate * until)
    hits, known = situation.failure_record
    if repair >= end or first <= 0 or not known:
        return Window(expected / pace_ms, math.exp(-rate * repair) if repair < end else 0.0,
                      first)
    seen = (hits + first) / (known + 1)
    before = (expected - until * (1 - first)) / first  # the law's mean time to a failure < H
    return Window(((1 - seen) * until + seen * before) / pace_ms, 1 - seen, seen)


def cycle_total(c: Candidate, win: Window) -> float:
    """total(c) over the window (module docstring); a hybrid's own total is built by _hybrid."""
    return c.transition_ms + win.iterations * c.iteration_ms + \
        win.repair_first * c.move_back_ms + win.failure_first * c.next_failure_ms


def candidates(plan: ExecutionPlan, lost: set[int], profile: Profile, situation: Situation,
               strategies: tuple[str, ...] = STRATEGIES, spares: int = 0,
               by_objective: bool = True) -> list[Candidate]:
    """Every strategy's plan over the survivors of `plan` without the ranks `lost` (the
    registry's proposals), predicted, costed over the horizon, cheapest first (infeasible ones
    last). The profile's slow ranks are those of `plan`. The unit is a tensor-parallel group:
    every strategy removes each group with a lost rank whole and numbers the ranks it keeps
    densely in their old order, so a candidate's new rank i is plan.survivors(lost, its world
    size)[i]; `spares` ranks wait out of the plan, and a substitute's ranks past those are
    theirs. `by_objective` (auto): the strategies that search layouts take the one the
    window's running cost rates cheapest (its next failure weighed: the fastest layout may be
    one that every loss forces to restart), where the window's pace is known
    (`Situation.failure_free_ms`); else, as a forced strategy does, the fastest."""
    if not plan.survivors(lost):
        return []
    hybrid = "reroute+restart" in strategies
    profile = profile.at_tensor_parallel(plan.tensor_parallel)
    objective = None
    if by_objective and situation.failure_free_ms > 0:
        ahead = window(situation, situation.failure_free_ms)
        objective = Objective(ahead.iterations, lambda new, ms: running_ms(
            new, ms, profile, situation, ahead))
    ctx = Context(profile, situation.eager_redundancy, spares, objective)
    after = ctx.after(plan, lost)
    proposed: dict[str, Candidate] = {}
    for name, strategy in REGISTRY.items():
        if name not in strategies and not (hybrid and name in ("reroute", "restart")):
            continue
        found = strategy.propose(plan, lost, ctx)
        if found is None:
            continue
        new = found.plan
        # under the distributed optimizer the shards are cut again for the new replica groups
        moved = 0 if strategy.restarts else \
            strategy.moved_bytes(plan, new, lost, ctx) + repartition_bytes(plan, new, lost, profile)
        c = _candidate(name, new, after, transition_ms(
            profile, moved_bytes=moved,
            loaded_bytes=_loaded_bytes(new, profile) if strategy.restarts else 0),
            found.prediction)
        c.lost_iterations = situation.iteration - situation.checkpoint_iteration \
            if strategy.restarts else 1
        proposed[name] = c
    out = [c for name, c in proposed.items() if name in strategies]
    if situation.eager_redundancy:
        for c in out:
            if c.strategy != "reroute":   # a rerouted plan has stages without owners
                _add_upkeep(c, after)
    for c in proposed.values():
        # the lost iterations are trained again on the candidate's plan, at its pace
        c.transition_ms += c.redo_ms
    pace = situation.failure_free_ms or min((c.iteration_ms for c in out if c.feasible),
                                            default=0.0)
    win = window(situation, pace)
    for name, c in proposed.items():
        # A substitute runs the old layout already: a rank that comes back becomes a spare.
        c.move_back_ms = 0.0 if name == "substitute" else move_back_ms(c.plan, plan, lost,
                                                                        profile)
        c.next_failure_ms = next_failure_ms(c.plan, c.iteration_ms, profile, situation,
                                            win.iterations)
    for c in out:
        if c.feasible:
            c.total_ms = cycle_total(c, win)
    if hybrid and "reroute" in proposed and "restart" in proposed:
        both = _hybrid(proposed["reroute"], proposed["restart"], profile, situation, win)
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
            situation: Situation, win: Window) -> Candidate | None:
    """Reroute now (`now`), and restart onto `then`'s plan from the next periodic checkpoint,
    written after k iterations counted from the interrupted one (run again); None without
    periodic saves or when the switch would come after the window's iterations. (A
    rerouted plan always differs from a re-planned one: it has a stage without ranks.)"""
    every = situation.save_interval
    if every <= 0:
        return None
    at = -(-situation.iteration // every) * every
    k = at - situation.iteration + 1
    if k >= win.iterations:
        return None
    switch = Switch("restart", then.plan, then.iteration_ms,
                    switch_ms(profile, loaded_bytes=_loaded_bytes(then.plan, profile)), at)
    both = Candidate("reroute+restart", now.plan, now.iteration_ms, now.transition_ms,
                     max(now.memory_bytes, then.memory_bytes), now.feasible and then.feasible,
                     switch=switch, move_back_ms=then.move_back_ms,
                     next_failure_ms=then.next_failure_ms, lost_iterations=now.lost_iterations)
    if both.feasible:
        both.total_ms = now.transition_ms + k * now.iteration_ms + switch.transition_ms + \
            (win.iterations - k) * then.iteration_ms + win.repair_first * then.move_back_ms + \
            win.failure_first * then.next_failure_ms
    return both


# ---- the failure-repair cycle ------------------------------------------------------------------
def moved_state_bytes(old: ExecutionPlan, new: ExecutionPlan, was: dict[int, int],
                      shape: ModelShape) -> int:
    """The state (STATE_BYTES_PER_PARAM a parameter) the rank of `new` that lacks the most
    lacks, its tensor-parallel shard (the ranks receive beside each other, each over its own
    link: the move's critical path): rank i of `new` held old rank was[i]'s under `old`
    (absent: nothing, a rank that comes back). The embedding, the final norm and the output
    layer count for a rank that takes them, never for one that holds them already."""
    largest = 0
    for i in new.ranks:
        st, first, last = new.stage_of(i), new.is_first_stage(i), new.is_last_stage(i)
        need = stage_param_count(shape, st.num_layers, first, last, 1)
        j = was.get(i)
        if j is not None:
            held = old.stage_of(j)
            kept = max(0, min(held.layer_end, st.layer_end) - max(held.layer_start,
                                                                  st.layer_start))
            # the layers it keeps, and the first or last stage's own parameters it held
            need -= stage_param_count(shape, kept, first and old.is_first_stage(j),
                                      last and old.is_last_stage(j), 1)
        largest = max(largest, STATE_BYTES_PER_PARAM * max(0, need) // new.tensor_parallel)
    return largest


def move_back_ms(new: ExecutionPlan, plan: ExecutionPlan, lost: set[int],
                 profile: Profile) -> float:
    """back(c): from `new` (a plan over plan.survivors(lost), its rank i on the i-th) to `plan`
    with the ranks `lost` back, a planned move (switch_ms) plus the state moved to the ranks."""
    used = plan.survivors(lost, new.world_size)
    was = {r: i for i, r in enumerate(used)}
    return switch_ms(profile) + profile.p2p_ms_per_mib * \
        moved_state_bytes(new, plan, was, profile.shape) / MIB


def fatal_share(plan: ExecutionPlan, eager: bool) -> float:
    """f(c): the share of `plan`'s ranks whose loss, with their tensor-parallel group, leaves a
    layer held by no other group (nor, `eager`, as a shadow copy): only a restart recovers."""
    holders: dict[int, set[int]] = {}   # layer -> the groups holding it, by their first rank

    def hold(group: int, layers: range) -> None:
        for layer in layers:
            holders.setdefault(layer, set()).add(group)

    for p in plan.pipelines:
        for st in p.stages:
            if st.ranks:
                hold(st.ranks[0], range(st.layer_start, st.layer_end))
    if eager:
        for owner, holder in shadow_pairs(plan):
            st = plan.stage_of(owner)
            hold(plan.stage_of(holder).ranks[0], range(st.layer_start, st.layer_end))
    fatal = {g for groups in holders.values() if len(groups) == 1 for g in groups}
    return sum(len(plan.stage_of(g).ranks) for g in fatal) / plan.world_size


def next_failure_ms(new: ExecutionPlan, iteration_ms: float, profile: Profile,
                    situation: Situation, window_iterations: float) -> float:
    """next(c): the expected cost of the next failure of `new` (running at `iteration_ms`),
    as the module docstring says; `window_iterations`: the window's N."""
    f = fatal_share(new, situation.eager_redundancy)
    in_place = transition_ms(profile, lost_iterations=1, iteration_ms=iteration_ms)
    since = situation.save_interval / 2 if situation.save_interval > 0 else \
        situation.iteration - situation.checkpoint_iteration + window_iterations
    restart = transition_ms(profile, loaded_bytes=_loaded_bytes(new, profile)) + \
        since * iteration_ms
    return (1 - f) * in_place + f * restart


def running_ms(plan: ExecutionPlan, iteration_ms: float, profile: Profile, situation: Situation,
               win: Window) -> float:
    """A plan's cost over `win` without its transition: N x iteration + q x next."""
    return win.iterations * iteration_ms + win.failure_first * next_failure_ms(
        plan, iteration_ms, profile, situation, win.iterations)


def rejoin_window(situation: Situation, pace_ms: float) -> Window:
    """The window of a rejoin: until the next failure or the end, no repair pending."""
    return window(replace(situation, repair_hours=math.inf), pace_ms)


@dataclass
class RejoinChoice:
    """What to do when ranks come back: `action` "now", "checkpoint" (after the save of
    `at_iteration`) or "stay" (they wait as spares); `costs`: each action's total over the
    window (ms)."""

    action: str
    costs: dict[str, float]
    at_iteration: int | None = None


def rejoin_choice(current: ExecutionPlan, current_ms: float, new: ExecutionPlan, new_ms: float,
                  was: dict[int, int], profile: Profile, situation: Situation,
                  by_checkpoint: bool = True) -> RejoinChoice:
    """Admit the ranks that came back into `new` (the admission's plan, strategies.rejoin's
    overlay: its rank i held `current`'s rank was[i], absent for a newcomer) now, at the next
    periodic checkpoint, or stay on `current` (they stand by as spares: a rebuild, nothing
    moved), by the cycle's objective over the window until
    the next failure or the end (module docstring). `situation.iteration` is the next
    iteration to run, `failure_free_ms` the pace the window is counted at (else `new_ms`).

        stay:       rebuild + N x current + q x next(current)
        now:        move + N x new + q x next(new)
        checkpoint: k x current + rebuild and read + (N - k) x new + q x next(new)
                    + s x (move - rebuild and read + next(current) - next(new))

    where move is the rebuild and the state the ranks lack from their peers, k the iterations
    until the next save (0: one is written at this boundary) and s = 1 - exp(-lambda k
    current) the chance that a failure comes before that save: it then meets the current plan,
    and the admission that waited moves state after all (seen on an executed Poisson trace:
    auto waited 2 iterations for a save, the next kill came in between, and auto ran at 0.979
    of the best fixed policy). `by_checkpoint` False: not at a checkpoint (an admission that absorbs
    places nobody takes moves state now)."""
    profile = profile.at_tensor_parallel(new.tensor_parallel)
    win = rejoin_window(situation, situation.failure_free_ms or new_ms)
    then = running_ms(new, new_ms, profile, situation, win)
    move = switch_ms(profile) + profile.p2p_ms_per_mib * \
        moved_state_bytes(current, new, was, profile.shape) / MIB
    costs = {"now": move + then}
    at = None
    every = situation.save_interval
    if every > 0 and by_checkpoint:
        at = -(-(situation.iteration - 1) // every) * every
        k = at - (situation.iteration - 1)
        if k < win.iterations:
            read = switch_ms(profile, loaded_bytes=_loaded_bytes(new, profile))
            before_save = -math.expm1(-failure_rate(situation) * k * current_ms)
            exposed = move - read + \
                next_failure_ms(current, current_ms, profile, situation, win.iterations) - \
                next_failure_ms(new, new_ms, profile, situation, win.iterations)
            costs["checkpoint"] = read + k * (current_ms - new_ms) + then + \
                before_save * exposed
    costs["stay"] = switch_ms(profile) + running_ms(current, current_ms, profile, situation, win)
    action = min(costs, key=costs.get)
    return RejoinChoice(action, costs, at if action == "checkpoint" else None)


def predicted(strategy: str, new: ExecutionPlan, plan: ExecutionPlan, lost: set[int],
              profile: Profile, eager: bool = False) -> Candidate:
    """A forced strategy's plan `new` over the survivors of `plan` without `lost`, predicted
    (its transition cost is what the recovery measures; none is estimated here)."""
    after = profile.for_survivors(set(plan.ranks) - set(plan.survivors(lost)))
    c = _candidate(strategy, new, after, 0.0)
    if eager:
        _add_upkeep(c, after)
    return c
