"""Admission: a restarted or new rank asks to join, the leader schedules it at an iteration
boundary, everyone admits it there (a new agreement), and the job's end closes the door."""

from __future__ import annotations

import json
from typing import Callable, Protocol

from chameleon_ext.control.failures import FailureLog
from chameleon_ext.control.keys import KEY_JOINS, KEY_TRAINED, key_admission, key_admit
from chameleon_ext.control.poll import poll
from chameleon_ext.control.store import Member, read_log


class Timing(Protocol):
    """When an admission is made (the planner's decision, e.g. decider.AdmissionTime)."""

    after: int                  # the iteration at whose end
    action: str                 # "now" (state from the peers), "checkpoint" or "spare"
    costs: dict[str, float]


When = Callable[[list[int]], Timing]   # the joiners waiting -> when they are admitted


class Admissions:
    def __init__(self, member: Member, failure_log: FailureLog):
        self.member = member
        self.failure_log = failure_log

    def request_join(self) -> None:
        """This (restarted or new) rank asks to be admitted at the next iteration boundary."""
        self.member.store.append(KEY_JOINS, f"{self.member.require_rank('join')},")

    def joins(self) -> list[int]:
        """Every rank that ever asked to join."""
        return sorted(read_log(self.member.store, KEY_JOINS))

    def schedule_admission(self, n: int, iteration: int, alive: list[int], admitted: set[int],
                           unit: int = 1, when: When | None = None) -> Timing | None:
        """The leader, at the boundary after `iteration`: make the n-th admission of the ranks
        asking to join (not yet admitted, not failed), unless it is made already; in whole
        `unit`s (a tensor-parallel group: a lone shard has no place in any plan), the lowest
        ranks first; at the end of the iteration and by the action `when(joiners)` says
        (default: the next iteration, moving state). Returns `when`'s answer, None when nobody
        waits or the admission is made already."""
        store = self.member.store
        key = key_admission(n)
        if store.check([key]):
            return None
        waiting = [r for r in self.joins() if r not in alive and r not in admitted]
        if waiting:
            failed = self.failure_log.failures()
            waiting = [r for r in waiting if r not in failed]
            waiting = waiting[:len(waiting) // unit * unit]
        if not waiting:
            return None
        at = when(waiting) if when else None
        after, action = (iteration + 1, "now") if at is None else (at.after, at.action)
        store.set(key, json.dumps({"after": after, "joiners": waiting, "action": action}))
        return at

    def admission_due(self, n: int, iteration: int) -> bool:
        """Whether the n-th admission is made and due at the end of `iteration`."""
        store = self.member.store
        key = key_admission(n)
        return store.check([key]) and iteration >= json.loads(store.get(key))["after"]

    def admission(self, n: int) -> dict:
        """The n-th admission: {"after": iteration, "joiners": [...], "action": how the
        joiners get their state, "now" (from the peers), "checkpoint" (everyone reads the
        checkpoint saved at that boundary) or "spare" (none: the plan is kept, the joiners
        stand by as spares)}."""
        return json.loads(self.member.store.get(key_admission(n)))

    def admit(self, rank: int, generation: int, candidates: list[int], n: int) -> None:
        """Tell joiner `rank` where to meet the others: agreement `generation` among
        `candidates`, as the n-th admission."""
        self.member.store.set(key_admit(rank), json.dumps(
            {"generation": generation, "candidates": candidates, "admission": n}))

    def admitted_to(self, timeout_s: float, poll_s: float = 0.05) -> dict | None:
        """A joiner: where it meets the others (admit's record), once it is admitted; None
        after `timeout_s` without it, or once the job has trained its last iteration
        (`trained`). The leader admits every joiner at the next boundary, or at the next
        periodic checkpoint's."""
        store = self.member.store
        key = key_admit(self.member.require_rank("join"))

        def look() -> dict | None:
            if store.check([key]):
                return json.loads(store.get(key))
            return {} if self.trained() else None   # {}: stop looking (an admission is never empty)

        return poll(look, timeout_s, poll_s) or None

    def mark_trained(self, iteration: int) -> None:
        """The job has trained its last iteration: a joiner has nothing left to join."""
        self.member.store.set(KEY_TRAINED, str(iteration))

    def trained(self) -> bool:
        return self.member.store.check([KEY_TRAINED])
