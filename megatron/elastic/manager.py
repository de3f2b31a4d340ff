"""The elastic side of a training job under chameleon-launch (`--chameleon`): torchft's Manager
for this stack.

The training loop talks to it in two places. In a step, through the runtime's `StepHooks`
(given when the runtime is built): `before_op` (failure injection, progress, a peer's failure
seen on the store) and `commit` (the step's vote: every rank applies the optimizer step of an
iteration or none does). Between steps: `notice` (an operation failed: the `Failure` to
recover from) and `reconfigure`, the one reconfiguration transaction that a failure (in a
step, a checkpoint save, an evaluation, the shutdown's reports), a hybrid's planned switch and
an admission of rejoining ranks all go through:

    capture the state (the caller's) -> leave the world -> agree on the store on who is alive
    (and that everyone applied the same steps) -> the leader chooses the plan and publishes it
    -> build the new world (its rendezvous gives up as soon as a participant is lost) -> move
    the state (the caller's `enter`: runtime, state transfer or checkpoint, first collective)

A failure at any point of it abandons that generation: everyone agrees again one generation up,
with whoever is left, as many times as needed. Every wait is bounded
(megatron.elastic.config's `Timeouts`). The caller's state is captured once, before the first
attempt, and entered afresh by every attempt.

A rank the chosen plan leaves out (a restart onto fewer, a lost rank's tensor-parallel
siblings, a joiner with no place) joins a retry if there is one; once the new world is
committed it is a *spare* (`Spare` is raised to the caller, which drops its state): alive,
heartbeating, out of the world, known to every member (`spares`: the agreement's alive ranks
less the plan's members). It waits in `stand_by` and takes part, without state like a joiner,
in the next transition the members open (they list their spares among its candidates), where
the leader may give it a place (a `substitute` for a lost rank, a place of an admission); it
leaves (NotNeeded, exit 0) only once the job trained its last iteration.

The failure path, file by file, in the one direction it runs:

    megatron/elastic/schedules.py      an op raises (or `before_op` sees a peer's failure)
    megatron/training/trainer.py       `notice` -> Failure; drain the step (`drained`); capture
                                       the state; `reconfigure(trigger, plan, enter)`
    megatron/elastic/manager.py        `_transact`: leave the world, agree, decide, rebuild
    chameleon_ext/control/             the agreement (agreement.py), the published plan and the
                                       barrier (generations.py), the new world's rendezvous
                                       (world.py's `rebuild_world`)
    chameleon_ext/planning/decider.py  the leader's Verdict (built here from the `Planning`
                                       and the node lookup this manager is given)
    megatron/training/trainer.py       `enter` (the one call back, typed `Enter`): the runtime
                                       for the plan (megatron/elastic/runtime.py's `build`,
                                       with this manager's `step_hooks`), state moved, the
                                       first collective -> `Entered`

The manager owns its state: the trainer tells it what happened (`applied_step`, `drained`,
`trained`) and never writes its fields. A job without --chameleon runs `DisabledManager`, the
same shape doing the plain thing: no hooks, no votes, a failure re-raised.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, ClassVar

import torch.distributed as dist

from chameleon_ext.control.agreement import (Agreement, AgreementTimeout, Boundary,
                                             DivergedSteps)
from chameleon_ext.control.faults import Injector
from chameleon_ext.control.generations import PublishTimeout
from chameleon_ext.control.keys import JOIN_AT_ENV, JOIN_ENV, STORE_ENV
from chameleon_ext.control.membership import Membership
from chameleon_ext.control.poll import poll
from chameleon_ext.control.store import (MembershipError, connect_store, generation_store,
                                         nodes_from_store)
from chameleon_ext.control.world import PeerLost, destroy_world, rebuild_world
from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.decider import Decider, Planning
from chameleon_ext.planning.decision import Decision, Switch, Verdict
from chameleon_ext.schedule.ir import Op, OpKind
from megatron.elastic import parallel_state
from megatron.elastic.config import ElasticConfig
from megatron.elastic.schedules import StepHooks

PHASE_OF = {OpKind.FWD: "forward", OpKind.BWD: "backward", OpKind.BWD_INPUT: "backward",
            OpKind.BWD_WEIGHT: "backward", OpKind.REDUCE_GRADS: "grad-reduce",
            OpKind.OPT_STEP: "optimizer"}
# Ops during which a rank waits on its peers: a hang's victims, never its cause.
WAITING_OPS = (OpKind.RECV_FWD, OpKind.RECV_BWD, OpKind.REDUCE_GRADS)


class Unrecoverable(RuntimeError):
    """No plan over the survivors can continue in-process; the message says why."""


class PeerFailed(RuntimeError):
    """A peer's failure is on the store: stop computing an iteration that cannot complete."""


