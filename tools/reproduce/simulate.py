"""Training under a failure trace, event by event, with one recovery policy: the average
throughput over the trace's span.

Between events the job trains at its plan's predicted iteration time (progress is counted in
iterations, fractions included; where the plans are timed on another device than the one the
job decides on, Costs.clock, as that one predicts it). A recovery takes progress back to where its lost work starts
(planner.Candidate.lost_iterations: the interrupted iteration's start or, for a restart, the
checkpoint), makes no progress for the rest of its predicted cost (detection, rebuild, state
moved or checkpoint read), then trains the lost iterations again on the new plan: its
transition_ms in all, as the planner predicts it. An event during a transition starts the next
one from that moment; the work lost stays lost (it is progress to make again, not a wait that
a later event could cut short).

- A failure of a GPU the plan uses: the planner ranks the policy's strategies on the current
  plan (planner.candidates; under auto each searching strategy's layout is the one the
  objective rates cheapest, the fixed policies' their fastest) and takes the cheapest, told the
  trace's losses so far as the job can record them (which of them the next loss came before
  their repair: planner.Situation.failure_record); where none of them has a feasible plan, or
  no survivor holds some layer any more, the job falls back to restart, as the real job does; where not even that fits, it stalls until
  GPUs come back. With tensor parallelism the failed GPU's whole group leaves the plan (its
  healthy GPUs idle until a rejoin re-plans). A failure of a GPU the plan leaves idle changes
  nothing. The failure-free plan's tensor-parallel groups that are up and out of the plan wait
  as spares, as the job's do (decider.Decider): auto weighs the substitute (they fill the lost
  places, the layout kept) with its other candidates, a fixed policy takes it first.
- A chosen hybrid (reroute now, restart at the next checkpoint) switches when that checkpoint is
  written, unless another change of plan comes first.
- A GPU up ("up", the executed traces': its worker asks to join): a spare until its admission,
  which the job schedules as the leader does (decider.Decider.admission_time): at the end of
  the iteration after the one it asked in, an iteration boundary, so a loss during the
  admission loses no iteration (its recovery starts where the admission stood). Then its
  rejoin, as below; a rejoin ("rejoin", table 2's traces) admits at its instant.
- A rejoin: with every GPU back, the failure-free plan; otherwise the policy's best plan over
  the GPUs up (planned from the failure-free plan with the rest lost, as strategies.rejoin
  hands them to the planner); auto takes it when it costs less than the current plan over the
  window until the next failure, its move paid first (planner.rejoin_choice's "now" against
  "stay"), a fixed policy at once, as the job's forced strategies admit.
  A planned move loses no work: the rebuild plus the state the GPUs lack, sent by their peers.
- Under a relaunching policy (Megatron's checkpoint-restart) a GPU back waits for the next
  failure's relaunch, which plans over every GPU up then: a running Megatron job cannot grow,
  and relaunching for the GPU would cost one relaunch more (the executed traces' Megatron
  runs alike, tools/reproduce/executed.py). Stalled (no plan fits), the job relaunches at the
  rejoin: the restart and the checkpoint read.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import (MIB, Profile, predict_plan, stage_params,
                                               switch_ms)
from chameleon_ext.planning.planner import (STRATEGIES, Candidate, Situation, Switch, candidates,
                                            choose, failure_record, moved_state_bytes,
                                            next_repair, rejoin_window, running_ms)
from chameleon_ext.planning.strategies.base import state_survives
from chameleon_ext.planning.strategies.redundancy import eager_cost
from tools.reproduce.cluster import Setup
from tools.reproduce.traces import Event, Trace


@dataclass(frozen=True)
class Policy:
    name: str
    label: str
    strategies: tuple[str, ...]
    eager: bool = False                # shadow copies kept all the time (their upkeep paid)
    relaunch: bool = False             # each change of plan relaunches the job
    # its strategies search layouts by the planner's objective (planner.candidates'
    # by_objective); a fixed policy takes each strategy's fastest, as a forced strategy does
    by_objective: bool = False


POLICIES = (
    Policy("auto", "auto (Chameleon)", STRATEGIES, by_objective=True),
    Policy("oobleck", "reparallelize only (Oobleck-like)", ("reparallelize",)),
    Policy("recycle", "reroute only (ReCycle-like)", ("reroute",)),
    Policy("bamboo", "takeover + eager state replication (Bamboo-like)", ("takeover",),
           eager=True),
    Policy("megatron", "checkpoint-restart (Megatron default)", ("restart",), relaunch=True),
)


@dataclass(frozen=True)
class Costs:
    checkpoint_min: float              # a checkpoint every this many minutes of training
    restart_min: float                 # a relaunch of the job (Megatron's restart)
    # A planned move's (an admission's) time where it was measured (the executed traces'),
    # else None: the model's, the rebuild and the state the GPUs lack.
    move_ms: float | None = None
    # The device a plan's iterations take their time on where it is not the one the job
    # decides with (the executed traces': the job decides with its own calibration, the
    # runs' pace is fitted per op, tools/reproduce/executed.py); None: the same.
    clock: Profile | None = None


@dataclass
class Outcome:
    policy: str
    trace: str
    span_h: float
    iterations: float
    recoveries: Counter = field(default_factory=Counter)  # strategy taken at a failure
    fallbacks: int = 0                 # failures the policy's own strategies could not absorb
    replans: int = 0                   # moves at rejoins (and hybrids' switches)
    transition_h: float = 0.0
    stalled_h: float = 0.0

    def samples_per_s(self, global_batch: int) -> float:
        return self.iterations * global_batch / (self.span_h * 3600)


def simulate(setup: Setup, policy: Policy, trace: Trace, costs: Costs,
             on_event: Callable[[], None] | None = None) -> Outcome:
    job = _Job(setup, policy, trace, costs)
    for event in trace.events:
        job.until(event.hour * 3.6e6)
        job.event(event)
        if on_event:
            on_event()
    job.until(trace.span_h * 3.6e6)
    return job.out


def every_policy(setup: Setup, trace: Trace, costs: Costs,
                 on_event: Callable[[], None] | None = None) -> list[Outcome]:
    """simulate() of every policy on `trace`, in POLICIES' order."""
    return [simulate(setup, p, trace, costs, on_event) for p in POLICIES]


