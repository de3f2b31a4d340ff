"""Failure traces over the GPUs of a cluster: which GPU fails when, and when it is back.

Fixed intervals are Oobleck's published traces (a failure every 6 h, 3 h, 1 h, 30 min, 10 min,
5 min); Poisson traces draw the gaps between failures from an exponential law with the given
mean (the cluster's MTBF). Either way the failed GPU is drawn uniformly among those up, and it
rejoins after the repair time (math.inf: never). A trace is fixed before any policy sees it, so every policy
meets the same failures.

The designed traces place their losses on the failure-free plan's stages (StageGroups), each a
case where one fixed policy is the wrong one: stage_outage (rerouting), alternating_stages
and around_checkpoints (restarting).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from chameleon_ext.plan.execution_plan import ExecutionPlan

FIXED_INTERVALS_H = (6.0, 3.0, 1.0, 0.5, 1 / 6, 1 / 12)
# The GPUs of the failure-free plan by stage: [stage][replica] -> its tensor-parallel group.
StageGroups = list[list[list[int]]]


def stage_groups(plan: ExecutionPlan) -> StageGroups:
    """The GPUs of a failure-free plan (its rank r is GPU r) by stage and replica."""
    return [[pipe.stages[j].ranks for pipe in plan.pipelines]
            for j in range(len(plan.pipelines[0].stages))]


@dataclass(frozen=True)
class Event:
    hour: float
    kind: str                          # "fail", "rejoin", or "up" (simulate: back, not admitted)
    gpu: int


@dataclass(frozen=True)
class Trace:
    name: str
    span_h: float
    mtbf_h: float                      # the mean time between failures the planner is told
    repair_h: float
    events: tuple[Event, ...]

    @property
    def failures(self) -> int:
        return sum(e.kind == "fail" for e in self.events)


def interval_name(hours: float) -> str:
    return f"every {hours:g} h" if hours >= 1 else f"every {round(hours * 60):d} min"


def _trace(name: str, failure_hours: list[float], gpus: int, span_h: float, mtbf_h: float,
           repair_h: float, rng: random.Random) -> Trace:
    """Failures at `failure_hours`, each of a GPU up at that moment (none when all are down),
    with their rejoins; events in time order, a rejoin before a failure at the same instant."""
    up = set(range(gpus))
    back: list[tuple[float, int]] = []
    events = []
    for hour in failure_hours:
        while back and back[0][0] <= hour:
            at, gpu = heapq.heappop(back)
            up.add(gpu)
            events.append(Event(at, "rejoin", gpu))
        if not up:
            continue
        gpu = rng.choice(sorted(up))
        up.remove(gpu)
        events.append(Event(hour, "fail", gpu))
        heapq.heappush(back, (hour + repair_h, gpu))
    events += [Event(at, "rejoin", gpu) for at, gpu in sorted(back) if at < span_h]
    return Trace(name, span_h, mtbf_h, repair_h, tuple(events))


def fixed_interval(interval_h: float, gpus: int, span_h: float, repair_h: float,
                   seed: int = 0) -> Trace:
    hours = [k * interval_h for k in range(1, int(span_h / interval_h) + 1)
             if k * interval_h < span_h]
    return _trace(interval_name(interval_h), hours, gpus, span_h, interval_h, repair_h,
                  random.Random(f"fixed-{interval_h}-{seed}"))


def poisson_rng(mean: float, seed: int) -> random.Random:
    """The random source of a Poisson trace of `mean` (here and tools.reproduce.executed): one
    seed for 12 and 12.0 alike, whichever type a caller's flag parses to."""
    return random.Random(f"poisson-{float(mean):g}-{seed}")


def poisson(mtbf_h: float, gpus: int, span_h: float, repair_h: float, seed: int = 0) -> Trace:
    rng = poisson_rng(mtbf_h, seed)
    hours, t = [], rng.expovariate(1 / mtbf_h)
    while t < span_h:
        hours.append(t)
        t += rng.expovariate(1 / mtbf_h)
    return _trace(f"Poisson, MTBF {mtbf_h:g} h", hours, gpus, span_h, mtbf_h, repair_h, rng)


