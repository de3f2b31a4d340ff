"""Agreement: the survivors of a broken world agree on the store on who continues.

Each agreement opens a generation: its alive list (the old launch ranks that continue, whose
new ranks are their places in it), the ranks dropped and why, and the last iteration whose
optimizer step all of them applied. Exactly one list is ever published per generation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from chameleon_ext.control.failures import FailureLog
from chameleon_ext.control.heartbeat import Heartbeat
from chameleon_ext.control.keys import KEY_GENERATION, gen_prefix
from chameleon_ext.control.poll import poll
from chameleon_ext.control.store import Member, MembershipError, parse_log


class AgreementTimeout(MembershipError, TimeoutError):
    """agree() did not converge in time; `missing` are the expected ranks that never arrived."""

    def __init__(self, generation: int, timeout_s: float, missing: list[int], arrived: list[int],
                 failed: list[int]):
        self.generation, self.timeout_s = generation, timeout_s
        self.missing, self.arrived, self.failed = missing, arrived, failed
        super().__init__(
            f"agreement on generation {generation} timed out after {timeout_s:g} s: "
            f"ranks {missing} never arrived (arrived: {arrived}; failed or stale: {failed})")


class ExcludedFromAgreement(MembershipError):
    """This rank was declared failed (or stale) and is not in the agreed alive list."""


class DivergedSteps(MembershipError):
    """Survivors report different last applied iterations: the step commit was not atomic."""


@dataclass(frozen=True)
class Boundary:
    """Where a rank holding state stood at an iteration's boundary when its world broke: the
    names of the actions it still runs there (the interrupted one first) and whether they are
    the job's final ones. A failure in a save can let some ranks finish its collectives and go
    on while others stay in it: every rank then resumes from the least advanced one's, or they
    would run different collectives (measured: 17 generations of 5 s timeouts in a row)."""

    pending: tuple[str, ...] = ()
    finishing: bool = False

    def behind(self) -> tuple[bool, int]:
        """Orders boundaries least advanced first: not yet at the final actions before those
        that are, then the most actions still to run."""
        return self.finishing, -len(self.pending)

    def to_dict(self) -> dict:
        return {"pending": list(self.pending), "finishing": self.finishing}

    @classmethod
    def from_dict(cls, d: dict) -> "Boundary":
        return cls(tuple(str(a) for a in d["pending"]), bool(d["finishing"]))


@dataclass
class Agreement:
    generation: int             # the new generation this agreement opens
    alive: list[int]            # sorted old ranks that continue; new rank = alive.index(old rank)
    failed: list[int]           # candidates not in `alive` (failed, stale or exited cleanly)
    leader: int                 # lowest alive rank holding state (else lowest): it published
    # failed rank -> cause / "stale" / "exited"
    causes: dict[int, str] = field(default_factory=dict)
    # The last iteration whose optimizer step every rank of `alive` applied: the leader checked
    # that they all report the same one (None: nobody reported one, e.g. only joiners).
    iteration: int | None = None
    # Where the least advanced rank holding state stood at that iteration's boundary, which
    # every rank resumes from (None: nobody holding state arrived).
    boundary: Boundary | None = None

    @property
    def world_size(self) -> int:
        return len(self.alive)

    def new_rank(self, old_rank: int) -> int:
        return self.alive.index(old_rank)

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "alive": self.alive,
                           "failed": self.failed, "leader": self.leader,
                           "causes": {str(k): v for k, v in self.causes.items()},
                           "iteration": self.iteration,
                           "boundary": None if self.boundary is None else self.boundary.to_dict()})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Agreement":
        d = json.loads(text)
        return cls(int(d["generation"]), [int(r) for r in d["alive"]],
                   [int(r) for r in d["failed"]], int(d["leader"]),
                   {int(k): v for k, v in d.get("causes", {}).items()}, d.get("iteration"),
                   None if d.get("boundary") is None else Boundary.from_dict(d["boundary"]))


class Agreements:
    """Agreeing on a generation's alive list, and reading one that was agreed."""

    def __init__(self, member: Member, failure_log: FailureLog, heartbeat: Heartbeat):
        self.member = member
        self.failure_log = failure_log
        self.heartbeat = heartbeat

    def notice(self, generation: int, when: float | None = None) -> float:
        """Record that this rank saw the world of `generation - 1` break; returns the first
        survivor's notice time (the job's moment of detection: the others may still have been
        busy with work the failure did not block)."""
        t = f"{time.time() if when is None else when:.6f}"
        return float(self.member.store.compare_set(f"{gen_prefix(generation)}/noticed", "", t))

    def agree(self, generation: int, candidates: list[int], timeout_s: float = 60.0,
              poll_s: float = 0.005, iteration: int | None = None,
              boundary: Boundary | None = None) -> Agreement:
        """Agree with the other survivors among `candidates` on the alive set of `generation`.

        Each rank writes its arrival under gen/{generation}, with `iteration`, the last
        iteration whose optimizer step it applied (None for a rank with no state, a joiner) and
        its `boundary` (Agreement.boundary; None without state); a
        candidate is expected unless it is reported failed, exited cleanly or is lost unreported
        (`Heartbeat.unreported_losses`: its node's agent or, unwatched, its own heartbeat went
        silent; re-checked while waiting). Once every expected rank has arrived, the lowest of
        them that holds state (reported an iteration; the lowest of all when none does) is the
        leader: it knows why the generation opened, which a rank without state (a joiner, a
        spare) does not. It checks that they applied the same steps and writes the final list
        with compare_set, so exactly one list is ever published and every survivor reads that
        one. A leader that dies before publishing is dropped like any other rank and the next
        one publishes. Raises AgreementTimeout naming the ranks that never arrived,
        ExcludedFromAgreement when this rank itself is reported failed or is not in the
        published list, and DivergedSteps when the survivors' iterations differ. A rank of the
        list that fails afterwards is handled by the next agree() call (generation + 1,
        candidates = this agreement's alive list). Destroy the broken process group before
        calling this (see chameleon_ext.control.world).
        """
        store = self.member.store
        me = self.member.require_rank("agree")
        cand = sorted({int(r) for r in candidates})
        if me not in cand:
            raise ValueError(f"rank {me} is not among the candidates {cand}")
        ns = gen_prefix(generation)
        final_key, arrivals_key = f"{ns}/final", f"{ns}/arrivals"
        store.set(f"{ns}/arrived/{me}", json.dumps({
            "time": time.time(), "iteration": iteration,
            "boundary": None if boundary is None else boundary.to_dict()}))
        store.append(arrivals_key, f"{me},")
        arrived: set[int] = {me}
        dropped: dict[int, str] = {}
        missing: list[int] = []

        def look() -> Agreement | None:
            nonlocal arrived, dropped, missing
            if store.check([final_key]):
                return Agreement.from_json(store.get(final_key))
            arrived = set(parse_log(store.get(arrivals_key))) & set(cand)
            fails = self.failure_log.failures()
            exits = set(self.failure_log.exited())
            dropped = {r: fails[r].cause for r in cand if r in fails}
            dropped.update({r: "exited" for r in cand if r in exits and r not in dropped})
            rest = [r for r in cand if r not in dropped and r != me]
            dropped.update(self.heartbeat.unreported_losses(rest))
            if me in dropped:
                raise ExcludedFromAgreement(
                    f"rank {me} has been reported {dropped[me]} and cannot join generation "
                    f"{generation}")
            expected = [r for r in cand if r not in dropped]
            missing = [r for r in expected if r not in arrived]
            if missing or self._leader(ns, expected) != me:
                return None
            ag = Agreement(generation, expected, sorted(dropped), me,
                           {r: dropped[r] for r in sorted(dropped)},
                           self._agreed_iteration(ns, expected),
                           self._agreed_boundary(ns, expected))
            won = Agreement.from_json(store.compare_set(final_key, "", ag.to_json()))
            if won.leader == me:
                store.set(KEY_GENERATION, str(generation))
            return won

        ag = poll(look, timeout_s, poll_s, grow=1.5, max_interval_s=0.05)
        if ag is None:
            raise AgreementTimeout(generation, timeout_s, missing, sorted(arrived),
                                   sorted(dropped))
        if me not in ag.alive:
            raise ExcludedFromAgreement(
                f"rank {me} is not in the alive list {ag.alive} agreed for generation "
                f"{generation} (declared {ag.causes.get(me, 'failed')} by leader {ag.leader})")
        if iteration is not None and ag.iteration is not None and iteration != ag.iteration:
            raise DivergedSteps(f"rank {me} applied the steps up to iteration {iteration}, "
                                f"generation {generation} agreed on {ag.iteration}")
        return ag

    def _leader(self, ns: str, ranks: list[int]) -> int:
        """The lowest of `ranks` (all arrived at agreement `ns`) that holds state, else the
        lowest."""
        arrivals = self.member.store.multi_get([f"{ns}/arrived/{r}" for r in ranks])
        holders = [r for r, v in zip(ranks, arrivals) if json.loads(v).get("iteration") is not None]
        return (holders or ranks)[0]

    def opened(self, generation: int) -> bool:
        """Whether some rank saw the world before `generation` break or arrived at its
        agreement (no waiting)."""
        ns = gen_prefix(generation)
        return self.member.store.check([f"{ns}/noticed"]) or \
            self.member.store.check([f"{ns}/arrivals"])

    def _agreed_iteration(self, ns: str, ranks: list[int]) -> int | None:
        """The one last applied iteration of `ranks` (arrived at agreement `ns`), or
        DivergedSteps naming who applied what."""
        arrivals = self.member.store.multi_get([f"{ns}/arrived/{r}" for r in ranks])
        applied = {r: json.loads(v).get("iteration") for r, v in zip(ranks, arrivals)}
        steps = {it for it in applied.values() if it is not None}
        if len(steps) > 1:
            raise DivergedSteps(f"survivors applied different steps: {applied} (rank: last "
                                "applied iteration)")
        return steps.pop() if steps else None

    def _agreed_boundary(self, ns: str, ranks: list[int]) -> Boundary | None:
        """The boundary of the least advanced of `ranks` (arrived at agreement `ns`;
        Boundary.behind)."""
        arrivals = self.member.store.multi_get([f"{ns}/arrived/{r}" for r in ranks])
        found = [Boundary.from_dict(b) for b in (json.loads(v).get("boundary") for v in arrivals)
                 if b is not None]
        return min(found, key=Boundary.behind, default=None)

    def agreement(self, generation: int) -> Agreement | None:
        """The published agreement of `generation`, if any (no waiting)."""
        store = self.member.store
        key = f"{gen_prefix(generation)}/final"
        return Agreement.from_json(store.get(key)) if store.check([key]) else None
