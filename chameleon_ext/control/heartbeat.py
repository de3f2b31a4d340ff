"""Heartbeats and progress: a worker says it lives and what its main thread does; anyone judges
from the ages of those heartbeats (and of the node agents') which ranks are lost unreported.

Heartbeat ages compare wall clocks (``time.time()``): across nodes the clocks must agree to well
within the heartbeat timeout (NTP). A rank that never wrote a heartbeat is never heartbeat-stale;
it can still be stale through its node agent (a node agent whose heartbeat is stale and that did
not say it finished takes all of its ranks with it).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from chameleon_ext.control.keys import (key_agent_done, key_agent_hb, key_hb, key_progress,
                                        key_worker)
from chameleon_ext.control.store import JsonRecord, Member, as_text


@dataclass(frozen=True)
class Progress(JsonRecord):
    """What a worker's main thread is doing, published with its heartbeat. A hang shows as a
    `seq` that stops moving while the heartbeat thread lives on; `waiting` phases (a receive, a
    collective, an agreement) are those of a hang's victims, never of its cause."""

    iteration: int = 0
    seq: int = 0                # bumped at every op and every step of a transition
    phase: str = "start"
    waiting: bool = False
    allow_s: float = 0.0        # how long this phase may go without a bump (0: no limit)


def _hb_age(value: bytes | str, now: float) -> float | None:
    """Age in seconds of a heartbeat value; None when it was switched off on purpose."""
    v = as_text(value)
    if v.startswith("off"):
        return None
    try:
        return now - float(v)
    except ValueError:
        return None


class Heartbeat:
    """A worker's heartbeat thread and progress, and everyone's view of the heartbeats.

    The heartbeat thread uses its own connection (``store.clone()``), so a main thread blocked
    in a store get (a gloo rendezvous, for example) never delays heartbeats.
    """

    def __init__(self, member: Member):
        self.member = member
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._worker_nodes: dict[int, int] = {}
        # Set by the main thread (tick), read by the heartbeat thread: a new immutable record
        # each time, so the thread always writes a whole one.
        self.progress = Progress()

    @property
    def store(self) -> dist.Store:
        return self.member.store

    # --- this worker's heartbeat

    def beat(self, store: dist.Store | None = None) -> None:
        rank = self.member.require_rank("heartbeat")
        store = store or self.store
        store.set(key_hb(rank), f"{time.time():.6f}")
        store.set(key_progress(rank), self.progress.to_json())

    def tick(self, iteration: int, phase: str, waiting: bool = False,
             allow_s: float | None = None) -> None:
        """The main thread moved on: to `phase` of `iteration` (published with the next
        heartbeat). `allow_s`: how long the phase may go without another tick before its agent
        takes it for a hang while peers wait (default: the previous phase's)."""
        prev = self.progress
        self.progress = Progress(iteration, prev.seq + 1, phase, waiting,
                                 prev.allow_s if allow_s is None else allow_s)

    def start(self, interval: float | None = None) -> None:
        """A daemon thread writing this rank's timestamp every `interval` s (default timeout/4)."""
        rank = self.member.require_rank("heartbeat")
        if self._thread is not None:
            return
        if interval is None:
            # Progress rides on the heartbeat: a hang is seen within this interval of its
            # allowance running out (half a second is ample against allowances of seconds).
            interval = min(0.5, max(0.05, self.member.heartbeat_timeout / 4))
        try:
            hb_store = self.store.clone()
        except Exception:       # a store type without clone: share it (and its lock)
            hb_store = self.store
        self.beat(hb_store)
        self._stop.clear()

        def beat() -> None:
            failures = 0
            while not self._stop.wait(interval):
                try:
                    self.beat(hb_store)
                    failures = 0
                except Exception as e:   # the store is gone: nothing to report to
                    failures += 1
                    if failures == 3:
                        print(f"[chameleon] rank {rank}: heartbeat to the store failing: {e}",
                              file=sys.stderr, flush=True)

        self._thread = threading.Thread(target=beat, name=f"chameleon-hb-{rank}", daemon=True)
        self._thread.start()

    def stop(self, retire: bool = True) -> None:
        """Stop the heartbeat thread; with `retire`, mark the heartbeat off so that this rank is
        not seen as stale (or hung) for no longer heartbeating."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        rank = self.member.rank
        if retire and rank is not None:
            # done on purpose: neither stale nor, while the process exits, hung
            self.progress = Progress(self.progress.iteration, self.progress.seq + 1, "done")
            try:
                self.store.set(key_progress(rank), self.progress.to_json())
                self.store.set(key_hb(rank), f"off:{time.time():.6f}")
            except Exception:
                pass

    # --- everyone's heartbeats

    def progress_of(self, ranks: list[int]) -> dict[int, Progress]:
        """The published progress of each rank that has one."""
        present = [r for r in ranks if self.store.check([key_progress(r)])]
        if not present:
            return {}
        values = self.store.multi_get([key_progress(r) for r in present])
        return {r: Progress.from_json(v) for r, v in zip(present, values)}

    def ages(self, ranks: list[int], now: float | None = None) -> dict[int, float]:
        """Seconds since each rank's last heartbeat, for ranks that have one (and did not retire)."""
        now = time.time() if now is None else now
        present = [r for r in ranks if self.store.check([key_hb(r)])]
        if not present:
            return {}
        values = self.store.multi_get([key_hb(r) for r in present])
        ages = {}
        for r, v in zip(present, values):
            age = _hb_age(v, now)
            if age is not None:
                ages[r] = age
        return ages

    def unreported_losses(self, ranks: list[int], now: float | None = None) -> dict[int, str]:
        """The ranks among `ranks` that count as lost although nobody reported them, and why:
        "node" when their node's agent went silent (the node is gone with every rank on it),
        "stale" when their own heartbeat did and no live agent of theirs is watching them. A
        silent worker whose agent lives is left to that agent, which kills it and reports it
        (a hang) within one of its polls: so a node's ranks are never taken one by one for
        stale workers while their node's loss is still being noticed."""
        now = time.time() if now is None else now
        lost_nodes = self.stale_nodes(now=now, nodes=self._nodes_of(ranks))
        out = {r: "node" for r in ranks if self._worker_nodes.get(r) in lost_nodes}
        for r, age in self.ages([r for r in ranks if r not in out], now).items():
            if age > self.member.heartbeat_timeout \
                    and not self._watched(self._worker_nodes.get(r)):
                out[r] = "stale"
        return out

    def _watched(self, node: int | None) -> bool:
        """Whether `node` has an agent that heartbeats and has not finished."""
        return node is not None and self.store.check([key_agent_hb(node)]) \
            and not self.store.check([key_agent_done(node)])

    def _nodes_of(self, ranks) -> set[int]:
        for r in ranks:
            if r not in self._worker_nodes and self.store.check([key_worker(r)]):
                self._worker_nodes[r] = int(json.loads(self.store.get(key_worker(r)))["node"])
        return {self._worker_nodes[r] for r in ranks if r in self._worker_nodes}

    def stale_nodes(self, now: float | None = None, nodes=None) -> set[int]:
        """Nodes whose agent heartbeat is older than heartbeat_timeout and that did not finish."""
        now = time.time() if now is None else now
        out = set()
        for n in sorted(nodes or ()):
            if not self.store.check([key_agent_hb(n)]) or self.store.check([key_agent_done(n)]):
                continue
            age = _hb_age(self.store.get(key_agent_hb(n)), now)
            if age is not None and age > self.member.heartbeat_timeout:
                out.add(n)
        return out
