"""The step vote: every rank of a world applies an iteration's optimizer step, or none does.

Keys under ``gen/{g}/commit/{i}/``: a vote counter and a decision written once (compare_set), so
every rank reads the same outcome whenever it looks (torchft's should_commit).
"""

from __future__ import annotations

from chameleon_ext.control.failures import FailureLog
from chameleon_ext.control.keys import gen_prefix
from chameleon_ext.control.poll import poll
from chameleon_ext.control.store import Member, as_text


class StepVote:
    def __init__(self, member: Member, failure_log: FailureLog):
        self.member = member
        self.failure_log = failure_log

    def commit(self, generation: int, iteration: int, world: list[int], timeout_s: float,
               poll_s: float = 0.0005) -> bool:
        """Vote to apply the optimizer step of `iteration` in the world of `generation` (its
        launch ranks `world`); True when every rank of it applies the step, False when none
        does. The step is applied iff all of them voted: the decision is written once
        (compare_set) by the rank that sees the last vote, or as "abort" by a rank that sees a
        member fail, a failure noticed in this world, or `timeout_s` pass first, so every rank
        reads the same outcome whenever it looks. A rank that never votes guarantees an abort;
        one that dies after voting cannot make the others differ."""
        store = self.member.store
        ns = f"{gen_prefix(generation)}/commit/{iteration}"
        decision_key, votes_key = f"{ns}/decision", f"{ns}/votes"
        broken_key = f"{gen_prefix(generation + 1)}/noticed"
        my_vote: int | None = store.add(votes_key, 1)

        def look() -> bool | None:
            nonlocal my_vote
            # The first look counts with this rank's own vote; later ones read the counter.
            votes, my_vote = (store.add(votes_key, 0) if my_vote is None else my_vote), None
            if votes >= len(world):
                return self._decide(decision_key, "commit")
            if store.check([decision_key]):
                return as_text(store.get(decision_key)) == "commit"
            failed = self.failure_log.failures()
            if any(r in failed for r in world) or store.check([broken_key]):
                return self._decide(decision_key, "abort")
            return None

        outcome = poll(look, timeout_s, poll_s, grow=2.0, max_interval_s=0.01)
        return self._decide(decision_key, "abort") if outcome is None else outcome

    def _decide(self, key: str, outcome: str) -> bool:
        return as_text(self.member.store.compare_set(key, "", outcome)) == "commit"

    def forget_commit(self, generation: int, iteration: int) -> None:
        """Drop a decided step's keys (every rank has read the decision of an iteration once
        all of them voted for the next one)."""
        ns = f"{gen_prefix(generation)}/commit/{iteration}"
        for key in (f"{ns}/votes", f"{ns}/decision"):
            self.member.store.delete_key(key)