class NotNeeded(RuntimeError):
    """This rank leaves the job: it trained its last iteration as a spare, or a planned leave."""


class Spare(Exception):
    """The committed plan has no place for this rank: it drops its state and stands by (not a
    RuntimeError, so that nothing on the way up takes it for a failed operation)."""


@dataclass
class Failure:
    """A failure noticed during `iteration` (1-based; the one interrupted or, outside a step,
    the next one) at `noticed` (time.time())."""

    iteration: int
    noticed: float
    error: str
    during: str = "step"     # step, checkpoint, eval, shutdown, startup


@dataclass
class PlannedSwitch:
    """A hybrid's second step, after the checkpoint of `switch.at_iteration`."""

    switch: Switch


@dataclass
class Admission:
    """The joiners of the due admission, after `iteration`."""

    iteration: int


Trigger = Failure | PlannedSwitch | Admission


@dataclass
class Handover:
    """What a rank entering without state (a joiner, a spare given a place) takes from the
    stayers, as of their last applied step: the LR schedule's state, the samples count, and
    where this rank stands at the iteration's boundary (the agreement publishes the least
    advanced rank's). JSON, in the published decision."""

    scheduler: dict
    consumed: int
    boundary: Boundary


@dataclass
class Entered:
    """What the caller's `enter` made of a decision: the last iteration whose step the new
    world's state holds, and the bytes of state that moved to reach it."""

    applied: int
    moved_bytes: int


# enter(decision, rank, agreed): the caller builds its part of the decision's world (`rank`
# in it; `agreed`: the last iteration every survivor applied, None for a joiner's world),
# moves the state into it and ends with a collective over it. Called once per attempt; may
# raise RuntimeError (a peer lost), after which it is called again in a later generation.
Enter = Callable[[Decision, int, int | None], Entered]


@dataclass
class Transition:
    """A committed reconfiguration."""

    decision: Decision
    rank: int
    entered: Entered
    failed: list[int]                 # launch ranks lost since the last committed world
    causes: dict[int, str]
    detect_ms: float | None           # death -> first noticed (by a survivor or the agent)
    first_notice: float               # time.time() it was first noticed, or the transition began
    old_generation: int
    attempts: int                     # generations tried (1 when nothing failed meanwhile)
    spares: list[int]                 # launch ranks alive out of the new world

    @property
    def plan(self) -> ExecutionPlan:
        return self.decision.plan