def _placed(name: str, losses: list[tuple[float, int]], span_h: float, mtbf_h: float,
            repair_h: float) -> Trace:
    """Losses of the given GPUs at the given hours (each GPU up then), each back after
    `repair_h`."""
    events = [Event(h, "fail", g) for h, g in losses] + [
        Event(h + repair_h, "rejoin", g) for h, g in losses if h + repair_h < span_h]
    events.sort(key=lambda e: (e.hour, e.kind == "fail"))  # a rejoin first at the same instant
    return Trace(name, span_h, mtbf_h, repair_h, tuple(events))


def stage_outage(stages: StageGroups, span_h: float, seed: int = 0) -> Trace:
    """Three losses of one stage's replicas (distinct replicas first, then other shards of
    their groups; fewer where the stage has fewer GPUs) 1 to 5 minutes apart, each back after
    3 h; at a random hour of the span's first half.

    Why: rerouting (ReCycle-like) piles the lost replicas' micro-batches onto the stage's last
    replica, a fair trade for a short outage but a 3 h bottleneck here, where a re-parallelized
    plan pays its move once and runs faster for hours. With fewer than three replicas the
    stage's state is gone and every policy must restart."""
    rng = random.Random(f"stage-outage-{seed}")
    groups = stages[rng.randrange(len(stages))]
    gpus = [g[k] for k in range(len(groups[0])) for g in groups][:3]
    hour = rng.uniform(0.05, 0.5) * span_h
    losses = []
    for gpu in gpus:
        losses.append((hour, gpu))
        hour += rng.uniform(1, 5) / 60
    # the planner is told the trace's mean gap: three losses in the span
    return _placed("one stage's replicas lost for 3 h", losses, span_h, span_h / 3, 3.0)


def alternating_stages(stages: StageGroups, span_h: float, seed: int = 0) -> Trace:
    """A loss every hour, alternately in two stages (a random replica's group), each back
    after 5 minutes.

    Why: every loss is a change of plan, undone 5 minutes later, and the two stages' losses ask
    for different layouts. A restart (Megatron) pays a relaunch and the work since the
    checkpoint for each 5-minute outage, where a reroute or a re-parallelization moves in
    seconds (the performance model's planned moves lose no work)."""
    rng = random.Random(f"alternating-{seed}")
    pair = rng.sample(range(len(stages)), 2) if len(stages) > 1 else [0, 0]
    losses = [(float(k), rng.choice(stages[pair[k % 2]])[0]) for k in range(1, math.ceil(span_h))]
    return _placed("hourly, alternating stages, 5 min repair", losses, span_h, 1.0, 5 / 60)


def around_checkpoints(gpus: int, span_h: float, checkpoint_h: float, repair_h: float,
                       seed: int = 0) -> Trace:
    """A loss at every m-th checkpoint (m: the checkpoints in about 1.5 h), alternately 2
    minutes after and 2 minutes before it, of a random GPU up then; each back after
    `repair_h`. The checkpoints are those of the failure-free clock; a policy's transitions
    before a loss shift its own checkpoints by their length.

    Why: a restart (Megatron) loses the work since the last checkpoint: almost none just after
    one, a whole interval just before, where rerouting until the next checkpoint is the better
    move; just after one, restarting onto a fresh layout at once is."""
    rng = random.Random(f"checkpoints-{seed}")
    every = max(1, round(1.5 / checkpoint_h)) * checkpoint_h
    back: dict[int, float] = {}
    losses = []
    for k in range(1, math.ceil(span_h / every) + 1):
        at = k * every + (2 if k % 2 else -2) / 60
        up = [g for g in range(gpus) if back.get(g, 0.0) <= at]
        if at >= span_h or not up:
            continue
        gpu = rng.choice(up)
        back[gpu] = at + repair_h
        losses.append((at, gpu))
    return _placed("around checkpoints", losses, span_h, every, repair_h)
