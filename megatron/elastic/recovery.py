"""In-process recovery of a worker after a peer is lost (`--chameleon`, under chameleon-launch).

The recipe (chameleon_ext.membership): drop the broken groups first (so peers still blocked in a
collective with us fail at once), agree with the other survivors on the store, let the leader
choose the new plan and publish it, re-create the world on the next generation's PrefixStore, and
rebuild the runtime around the state this rank already holds. The interrupted iteration then runs
again from its start: its partial gradients are discarded with the old runtime, and no survivor
has stepped its optimizer (the world loss sum before the step is the commit point).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from chameleon_ext import membership, planner
from chameleon_ext.faults import Injector
from chameleon_ext.perf_model import Profile
from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.planner import Situation
from chameleon_ext.schedule_ir import Op, OpKind
from chameleon_ext.strategies.rejoin import overlay
from chameleon_ext.strategies.reroute import reroute
from chameleon_ext.strategies.restart import restart_plan
from chameleon_ext.strategies.reparallelize import reparallelize
from chameleon_ext.strategies.takeover import takeover
from megatron.elastic import parallel_state

PHASE_OF = {OpKind.FWD: "forward", OpKind.BWD: "backward", OpKind.BWD_INPUT: "backward",
            OpKind.BWD_WEIGHT: "backward", OpKind.REDUCE_GRADS: "grad-reduce",
            OpKind.OPT_STEP: "optimizer"}


class Unrecoverable(RuntimeError):
    """No plan over the survivors can continue in-process; the message says why."""


class PeerFailed(RuntimeError):
    """A peer's failure is on the store: stop computing an iteration that cannot complete."""


class NotNeeded(RuntimeError):
    """The new plan has no place for this rank (a restart plan smaller than the survivors)."""


@dataclass
class Outcome:
    plan: ExecutionPlan
    rank: int
    strategy: str                   # "restart" (from a checkpoint) or one carrying the state over
    failed: list[int]               # launch ranks lost in this event
    causes: dict[int, str]
    detect_ms: float | None         # death -> first noticed (by a survivor or the agent)
    first_notice: float             # time.time() the first survivor noticed: reconfiguration
                                    # of the job runs from there until its new runtime is built
    old_generation: int
    decision: dict                  # the leader's published choice (see Recovery._choose)


@dataclass
class Planning:
    """What the leader of a recovery predicts with: the live profile (`profile(plan,
    launch_ranks)`: calibrated under `plan`, or None) and the job's situation at the
    interrupted iteration."""

    profile: Callable[[ExecutionPlan, list[int]], Profile | None]
    situation: Callable[[int], Situation]