@dataclass
class ElasticManager:
    """The elastic side of one launch rank. It owns its state (membership, generation, the
    applied step, the decider); the trainer tells it what happened and never writes it."""

    enabled: ClassVar[bool] = True
    config: ElasticConfig               # the job's elastic part: the strategy, every timeout
    store: dist.Store                   # the job's store (connect_store)
    injector: Injector
    planning: Planning                  # what the leader predicts with
    target: ExecutionPlan               # the failure-free plan: where a rejoin goes back to
    backend: str                        # --distributed-backend of every world it builds
    placement: str = "megatron"         # --chameleon-placement
    # the distributed optimizer's instances; 0: the optimizer's state is not sharded
    sharded: int = 0

    def __post_init__(self) -> None:
        self.members = Membership.from_env(self.store, self.config.timeouts.heartbeat_s)
        self.launch_rank = self.members.rank
        # A restarted worker (chameleon-launch --max-restarts) joins a running job: its world
        # is known once it is admitted.
        self.joining = os.environ.get(JOIN_ENV) == "1"
        self.alive = [] if self.joining else list(range(self.members.world_size))
        self.generation = 0
        self.applied = 0                # the last iteration whose step this rank applied
        self.admissions = 0             # admissions of joiners so far (membership key layout)
        self.admitted: set[int] = set()
        self.spares: list[int] = []     # launch ranks alive out of the committed world
        self._spares_lost: set[int] = set()  # those of them reported lost since (lost_spares)
        self._timing: tuple | None = None   # the leader's last rejoin timing it logged
        self.peer_failed = threading.Event()
        self.placeholders: list = []    # a drain's sends, kept until their group is gone
        self._alive_lock = threading.Lock()  # no stale failure may flag the next generation
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.decider = Decider(self.config.strategy, self.config.eager, planning=self.planning,
                               target=self.target, placement=self.placement, nodes=self._nodes,
                               sharded=self.sharded,
                               buddy=self.config.shard_redundancy == "buddy")

    def _nodes(self, ranks: list[int]) -> dict[int, int]:
        # Every launch rank has its launcher's record before it starts: 5 s is ample.
        return nodes_from_store(self.store, ranks, timeout_s=5.0)

    @classmethod
    def available(cls) -> bool:
        return bool(os.environ.get(STORE_ENV))

    def initialize_world(self, timeout_s: float) -> int:
        """Generation 0's world, on the job's store like every later one: its rendezvous gives
        up as soon as a rank is lost (raises PeerLost) instead of after `timeout_s`. Returns
        this rank's rank in it."""
        return rebuild_world(
            self.store, Agreement(0, list(range(self.members.world_size)), [], 0),
            self.launch_rank, self.backend, timeout_s, members=self.members)

    def bound_world_ops(self) -> None:
        """From now on the world's own operations (loss sum, state transfer, commit) wait no
        longer than any group's: a silent peer is a failure, not a slow start."""
        parallel_state.bound_operations(dist.group.WORLD,
                                        timedelta(seconds=self.config.timeouts.comm_s))

    def step_hooks(self) -> StepHooks:
        """The executor's calls into this manager, for every runtime it builds."""
        return StepHooks(before_op=self.before_op, commit=self.commit, tick=self._tick_in_step)

    def start(self) -> None:
        """Heartbeats and progress on the store, and the failure watcher."""
        self.members.heartbeat.start()
        self.injector.announce = self.members.failure_log.announce_death
        self.tick(0, "start")
        self._watcher = threading.Thread(target=self._watch, name="chameleon-failure-watch",
                                         daemon=True)
        self._watcher.start()
        # Whatever the way out (an error's sys.exit included), the threads stop before the
        # interpreter finalizes: a daemon thread inside a store call then would be unwound
        # through C++ frames, and the process would end in std::terminate (SIGABRT) or hang.
        atexit.register(self.stop)

    def _watch(self, interval_s: float = 0.02) -> None:
        """A rank busy computing would notice a peer's death only at its next communication
        with the dead one's group, possibly after the rest of the doomed iteration; the watcher
        (its own store connection) lets it stop at the next op instead."""
        members = Membership.from_env(connect_store(), self.config.timeouts.heartbeat_s)
        while not self._stopping.wait(interval_s):
            if self.applied is None:    # a spare or a joiner: no step of its own to stop
                continue
            try:
                failed = members.failure_log.failures()
            except (RuntimeError, OSError):  # the store is going away with the job
                return
            with self._alive_lock:
                if any(r in failed for r in self.alive if r != self.launch_rank):
                    self.peer_failed.set()

    # ---- in a step ---------------------------------------------------------------------------
    def progress_allowance(self, iteration_ms: list[float]) -> float:
        """How long a step's phase may go without progress while peers wait."""
        timeouts = self.config.timeouts
        if timeouts.progress_s is not None:
            return timeouts.progress_s
        if len(iteration_ms) < 3:   # first iterations warm up: nothing typical measured yet
            return max(timeouts.heartbeat_s, 60.0)
        recent = sorted(iteration_ms[-10:])
        return max(timeouts.heartbeat_s, 10.0 * recent[len(recent) // 2] / 1e3)

    def tick(self, iteration: int, phase: str, waiting: bool = False,
             allow_s: float | None = None) -> None:
        self.members.heartbeat.tick(iteration, phase, waiting, allow_s)

    def _tick_in_step(self, iteration: int, phase: str, waiting: bool) -> None:
        """Progress inside an op of `iteration` (0-based, the executor's)."""
        self.members.heartbeat.tick(iteration + 1, phase, waiting)

    def before_op(self, op: Op, iteration: int) -> None:
        self.members.heartbeat.tick(iteration + 1, op.kind.value, op.kind in WAITING_OPS)
        phase = PHASE_OF.get(op.kind)
        if phase:
            self.injector.maybe_fire(iteration + 1, phase)
        if self.peer_failed.is_set():
            raise PeerFailed(f"a peer's failure is on the store (before {op})")

    def commit(self, iteration: int) -> bool:
        """The vote on the step of `iteration` (0-based, the executor's): True when every
        rank of this world applies it."""
        # A voter's loss aborts the vote at once (its record, or a peer's notice); the bound
        # only ends a silent stall, which its agent turns into a record well before it.
        ok = self.members.step_vote.commit(self.generation, iteration + 1, self.alive,
                                           self.config.timeouts.agree_s)
        self.injector.maybe_fire(iteration + 1, "commit")
        if ok and self.launch_rank == self.alive[0] and iteration > 0:
            self.members.step_vote.forget_commit(self.generation, iteration)
        return ok

    def lost_ranks(self, wait_s: float = 1.0) -> set[int]:
        """Current ranks reported failed on the store, waiting up to `wait_s` for a first
        report (the agent writes one within milliseconds of an exit; a hang has none yet)."""
        def look() -> set[int] | None:
            failed = self.members.failure_log.failures()
            return {i for i, r in enumerate(self.alive) if r in failed} or None

        return poll(look, wait_s, 0.005) or set()

    def notice(self, error: RuntimeError, iteration: int, during: str = "step") -> Failure:
        """Called the moment this rank sees its world break (`error`, during `iteration`,
        1-based): the failure to recover from."""
        now = time.time()
        self.members.agreements.notice(self.generation + 1, now)
        return Failure(iteration, now, _first_line(error), during)

    def drained(self, sends: list) -> None:
        """The placeholder sends of an interrupted step's drain: kept until their groups are
        gone (a dropped gloo send is withdrawn before it is delivered)."""
        self.placeholders = sends

    def applied_step(self, iteration: int) -> None:
        """This rank's state holds the step of `iteration` (a committed step, a checkpoint)."""
        self.applied = iteration

    def trained(self, iteration: int) -> None:
        """The job trained its last iteration (once per job: by its lead): a late joiner is
        sent away."""
        self.members.admissions.mark_trained(iteration)

    # ---- the reconfiguration transaction -----------------------------------------------------
    def reconfigure(self, trigger: Trigger, plan: ExecutionPlan, enter: Enter,
                    handover: Handover) -> Transition:
        """Move the job from `plan` (the committed world's) to the plan the leader chooses for
        `trigger`, retrying one generation up whenever a rank is lost meanwhile; `enter` builds
        this rank's part of each attempt's world (see `Enter`); `handover` is what the ranks
        that enter without state take. Raises Unrecoverable, Spare (the committed plan has no
        place for this rank) or MembershipError."""
        if isinstance(trigger, Failure):
            first_notice = self.members.agreements.notice(self.generation + 1, trigger.noticed)
            iteration = trigger.iteration
        else:
            first_notice = time.time()
            iteration = self.applied
        # The spares wait for this agreement: they are candidates like the members.
        candidates = sorted(set(self.alive) | set(self.spares))
        action = "now"
        if isinstance(trigger, Admission):
            record = self.members.admissions.admission(self.admissions)
            action = record["action"]
            candidates = sorted(set(candidates) | set(record["joiners"]))
            if self.launch_rank == min(self.alive):
                for r in record["joiners"]:
                    self.members.admissions.admit(r, self.generation + 1, candidates,
                                                  self.admissions)
            self.admissions += 1
            self.admitted.update(record["joiners"])


        def decide(ag: Agreement) -> Verdict:
            lost = {i for i, r in enumerate(self.alive) if r not in ag.alive}
            spares = [r for r in ag.alive if r not in self.alive]
            if isinstance(trigger, Admission):
                verdict = self.decider.for_admission(plan, self.alive, ag.alive, iteration,
                                                     action)
            elif isinstance(trigger, PlannedSwitch):
                verdict = self.decider.for_switch(trigger.switch, plan, self.alive, lost,
                                                  iteration, spares)
            else:
                verdict = self.decider.after_failure(plan, self.alive, lost, iteration, spares)
            if verdict.decision is not None:
                d = verdict.decision
                d.scheduler, d.consumed_samples = handover.scheduler, handover.consumed
                # never None: this rank arrived with its own
                d.pending, d.finishing = list(ag.boundary.pending), ag.boundary.finishing
                d.admissions = self.admissions
            return verdict

        return self._transact(self.generation + 1, candidates, decide, enter, iteration,
                              first_notice, handover.boundary)

    def join(self, enter: Enter, timeout_s: float) -> Transition:
        """A restarted or new rank: ask to join (not before CHAMELEON_JOIN_AT, when set), wait
        for the admission, enter the world."""
        self._wait_for_repair()
        self.members.admissions.request_join()
        admit = self.members.admissions.admitted_to(timeout_s)
        if admit is None and self.members.admissions.trained():
            raise NotNeeded("the job trained its last iteration before this rank was admitted")
        if admit is None:
            raise Unrecoverable(f"launch rank {self.launch_rank} asked to join and was not "
                                f"admitted within {timeout_s:g} s")
        self.admissions = admit["admission"] + 1
        self.alive = [r for r in admit["candidates"] if r != self.launch_rank]
        self.admitted = set(admit["candidates"])
        self.applied = None  # nothing applied here yet: the stayers' steps are the truth

        def decide(ag: Agreement) -> Verdict:
            # A joiner leads only when every rank that stayed is gone: nobody holds the state.
            return Verdict(unrecoverable="every rank holding the model's state was lost while "
                                         "ranks were being admitted")

        return self._transact(admit["generation"], admit["candidates"], decide, enter, 0,
                              time.time())

    def _wait_for_repair(self) -> None:
        """A worker started ahead of its repair time (chameleon-launch --start-ahead) waits
        for it out of the job, looking 5 times a second whether the job ended meanwhile
        (NotNeeded: it exits 0 at once). The wait is the launcher's own bound: the rest of
        --restart-delay."""
        wait_s = float(os.environ.get(JOIN_AT_ENV) or 0.0) - time.time()
        if wait_s <= 0:
            return
        # No allowance (0): no rank waits on one out of the job, so its stall is nobody's hang;
        # a bound here would also hold through the join that follows (an allowance lasts until
        # a tick changes it), which waits for the admission as long as the leader decides.
        self.tick(0, "waiting for its repair time", allow_s=0.0)
        ended = self.members.admissions.trained
        if poll(lambda: True if ended() else None, wait_s, 0.2) is not None:
            raise NotNeeded("the job trained its last iteration before this rank's repair time")

    def stand_by(self, enter: Enter) -> Transition:
        """A spare (it dropped its state): wait, heartbeating, for the members to open the next
        generation (a failure, a switch, an admission), then take part in it without state, like
        a joiner (`enter` builds a world from the stayers' state alone). Returns the transition
        that gave this rank a place; raises Spare when it gave none, NotNeeded once the job
        trained its last iteration, Unrecoverable or MembershipError."""
        generation = self.generation + 1
        members = list(self.alive)
        self.applied = None     # nothing held: the stayers' steps are the truth
        phase = f"spare after generation {self.generation}"

        def look() -> str | None:
            opened = self.members.agreements.opened(generation)
            # After `opened`: the end is marked before any transition of the final actions,
            # which a spare never enters.
            if self.members.admissions.trained():
                return "trained"
            if opened:
                return "opened"
            # Every member gone with nobody to open the generation: the spares open it, and
            # the agreement's leader says that nobody holds the state.
            return "opened" if len(self.members.failure_log.gone(members)) == len(members) \
                else None

        # The wait lasts as long as the job, which always ends it: the lead marks the end,
        # a failure or an admission opens a generation, or the agents report every member
        # gone. It goes in rounds of one heartbeat timeout, each a bump of this rank's progress
        # (its main thread lives); the phase waits on nobody and has no allowance (0), so it
        # is never a hang, nor a hang's victim that would make a slow member look hung.
        found = None
        while found is None:
            self.tick(0, phase, waiting=False, allow_s=0.0)
            found = poll(look, self.config.timeouts.heartbeat_s, 0.05, grow=1.5,
                         max_interval_s=0.5)
        if found == "trained":
            raise NotNeeded(f"the job trained its last iteration while launch rank "
                            f"{self.launch_rank} stood by as a spare")

        def decide(ag: Agreement) -> Verdict:
            # A spare leads only when no rank holding state arrived: only a checkpoint has it.
            return self.decider.onto_spares(sorted(ag.alive), ag.generation)

        return self._transact(generation, sorted(set(members) | set(self.spares)), decide,
                              enter, 0, time.time())

    def _transact(self, generation: int, candidates: list[int],
                  decide: Callable[[Agreement], Verdict], enter: Enter,
                  iteration: int, first_notice: float,
                  boundary: Boundary | None = None) -> Transition:
        causes: dict[int, str] = {}
        committed_alive, old_generation = list(self.alive), self.generation
        attempts = fruitless = 0
        while True:
            attempts += 1
            self._leave_world()
            self.tick(iteration, f"agreement of generation {generation}", waiting=True)
            ag = self.members.agreements.agree(generation, candidates,
                                               self.config.timeouts.agree_s,
                                               iteration=self.applied, boundary=boundary)
            causes.update(ag.causes)
            decision = self._verdict(ag, decide)
            if decision is None:            # the leader died before publishing: again, up one
                generation, candidates = self.members.generations.abandon(ag.generation), \
                    [r for r in ag.alive if r != ag.leader]
                continue
            participants = decision.members or ag.alive[:decision.plan.world_size]
            if self.launch_rank not in participants:
                # Out of the plan: a spare once the new world holds the state, or in a retry.
                self.tick(iteration, f"out of generation {ag.generation}", waiting=True)
                retry = self.members.generations.outcome(ag.generation,
                                                         self.config.timeouts.agree_s)
                if retry is None:
                    self._committed(ag, participants)
                    raise Spare(f"the {decision.strategy} plan uses {len(participants)} of the "
                                f"{len(ag.alive)} ranks alive; launch rank {self.launch_rank} "
                                "is a spare")
                generation, candidates = retry, ag.alive
                continue
            try:
                entered, rank = self._enter(ag, participants, decision, enter, iteration)
            except Exception as e:
                # Whatever ends this attempt here, the others must not wait for this rank.
                generation = self.members.generations.abandon(ag.generation)
                if not isinstance(e, (RuntimeError, MembershipError)) or \
                        isinstance(e, (Unrecoverable, DivergedSteps,
                                       AgreementTimeout)):
                    raise
                self._leave_world()
                failed = self._failed_meanwhile(participants)
                if self.launch_rank == ag.leader:   # once per job, not once per survivor
                    print(f"[chameleon] generation {ag.generation} abandoned "
                          f"({_first_line(e)}); lost meanwhile: {failed or 'none seen yet'}; "
                          f"agreeing again as generation {generation}", flush=True)
                # An attempt that failed with nobody lost (a false alarm of a timeout on a
                # loaded host) is tried again; the same failure three times over is a fault of
                # the plan, not of a rank.
                fruitless = 0 if failed else fruitless + 1
                if fruitless >= 3:
                    raise Unrecoverable(f"the world of the {decision.strategy} plan could not "
                                        f"be built {fruitless} times with no rank lost: "
                                        f"{_first_line(e)}") from None
                candidates = [r for r in ag.alive if r not in failed]
                continue
            break
        if rank == 0:
            self.members.generations.committed(ag.generation)
        newcomer = self.applied is None
        self._committed(ag, participants)
        if newcomer:    # the stayers' count, and whom they admitted, from the admissions made
            self.admissions = decision.admissions
            self.admitted = {r for n in range(self.admissions)
                             for r in self.members.admissions.admission(n)["joiners"]}
        self.applied = entered.applied
        failed = [r for r in committed_alive if r not in ag.alive]
        records = self.members.failure_log.failures()
        # From the death to its first sign anywhere: a survivor's failed op, or the record.
        death_time = self.members.failure_log.death_time
        detect = [min(first_notice, records[r].time) - death_time(r, records[r])
                  for r in failed if r in records]
        return Transition(decision, rank, entered, failed,
                          {r: causes.get(r, "failed") for r in failed},
                          1e3 * max(detect) if detect else None, first_notice, old_generation,
                          attempts, list(self.spares))

    def _committed(self, ag: Agreement, participants: list[int]) -> None:
        """Generation `ag.generation`'s world, of `participants`, holds the state: every rank of
        the agreement, member or spare, knows the same world and the same spares."""
        with self._alive_lock:
            self.generation, self.alive = ag.generation, participants
            self.peer_failed.clear()
        self.spares = [r for r in ag.alive if r not in participants]

    def _verdict(self, ag: Agreement,
                 decide: Callable[[Agreement], Verdict]) -> Decision | None:
        """The leader decides and publishes; everyone returns the published decision (None
        when the leader was lost before publishing)."""
        if ag.leader == self.launch_rank:
            self.members.generations.publish(ag.generation, "plan", decide(ag).to_json())
        try:
            text = self.members.generations.read(ag.generation, "plan",
                                                 self.config.timeouts.agree_s,
                                                 publisher=ag.leader)
        except PublishTimeout:
            return None
        verdict = Verdict.from_json(text)
        if verdict.decision is None:
            raise Unrecoverable(verdict.unrecoverable)
        return verdict.decision

    def _enter(self, ag: Agreement, participants: list[int], decision: Decision,
               enter: Enter, iteration: int) -> tuple[Entered, int]:
        """Build the world of `participants` and enter `decision` in it (one attempt)."""
        self.injector.maybe_fire(iteration, "recovery")
        self.tick(iteration, f"barrier of generation {ag.generation}", waiting=True)
        gone = self.members.generations.ready(ag.generation, participants,
                                              self.config.timeouts.agree_s)
        if gone:
            raise PeerLost(f"rank(s) {gone} lost before generation "
                                      f"{ag.generation}'s world was built")
        world = Agreement(ag.generation, participants, ag.failed, ag.leader,
                                     ag.causes, ag.iteration)
        self.tick(iteration, f"rendezvous of generation {ag.generation}", waiting=True)
        rank = rebuild_world(self.store, world, self.launch_rank, self.backend,
                             self.config.timeouts.rendezvous_s, members=self.members)
        self.bound_world_ops()   # its rendezvous above had its own bound
        self.injector.maybe_fire(iteration, "rebuild")
        decision.plan.generation = ag.generation    # one generation count: the membership's
        self.tick(iteration, f"entering generation {ag.generation}", waiting=True)
        return enter(decision, rank, ag.iteration), rank

    def _failed_meanwhile(self, ranks: list[int]) -> list[int]:
        """The ranks among `ranks` reported lost, waiting briefly for a first report (the
        agent writes one within milliseconds of a death; an abandoned attempt without one
        is tried again with the same ranks)."""
        return poll(lambda: self.members.failure_log.gone(ranks) or None, 1.0, 0.01) or []

    def _leave_world(self) -> None:
        parallel_state.destroy()
        self.placeholders = []
        destroy_world()

    # ---- rejoin ------------------------------------------------------------------------------
    def admission_due(self, iteration: int, plan: ExecutionPlan) -> bool:
        """At the end of `iteration` (every rank, the same answer): whether the ranks that asked
        to join are admitted now. The leader schedules an admission when the decider says
        (`Decider.admission_time`: the end of the next iteration at the earliest: every rank
        reaches that boundary only after that iteration's commit, which needs the leader's
        vote, cast after it wrote the record; or a later checkpoint's), into the plan or as
        spares."""
        if self.launch_rank == min(self.alive):
            at = self.members.admissions.schedule_admission(
                self.admissions, iteration, self.alive, self.admitted,
                self.target.tensor_parallel,
                # the spares take places beside the joiners (Decider.for_admission)
                lambda joiners: self.decider.admission_time(
                    plan, self.alive, sorted(set(self.spares) | set(joiners)), iteration))
            if at is not None and at.costs and (at.action, at.after) != self._timing:
                self._timing = (at.action, at.after)   # one line per change of mind
                costs = ", ".join(f"{k} {v / 1e3:.1f} s" for k, v in sorted(at.costs.items()))
                print(f"[chameleon] rejoin after iteration {iteration}: {at.action}"
                      + (f" (at the end of iteration {at.after})" if at.after else "")
                      + f"; predicted over the window: {costs}", flush=True)
        return self.members.admissions.admission_due(self.admissions, iteration)

    def lost_spares(self) -> tuple[list[int], int]:
        """The spares reported failed since the last call (a clean exit, at the job's end or a
        planned leave, is not a loss), and how many are left. Nothing else changes: the next
        transition's agreement leaves them out, as it does any rank lost before it (a spare
        holds no state, so its loss interrupts nobody)."""
        if not self.spares:
            return [], 0
        records = self.members.failure_log.failures()
        failed = [r for r in self.spares if r in records]
        new = [r for r in failed if r not in self._spares_lost]
        self._spares_lost.update(new)
        return new, len(self.spares) - len(failed)

    def stop(self) -> None:
        """Stop the watcher and the heartbeats (idempotent)."""
        self._stopping.set()
        if self._watcher is not None:
            # bounded by one poll of the store (its timeout, if the store is gone)
            self._watcher.join(timeout=5)
            self._watcher = None
        self.members.heartbeat.stop()

    def leave(self) -> None:
        """This rank is done with the job (finished, or not needed): its groups go, while the
        interpreter is whole (gloo's threads joined at its teardown end in std::terminate)."""
        try:
            self._leave_world()
        finally:
            self.stop()


@dataclass
class DisabledManager:
    """The manager of a job without --chameleon (torchtitan's `FTManager(None)`): the same calls
    as ElasticManager's, each doing what a plain Megatron job does. Nothing runs beside the
    loop, every step is applied, and a failure ends the job."""

    enabled: ClassVar[bool] = False
    joining: ClassVar[bool] = False
    backend: str = "gloo"

    def initialize_world(self, timeout_s: float) -> int:
        """The world of $RANK and $WORLD_SIZE; its operations wait up to `timeout_s`."""
        rank = int(os.environ.get("RANK", "0"))
        # Under chameleon-launch the world meets on the job's store (env:// knows only a
        # TCPStore; the store may be an etcd cluster).
        store = None
        if os.environ.get(STORE_ENV):
            store = generation_store(connect_store(), 0)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(self.backend, rank=rank,
                                world_size=int(os.environ.get("WORLD_SIZE", "1")), store=store,
                                timeout=timedelta(seconds=timeout_s))
        return rank

    def bound_world_ops(self) -> None:
        """The world's operations keep --distributed-timeout-minutes, as in Megatron."""

    def step_hooks(self) -> StepHooks:
        return StepHooks()

    def start(self) -> None:
        """No heartbeats, no watcher: nobody recovers this job."""

    def progress_allowance(self, iteration_ms: list[float]) -> float:
        return math.inf

    def tick(self, iteration: int, phase: str, waiting: bool = False,
             allow_s: float | None = None) -> None:
        """Nobody watches a plain job's progress."""

    def notice(self, error: RuntimeError, iteration: int, during: str = "step") -> Failure:
        raise error

    def applied_step(self, iteration: int) -> None:
        """Nothing to agree on later."""

    def trained(self, iteration: int) -> None:
        """No joiner to send away."""

    def admission_due(self, iteration: int, plan: ExecutionPlan) -> bool:
        return False

    def lost_spares(self) -> tuple[list[int], int]:
        return [], 0

    def reconfigure(self, trigger: Trigger, plan: ExecutionPlan, enter: Enter) -> Transition:
        raise Unrecoverable("a job without --chameleon does not reconfigure")

    def leave(self) -> None:
        """The job is done: every rank meets once more and the world goes, while the
        interpreter is whole (gloo's threads joined at its teardown end in std::terminate)."""
        dist.barrier()
        destroy_world()


def _first_line(e: BaseException) -> str:
    text = str(e).splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"
