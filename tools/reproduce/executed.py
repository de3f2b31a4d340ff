"""Failure traces executed by real jobs on emulated devices: every policy meets the same kills
and rejoins, and its average throughput is measured in samples per second of wall time, from
the end of iteration 1 (a warm-up every policy shares) to the end of the last.

Each rank emulates a dedicated device of a profile (--chameleon-emulate, `dilation` times
slower), so losing a rank costs what it would on the profile's devices, not less. A trace
names which launch rank is lost when, and how many iterations of failure-free time later its
slot is back (chameleon-launch --max-restarts with --restart-delay; the new worker is started
ahead, --start-ahead, and asks to join when the repair time is up, at the next iteration
boundary). A loss "at iteration i" is a SIGKILL from outside (tools/inject_failure.py --trace)
at a wall-clock instant: the middle of iteration i on the failure-free clock, counted from the
end of iteration 1, whatever the job does then (a step, a recovery, a save, a relaunch), as
the simulator places it; a slower policy meets the same losses at the same moments. A rank is
killed at most once. No stage loses all its replicas at once.

A trace compresses time: its interval between failures stands for an hour of training. The
same compression applies to the costs a real job has in minutes: a checkpoint every 30 minutes
(save_interval), a relaunch of 5 minutes (RELAUNCH_S) and the storage a checkpoint is written
to (--chameleon-emulate-storage). What cannot be compressed is real here: process start-up,
detection and rebuilds on these cores.

Policies (tools/reproduce/simulate.POLICIES): auto, reparallelize only (Oobleck-like), reroute
only (ReCycle-like), takeover with eager state replication (Bamboo-like), each one job under
chameleon-launch; and Megatron checkpoint-restart: the job (--chameleon for the emulation, no
in-process recovery: chameleon-launch --max-failures 0 stops it at the first failure) is
relaunched with --load, after the relaunch time less what the relaunch here already took,
over the GPUs up at that moment (the restart re-plan over them, --chameleon-plan); a rejoin
waits for the next relaunch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import re
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import ModelShape, Profile, analytical_profile, predict_plan
from chameleon_ext.planning.planner import replan
from chameleon_ext.planning.strategies.base import balanced_layers, with_layers
from megatron.elastic.emulation import STORAGE_MIB_PER_S, emulated_profile
from tests.launch import SMALL_MODEL, TimedKills, free_port, last_losses, run_chameleon
from tools.reproduce import simulate, traces
from tools.reproduce.cluster import Setup

# A real job's costs in seconds that a trace compresses with its time (see the docstring):
# an hour between failures, a checkpoint every 30 minutes, a relaunch of 5 minutes (the
# simulated table's defaults).
HOUR_S, CHECKPOINT_S, RELAUNCH_S = 3600.0, 1800.0, 300.0
# The default emulated device: an H200 running a GPT of 1.3B parameters' shape (the issue's
# measured post-recovery figure used it), in micro-batches of 2 sequences; the job's 4 layers
# each cost one of its layers. At 1 sequence a micro-batch the gradient reduction and the
# output layer set the iteration time: 6 of the 8 ranks ran within 1.6% of all 8 (the
# planner's fastest layout over 8 left 2 idle), and no loss cost a policy anything to speak of.
DEFAULT_SHAPE = ModelShape(24, 2048, 16, 2048, 2, 50304)
# The first kill leaves the calibration its warm-up (3 iterations) and one measured iteration;
# the last leaves the job two iterations to recover in.
FIRST_KILL, LAST_MARGIN = 5, 3
# 8 to 32 processes starting on a few shared cores hold the agent's store back for seconds;
# a lost worker is seen at once by its exit, so a long heartbeat costs nothing here.
LAUNCHER = ["--heartbeat-timeout", "30"]
# A killed slot's replacement starts this long before its repair time is up and joins only
# then, so that its start-up is not counted in the repair (forked from the agent's fork server
# it imports nothing, but its runtime's set-up is real time on these cores; started with
# their own imports, workers took 10-11 s here); ahead of the repair rather than at the kill,
# so that it does not share these cores with the survivors' recovery.
START_AHEAD_S = 15.0
MICRO_BATCHES = 4                      # per pipeline and iteration, of SMALL_MODEL's 2 samples
CHAMELEON_FLAGS = {
    "auto": ["--chameleon-strategy", "auto"],
    "oobleck": ["--chameleon-strategy", "reparallelize"],
    "recycle": ["--chameleon-strategy", "reroute"],
    "bamboo": ["--chameleon-strategy", "takeover", "--chameleon-redundancy", "eager"],
}
MEGATRON = "megatron"


class TraceError(RuntimeError):
    """A run of an executed trace that did not end as it should; the message says which."""


class TraceSetError(ValueError):
    """Traces that cannot be placed on the iterations asked for; the message says why."""


@dataclass(frozen=True)
class Kill:
    iteration: int                     # killed in the middle of this iteration's failure-free time
    rank: int                          # a launch rank of the failure-free job

    def after_s(self, iteration_ms: float) -> float:
        """Its instant: seconds after the end of iteration 1 at `iteration_ms` an iteration."""
        return (self.iteration - 1.5) * iteration_ms / 1e3


@dataclass(frozen=True)
class ExecutedTrace:
    name: str
    iterations: int
    interval: float                    # iterations between failures (the mean, Poisson)
    repair: int | None                 # iterations until a killed slot starts again; None: never
    kills: tuple[Kill, ...]


@dataclass(frozen=True)
class Config:
    """The job every policy runs, and how a trace's time is compressed."""

    ranks: int
    pipeline: int
    dilation: float
    profile: Path                      # the emulated device (undilated)
    data: str
    interval: float                    # a trace's iterations between failures: one hour

    @functools.cached_property
    def plan(self) -> ExecutionPlan:
        """The failure-free plan: `pipeline` stages of ranks / pipeline replicas, the layers
        split as the planner balances them for the emulated device (Megatron's even split
        leaves the output layer's stage the slowest); every job runs it (--chameleon-plan)."""
        even = ExecutionPlan.failure_free(self.ranks, 1, self.pipeline, 4, 2, self.global_batch)
        # the undilated device: the dilation scales every stage alike
        return with_layers(even, balanced_layers(even.num_layers, self.pipeline,
                                                 Profile.load(self.profile)))

    @property
    def global_batch(self) -> int:
        return 2 * MICRO_BATCHES * self.ranks // self.pipeline

    @functools.cached_property
    def device(self) -> Profile:
        """The emulated device as the planner sees it (dilated, compressed storage)."""
        return emulated_profile(Profile.load(self.profile), self.dilation, self.storage_mib_per_s)

    @functools.cached_property
    def compression(self) -> float:
        """Real seconds per second of the emulated device's time in a trace."""
        device_ms = predict_plan(self.plan, Profile.load(self.profile)).iteration_ms  # undilated
        return HOUR_S / (self.interval * device_ms / 1e3)

    @property
    def storage_mib_per_s(self) -> float:
        return STORAGE_MIB_PER_S * self.compression

    @property
    def save_interval(self) -> int:
        return max(1, round(self.interval * CHECKPOINT_S / HOUR_S))

    @property
    def relaunch_wall_s(self) -> float:
        """The compressed relaunch, in wall seconds of this machine (dilated)."""
        return RELAUNCH_S / self.compression * self.dilation


