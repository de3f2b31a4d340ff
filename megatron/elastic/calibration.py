"""Live calibration of the performance model from the Megatron timers of a running job.

Each rank keeps, over its failure-free iterations after a warm-up, the mean duration of each of
its compute ops (the executor's "forward-compute", "backward-compute", "backward-input",
"backward-weight" and "optimizer" timers, read through their cumulative active time, so Megatron's
own timer logging and resets do not disturb it) and of whole iterations, and publishes them on the
job's store: a StageSample per rank, which outlives the rank, so the leader of a recovery fits its
profile from the lost rank's costs too.

The fit (`profile_from_samples`): per-layer costs by least squares over the stages. On a CPU
host whose cores the ranks share, of each op's CPU time (its cost with a core to itself; the
performance model adds the sharing back for any plan), else of the timers' wall time. A rank
much slower than the others (its compute's wall time over its CPU time well above theirs, or on
a GPU its wall time above the fit of its stage) is recorded in the profile's `rank_slowdown` and
left out of the fit, so the planner sees it; and the iteration time the simulator does not see
(data loading, Python between ops) is kept as an overhead.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import (Profile, fit_layer_costs, optimizer_params,
                                             overhead_ms, predict)
from chameleon_ext.planning.strategies.redundancy import eager_cost
from chameleon_ext.schedule.choice import choose_schedule
from chameleon_ext.schedule.ir import COMPUTE, Op, Schedule
from megatron.elastic.schedules import SHADOW_SYNC
from megatron.elastic.schedules import TIMER_OF as SCHEDULE_TIMERS

TIMER_OF = {kind: SCHEDULE_TIMERS[kind] for kind in COMPUTE}  # the compute ops' timers
# A rank this much slower than the fit of its stage is slow, not noise (ranks sharing cores
# differ by some 10-20% between iterations on their own).
SLOW_RATIO = 1.3


@dataclass
class StageSample:
    """One rank's measured means (ms per op of each kind, and per iteration) under one plan."""

    rank: int
    layers: int
    first: bool
    last: bool
    params: int                        # those its optimizer steps (perf_model.optimizer_params)
    iterations: int
    op_ms: dict[str, float]            # timer name -> mean wall time of one op
    op_cpu_ms: dict[str, float]        # timer name -> mean CPU time of one op ({}: not timed)
    op_counts: dict[str, int]          # timer name -> ops per iteration
    iteration_ms: float
    busy_ms: float                     # compute wall time per iteration
    # bytes one micro-batch's forward keeps for its backward: "embedding", "layers" (per
    # layer), "head" (memory_meter.MemoryMeter.per_microbatch; {}: not measured)
    activation_bytes: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StageSample":
        return cls(**d)

    def compute_ms(self) -> float | None:
        """Forward plus backward of one micro-batch."""
        bwd = self.op_ms.get("backward-compute")
        if bwd is None and "backward-input" in self.op_ms and "backward-weight" in self.op_ms:
            bwd = self.op_ms["backward-input"] + self.op_ms["backward-weight"]
        fwd = self.op_ms.get("forward-compute")
        return None if fwd is None or bwd is None else fwd + bwd


