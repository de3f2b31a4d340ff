"""Candidate plans after a failure, their predicted costs, and the choice among them.

Every available strategy proposes its plan over the survivors (chameleon_ext.strategies): reroute
(the lost stage's micro-batches to its replicas) and restart (the latest checkpoint onto the
homogeneous plan over the survivors predicted fastest, among every pipeline depth and width, its
layers split by a dynamic program over contiguous layer ranges so that the stages' predicted
costs are balanced). Each candidate is predicted with the performance model
(chameleon_ext.perf_model: the simulator over the schedule the executor would run) and costed as

    transition + horizon x predicted iteration time

where the horizon is the number of iterations expected before the next event: the job's remaining
iterations, or fewer when `--chameleon-mtbf` says a failure comes sooner. A candidate whose
predicted memory exceeds the device's is never chosen.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from chameleon_ext.perf_model import (MIB, Profile, predict, predict_homogeneous, stage_params,
                                      transition_ms)
from chameleon_ext.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.schedule_choice import choose_schedule
from chameleon_ext.schedule_ir import Schedule
from chameleon_ext.strategies.reroute import reroute
from chameleon_ext.strategies.restart import homogeneous

STRATEGIES = ("reroute", "restart")


@dataclass
class Situation:
    """What the planner knows at a failure besides the plan and the profile."""

    iteration: int                     # the interrupted iteration (1-based)
    checkpoint_iteration: int          # of the latest checkpoint (0: none; restart from scratch)
    remaining_iterations: int          # iterations left to train, the interrupted one included
    mtbf_hours: float | None = None
    failure_free_ms: float = 0.0       # iteration time before the failure (for lost work)


@dataclass
class Candidate:
    strategy: str
    plan: ExecutionPlan
    schedule: Schedule
    iteration_ms: float
    transition_ms: float
    memory_bytes: int                  # the largest per-rank estimate
    feasible: bool
    total_ms: float = math.inf

    def summary(self) -> dict:
        """The metrics file's form (ARCHITECTURE.md: recovery.candidates)."""
        return {"strategy": self.strategy, "predicted_iter_ms": round(self.iteration_ms, 3),
                "transition_ms": round(self.transition_ms, 1),
                "memory_mib": round(self.memory_bytes / MIB, 1), "feasible": self.feasible,
                "total_ms": round(self.total_ms, 1) if math.isfinite(self.total_ms) else None,
                "world": self.plan.world_size,
                "layout": f"{len(self.plan.pipelines)} pipeline(s) x "
                          f"{len(self.plan.pipelines[0].stages)} stage(s)"}


def horizon_iterations(situation: Situation, iteration_ms: float) -> float:
    """Iterations expected before the next event."""
    n = float(situation.remaining_iterations)
    if situation.mtbf_hours and iteration_ms > 0:
        n = min(n, situation.mtbf_hours * 3.6e6 / iteration_ms)
    return n


def candidates(plan: ExecutionPlan, lost: set[int], profile: Profile, situation: Situation,
               strategies: tuple[str, ...] = STRATEGIES) -> list[Candidate]:
    """Every strategy's plan over the survivors of `plan` without the ranks `lost`, predicted,
    costed over the horizon, cheapest first (infeasible ones last)."""
    survivors = plan.world_size - len(lost)
    out: list[Candidate] = []
    lost_ms = situation.failure_free_ms
    if "reroute" in strategies:
        new = reroute(plan, lost)
        if new is not None and new.world_size == survivors:
            out.append(_candidate("reroute", new, profile,
                                  transition_ms(profile, lost_iterations=1, iteration_ms=lost_ms)))
    if "restart" in strategies:
        new = replan(plan, survivors, profile)
        if new is not None:
            loaded = max(stage_params(new, r, profile.shape) for r in new.ranks) * \
                profile.bytes_per_param
            lost_its = situation.iteration - situation.checkpoint_iteration
            out.append(_candidate("restart", new, profile, transition_ms(
                profile, loaded_bytes=loaded, lost_iterations=lost_its, iteration_ms=lost_ms)))
    for c in out:
        if c.feasible:
            c.total_ms = c.transition_ms + horizon_iterations(situation, c.iteration_ms) * \
                c.iteration_ms
    return sorted(out, key=lambda c: (not c.feasible, c.total_ms))


def choose(ranked: list[Candidate]) -> Candidate | None:
    return ranked[0] if ranked and ranked[0].feasible else None