def default_profile(path: Path) -> Path:
    """The analytical H200 profile of DEFAULT_SHAPE, written to `path`."""
    analytical_profile(DEFAULT_SHAPE, "H200").save(path)
    return path


# ---- traces -------------------------------------------------------------------------------------
def _victims(at: list[int], plan: ExecutionPlan, rng: random.Random) -> tuple[Kill, ...]:
    """A rank for each kill, never one killed before, never a stage's last replica."""
    left: dict[int, list[int]] = {}
    for r in plan.ranks:
        left.setdefault(plan.position(r).stage, []).append(r)
    kills = []
    for it in at:
        stages = [s for s, ranks in left.items() if len(ranks) > 1]
        if not stages:
            break
        ranks = left[rng.choice(stages)]
        kills.append(Kill(it, ranks.pop(rng.randrange(len(ranks)))))
    return tuple(kills)


def default_repair(every: int) -> int:
    """A killed slot's repair, in iterations: 3/4 of the interval between kills, so that a
    repair never ends at the instant of the next fixed-interval kill (whether that kill or the
    joiner's request comes first is then a race of milliseconds: at 60b221f the joiner took the
    lost place in 1 of the 8 such coincidences of four policies' runs)."""
    return max(1, every * 3 // 4)


def fixed_interval(iterations: int, every: int, plan: ExecutionPlan, repair: int | None,
                   seed: int = 0) -> ExecutedTrace:
    """A kill every `every` iterations (Oobleck's fixed-interval traces, compressed)."""
    at = list(range(max(every, FIRST_KILL), iterations - LAST_MARGIN + 1, every))
    return ExecutedTrace(f"every {every} iterations", iterations, every, repair,
                         _victims(at, plan, random.Random(f"fixed-{every}-{seed}")))


def poisson(iterations: int, mean: float, plan: ExecutionPlan, repair: int | None,
            seed: int = 0) -> ExecutedTrace:
    """Gaps between kills drawn from an exponential law of mean `mean` iterations."""
    rng = traces.poisson_rng(mean, seed)
    at, t = [], FIRST_KILL - 1 + rng.expovariate(1 / mean)
    while t <= iterations - LAST_MARGIN:
        if not at or math.ceil(t) > at[-1]:
            at.append(math.ceil(t))
        t += rng.expovariate(1 / mean)
    return ExecutedTrace(f"Poisson, mean {mean:g} iterations", iterations, mean, repair,
                         _victims(at, plan, rng))


def stage_outage(iterations: int, every: int, plan: ExecutionPlan,
                 seed: int = 0) -> ExecutedTrace:
    """Table 2's designed trace traces.stage_outage (three of one stage's replicas lost minutes
    apart, each back after 3 hours) at `every` iterations an hour: each loss in the iteration
    its hour falls in, or the one after the loss before it (the injector kills at most one
    rank an iteration), never before FIRST_KILL."""
    t = traces.stage_outage(traces.stage_groups(plan), iterations / every, seed)
    kills: list[Kill] = []
    for e in t.events:
        if e.kind == "fail":
            at = max(math.ceil(e.hour * every), FIRST_KILL,
                     kills[-1].iteration + 1 if kills else 0)
            kills.append(Kill(at, e.gpu))
    if kills[-1].iteration > iterations - LAST_MARGIN:
        raise TraceSetError(f"{iterations} iterations leave no room for the stage outage's "
                            "losses at iterations "
                            f"{', '.join(str(k.iteration) for k in kills)}")
    return ExecutedTrace(t.name, iterations, t.mtbf_h * every, round(t.repair_h * every),
                         tuple(kills))


def trace_set(iterations: int, every: int, poisson_mean: float | None,
              plan: ExecutionPlan, repair: int | None, seed: int, fixed: bool = True,
              outage: bool = False) -> list[ExecutedTrace]:
    """The fixed-interval trace (unless not `fixed`), a Poisson one when `poisson_mean` is
    given, and table 2's stage outage with `outage` (its own repair: 3 hours)."""
    trs = [fixed_interval(iterations, every, plan, repair, seed)] if fixed else []
    if poisson_mean is not None:
        trs.append(poisson(iterations, poisson_mean, plan, repair, seed))
    if outage:
        trs.append(stage_outage(iterations, every, plan, seed))
    return trs


# ---- runs ---------------------------------------------------------------------------------------
@dataclass
class Measured:
    policy: str
    trace: str
    iterations: int
    wall_s: float                      # the end of iteration 1 to the end of the last one
    samples_per_s: float
    losses: list[float]
    recoveries: Counter = field(default_factory=Counter)  # strategy taken at each failure
    rejoins: int = 0
    overrun_share: float = 0.0
    valid: bool = True
    startup_s: float = 0.0             # launch to the start of iteration 1
    median_iteration_ms: float = 0.0
    # Host time of the in-process transitions (recoveries and rejoins: from the first notice to
    # the new world's start), real here and not compressed with the trace.
    transition_s: float = 0.0
    # Each in-process recovery's host time, first notice to the new world's start (ms).
    recovery_ms: list[float] = field(default_factory=list)
    # Each admission's, its decision to the new world's start, the state moved included (ms).
    rejoin_ms: list[float] = field(default_factory=list)
    # Megatron: each relaunch's wall seconds, from the kill to the end of the next launch's
    # first iteration less one of its iterations (detection, the relaunch, process start-up,
    # the checkpoint read, the first iteration's warm-up).
    relaunch_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        # not dataclasses.asdict: it rebuilds a Counter from its (key, count) pairs as keys
        return {f.name: dict(self.recoveries) if f.name == "recoveries" else getattr(self, f.name)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Measured":
        return cls(**{**d, "recoveries": Counter(d["recoveries"])})

    @property
    def pace_ms(self) -> float:
        """Its mean iteration, the end of iteration 1 to the end of the last: the median's
        iteration and what the median leaves out (the checkpoint saves, the slower ones)."""
        return self.wall_s * 1e3 / (self.iterations - 1)


def _args(c: Config, iterations: int, checkpoints: Path, plan_file: Path) -> list[str]:
    return SMALL_MODEL + [
        "--chameleon-plan", str(plan_file), "--pipeline-model-parallel-size", str(c.pipeline),
        "--global-batch-size", str(c.global_batch), "--train-iters", str(iterations),
        "--lr-decay-iters", str(iterations), "--lr", "3e-3", "--data-path", c.data,
        "--split", "100,0,0", "--log-interval", str(iterations), "--chameleon",
        "--chameleon-emulate", str(c.profile), "--chameleon-emulate-dilation", str(c.dilation),
        "--chameleon-emulate-storage", f"{c.storage_mib_per_s:.1f}",
        "--save", str(checkpoints), "--save-interval", str(c.save_interval)]


def _plan_file(c: Config, workdir: Path) -> Path:
    """The failure-free plan, written in `workdir` for the jobs to read."""
    path = workdir / "failure-free-plan.json"
    workdir.mkdir(parents=True, exist_ok=True)
    c.plan.save(path)
    return path


def _measure(policy: str, trace: str, events: list[dict], iterations: int, c: Config,
             launched: float) -> Measured:
    its = [e for e in events if e["event"] == "iteration"]
    if not its or max(e["iteration"] for e in its) != iterations:
        raise TraceError(f"{policy} on {trace}: the job did not reach iteration {iterations}")
    start = its[0]["time"] - its[0]["elapsed_ms"] / 1e3
    # Iteration 1 is the same warm-up under every policy (no kill comes before FIRST_KILL),
    # and its host time (first allocations, first messages) varies by seconds between
    # identical runs here: the throughput is counted after it.
    wall = its[-1]["time"] - its[0]["time"]
    emu = [e for e in events if e["event"] == "emulation"]
    ops = sum(e["ops"] for e in emu)
    share = sum(e["overruns"] for e in emu) / ops if ops else 0.0
    m = Measured(policy, trace, iterations, wall, (iterations - 1) * c.global_batch / wall,
                 last_losses(events), overrun_share=share,
                 valid=bool(emu) and all(e["valid"] for e in emu), startup_s=start - launched)
    m.recoveries = Counter(e["strategy"] for e in events if e["event"] == "recovery")
    m.rejoins = sum(e["event"] == "rejoin" for e in events)
    m.transition_s = sum(e["reconfigure_ms"] for e in events
                         if e["event"] in ("recovery", "rejoin")) / 1e3
    m.recovery_ms = [e["reconfigure_ms"] for e in events if e["event"] == "recovery"]
    m.rejoin_ms = [e["reconfigure_ms"] for e in events if e["event"] == "rejoin"]
    m.median_iteration_ms = statistics.median(e["elapsed_ms"] for e in its)
    return m


def failure_free(c: Config, iterations: int, workdir: Path) -> Measured:
    """The job without failures: the throughput every policy is set against, its losses and
    iteration time (a repair's length in wall seconds)."""
    launched = time.time()
    with tempfile.TemporaryDirectory(prefix="traces-ckpt-") as ckpt:
        run = run_chameleon(c.ranks, _args(c, iterations, Path(ckpt), _plan_file(c, workdir)),
                            workdir,
                            name="failure-free", timeout=_timeout(c, iterations),
                            launcher_args=LAUNCHER)
    if run.returncode != 0:
        raise TraceError(f"the failure-free run exited with {run.returncode}: "
                         f"{_last_line(run.stderr)}")
    return _measure("failure-free", "none", run.metrics, iterations, c, launched)


def run_policy(policy: str, trace: ExecutedTrace, c: Config, ff: Measured,
               workdir: Path) -> Measured:
    # file names of letters, digits, dots and dashes: the trace names have spaces, commas, quotes
    name = f"{policy}-{re.sub('[^A-Za-z0-9.]+', '-', trace.name).strip('-')}"
    if policy == MEGATRON:
        return _megatron(trace, c, ff, workdir, name)
    repair = [] if trace.repair is None else [
        "--max-restarts", str(len(trace.kills)),
        "--restart-delay", f"{trace.repair * ff.median_iteration_ms / 1e3:.3f}",
        "--start-ahead", f"{START_AHEAD_S:g}"]
    launched, port = time.time(), free_port()
    kills = TimedKills(port, workdir / f"{name}-kills.txt",
                       [(k.after_s(ff.median_iteration_ms), k.rank) for k in trace.kills],
                       after=1).start()
    with tempfile.TemporaryDirectory(prefix="traces-ckpt-") as ckpt:
        run = run_chameleon(
            c.ranks, _args(c, trace.iterations, Path(ckpt), _plan_file(c, workdir))
            + CHAMELEON_FLAGS[policy]
            # the planner's horizon: the trace's interval, in this machine's (dilated) hours
            + ["--chameleon-mtbf", f"{trace.interval * ff.median_iteration_ms / 3.6e6:.6g}"],
            workdir, name=name, port=port,
            timeout=_timeout(c, trace.iterations, len(trace.kills)),
            launcher_args=LAUNCHER + ["--max-failures", str(len(trace.kills))] + repair)
    kills.join()
    if run.returncode != 0:
        raise TraceError(f"{policy} on {trace.name} exited with {run.returncode}: "
                         f"{_last_line(run.stderr)}")
    return _measure(policy, trace.name, run.metrics, trace.iterations, c, launched)


def _megatron(trace: ExecutedTrace, c: Config, ff: Measured, workdir: Path,
              name: str) -> Measured:
    """Checkpoint-restart: one job per stretch between failures, each relaunched over the GPUs
    up (a GPU is a launch rank of the failure-free job)."""
    with tempfile.TemporaryDirectory(prefix="traces-ckpt-") as ckpt:
        return _relaunched(trace, c, ff, workdir, name, Path(ckpt))


def _relaunched(trace: ExecutedTrace, c: Config, ff: Measured, workdir: Path, name: str,
                ckpt: Path) -> Measured:
    metrics: list[dict] = []
    back_at: dict[int, float] = {}     # a killed GPU -> wall time it is up again
    repair_s = math.inf if trace.repair is None else trace.repair * ff.median_iteration_ms / 1e3
    pending = list(trace.kills)
    anchor: float | None = None        # the end of iteration 1: the kills' clock starts there
    launched, relaunches = time.time(), 0
    gaps: list[float] = []             # each relaunch, kill to the next first iteration
    killed_at = 0.0
    for segment in range(len(trace.kills) + 1):
        now = time.time()
        # losses that came while no job ran on them (a relaunch, a GPU left idle)
        while anchor is not None and pending and \
                anchor + pending[0].after_s(ff.median_iteration_ms) <= now:
            k = pending.pop(0)
            back_at[k.rank] = anchor + k.after_s(ff.median_iteration_ms) + repair_s
        down = {g for g, t in back_at.items() if t > now}
        plan, gpus = c.plan, list(range(c.ranks))
        if down:
            plan = replan(c.plan, down, c.device)
            if plan is None:
                raise TraceError(f"{name}: no plan over the GPUs up")
            gpus = c.plan.survivors(down, plan.world_size)
        plan_file = _plan_file(c, workdir)
        if plan is not c.plan:
            plan_file = workdir / f"{name}-plan-{segment}.json"
            plan.save(plan_file)
        args = _args(c, trace.iterations, ckpt, plan_file) + \
            (["--load", str(ckpt)] if segment else [])
        # The next loss of a GPU this job runs on ends it (--max-failures 0); an idle GPU's
        # loss changes only when it is up again.
        hit = next((k for k in pending if k.rank in gpus), None)
        seg, port = f"{name}-{segment}", free_port()
        kills = None
        if hit is not None:
            at = hit.after_s(ff.median_iteration_ms)
            kills = TimedKills(port, workdir / f"{seg}-kills.txt",
                               [(at if anchor is None else anchor + at, gpus.index(hit.rank))],
                               after=1 if anchor is None else None).start()
        run = run_chameleon(plan.world_size, args, workdir, name=seg, port=port,
                            timeout=_timeout(c, trace.iterations),
                            launcher_args=LAUNCHER + ["--max-failures", "0"])
        if kills is not None:
            kills.join()
        its = [e for e in run.metrics if e["event"] == "iteration"]
        if len(its) > 1 and relaunches:
            pace_s = statistics.median(e["elapsed_ms"] for e in its[1:]) / 1e3
            gaps.append(its[0]["time"] - pace_s - killed_at)
        metrics += run.metrics
        if anchor is None:
            if not its:
                raise TraceError(f"{name}: segment {seg} trained no iteration: "
                                 f"{_last_line(run.stderr)}")
            anchor = its[0]["time"]
        if run.returncode == 0:
            break
        if hit is None or kills.returncode != 0 or not kills.signalled_at:
            raise TraceError(f"{name}: segment {seg} exited with {run.returncode} without "
                             f"its kill: {_last_line(run.stderr)}")
        pending.remove(hit)
        killed_at = kills.signalled_at[0]
        back_at[hit.rank] = killed_at + repair_s
        relaunches += 1
        # Megatron's relaunch takes RELAUNCH_S (compressed); the next launch's own start-up
        # here is part of it, so only what the failure-free run's start-up leaves is slept.
        time.sleep(max(0.0, c.relaunch_wall_s - ff.startup_s))
    else:
        raise TraceError(f"{name}: still training after {len(trace.kills) + 1} launches")
    m = _measure(MEGATRON, trace.name, metrics, trace.iterations, c, launched)
    m.recoveries = Counter({"relaunch": relaunches})
    m.relaunch_s = gaps
    return m


def _timeout(c: Config, iterations: int, kills: int = 0) -> float:
    """Bounds one job: its iterations at 4x the emulated time, plus 3 minutes of start-up and
    2 per recovery on a few shared cores; far beyond that it is stuck."""
    ms = predict_plan(c.plan, c.device).iteration_ms
    return 4 * iterations * ms / 1e3 + 180 + 120 * kills


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no output)"])[-1]


# ---- predictions -------------------------------------------------------------------------------
def predicted(trace: ExecutedTrace, c: Config, policy: simulate.Policy, iteration_ms: float,
              device: Profile, relaunch_s: float, move_ms: float | None = None,
              clock: Profile | None = None) -> simulate.Outcome:
    """What tools/reproduce/simulate predicts for the trace on `device` (the emulated one,
    its host costs calibrated: Comparison.device): the kills and rejoins at their instants
    (`iteration_ms`: the failure-free iteration they were placed by, measured), a relaunch of
    `relaunch_s` (Comparison.relaunch_s), an admission of `move_ms` (Comparison.move_ms), each
    plan's iterations timed on `clock` (Comparison.clock; None: on `device`); counted, as measured, from the end of iteration 1 to the end of the last, however long the
    job takes to train them (the outcome's samples_per_s(c.global_batch)), and the recoveries
    it simulated."""
    ms = predict_plan(c.plan, device).iteration_ms
    events = []
    for k in trace.kills:
        events.append(traces.Event(k.after_s(iteration_ms) / 3600, "fail", k.rank))
        if trace.repair is not None:
            # Its worker asks to join at the repair time, a spare until the job admits it at
            # the end of the iteration after the one it asked in (simulate's "up", as
            # decider.Decider.admission_time); the repair time counts from the kill as
            # signalled, a little after its instant, so a kill at the same instant (the same
            # formula) comes first.
            back = Kill(k.iteration + trace.repair, k.rank).after_s(iteration_ms) / 3600
            events.append(traces.Event(back, "up", k.rank))
    hours = ms / 3.6e6
    t = traces.Trace(trace.name, (trace.iterations - 1) * hours, trace.interval * hours,
                     math.inf if trace.repair is None else trace.repair * hours,
                     tuple(sorted(events, key=lambda e: (e.hour, e.kind != "fail"))))
    setup = Setup("executed", 1, device, c.plan, c.plan, ms)
    costs = simulate.Costs(c.save_interval * ms / 6e4, relaunch_s / 60, move_ms, clock)
    return simulate.train_until(setup, policy, t, costs, trace.iterations - 1)


# ---- a comparison -------------------------------------------------------------------------------
@dataclass
class Comparison:
    """Every policy on every trace, `repeats` times, the policies' order rotated each repeat
    (a slow spell of the machine then falls on different policies); a failure-free run opens
    each repeat."""

    config: Config
    traces: list[ExecutedTrace]
    policies: list[simulate.Policy]
    failure_free: list[Measured] = field(default_factory=list)
    runs: dict[tuple[str, str], list[Measured]] = field(default_factory=dict)
    # (trace, policy) -> the simulator's run of it (Comparison.predicted_samples_per_s)
    predicted: dict[tuple[str, str], simulate.Outcome] = field(default_factory=dict)

    def samples_per_s(self, trace: str, policy: str) -> float:
        return statistics.fmean(m.samples_per_s for m in self.runs[trace, policy])

    @property
    def failure_free_samples_per_s(self) -> float:
        return statistics.fmean(m.samples_per_s for m in self.failure_free)

    @functools.cached_property
    def op_overhead_ms(self) -> float:
        """The host time per forward or backward op that makes the failure-free plan's
        predicted iteration the failure-free run's pace (the emulation pads each op to the
        device's time, not the executor's own work between ops; the pace has the checkpoint
        saves every policy makes too): its predicted throughput is the measured one. 0 when
        the prediction is not below it."""
        c = self.config
        target = self._failure_free_pace_ms

        def predicted(h: float) -> float:
            return predict_plan(c.plan, dataclasses.replace(c.device, op_overhead_ms=h)
                                ).iteration_ms

        # Every op on the critical path adds h, so h = the shortfall overshoots: bisect below.
        lo, hi = 0.0, target - predicted(0.0)
        if hi <= 0:
            return 0.0
        for _ in range(40):     # the shortfall / 2^40: far below a microsecond
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid) < target else (lo, mid)
        return hi

    @property
    def iteration_overhead_ms(self) -> float:
        """The failure-free run's pace less its predicted iteration: what the job's own
        calibration keeps as a per-iteration overhead (megatron.elastic.calibration.calibrate:
        the measured iteration the simulated one lacks, at most half of it taken off)."""
        simulated = predict_plan(self.config.plan, self.config.device).iteration_ms
        return max(-simulated / 2, self._failure_free_pace_ms - simulated)

    @property
    def _failure_free_pace_ms(self) -> float:
        return statistics.fmean(m.pace_ms for m in self.failure_free)

    def device(self, trace: str, policy: str) -> Profile:
        """The emulated device as the job decides on it: its host costs the simulator cannot
        know calibrated from the runs as the job calibrates them (a per-iteration overhead,
        iteration_overhead_ms), and a recovery's rebuild (detection to the new world: gloo
        groups, the runtime, state moved; real here, not emulated), the median of the policy's
        recoveries on `trace`. The job ranks its candidates on its own calibration, and so
        must the prediction of what it does: decided on the per-op fit, Oobleck-like chose a
        7-rank layout the job never took, 3.0% and 3.6% under its measured throughput (the
        runs of 2583843)."""
        took = [ms for m in self.runs.get((trace, policy), []) for ms in m.recovery_ms]
        device = dataclasses.replace(self.config.device,
                                     iteration_overhead_ms=self.iteration_overhead_ms)
        return dataclasses.replace(device, rebuild_ms=statistics.median(took)) if took \
            else device

    def clock(self, trace: str, policy: str) -> Profile:
        """The device the plans' iterations take their time on: the host time as a cost of
        each op (op_overhead_ms), which grows with the ops a rank runs; a 2 x 3 plan of 16
        micro-batches a pipeline measured 3412 ms, 3227 ms predicted without it, the job's
        per-iteration overhead 81 ms short of it."""
        return dataclasses.replace(self.device(trace, policy), iteration_overhead_ms=0.0,
                                   op_overhead_ms=self.op_overhead_ms)

    def move_ms(self, trace: str, policy: str) -> float | None:
        """An admission's host time under `policy` on `trace` (the decision to the new
        world's start, the state moved included; real here, as a rebuild is), the median of
        those measured; None where none was."""
        took = [ms for m in self.runs.get((trace, policy), []) for ms in m.rejoin_ms]
        return statistics.median(took) if took else None

    def relaunch_s(self, trace: str) -> float:
        """Megatron's relaunch on `trace`, mean over its relaunches here, less the detection
        and the rebuild that the simulator charges beside it (wall seconds; the compressed
        relaunch when none was measured)."""
        gaps = [g for m in self.runs.get((trace, MEGATRON), []) for g in m.relaunch_s]
        d = self.config.device
        return max(0.0, statistics.fmean(gaps) - (d.detect_ms + d.rebuild_ms) / 1e3) if gaps \
            else self.config.relaunch_wall_s

    def spread(self, trace: str, policy: str) -> float:
        """(largest - smallest) / mean of the repeats' samples per second; 0 with one."""
        rates = [m.samples_per_s for m in self.runs[trace, policy]]
        return (max(rates) - min(rates)) / statistics.fmean(rates)

    def ratio(self, trace: str, policy: str) -> float:
        """auto over `policy`, measured."""
        return self.samples_per_s(trace, "auto") / self.samples_per_s(trace, policy)

    @property
    def predicted_failure_free(self) -> float:
        """The simulator's failure-free throughput of the emulated job, samples/s (its op
        overhead calibrated to the measured one: equal to it but for rounding)."""
        c = self.config
        device = dataclasses.replace(c.device, op_overhead_ms=self.op_overhead_ms)
        return c.global_batch / predict_plan(c.plan, device).iteration_ms * 1e3

    def predict(self) -> None:
        """The simulator's run of every trace under every policy, calibrated from the runs."""
        pace = statistics.fmean(m.median_iteration_ms for m in self.failure_free)
        for t in self.traces:
            for p in self.policies:
                self.predicted[t.name, p.name] = predicted(
                    t, self.config, p, pace, self.device(t.name, p.name),
                    self.relaunch_s(t.name) if p.relaunch else 0.0, self.move_ms(t.name, p.name),
                    self.clock(t.name, p.name))

    def to_json(self) -> str:
        """The runs' measurements, the device and the traces: what the predictions are made
        from (from_json then predict() again, after a change to the simulator)."""
        c = self.config
        return json.dumps({
            "config": {"ranks": c.ranks, "pipeline": c.pipeline, "dilation": c.dilation,
                       "device": Profile.load(c.profile).to_dict(), "interval": c.interval},
            "traces": [dataclasses.asdict(t) for t in self.traces],
            "policies": [p.name for p in self.policies],
            "failure_free": [m.to_dict() for m in self.failure_free],
            "runs": [{"trace": t, "policy": p, "measured": [m.to_dict() for m in ms]}
                     for (t, p), ms in self.runs.items()]}, indent=1)

    @classmethod
    def from_json(cls, text: str, workdir: Path) -> "Comparison":
        """A comparison's runs saved by to_json, its device written to `workdir`; not yet
        predicted. Raises ValueError (KeyError, TypeError) on a file that is not one."""
        d = json.loads(text)
        c = d["config"]
        device = workdir / "device.json"
        Profile.from_dict(c["device"]).save(device)
        config = Config(c["ranks"], c["pipeline"], c["dilation"], device, "", c["interval"])
        trs = [ExecutedTrace(t["name"], t["iterations"], t["interval"], t["repair"],
                             tuple(Kill(**k) for k in t["kills"])) for t in d["traces"]]
        by_name = {p.name: p for p in simulate.POLICIES}
        out = cls(config, trs, [by_name[n] for n in d["policies"]],
                  [Measured.from_dict(m) for m in d["failure_free"]])
        out.runs = {(r["trace"], r["policy"]): [Measured.from_dict(m) for m in r["measured"]]
                    for r in d["runs"]}
        return out

    def predicted_samples_per_s(self, trace: str, policy: str) -> float:
        return self.predicted[trace, policy].samples_per_s(self.config.global_batch)

    def predicted_ratio(self, trace: str, policy: str) -> float:
        return self.predicted_samples_per_s(trace, "auto") / \
            self.predicted_samples_per_s(trace, policy)


def compare(c: Config, trs: list[ExecutedTrace], policies: list[simulate.Policy],
            repeats: int, workdir: Path, on_run=None) -> Comparison:
    """`on_run(label)` after each run (a progress bar)."""
    out = Comparison(c, trs, policies)
    iterations = trs[0].iterations
    if any(t.iterations != iterations for t in trs):
        raise ValueError("the traces of one comparison train the same iterations (the "
                         "failure-free run is their common reference)")
    for r in range(repeats):
        out.failure_free.append(failure_free(c, iterations, workdir / f"repeat{r}"))
        ff = out.failure_free[-1]
        if on_run:
            on_run("failure-free")
        order = policies[r % len(policies):] + policies[:r % len(policies)]
        for t in trs:
            for p in order:
                m = run_policy(p.name, t, c, ff, workdir / f"repeat{r}")
                out.runs.setdefault((t.name, p.name), []).append(m)
                if on_run:
                    on_run(f"{p.name}, {t.name}")
    out.predict()
    return out