def train_until(setup: Setup, policy: Policy, trace: Trace, costs: Costs,
                iterations: float) -> Outcome:
    """The job trained until it has `iterations`, however long that takes, as the executed
    traces measure it: its outcome over that time (span_h: how long it took, math.inf if it
    never does; its recoveries and moves until then). Events come at their hours wherever the
    job is by then, after the trace's span too; the span is only the planner's horizon."""
    job = _Job(setup, policy, trace, costs)
    done = None
    for event in trace.events:
        done = job.reached(event.hour * 3.6e6, iterations)
        if done is not None:
            break
        job.until(event.hour * 3.6e6)
        job.event(event)
    else:
        done = job.reached(math.inf, iterations)
    return dataclasses.replace(job.out, iterations=iterations,
                               span_h=math.inf if done is None else done / 3.6e6)


def failure_free_ms(setup: Setup, policy: Policy) -> float:
    """The policy's iteration time on the failure-free plan (eager: with the shadows' upkeep)."""
    upkeep = eager_cost(setup.plan, setup.profile).sync_ms if policy.eager else 0.0
    return setup.iteration_ms + upkeep


class _Job:
    def __init__(self, setup: Setup, policy: Policy, trace: Trace, costs: Costs) -> None:
        self.setup, self.policy, self.trace = setup, policy, trace
        self.profile: Profile = setup.profile
        self.world = setup.plan.world_size
        self.ff_ms = failure_free_ms(setup, policy)
        self.relaunch_ms = costs.restart_min * 6e4 if policy.relaunch else 0.0
        self.measured_move_ms = costs.move_ms
        self.clock = costs.clock
        self.save_every = max(1, round(costs.checkpoint_min * 6e4 / setup.iteration_ms))
        self.plan: ExecutionPlan | None = setup.plan
        self.gpus = list(range(self.world))  # the GPU of each rank of the plan
        self.up = set(self.gpus)
        self.iteration_ms = self._timed(setup.plan, self.ff_ms)
        self.t = self.resume = 0.0
        self.switch: tuple[float, Switch] | None = None
        self.failed_at: list[float] = []   # every loss so far, ms
        self.down_since: dict[int, float] = {}   # a GPU lost and not back yet -> its loss, ms
        # a GPU up and waiting -> the iterations done at the boundary that admits it
        self.admissions: dict[int, int] = {}
        self.out = Outcome(policy.name, trace.name, trace.span_h, 0.0)

    # ---- time ---------------------------------------------------------------------------------
    def advance(self, to: float) -> None:
        if self.plan is None:
            self.out.stalled_h += (to - self.t) / 3.6e6
        else:
            start = max(self.t, self.resume)
            self.out.iterations += max(0.0, to - start) / self.iteration_ms
            self.out.transition_h += max(0.0, min(to, self.resume) - self.t) / 3.6e6
        self.t = to

    def reached(self, to: float, iterations: float) -> float | None:
        """The moment, no later than `to`, at which the job has trained `iterations` (its own
        events before `to` taken as they come); None if it has not by then."""
        while True:
            due = self._next_own(to)
            at = to if due is None else due[0]
            if self.plan is not None:
                done = max(self.t, self.resume) + \
                    (iterations - self.out.iterations) * self.iteration_ms
                if done <= at:
                    return max(self.t, done)
            if due is None:
                return None
            self.advance(at)
            due[1]()

    def until(self, to: float) -> None:
        """Advance to `to`, taking the job's own events before it as they come."""
        while (due := self._next_own(to)) is not None:
            self.advance(due[0])
            due[1]()
        self.advance(to)

    def _next_own(self, to: float) -> tuple[float, Callable[[], None]] | None:
        """The job's next own event no later than `to`: a hybrid's switch at its checkpoint,
        or an admission at its boundary; None if none."""
        due = []
        if self.switch is not None and self.switch[0] <= to:
            due.append((self.switch[0], self._switch))
        for gpu, boundary in self.admissions.items():
            # stalled, at once: the job waits for GPUs, no iteration runs
            at = self.t if self.plan is None else max(self.t, self.resume) + \
                max(0.0, boundary - self.out.iterations) * self.iteration_ms
            if at <= to:
                due.append((at, lambda gpu=gpu, boundary=boundary: self._admit(gpu, boundary)))
        return min(due, key=lambda d: d[0], default=None)

    def _admit(self, gpu: int, boundary: int) -> None:
        if self.plan is not None:
            # the job stands at the boundary: its progress, summed in floats, may fall short of
            # it by a rounding, which a loss during the admission would count as begun
            self.out.iterations = max(self.out.iterations, float(boundary))
        self.rejoin(gpu)

    def _switch(self) -> None:
        _, sw = self.switch
        self.out.replans += 1
        self._adopt(sw.plan, self._gpus_of(self.plan, set(), sw.plan, []), sw.iteration_ms,
                    sw.transition_ms)

    def situation(self) -> Situation:
        """As the job tells the planner at a failure: the trace's MTBF, the time until a lost
        GPU is back (this failure's repair, or sooner an earlier loss's: planner.next_repair),
        the iterations left in the span, the current pace."""
        done = int(self.out.iterations)
        ms = self.iteration_ms if self.plan is not None else self.ff_ms
        left = (self.trace.span_h * 3.6e6 - self.t) / ms
        return Situation(iteration=done + 1, checkpoint_iteration=done // self.save_every *
                         self.save_every, remaining_iterations=max(1, int(left)),
                         mtbf_hours=self.trace.mtbf_h, failure_free_ms=ms,
                         save_interval=self.save_every, eager_redundancy=self.policy.eager,
                         repair_hours=next_repair(self.trace.repair_h * 3.6e6,
                                                  [at for at in self.down_since.values()
                                                   if at < self.t], self.t) / 3.6e6,
                         failure_record=self.failure_record())

    def failure_record(self) -> tuple[int, int]:
        """As the job keeps it (planning.JobClock): the trace's losses so far."""
        return failure_record(self.failed_at, self.trace.repair_h * 3.6e6, self.t)

    # ---- events -------------------------------------------------------------------------------
    def event(self, e: Event) -> None:
        {"fail": self.fail, "rejoin": self.rejoin, "up": self.asks}[e.kind](e.gpu)

    def asks(self, gpu: int) -> None:
        """The GPU's worker asks to join: a spare now, admitted at the end of the iteration
        after the one it asks in (_next_own; stalled, at once)."""
        self.up.add(gpu)
        self.admissions[gpu] = math.floor(self.out.iterations) + 2

    def fail(self, gpu: int) -> None:
        self.up.discard(gpu)
        self.admissions.pop(gpu, None)       # a joiner lost while it waited
        self.failed_at.append(self.t)
        self.down_since[gpu] = self.t
        if self.plan is None or gpu not in self.gpus:
            return
        if self.policy.relaunch:
            # The relaunch plans over every GPU up, those back since the last one included:
            # from the failure-free plan (its rank r is GPU r), the others lost.
            self.plan, self.gpus = self.setup.plan, list(range(self.world))
            lost = set(range(self.world)) - self.up
        else:
            lost = {self.gpus.index(gpu)}
        if not self.plan.survivors(lost):
            self.plan, self.gpus, self.switch = None, [], None
            return
        situation = self.situation()
        # No survivor holds some layer (a stage's last replica lost): only the checkpoint has
        # it, as decider.Decider rules; no strategy can carry the state over.
        forced = not state_survives(self.plan, lost, self.policy.eager)
        spares = self._spares()
        best, fell_back = self._choose(self.plan, lost, ("restart",) if forced
                                       else self.policy.strategies, situation, len(spares))
        self.out.fallbacks += fell_back or (forced and "restart" not in self.policy.strategies)
        if best is None:
            self.plan, self.gpus, self.switch = None, [g for g in self.gpus if g != gpu], None
            return
        self.out.recoveries[best.strategy] += 1
        # The lost work is progress to make again, not a wait a later event could cut short.
        self.out.iterations = float(situation.iteration - best.lost_iterations)
        self._adopt(best.plan, self._gpus_of(self.plan, lost, best.plan, spares),
                    best.iteration_ms, best.transition_ms - best.redo_ms + self.relaunch_ms)
        if best.switch is not None:
            k = best.switch.at_iteration - situation.iteration + 1
            self.switch = (self.resume + k * best.iteration_ms, best.switch)

    def rejoin(self, gpu: int) -> None:
        self.up.add(gpu)
        self.admissions.pop(gpu, None)
        self.down_since.pop(gpu, None)
        if gpu in self.gpus:
            return  # admitted already: it took a lost place while it waited (substitute)
        if self.policy.relaunch and self.plan is not None:
            return  # a running Megatron job cannot grow: the GPU waits for the next relaunch
        down = set(range(self.world)) - self.up
        if not down:
            gpus = sorted(self.up)
            self.out.replans += 1
            self._adopt(self.setup.plan, gpus, self.ff_ms, self._move_ms(self.setup.plan, gpus))
            return
        # A planned move loses no work: the candidates are weighed as planner.rejoin_choice
        # weighs a move now against staying, over the window until the next failure: the
        # move, the iterations at its pace, and the next failure's expected cost from its
        # plan (a plan whose every loss is fatal pays for the restart it would force).
        situation = self.situation()
        win = rejoin_window(situation, situation.failure_free_ms)
        steady = tuple(s for s in self.policy.strategies if s != "reroute+restart")
        ff = self.setup.plan  # its rank r is GPU r
        moves = []
        for c in candidates(ff, down, self.profile, situation, steady,
                            by_objective=self.policy.by_objective):
            if c.feasible:
                used = ff.survivors(down, c.plan.world_size)
                moves.append((self._move_ms(c.plan, used) + running_ms(
                    c.plan, c.iteration_ms, self.profile, situation, win), c, used))
        if not moves:
            return
        cost, best, used = min(moves, key=lambda m: m[0])
        # auto weighs the move against staying (the GPU a spare meanwhile); a fixed policy
        # admits at once, its strategy absorbing the places still empty (decider.Decider)
        if self.plan is not None and self.policy.by_objective and \
                cost >= running_ms(self.plan, self.iteration_ms, self.profile, situation, win):
            return
        self.out.replans += 1
        self._adopt(best.plan, used, best.iteration_ms, self._move_ms(best.plan, used))

    # ---- helpers ------------------------------------------------------------------------------
    def _choose(self, plan: ExecutionPlan, lost: set[int], strategies: tuple[str, ...],
                situation: Situation, spares: int = 0) -> tuple[Candidate | None, bool]:
        """The cheapest feasible candidate of `strategies` (`spares` GPUs waiting; a fixed
        policy's substitute first), else restart's; and whether it is the fallback."""
        objective = self.policy.by_objective
        if spares and "substitute" not in strategies and not self.policy.relaunch:
            # a forced strategy substitutes first where spares wait (decider.Decider)
            best = choose(candidates(plan, lost, self.profile, situation, ("substitute",),
                                     spares, objective))
            if best is not None:
                return best, False
        best = choose(candidates(plan, lost, self.profile, situation, strategies, spares,
                                 objective))
        if best is None and "restart" not in strategies:
            best = choose(candidates(plan, lost, self.profile, situation, ("restart",),
                                     by_objective=objective))
            return best, best is not None
        return best, False

    def _gpus_of(self, plan: ExecutionPlan, lost: set[int], new: ExecutionPlan,
                 spares: list[int]) -> list[int]:
        """The GPUs of `new`, a plan over the survivors of `plan` (run on self.gpus) without
        `lost`: its rank i on the i-th of plan.survivors(lost, its world), and a substitute's
        ranks past those on `spares`, in order."""
        kept = [self.gpus[r] for r in plan.survivors(lost, new.world_size)]
        return kept + list(spares[:new.world_size - len(kept)])

    def _spares(self) -> list[int]:
        """The GPUs of the failure-free plan's tensor-parallel groups that are all up and out
        of the plan, group by group."""
        used = set(self.gpus)
        return [g for group in self.setup.plan.tp_groups()
                if self.up.issuperset(group) and used.isdisjoint(group) for g in group]

    def _adopt(self, plan: ExecutionPlan, gpus: list[int], iteration_ms: float,
               transition_ms: float) -> None:
        """Run `plan` on `gpus`, decided at `iteration_ms` an iteration, after
        `transition_ms`."""
        self.plan, self.gpus = plan, gpus
        self.iteration_ms = self._timed(plan, iteration_ms)
        self.resume = self.t + transition_ms
        self.switch = None

    def _timed(self, plan: ExecutionPlan, decided_ms: float) -> float:
        """The iteration `plan` takes, decided at `decided_ms`: on the clock's device, as much
        more or less as the clock predicts it."""
        if self.clock is None:
            return decided_ms
        return decided_ms + predict_plan(plan, self.clock).iteration_ms - \
            predict_plan(plan, self.profile).iteration_ms

    def _move_ms(self, new: ExecutionPlan, gpus: list[int]) -> float:
        """A planned move to `new` on `gpus`: the rebuild and the state new to each GPU from its
        peers, or with a relaunch the job's restart and the checkpoint read."""
        shape = self.profile.shape
        if self.policy.relaunch:
            largest = max(stage_params(new, r, shape) for r in new.ranks)
            return self.relaunch_ms + switch_ms(self.profile, loaded_bytes=largest *
                                                self.profile.bytes_per_param)
        if self.measured_move_ms is not None:
            return self.measured_move_ms
        # Stalled (no plan), nobody holds anything: `was` is empty and `old` never read.
        rank_of = {g: r for r, g in enumerate(self.gpus)} if self.plan is not None else {}
        was = {r: rank_of[g] for r, g in enumerate(gpus) if g in rank_of}
        moved = moved_state_bytes(self.plan or new, new, was, shape)
        return switch_ms(self.profile) + self.profile.p2p_ms_per_mib * moved / MIB