def _candidate(strategy: str, plan: ExecutionPlan, profile: Profile,
               transition: float) -> Candidate:
    schedule = choose_schedule(plan, fuse=False)
    pred = predict(plan, schedule, profile)
    fits = profile.device_memory_bytes <= 0 or pred.peak_memory_bytes <= profile.device_memory_bytes
    return Candidate(strategy, plan, schedule, pred.iteration_ms, transition,
                     pred.peak_memory_bytes, fits)


def replan(plan: ExecutionPlan, survivors: int, profile: Profile) -> ExecutionPlan | None:
    """The fastest predicted homogeneous plan over at most `survivors` ranks that fits in
    memory: every pipeline depth and data-parallel width that divides the micro-batches, each
    with its layers balanced (balanced_layers); ties go to restart_plan's order (more ranks,
    then the depth closest to the old one). None when not even one pipeline fits."""
    tp, old_depth, mbs = plan.tensor_parallel, len(plan.pipelines[0].stages), \
        plan.num_micro_batches
    layouts = []
    for depth in range(1, plan.num_layers + 1):
        sizes = balanced_layers(plan.num_layers, depth, profile)
        slowest = max(stage_cost_ms(profile, n, s == 0, s == depth - 1)
                      for s, n in enumerate(sizes))
        for dp in range(1, survivors // (tp * depth) + 1):
            if mbs % dp == 0:
                # 1F1B runs every micro-batch through the slowest stage: a lower bound
                bound = mbs // dp * slowest * profile.sharing(depth * dp * tp)
                layouts.append((bound, depth, dp, sizes))
    best: tuple[float, tuple, ExecutionPlan] | None = None
    for bound, depth, dp, sizes in sorted(layouts, key=lambda x: x[0]):
        if best is not None and bound > best[0]:
            break
        new = with_layers(homogeneous(plan, depth, dp), sizes)
        pred = predict_homogeneous(new, profile)
        if profile.device_memory_bytes and pred.peak_memory_bytes > profile.device_memory_bytes:
            continue
        key = (pred.iteration_ms, (-depth * dp, abs(depth - old_depth), -depth))
        if best is None or key < best[:2]:
            best = (*key, new)
    return best[2] if best else None


def stage_cost_ms(profile: Profile, layers: int, first: bool, last: bool) -> float:
    """Forward plus backward of one micro-batch on a stage of `layers` layers."""
    p = profile
    per_layer = p.layer_fwd_ms + p.layer_bwd_input_ms + p.layer_bwd_weight_ms
    return layers * per_layer + first * (p.embedding_fwd_ms + p.embedding_bwd_ms) + \
        last * (p.head_fwd_ms + p.head_bwd_ms)


def balanced_layers(num_layers: int, depth: int, profile: Profile) -> list[int]:
    """Layers per stage (contiguous ranges, each at least one) minimising the costliest stage:
    a dynamic program over (stages used, layers used); ties keep earlier stages smaller."""
    inf = math.inf
    # best[s][n]: the smallest max-stage cost of putting the first n layers on the first s stages
    best = [[inf] * (num_layers + 1) for _ in range(depth + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(depth + 1)]
    best[0][0] = 0.0
    for s in range(1, depth + 1):
        last = s == depth
        for n in range(s, num_layers - (depth - s) + 1):
            for k in range(s - 1, n):  # stage s holds layers [k, n)
                c = max(best[s - 1][k], stage_cost_ms(profile, n - k, s == 1, last))
                if c < best[s][n] - 1e-12:
                    best[s][n], cut[s][n] = c, k
    sizes, n = [], num_layers
    for s in range(depth, 0, -1):
        k = cut[s][n]
        sizes.append(n - k)
        n = k
    return sizes[::-1]


def with_layers(plan: ExecutionPlan, sizes: list[int]) -> ExecutionPlan:
    """`plan` (homogeneous) with every pipeline's stages holding `sizes` layers."""
    depth = len(sizes)
    starts = [sum(sizes[:s]) for s in range(depth)]
    pipelines = [Pipeline([Stage(starts[s], starts[s] + sizes[s], list(st.ranks))
                           for s, st in enumerate(p.stages)], list(p.micro_batches))
                 for p in plan.pipelines]
    new = dataclasses.replace(plan, pipelines=pipelines)
    new.validate()
    return new