@dataclass
class Recovery:
    backend: str
    strategy: str = "reroute"       # --chameleon-strategy: auto, reroute or takeover (restart
                                    # where they cannot) or restart
    agree_timeout_s: float = 60.0
    injector: Injector = field(default_factory=lambda: Injector([], 0))
    planning: "Planning | None" = None
    eager: bool = False             # --chameleon-redundancy eager: takeover by shadow holders
    target: ExecutionPlan | None = None  # the failure-free plan: where a rejoin goes back to

    def __post_init__(self) -> None:
        self.store = membership.connect_store()
        self.members = membership.Membership.from_env(self.store)
        self.launch_rank = self.members.rank
        # A restarted worker (chameleon-launch --max-restarts) joins a running job: its world
        # is known once it is admitted.
        joining = os.environ.get(membership.JOIN_ENV) == "1"
        self.alive = [] if joining else list(range(self.members.world_size))
        self.generation = 0
        self.admissions = 0             # admissions of joiners so far (membership key layout)
        self.admitted: set[int] = set()
        self.members.start_heartbeat()
        self.injector.announce = self.members.announce_death
        # A rank busy computing would notice a peer's death only at its next communication
        # with the dead one's group, possibly after the rest of the doomed iteration; the
        # watcher (its own store connection) lets it stop at the next op instead.
        self.peer_failed = threading.Event()
        self.placeholders: list = []
        self._alive_lock = threading.Lock()  # no stale failure may flag the next generation
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="chameleon-failure-watch",
                                         daemon=True)
        self._watcher.start()

    def _watch(self, interval_s: float = 0.02) -> None:
        members = membership.Membership.from_env(membership.connect_store())
        while not self._stopping.wait(interval_s):
            try:
                failed = members.failures()
            except (RuntimeError, OSError):  # the store is going away with the job
                return
            with self._alive_lock:
                if any(r in failed for r in self.alive if r != self.launch_rank):
                    self.peer_failed.set()

    @classmethod
    def available(cls) -> bool:
        return bool(os.environ.get("CHAMELEON_STORE"))

    def before_op(self, op: Op, iteration: int) -> None:
        phase = PHASE_OF.get(op.kind)
        if phase:
            self.injector.maybe_fire(iteration + 1, phase)
        if self.peer_failed.is_set():
            raise PeerFailed(f"a peer's failure is on the store (before {op})")

    def lost_ranks(self, wait_s: float = 1.0) -> set[int]:
        """Current ranks reported failed on the store, waiting up to `wait_s` for a first
        report (the agent writes one within milliseconds of an exit; a hang has none yet)."""
        deadline = time.monotonic() + wait_s
        while True:
            failed = self.members.failures()
            lost = {i for i, r in enumerate(self.alive) if r in failed}
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.005)

    def notice(self) -> float:
        """Called the moment an op of this rank fails; returns the time (time.time())."""
        now = time.time()
        self.members.notice(self.generation + 1, now)
        return now

    def recover(self, plan: ExecutionPlan, iteration: int, noticed: float) -> Outcome:
        """Agree, choose and rebuild after a failure during `iteration` (1-based) that this rank
        noticed at `noticed` (time.time(): its reconfiguration starts there). A
        survivor lost meanwhile (before the new world exists) starts the agreement over, one
        generation up, with the failures counted from `plan`."""
        self._leave_world()
        self.placeholders = []  # the drain's sends, kept until their group was gone
        first_notice = self.members.notice(self.generation + 1, noticed)

        def decide(ag: membership.Agreement) -> str:
            lost = {i for i, r in enumerate(self.alive) if r not in ag.alive}
            return self._choose(plan, lost, self.alive, iteration)

        ag, choice, new_plan, rank, causes = self._reconfigure(self.alive, self.generation + 1,
                                                               decide, iteration)
        failed = [r for r in self.alive if r not in ag.alive]
        records = self.members.failures()
        # From the death to its first sign anywhere: a survivor's failed op, or the record.
        detect = [min(first_notice, records[r].time) - self.members.death_time(r, records[r])
                  for r in failed if r in records]
        old_generation = self._enter(ag)
        return Outcome(new_plan, rank, choice["strategy"], failed,
                       {r: causes.get(r, "failed") for r in failed},
                       1e3 * max(detect) if detect else None, first_notice,
                       old_generation, choice)

    def _reconfigure(self, candidates: list[int], generation: int,
                     decide: Callable[[membership.Agreement], str], iteration: int
                     ) -> tuple[membership.Agreement, dict, ExecutionPlan, int, dict[int, str]]:
        """Agree on the alive set among `candidates` (launch ranks) for `generation`, let the
        leader `decide` the plan (JSON, or "none") and publish it, and build the new world. A
        candidate lost meanwhile (before the new world exists) starts it over, one generation
        up. Returns the agreement, the decision, its plan, this rank's rank in it and the
        causes of the candidates dropped."""
        causes: dict[int, str] = {}
        while True:
            ag = self.members.agree(generation, candidates, self.agree_timeout_s)
            causes.update(ag.causes)
            if ag.leader == self.launch_rank:
                self.members.publish(ag.generation, "plan", decide(ag))
            try:
                text = self.members.read(ag.generation, "plan", publisher=ag.leader).decode()
            except membership.PublishTimeout:
                candidates = [r for r in ag.alive if r != ag.leader]
                generation = ag.generation + 1
                continue
            if text == "none":
                failed = [r for r in self.alive if r not in ag.alive]
                raise Unrecoverable(f"lost launch rank(s) {failed}: no plan fits the "
                                    f"{len(ag.alive)} survivor(s), not even one pipeline")
            choice = json.loads(text)
            new_plan = ExecutionPlan.from_dict(choice["plan"])
            # new rank i is launch rank members[i]: with tensor parallelism a lost rank's
            # group leaves whole, so the world is not always a prefix of the survivors
            members = choice.get("members") or ag.alive[:new_plan.world_size]
            if members != ag.alive:
                ag = dataclasses.replace(ag, alive=members)
                if self.launch_rank not in ag.alive:
                    raise NotNeeded(f"the {choice['strategy']} plan uses {new_plan.world_size} "
                                    f"of the survivors; launch rank {self.launch_rank} is not "
                                    "among them")
            self.injector.maybe_fire(iteration, "recovery")
            gone = self.members.ready(ag.generation, ag.alive, self.agree_timeout_s)
            if not gone:
                break
            candidates = [r for r in ag.alive if r not in gone]
            generation = ag.generation + 1
        rank = membership.rebuild_world(self.store, ag, self.launch_rank, self.backend)
        new_plan.generation = ag.generation  # one generation count: the membership's
        return ag, choice, new_plan, rank, causes

    def _enter(self, ag: membership.Agreement) -> int:
        """The agreed world is this rank's now; returns the generation it leaves."""
        with self._alive_lock:
            old_generation, self.generation, self.alive = self.generation, ag.generation, \
                ag.alive
            self.peer_failed.clear()
        return old_generation

    # ---- rejoin -------------------------------------------------------------------------------
    def admission_due(self, iteration: int) -> bool:
        """At the end of `iteration` (every rank, the same answer): whether the ranks that asked
        to join are admitted now. The leader schedules an admission for the end of the next
        iteration: every rank reaches that boundary only after the leader's world loss sum of
        it, so after the leader wrote the record."""
        key = membership.key_admission(self.admissions)
        if self.launch_rank == min(self.alive) and not self.store.check([key]):
            # joins() first: on every iteration of a job nobody joins, it is the one read
            waiting = [r for r in self.members.joins()
                       if r not in self.alive and r not in self.admitted]
            if waiting:
                failed = self.members.failures()
                waiting = [r for r in waiting if r not in failed]
            if waiting:
                self.store.set(key, json.dumps({"after": iteration + 1, "joiners": waiting}))
        return self.store.check([key]) and \
            iteration >= json.loads(self.store.get(key))["after"]

    def admit(self, plan: ExecutionPlan, iteration: int, scheduler: dict) -> Outcome:
        """Admit the joiners of the due admission after `iteration`: one generation up, the
        failure-free plan laid over the grown world (strategies.rejoin); `scheduler`: the LR
        schedule's state, which the joiners take."""
        record = json.loads(self.store.get(membership.key_admission(self.admissions)))
        self._leave_world()
        generation = self.generation + 1
        candidates = sorted(set(self.alive) | set(record["joiners"]))
        if self.launch_rank == min(self.alive):
            for r in record["joiners"]:
                self.store.set(membership.key_admit(r), json.dumps(
                    {"generation": generation, "candidates": candidates,
                     "admission": self.admissions}))
        self.admissions += 1
        self.admitted.update(record["joiners"])
        started = time.time()
        ag, choice, new_plan, rank, _ = self._reconfigure(
            candidates, generation,
            lambda ag: self._choose_rejoin(plan, ag, iteration, scheduler), iteration)
        old_generation = self._enter(ag)
        return Outcome(new_plan, rank, choice["strategy"], [], {}, None, started,
                       old_generation, choice)

    def join(self, timeout_s: float) -> Outcome:
        """A restarted or new rank: ask to join, wait for the admission, enter the world."""
        self.members.request_join()
        key = membership.key_admit(self.launch_rank)
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise Unrecoverable(f"launch rank {self.launch_rank} asked to join and was not "
                                    f"admitted within {timeout_s:g} s")
            time.sleep(0.05)
        admit = json.loads(self.store.get(key))
        self.admissions = admit["admission"] + 1
        self.alive = [r for r in admit["candidates"] if r != self.launch_rank]
        self.admitted = set(admit["candidates"])
        started = time.time()
        # a joiner never leads (its rank is above every stayer's) unless no stayer is left
        ag, choice, new_plan, rank, _ = self._reconfigure(
            admit["candidates"], admit["generation"], lambda ag: "none", 0)
        old_generation = self._enter(ag)
        return Outcome(new_plan, rank, choice["strategy"], [], {}, None, started,
                       old_generation, choice)

    def _choose_rejoin(self, plan: ExecutionPlan, ag: membership.Agreement, iteration: int,
                       scheduler: dict) -> str:
        """The leader's decision for the grown world: the failure-free plan over it, each
        stayer on the layers it holds; with fewer ranks than that plan, the places nobody
        takes are absorbed by the --chameleon-strategy as if they had failed."""
        members = [self.alive.index(r) if r in self.alive else None for r in ag.alive]
        new, lost = overlay(self.target, plan, members)
        if lost:
            decision = json.loads(self._choose(new, lost, ag.alive, iteration))
        else:
            decision = self._forced("rejoin", new, new, set(), self.planning.profile(
                plan, self.alive) if self.planning else None)
            decision["members"] = list(ag.alive)
        decision.update(iteration=iteration, scheduler=scheduler,
                        joined=[r for r in ag.alive if r not in self.alive])
        return json.dumps(decision)

    def _leave_world(self) -> None:
        parallel_state.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
        # Destroyed groups sit in reference cycles; only their collection closes the sockets,
        # which is what makes peers still blocked on us fail now instead of at their timeout.
        gc.collect()

    def _choose(self, plan: ExecutionPlan, lost: set[int], launch: list[int],
                iteration: int) -> str:
        """The leader's decision, as published (JSON: strategy, plan, the launch ranks of its
        world in rank order, the ranked candidates with their predictions, and the switch of a
        hybrid), or "none". `launch`: the launch rank of each rank of `plan`.

        `auto` ranks every strategy's candidate with the profile calibrated so far,
        `reparallelize` predicts its mixes of pipeline depths with it, and `reroute+restart`
        takes the hybrid where there is one (periodic saves, the next one within the horizon);
        before any calibration (a failure during the first iterations, no
        --chameleon-profile) `reparallelize` balances layers by count, and the others (or
        without a hybrid) reroute. Forced: reroute (or takeover) where it absorbs the failure,
        else restart; its plan is still predicted when there is a profile, so the log shows
        predicted beside measured. Every plan runs on whole tensor-parallel groups: a lost
        rank's healthy siblings are not among the members (they leave, NotNeeded).
        """
        profile = self.planning.profile(plan, self.alive) if self.planning else None
        best = None
        if self.strategy in ("auto", "reroute+restart", "reparallelize") and profile is not None:
            situation = self.planning.situation(iteration)
            ranked = planner.candidates(plan, lost, profile, situation,
                                        planner.STRATEGIES if self.strategy == "auto"
                                        else (self.strategy,))
            best = planner.choose(ranked)
            if best is None and self.strategy == "auto":
                return "none"
        def members(new: ExecutionPlan) -> list[int]:
            return [launch[r] for r in plan.survivors(lost, new.world_size)]

        if best is not None:
            return json.dumps({
                "strategy": best.strategy, "plan": best.plan.to_dict(),
                "predicted_iter_ms": best.iteration_ms,
                "switch": None if best.switch is None else {
                    "strategy": best.switch.strategy, "at_iteration": best.switch.at_iteration,
                    "plan": best.switch.plan.to_dict(),
                    "predicted_iter_ms": best.switch.iteration_ms},
                "candidates": [c.summary() for c in ranked], "profile": profile.source,
                "members": members(best.plan)})
        new, strategy = None, self.strategy
        if self.strategy in ("reroute", "auto", "reroute+restart"):
            new, strategy = reroute(plan, lost, profile.rank_slowdown if profile else None), \
                "reroute"
        elif self.strategy == "takeover":
            new = takeover(plan, lost, None if profile is None else
                           lambda n, first, last: planner.stage_cost_ms(profile, n, first, last),
                           self.eager)
        elif self.strategy == "reparallelize":  # nothing measured yet: layers as the cost
            new = reparallelize(plan, lost, lambda n, first, last: float(n),
                                lambda layers, d: [layers // d + (i < layers % d)
                                                   for i in range(d)])
        if new is None:
            new, strategy = restart_plan(plan, lost), "restart"
        if new is None:
            return "none"
        return json.dumps({**self._forced(strategy, new, plan, lost, profile),
                           "members": members(new)})

    def _forced(self, strategy: str, new: ExecutionPlan, plan: ExecutionPlan, lost: set[int],
                profile: Profile | None) -> dict:
        """The decision for a plan chosen without the planner, predicted when there is a
        profile, so the log shows predicted beside measured."""
        decision = {"strategy": strategy, "plan": new.to_dict(), "switch": None,
                    "candidates": [], "profile": None, "predicted_iter_ms": None}
        if profile is not None:
            ranked = planner.predicted(strategy, new, plan, lost, profile, self.eager)
            decision.update(predicted_iter_ms=ranked.iteration_ms,
                            candidates=[ranked.summary()], profile=profile.source)
        return decision

    def switch(self, new_plan: ExecutionPlan, iteration: int) -> tuple[ExecutionPlan, int]:
        """A hybrid's planned second step after `iteration` (its checkpoint just written): every
        rank leaves the current world and the first `new_plan.world_size` of them form the new
        one, one generation up. Returns (the plan, this rank's rank in it)."""
        parallel_state.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        ag = self.members.agree(self.generation + 1, self.alive, self.agree_timeout_s)
        if ag.alive != self.alive:
            raise Unrecoverable(f"launch rank(s) {sorted(set(self.alive) - set(ag.alive))} lost "
                                f"while switching plans after iteration {iteration}")
        ag = dataclasses.replace(ag, alive=ag.alive[:new_plan.world_size])
        if self.launch_rank not in ag.alive:
            raise NotNeeded(f"the plan switched to after iteration {iteration} uses "
                            f"{new_plan.world_size} ranks; launch rank {self.launch_rank} is "
                            "not among them")
        if self.members.ready(ag.generation, ag.alive, self.agree_timeout_s):
            raise Unrecoverable(f"a rank was lost while switching plans after iteration "
                                f"{iteration}")
        rank = membership.rebuild_world(self.store, ag, self.launch_rank, self.backend)
        new_plan.generation = ag.generation
        with self._alive_lock:
            self.generation, self.alive = ag.generation, ag.alive
        return new_plan, rank

    def stop(self) -> None:
        self._stopping.set()
        self.members.stop()