@dataclass
class Calibrator:
    """Means of this rank's compute ops under its current plan, from `timers` (level 2), and
    their CPU time from `clock` (schedules.ComputeClock)."""

    timers: object
    clock: object = None
    warmup: int = 3
    _counts: dict[str, int] = field(default_factory=dict)
    _base: dict[str, float] = field(default_factory=dict)
    _cpu_base: dict[str, float] = field(default_factory=dict)
    _iteration_ms: list[float] = field(default_factory=list)
    _skip: int = 0
    _place: tuple = ()
    _memory: object = None

    def start(self, plan: ExecutionPlan, rank: int, ops: list[Op], profile: Profile,
              shadows: bool = False, memory=None) -> None:
        """A new plan (`shadows`: whose iterations begin with eager redundancy's refresh;
        `memory`: the runtime's memory_meter.MemoryMeter): forget what was measured under the
        old one."""
        self._memory = memory
        self._counts = {SHADOW_SYNC: 1} if shadows else {}
        for op in ops:
            name = TIMER_OF.get(op.kind)
            if name:
                self._counts[name] = self._counts.get(name, 0) + 1
        # the parameters its optimizer steps (its shard under the distributed optimizer): what
        # the optimizer timer's time is per
        self._place = (rank, plan.stage_of(rank).num_layers, plan.is_first_stage(rank),
                       plan.is_last_stage(rank), round(optimizer_params(plan, rank, profile)))
        self._iteration_ms = []
        self._skip = self.warmup

    def after_iteration(self, elapsed_ms: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._base = self._active()
                self._cpu_base = dict(self.clock.cpu_s) if self.clock else {}
            return
        self._iteration_ms.append(elapsed_ms)

    def sample(self) -> StageSample | None:
        n = len(self._iteration_ms)
        if n == 0:
            return None
        now = self._active()
        op_ms = {name: 1e3 * (now[name] - self._base.get(name, 0.0)) / (n * count)
                 for name, count in self._counts.items()}
        cpu = {name: 1e3 * (self.clock.cpu_s.get(name, 0.0) - self._cpu_base.get(name, 0.0))
               / (n * count) for name, count in self._counts.items()} if self.clock else {}
        busy = sum(op_ms[name] * count for name, count in self._counts.items()
                   if name != SHADOW_SYNC)
        kept = self._memory.per_microbatch() if self._memory and self._memory.forwards else {}
        return StageSample(*self._place, n, op_ms, cpu, dict(self._counts),
                           statistics.median(self._iteration_ms), busy, kept)

    def _active(self) -> dict[str, float]:
        return {name: self.timers(name, log_level=2).active_time() for name in self._counts}


def profile_from_samples(samples: list[StageSample], base: Profile) -> Profile:
    """`base` (its links, memory and transition costs) with compute costs fitted to `samples`
    and its slow ranks found; source "measured"."""
    slow = _slow_ranks(samples, base)
    steady = [s for s in samples if s.rank not in slow] or samples
    fitted = _fit(steady, base)
    if not _cpu_timed(samples, base):  # slow ranks against the fit of their stages
        slow = _slow_against(samples, fitted)
        steady = [s for s in samples if s.rank not in slow] or samples
        fitted = _fit(steady, base)
        slow = _slow_against(samples, fitted)
    return _activations(samples, dataclasses.replace(fitted, rank_slowdown=slow))


def _activations(samples: list[StageSample], profile: Profile) -> Profile:
    """`profile` with the activation bytes the stages measured (medians), where they did."""
    def median(part: str, where) -> int | None:
        seen = [s.activation_bytes[part] for s in samples if s.activation_bytes and where(s)]
        return round(statistics.median(seen)) if seen else None

    found = {"layer_activation_bytes": median("layers", lambda s: s.layers > 0),
             "embedding_activation_bytes": median("embedding", lambda s: s.first),
             "head_activation_bytes": median("head", lambda s: s.last)}
    return dataclasses.replace(profile, **{k: v for k, v in found.items() if v is not None})


def _cpu_timed(samples: list[StageSample], base: Profile) -> bool:
    """Costs from CPU time: ranks sharing a CPU host's cores (on a GPU, ops run
    asynchronously and only the timers' wall time means anything)."""
    return base.cores > 0 and all(s.op_cpu_ms for s in samples)


def _fit(samples: list[StageSample], base: Profile) -> Profile:
    """Per-layer and output-layer costs, least squares over the stages: of CPU time where
    ranks share cores (what an op costs with a core to itself), else of wall time."""
    cpu = _cpu_timed(samples, base)

    def ms(s: StageSample, name: str) -> float | None:
        return (s.op_cpu_ms if cpu else s.op_ms).get(name)

    def per(ms_of) -> list[tuple[int, bool, bool, float]]:
        return [(s.layers, s.first, s.last, v) for s in samples if (v := ms_of(s)) is not None]

    def fwd_bwd(s: StageSample) -> float | None:
        f = ms(s, "forward-compute")
        b = ms(s, "backward-compute")
        if b is None and ms(s, "backward-input") is not None:
            b = ms(s, "backward-input") + (ms(s, "backward-weight") or 0.0)
        return None if f is None or b is None else f + b

    layer_fwd, head_fwd = fit_layer_costs(per(lambda s: ms(s, "forward-compute")), base.shape)
    layer_fb, head_fb = fit_layer_costs(per(fwd_bwd), base.shape, with_backward=True)
    layer_bwd, head_bwd = max(0.0, layer_fb - layer_fwd), max(0.0, head_fb - head_fwd)
    split = [s for s in samples if ms(s, "backward-input") is not None
             and ms(s, "backward-weight") is not None]
    input_share = (sum(ms(s, "backward-input") for s in split)
                   / sum(ms(s, "backward-input") + ms(s, "backward-weight") for s in split)
                   ) if split else 0.5
    opt = [(v, s.params) for s in samples if (v := ms(s, "optimizer")) is not None]
    opt_per_mparam = (sum(v for v, _ in opt) / (sum(p for _, p in opt) / 1e6)) if opt else \
        base.optimizer_ms_per_mparam
    return dataclasses.replace(
        base, source="measured", layer_fwd_ms=layer_fwd,
        layer_bwd_input_ms=layer_bwd * input_share,
        layer_bwd_weight_ms=layer_bwd * (1 - input_share),
        embedding_fwd_ms=0.0, embedding_bwd_ms=0.0, head_fwd_ms=head_fwd, head_bwd_ms=head_bwd,
        optimizer_ms_per_mparam=opt_per_mparam,
        notes=[*base.notes, f"compute fitted to {len(samples)} rank(s), "
                            f"{min(s.iterations for s in samples)}+ iterations each, from "
                            f"{'CPU' if cpu else 'wall'} time"])


def _slow_ranks(samples: list[StageSample], base: Profile) -> dict[int, float]:
    """Where costs come from CPU time: rank -> its compute's wall over CPU time relative to the
    median rank's, for the ranks at least SLOW_RATIO above it (a slow device takes longer than
    its share of the cores explains)."""
    if not _cpu_timed(samples, base):
        return {}
    stretch = {s.rank: s.busy_ms / sum(s.op_cpu_ms[n] * s.op_counts[n] for n in s.op_cpu_ms)
               for s in samples}
    typical = statistics.median(stretch.values())
    return {r: round(v / typical, 3) for r, v in stretch.items() if v / typical >= SLOW_RATIO}


def _slow_against(samples: list[StageSample], fitted: Profile) -> dict[int, float]:
    """rank -> measured over fitted compute time, for the ranks at least SLOW_RATIO slower."""
    p = fitted
    slow = {}
    for s in samples:
        measured = s.compute_ms()
        expected = (s.layers * (p.layer_fwd_ms + p.layer_bwd_input_ms + p.layer_bwd_weight_ms)
                    + s.last * (p.head_fwd_ms + p.head_bwd_ms))
        if measured is not None and expected > 0 and measured / expected >= SLOW_RATIO:
            slow[s.rank] = round(measured / expected, 3)
    return slow


def calibrate(plan: ExecutionPlan, schedule: Schedule, samples: list[StageSample],
              base: Profile) -> Profile:
    """The profile fitted to `samples` (measured under `plan` and `schedule`), with the part of
    the measured iteration the simulated one lacks kept as `iteration_overhead_ms`."""
    # The timers measured a shard of each op at the plan's tensor-parallel degree, its
    # all-reduces included (perf_model.Profile.tensor_parallel).
    fitted = dataclasses.replace(
        profile_from_samples(samples, base), iteration_overhead_ms=0.0,
        tensor_parallel=plan.tensor_parallel,
        tp_allreduce_ms=base.tp_allreduce_ms if base.tensor_parallel == plan.tensor_parallel
        else -1.0)
    if _cpu_timed(samples, base):
        fitted = _effective_cores(plan, schedule, samples, fitted)
    sim = predict(plan, schedule, fitted)
    simulated = sim.iteration_ms
    measured = statistics.median(s.iteration_ms for s in samples)
    refresh = [s.op_ms[SHADOW_SYNC] for s in samples if SHADOW_SYNC in s.op_ms]
    if refresh:  # eager redundancy's refresh: its own cost, not an overhead of every plan
        synced = max(refresh)
        modelled = eager_cost(plan, fitted).refresh_ms
        if modelled > 0:
            fitted = dataclasses.replace(fitted, shadow_sync_factor=synced / modelled)
        # what the refresh adds to the iteration, as predictions with shadows charge it
        measured -= eager_cost(plan, fitted).sync_ms if modelled > 0 else synced
    # Negative when the simulation overshoots the plan it was fitted under: the same bias,
    # taken off every plan's prediction (in a core's time where ranks share cores).
    unit = overhead_ms(dataclasses.replace(fitted, iteration_overhead_ms=1.0), sim.sharing)
    return dataclasses.replace(fitted, iteration_overhead_ms=max(-simulated / 2,
                                                                 measured - simulated) / unit)


def _effective_cores(plan: ExecutionPlan, schedule: Schedule, samples: list[StageSample],
                     fitted: Profile, rounds: int = 3) -> Profile:
    """`fitted` with the cores that make the model's slowdown by sharing them the measured one
    (compute wall over CPU time, median over the ranks not slowed on purpose): other work on
    the host (gloo's threads, other jobs) leaves fewer than it has, hyperthreads more."""
    stretch = statistics.median(
        s.busy_ms / sum(s.op_cpu_ms[n] * s.op_counts[n] for n in s.op_cpu_ms)
        for s in samples if s.rank not in fitted.rank_slowdown)
    if stretch <= 1.0:
        return fitted
    physical = fitted.cores
    for _ in range(rounds):
        modelled = statistics.median(
            f for r, f in predict(plan, schedule, fitted, validate=False).sharing.items()
            if r not in fitted.rank_slowdown)
        if modelled <= 1.0:
            break
        cores = min(max(fitted.cores * modelled / stretch, physical / 2), physical * 2)
        fitted = dataclasses.replace(fitted, cores=cores)
    return fitted


PROFILE_KEY = "chameleon/profile"     # the latest calibrated profile (LiveCalibration.profile)


def sample_key(launch_rank: int) -> str:
    return f"chameleon/sample/{launch_rank}"


class LiveCalibration:
    """This rank's Calibrator, its latest sample published on the job's store after every
    measured iteration, and the job's profile fitted from every rank's published samples."""

    def __init__(self, store, launch_rank: int, timers, base: Profile, clock=None,
                 warmup: int = 3) -> None:
        self.store = store
        self.launch_rank = launch_rank
        self.base = base
        self.calibrator = Calibrator(timers, clock, warmup)
        self._generation = 0

    def start(self, plan: ExecutionPlan, rank: int, ops: list[Op], shadows: bool = False,
              memory=None) -> None:
        self._generation = plan.generation
        self.calibrator.start(plan, rank, ops, self.base, shadows, memory)

    def after_iteration(self, elapsed_ms: float) -> None:
        self.calibrator.after_iteration(elapsed_ms)
        sample = self.calibrator.sample()
        if sample is not None:
            self.store.set(sample_key(self.launch_rank), json.dumps(
                {"generation": self._generation, "sample": sample.to_dict()}))

    def measured_transition(self, detect_ms: float | None, reconfigure_ms: float) -> None:
        """A recovery of this job took this long: the next decision costs transitions so."""
        self.base = dataclasses.replace(
            self.base, rebuild_ms=reconfigure_ms,
            detect_ms=self.base.detect_ms if detect_ms is None else max(detect_ms, 0.0))

    def samples(self, plan: ExecutionPlan, launch_ranks: list[int]) -> list[StageSample]:
        """The published samples measured under `plan` by the ranks (launch_ranks[i]: rank i)."""
        out = []
        for r in launch_ranks:
            key = sample_key(r)
            if not self.store.check([key]):
                continue
            d = json.loads(self.store.get(key))
            if d["generation"] == plan.generation:
                out.append(StageSample.from_dict(d["sample"]))
        return out

    def profile(self, plan: ExecutionPlan, launch_ranks: list[int]) -> Profile | None:
        """The profile calibrated under `plan` (published on the store); when nothing was
        measured under it yet, the latest one published, calibrated under an earlier plan;
        else the base profile when it has costs of its own (--chameleon-profile); else None.

        A loss that comes a few iterations after the last one (a stage's replicas lost
        minutes apart) finds nothing measured under the plan it interrupts: the base, without
        the host's costs, under-predicted a restart plan by 2.8% there and its fit by stage
        was lost. The fitted per-layer costs hold for any plan; the slow ranks it found are
        kept by launch rank, which outlives the plans' numbering."""
        samples = self.samples(plan, launch_ranks)
        if samples:
            fitted = calibrate(plan, choose_schedule(plan, fuse=False), samples, self.base)
            slow = {launch_ranks[r]: f for r, f in fitted.rank_slowdown.items()}
            self.store.set(PROFILE_KEY, json.dumps(
                dataclasses.replace(fitted, rank_slowdown=slow).to_dict()))
            return fitted
        if self.store.check([PROFILE_KEY]):
            latest = Profile.from_dict(json.loads(self.store.get(PROFILE_KEY)))
            rank_of = {launch: r for r, launch in enumerate(launch_ranks)}
            return dataclasses.replace(
                latest, rebuild_ms=self.base.rebuild_ms, detect_ms=self.base.detect_ms,
                rank_slowdown={rank_of[launch]: f for launch, f in latest.rank_slowdown.items()
                               if launch in rank_of})
        return self.base if self.base.layer_fwd_ms > 0 else None
