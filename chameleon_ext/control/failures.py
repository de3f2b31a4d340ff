"""Failure records and clean exits on the store: who is gone, why, and since when.

A failure is reported once per rank (the first report wins, compare_set) by whoever sees it: the
rank's agent (a death, a hang), another node's agent (a lost node), or a worker (a broken
collective). A clean exit is no failure, but the rank will not come back either.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from chameleon_ext.control.keys import (CAUSES, KEY_EXITS, KEY_FAILURES, key_dying, key_exit,
                                        key_failure)
from chameleon_ext.control.store import JsonRecord, Member, read_log

# Between looks at the failure records while a rendezvous key or a barrier is awaited. A look
# is a few store operations per rank; at 0.05 s, 8 ranks creating their groups on 2 loaded cores
# queued enough of them on the agent's TCPStore to stall it for seconds (measured: a get waited
# 5 s). A loss during a rendezvous is rare (a second failure); 0.25 s more to notice it is cheap.
LOSS_CHECK_S = 0.25


@dataclass
class FailureRecord(JsonRecord):
    rank: int
    cause: str                  # one of CAUSES
    detail: str = ""
    time: float = 0.0           # wall time the failure was observed
    detect_ms: float | None = None   # failure -> record latency, when the reporter knows it
    reporter: str = ""          # "agent node 0 pid 123", "rank 2 pid 456", ...


class FailureLog:
    """The job's failure records and clean exits, as one member reads and writes them."""

    def __init__(self, member: Member):
        self.member = member
        self._cache: dict[int, FailureRecord] = {}

    def report_failure(self, rank: int, cause: str, detail: str = "", *,
                       when: float | None = None, detect_ms: float | None = None,
                       reporter: str | None = None) -> FailureRecord:
        """Record that `rank` failed; returns the record in the store (the first report wins)."""
        if cause not in CAUSES:
            raise ValueError(f"unknown failure cause {cause!r} (one of {', '.join(CAUSES)})")
        me = self.member.rank
        if reporter is None:
            reporter = (f"rank {me} pid {os.getpid()}" if me is not None
                        else f"pid {os.getpid()} on {socket.gethostname()}")
        rec = FailureRecord(int(rank), cause, detail, time.time() if when is None else when,
                            detect_ms, reporter)
        stored = self.member.store.compare_set(key_failure(rank), "", rec.to_json())
        self.member.store.append(KEY_FAILURES, f"{int(rank)},")
        return FailureRecord.from_json(stored)

    def failures(self) -> dict[int, FailureRecord]:
        """Every reported failure of the job, by rank."""
        store = self.member.store
        ranks = read_log(store, KEY_FAILURES)
        new = [r for r in ranks if r not in self._cache]
        if new:
            for r, v in zip(new, store.multi_get([key_failure(r) for r in new])):
                self._cache[r] = FailureRecord.from_json(v)
        return dict(self._cache)

    def record_exit(self, rank: int, exitcode: int = 0) -> None:
        """Record a deliberate (clean) exit of `rank`: not a failure, but it will not come back."""
        self.member.store.set(key_exit(rank), json.dumps({"rank": rank, "exitcode": exitcode,
                                                          "time": time.time()}))
        self.member.store.append(KEY_EXITS, f"{int(rank)},")

    def exited(self) -> list[int]:
        """Ranks that exited cleanly (exit code 0)."""
        return sorted(read_log(self.member.store, KEY_EXITS))

    def gone(self, ranks: list[int]) -> list[int]:
        """The ranks among `ranks` reported failed or exited cleanly, sorted."""
        failed, exits = self.failures(), set(self.exited())
        return sorted(r for r in ranks if r in failed or r in exits)

    def announce_death(self) -> None:
        """An injected fault is about to stop this rank: its exact time, to measure detection."""
        rank = self.member.require_rank("announce a death")
        self.member.store.set(key_dying(rank), f"{time.time():.6f}")

    def death_time(self, rank: int, record: FailureRecord) -> float:
        """When `rank` stopped: its own announcement if it made one, else the agent's record
        less the agent's latency (an upper bound: the agent may wake late on a busy host)."""
        store = self.member.store
        if store.check([key_dying(rank)]):
            return float(store.get(key_dying(rank)))
        return record.time - (record.detect_ms or 0.0) / 1e3
