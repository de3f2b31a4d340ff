"""The leader's choice at a reconfiguration: which plan the new world runs, and why.

Only the agreement's leader decides; the others read its published `Verdict`. The planner
(chameleon_ext.planning.planner) ranks every strategy's candidate with the live profile under `auto`
(and predicts `reparallelize`'s mixes and `reroute+restart`'s hybrid); a forced strategy
takes its own plan where it absorbs the failure, else `restart`, and is still predicted when
there is a profile, so the log shows predicted beside measured. Under the spread placement a
restart's fresh plan is laid over the survivors' nodes the same way as the failure-free plan
(chameleon_ext.plan.placement.spread_over); every other strategy keeps each survivor in its place.

Spares (launch ranks alive in the agreement but out of the plan: left out by an earlier plan, or
joiners with no place) are the decider's to use: `auto` weighs the substitute candidate (they
take the lost places) with the others; a forced strategy substitutes first where they can, since
they would otherwise sit idle; an admission places them like joiners. The new world's members
are the stayers first, so its rank 0, the job's lead, always holds the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError
from chameleon_ext.plan.placement import spread_over
from chameleon_ext.planning import planner
from chameleon_ext.planning.decision import Decision, Switch, Verdict
from chameleon_ext.planning.perf_model import Profile, predict_plan
from chameleon_ext.planning.planner import Situation
from chameleon_ext.planning.strategies import REGISTRY, Context
from chameleon_ext.planning.strategies.base import state_survives
from chameleon_ext.plan.sharding import instances_for, lost_shards
from chameleon_ext.planning.strategies.rejoin import overlay


@dataclass
class Planning:
    """What the leader predicts with: the live profile (`profile(plan, launch_ranks)`:
    calibrated under `plan`, or None), the job's situation at a failure during an iteration
    (`situation`: counted as one more failure) and before an iteration (`outlook`: no failure
    counted)."""

    profile: Callable[[ExecutionPlan, list[int]], Profile | None]
    situation: Callable[[int], Situation]
    outlook: Callable[[int], Situation] | None = None


@dataclass
class AdmissionTime:
    """When the ranks asking to join are admitted: at the end of iteration `after` by `action`
    ("now": their state from the peers; "checkpoint": from the checkpoint saved at that
    boundary; "spare": the plan kept, they stand by as spares, for the next loss). `costs`:
    each action's predicted total over the window (ms; planner.rejoin_choice, where "stay" is
    the spare's), empty where the decision is not the planner's."""

    after: int
    action: str
    costs: dict[str, float]


@dataclass
class Decider:
    strategy: str = "auto"              # --chameleon-strategy
    eager: bool = False                 # --chameleon-redundancy eager: takeover by holders
    planning: Planning | None = None
    target: ExecutionPlan | None = None  # the failure-free plan: where a rejoin goes back to
    placement: str = "megatron"         # --chameleon-placement
    # launch ranks -> their nodes (store.nodes_from_store over the job's store)
    nodes: Callable[[list[int]], dict[int, int]] | None = None
    # the distributed optimizer's instances (--num-distributed-optimizer-instances); 0: the
    # optimizer's state is replicated whole over each stage's replicas, not sharded
    sharded: int = 0
    buddy: bool = False                 # --chameleon-shard-redundancy buddy: shards held twice

    def after_failure(self, plan: ExecutionPlan, launch_ranks: list[int], lost: set[int],
                      iteration: int, spares: list[int] = ()) -> Verdict:
        """The plan over the survivors of `plan` (whose rank r is launch rank
        launch_ranks[r]) without the ranks `lost`, after a failure during `iteration`;
        `spares`: the launch ranks waiting out of the plan, in the order they take places."""
        profile = self._profile(plan, launch_ranks)
        verdict = self._after_failure(plan, lost, iteration, profile, len(spares))
        d = verdict.decision
        if d is None:
            return verdict
        # Every plan runs on whole tensor-parallel groups, numbered in their old order: a lost
        # rank's healthy siblings are not members (they leave, or stay spares).
        used = plan.survivors(lost, d.plan.world_size)
        why = None if d.restarts else self._state_lost(plan, set(plan.ranks) - set(used))
        if why is not None:
            # Spares leave with their state: a plan that carries the state must hold it all.
            new, _ = self._restart(plan, lost, profile)
            if new is None:
                return self._none(lost, plan.world_size - len(lost))
            d = self._forced("restart", new, plan, lost, profile)
            d.why = why
            verdict = Verdict(d)
            used = plan.survivors(lost, d.plan.world_size)
        # A substitute's places past the survivors' are the spares', in order.
        d.members = [launch_ranks[r] for r in used] + \
            list(spares[:d.plan.world_size - len(used)])
        self._place_restart(d, plan, lost, launch_ranks)
        return verdict

    def _after_failure(self, plan: ExecutionPlan, lost: set[int], iteration: int,
                       profile: Profile | None, spares: int = 0,
                       strategies: tuple[str, ...] = planner.STRATEGIES) -> Verdict:
        """`strategies`: those auto ranks."""
        survivors = plan.world_size - len(lost)
        why = self._state_lost(plan, lost)
        if why is not None:
            # Only a checkpoint has the state.
            new, _ = self._restart(plan, lost, profile)
            if new is None:
                return self._none(lost, survivors)
            d = self._forced("restart", new, plan, lost, profile)
            d.why = why
            return Verdict(d)
        if self.strategy in ("auto", "reroute+restart") and profile is not None:
            ranked = planner.candidates(plan, lost, profile, self.planning.situation(iteration),
                                        strategies if self.strategy == "auto"
                                        else (self.strategy, "substitute"), spares)
            # A plan that leaves out a state's last holder (a shard's: spares drop their state)
            # would restart from the checkpoint after all: the next one is taken instead.
            best = planner.choose([c for c in ranked if c.strategy == "restart" or
                                   self._state_lost(plan, set(plan.ranks) - set(
                                       plan.survivors(lost, c.plan.world_size))) is None])
            if best is not None:
                return Verdict(Decision(
                    best.strategy, best.plan, best.iteration_ms,
                    None if best.switch is None else Switch(
                        best.switch.strategy, best.switch.at_iteration, best.switch.plan,
                        best.switch.iteration_ms),
                    [c.summary() for c in ranked], profile.source))
            if self.strategy == "auto":
                return self._none(lost, survivors)
        found = REGISTRY["substitute"].propose(plan, lost, self._context(plan, profile, spares))
        if found is not None:
            return Verdict(self._forced("substitute", found.plan, plan, lost, profile))
        new, strategy = self._forced_plan(plan, lost, profile)
        if new is None:
            new, strategy = self._restart(plan, lost, profile)
        if new is None:
            return self._none(lost, survivors)
        return Verdict(self._forced(strategy, new, plan, lost, profile))

    def for_switch(self, switch: Switch, plan: ExecutionPlan, launch_ranks: list[int],
                   lost: set[int], iteration: int, spares: list[int] = ()) -> Verdict:
        """A hybrid's planned second step, as planned when nobody was lost meanwhile (the
        spares stay spares)."""
        if lost:
            return self.after_failure(plan, launch_ranks, lost, iteration + 1, spares)
        d = Decision(switch.strategy, switch.plan, switch.predicted_iter_ms,
                     members=[launch_ranks[r] for r in
                              plan.survivors(set(), switch.plan.world_size)])
        self._place_restart(d, plan, set(), launch_ranks)
        return Verdict(d)

    def admission_time(self, plan: ExecutionPlan, launch_ranks: list[int], joiners: list[int],
                       iteration: int) -> AdmissionTime:
        """At the boundary after `iteration`: when and how the `joiners` are admitted. Under
        `auto` with a live profile, the cycle's objective decides (planner.rejoin_choice)
        between the earliest admission into the failure-free plan (the end of the next
        iteration: every rank must read the schedule before it reaches that boundary), the
        next periodic checkpoint's boundary (the state read from it: no moves between peers)
        and staying on the plan, the joiners admitted at the earliest as spares (warm for the
        next loss); a forced strategy or no profile admits into the plan at the earliest. A
        regrowth that does not fill the failure-free plan weighs the plan that absorbs the
        places nobody takes, now, against staying, and stays where that plan would restart:
        an admission never throws committed work away."""
        earliest = AdmissionTime(iteration + 1, "now", {})
        profile = self._profile(plan, launch_ranks)
        if self.strategy != "auto" or profile is None or self.planning is None or \
                self.planning.outlook is None:
            return earliest
        grown, members, new, lost = self._regrown(plan, launch_ranks,
                                                   launch_ranks + sorted(joiners))
        if lost:
            d = self._absorbed(new, lost, grown, iteration, profile).decision
            if d is None or d.restarts:
                return AdmissionTime(iteration + 1, "spare", {})
            new = d.plan
            members = [launch_ranks.index(r) if r in launch_ranks else None for r in d.members]
        # The window starts after the earliest boundary the admission can take.
        situation = self.planning.outlook(iteration + 2)
        same_tp = profile.at_tensor_parallel(plan.tensor_parallel)
        choice = planner.rejoin_choice(
            plan, predict_plan(plan, same_tp).iteration_ms, new,
            predict_plan(new, same_tp).iteration_ms,
            {i: m for i, m in enumerate(members) if m is not None}, profile, situation,
            by_checkpoint=not lost)
        if choice.action == "checkpoint":
            return AdmissionTime(choice.at_iteration, "checkpoint", choice.costs)
        return AdmissionTime(iteration + 1, "spare" if choice.action == "stay" else "now",
                             choice.costs)

    def _absorbed(self, new: ExecutionPlan, lost: set[int], grown: list[int], iteration: int,
                  profile: Profile | None) -> Verdict:
        """The grown world's plan where it does not fill the failure-free plan `new` (its
        places `lost` nobody takes, absorbed as if they had failed; auto never restarts from
        the checkpoint here: the ranks that stay hold the state), its members launch ranks."""
        verdict = self._after_failure(new, lost, iteration, profile, strategies=tuple(
            s for s in planner.STRATEGIES if s != "restart"))
        if verdict.decision is not None:
            verdict.decision.members = [
                grown[r] for r in new.survivors(lost, verdict.decision.plan.world_size)]
        return verdict

    def _regrown(self, plan: ExecutionPlan, launch_ranks: list[int], alive: list[int]
                 ) -> tuple[list[int], list[int | None], ExecutionPlan, set[int]]:
        """The grown world: the stayers of `plan` among `alive`, then as many of the others
        (joiners, spares) as the failure-free plan has places for, lowest first; each one's
        rank in `plan` (None: a newcomer); and the failure-free plan laid over them (overlay:
        its places nobody takes)."""
        stayers = [r for r in launch_ranks if r in alive]
        room = self.target.world_size - len(stayers)
        grown = stayers + sorted(r for r in alive if r not in launch_ranks)[:room]
        members = [launch_ranks.index(r) if r in launch_ranks else None for r in grown]
        new, lost = overlay(self.target, plan, members)
        return grown, members, new, lost

    def for_admission(self, plan: ExecutionPlan, launch_ranks: list[int], alive: list[int],
                      iteration: int, action: str = "now") -> Verdict:
        """The failure-free plan laid over the grown world (the stayers of `plan` among the
        launch ranks `alive`, then as many of the others, joiners and spares, as it has places
        for, lowest first; the rest stay spares), each stayer on the layers it holds; with
        fewer ranks than that plan, the places nobody takes are absorbed by the strategy as if
        they had failed. `action` (admission_time's) "checkpoint": every rank reads the
        checkpoint saved at this boundary instead of moving state between peers; "spare": the
        plan is kept, the joiners stand by as spares (unless a stayer was lost meanwhile)."""
        grown, _, new, lost = self._regrown(plan, launch_ranks, alive)
        profile = self._profile(plan, launch_ranks)   # measured under the plan running now
        if action == "spare" and all(r in alive for r in launch_ranks):
            kept = plan.relabelled({r: r for r in plan.ranks}, plan.generation + 1)
            verdict = Verdict(self._forced("rejoin", kept, kept, set(), profile))
            verdict.decision.members = list(launch_ranks)
        elif action == "checkpoint" and not lost:
            verdict = Verdict(self._forced("restart", new, new, set(), profile))
            verdict.decision.members = list(grown)
        elif lost:
            verdict = self._absorbed(new, lost, grown, iteration, profile)
        else:
            verdict = Verdict(self._forced("rejoin", new, new, set(), profile))
            verdict.decision.members = list(grown)
        if verdict.decision is not None:
            verdict.decision.joined = [r for r in verdict.decision.members
                                       if r not in launch_ranks]
        return verdict

    def _place_restart(self, d: Decision, plan: ExecutionPlan, lost: set[int],
                       launch_ranks: list[int]) -> None:
        """Under the spread placement, a restart's fresh plan (Megatron's order over the first
        surviving groups) takes its groups from as many of the survivors' nodes as possible
        and is placed the spread way: `d.plan` and `d.members` are replaced."""
        if not d.restarts or self.placement != "spread" or self.nodes is None:
            return
        groups = [[launch_ranks[r] for r in g] for g in plan.surviving_groups(lost)]
        try:
            nodes = self.nodes(sorted(r for g in groups for r in g))
        except PlanError:       # a survivor without a launcher's record: Megatron's order
            return
        d.plan, d.members = spread_over(d.plan, groups, nodes)

    def _profile(self, plan: ExecutionPlan, launch_ranks: list[int]) -> Profile | None:
        return self.planning.profile(plan, launch_ranks) if self.planning else None

    def _forced_plan(self, plan: ExecutionPlan, lost: set[int], profile: Profile | None
                     ) -> tuple[ExecutionPlan | None, str]:
        """The forced strategy's own proposal (before any calibration, auto and the hybrid
        reroute)."""
        name = "reroute" if self.strategy in ("auto", "reroute+restart") else self.strategy
        found = REGISTRY[name].propose(plan, lost, self._context(plan, profile))
        return (None, name) if found is None else (found.plan, name)

    def _restart(self, plan: ExecutionPlan, lost: set[int], profile: Profile | None
                 ) -> tuple[ExecutionPlan | None, str]:
        found = REGISTRY["restart"].propose(plan, lost, self._context(plan, profile))
        return (None if found is None else found.plan), "restart"

    def _context(self, plan: ExecutionPlan, profile: Profile | None, spares: int = 0
                 ) -> Context:
        return Context(None if profile is None else profile.at_tensor_parallel(
            plan.tensor_parallel), self.eager, spares)

    def _forced(self, strategy: str, new: ExecutionPlan, plan: ExecutionPlan, lost: set[int],
                profile: Profile | None) -> Decision:
        decision = Decision(strategy, new)
        if profile is not None:
            ranked = planner.predicted(strategy, new, plan, lost, profile, self.eager)
            decision.predicted_iter_ms = ranked.iteration_ms
            decision.candidates, decision.profile = [ranked.summary()], profile.source
        return decision

    def onto_spares(self, spares: list[int], generation: int) -> Verdict:
        """Every rank of the plan is lost while `spares` (launch ranks that hold no state) stand
        by: a restart from the latest checkpoint onto the failure-free plan, or onto the
        largest homogeneous plan of it that the spares fill, numbered at `generation`."""
        target = self.target
        if target is None:
            return Verdict(unrecoverable="every rank holding the model's state was lost while "
                                         "spares stood by")
        lost = set(range(len(spares), target.world_size))
        new, _ = self._restart(target, lost, None) if lost else (target, "restart")
        if new is None:
            return self._none(set(target.ranks), len(spares))
        d = Decision("restart", new.relabelled({r: r for r in new.ranks}, generation),
                     members=list(spares[:new.world_size]),
                     why="every rank of the plan was lost; the spares read the checkpoint")
        return Verdict(d)

    def _state_lost(self, plan: ExecutionPlan, lost: set[int]) -> str | None:
        """Why the ranks of `plan` outside `lost` do not hold the whole training state, if
        they do not."""
        if not state_survives(plan, lost, self.eager):
            return "every holder of some layer's state is lost"
        gone = lost_shards(plan, lost, self.sharded, self.buddy) if self.sharded else []
        if gone:
            return (f"the distributed optimizer's shard held by rank(s) {list(gone[0])} is lost"
                    + (f" with {len(gone) - 1} more" if len(gone) > 1 else "")
                    + f" ({instances_for(plan, self.sharded)} instance(s)"
                    + (", buddy copies" if self.buddy else "") + ", no other copy)")
        return None

    @staticmethod
    def _none(lost: set[int], survivors: int) -> Verdict:
        return Verdict(unrecoverable=f"lost rank(s) {sorted(lost)}: no plan fits the "
                                     f"{survivors} survivor(s), not even one pipeline")

