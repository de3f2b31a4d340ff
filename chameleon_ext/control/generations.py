"""A generation's reconfiguration on the store, after its agreement: what the leader publishes
for it (the plan), the barrier before its world is built, and its outcome (committed: the world
holds the state; abandoned: everyone agrees again one generation up)."""

from __future__ import annotations

import time

from chameleon_ext.control.agreement import AgreementTimeout
from chameleon_ext.control.failures import LOSS_CHECK_S, FailureLog
from chameleon_ext.control.keys import gen_prefix
from chameleon_ext.control.poll import poll
from chameleon_ext.control.store import Member, MembershipError, as_text


class PublishTimeout(MembershipError, TimeoutError):
    """read() found nothing published under the key in time (or its publisher failed)."""


class Generations:
    def __init__(self, member: Member, failure_log: FailureLog):
        self.member = member
        self.failure_log = failure_log

    # --- publish / read (e.g. the leader's plan)

    def publish(self, generation: int, key: str, data: bytes | str) -> None:
        self.member.store.set(f"{gen_prefix(generation)}/pub/{key}", data)

    def read(self, generation: int, key: str, timeout_s: float = 60.0,
             publisher: int | None = None, poll_s: float = 0.005) -> bytes:
        """What was published under `key` for `generation`; waits up to timeout_s. With
        `publisher`, gives up early when that rank is reported failed."""
        store = self.member.store
        full = f"{gen_prefix(generation)}/pub/{key}"

        def look() -> bool | None:
            if store.check([full]):
                return True
            if publisher is not None and publisher in self.failure_log.failures():
                if store.check([full]):
                    return True
                raise PublishTimeout(f"publisher rank {publisher} failed before publishing "
                                     f"{key!r} for generation {generation}")
            return None

        if poll(look, timeout_s, poll_s, grow=1.5, max_interval_s=0.05) is None:
            raise PublishTimeout(f"nothing published under {key!r} for generation "
                                 f"{generation} within {timeout_s:g} s"
                                 + (f" (publisher: rank {publisher})"
                                    if publisher is not None else ""))
        return store.get(full)

    # --- the barrier before the world is built

    def ready(self, generation: int, ranks: list[int], timeout_s: float = 60.0,
              poll_s: float = 0.005) -> list[int]:
        """Barrier of `ranks` on the store before they build the world of `generation`: returns
        [] once all are ready, or the ranks among them reported failed or exited while
        waiting (a failure during reconfiguration; the caller agrees again, one generation up).
        A process-group rendezvous would instead wait for a dead member until its timeout."""
        store = self.member.store
        me = self.member.require_rank("ready")
        ns = gen_prefix(generation)
        store.set(f"{ns}/ready/{me}", "1")
        waiting = [r for r in ranks if r != me]
        next_look = time.monotonic() + LOSS_CHECK_S

        def look() -> list[int] | None:
            nonlocal waiting, next_look
            waiting = [r for r in waiting if not store.check([f"{ns}/ready/{r}"])]
            if not waiting:
                return []
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + LOSS_CHECK_S
                gone = self.failure_log.gone(waiting)
                if gone:
                    return gone
            return None

        gone = poll(look, timeout_s, poll_s, grow=1.5, max_interval_s=0.05)
        if gone is None:
            raise AgreementTimeout(generation, timeout_s, waiting, [me], [])
        return gone

    # --- the outcome

    def abandon(self, generation: int) -> int:
        """`generation`'s world could not be built: everyone agrees again one generation up.
        Returns that generation (the first rank to abandon it names it)."""
        won = self.member.store.compare_set(f"{gen_prefix(generation)}/retry", "",
                                            str(generation + 1))
        return int(as_text(won))

    def committed(self, generation: int) -> None:
        """`generation`'s world is built and holds the job's state (its leader says so)."""
        self.member.store.set(f"{gen_prefix(generation)}/committed", f"{time.time():.6f}")

    def outcome(self, generation: int, timeout_s: float, poll_s: float = 0.01) -> int | None:
        """For a rank the plan of `generation` left out: None once that world is committed
        (the rank may leave), or the generation to agree again in (it was abandoned)."""
        store = self.member.store
        ns = gen_prefix(generation)

        # A 1-tuple: None is itself an answer here (committed).
        def look() -> tuple[int | None] | None:
            if store.check([f"{ns}/committed"]):
                return (None,)
            if store.check([f"{ns}/retry"]):
                return (int(as_text(store.get(f"{ns}/retry"))),)
            return None

        found = poll(look, timeout_s, poll_s)
        if found is None:
            raise MembershipError(f"generation {generation}'s world was neither built nor "
                                  f"abandoned within {timeout_s:g} s")
        return found[0]
