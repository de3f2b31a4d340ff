"""Failure traces over the GPUs of a cluster: which GPU fails when, and when it is back.

Fixed intervals are Oobleck's published traces (a failure every 6 h, 3 h, 1 h, 30 min, 10 min,
5 min); Poisson traces draw the gaps between failures from an exponential law with the given
mean (the cluster's MTBF). Either way the failed GPU is drawn uniformly among those up, and it
rejoins after the repair time (math.inf: never). A trace is fixed before any policy sees it, so every policy
meets the same failures.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

FIXED_INTERVALS_H = (6.0, 3.0, 1.0, 0.5, 1 / 6, 1 / 12)


@dataclass(frozen=True)
class Event:
    hour: float
    kind: str                          # "fail" or "rejoin"
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
