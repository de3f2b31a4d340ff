"""What an agent watches besides its workers' exits: its own workers' hangs (a silent
heartbeat, progress stalled while peers wait, a failure record someone else wrote) and the
other nodes' agents (a silent heartbeat, or one that never appeared)."""

from __future__ import annotations

import os
import signal
import time

from chameleon_ext.control.agent_log import log
from chameleon_ext.control.agent_store import StoreGuard
from chameleon_ext.control.keys import KEY_NEXT_MEMBER, key_agent_hb
from chameleon_ext.control.launch_config import LaunchConfig
from chameleon_ext.control.membership import Membership
from chameleon_ext.control.store import node_info
from chameleon_ext.control.workers import Workers


class Watch:
    def __init__(self, config: LaunchConfig, members: Membership, guard: StoreGuard,
                 workers: Workers, hb_interval: float):
        self.config = config
        self.members = members
        self.guard = guard
        self.workers = workers
        self.node = config.node_rank
        # How often the agent writes its own heartbeat: the store's lag is judged against it.
        self.hb_interval = hb_interval
        self.lost_nodes: set[int] = set()
        self._progress_seen: dict[int, tuple[int, float]] = {}  # rank -> (seq, first seen)

    @property
    def _reporter(self) -> str:
        return f"agent node {self.node} pid {os.getpid()}"

    # --- this node's workers

    def check_hangs(self, clock: float) -> None:
        """Kill the local workers that are lost although their process lives: a silent
        heartbeat (the whole process stopped), progress that stalled past its phase's allowance
        while peers wait on them (a main thread stuck with its heartbeat thread alive), or a
        failure record someone else wrote (a rank declared failed must never come back)."""
        w = self.workers
        ranks = [w.ranks[lr] for lr in w.running if w.ranks[lr] not in w.reported]
        if not ranks:
            return
        ages = self.guard.call(self.members.heartbeat.ages, ranks, clock) or {}
        for rank, age in ages.items():
            if age > self.config.heartbeat_timeout_s:
                self._kill_lost(rank, f"heartbeat silent for {age:.1f} s")
        ranks = [r for r in ranks if r not in w.reported]
        for rank, why in self._stalled(ranks).items():
            self._kill_lost(rank, why)
        failed = self.guard.call(self.members.failure_log.failures) or {}
        for rank in [r for r in ranks if r in failed and r not in w.reported]:
            w.reported.add(rank)
            w.signal(w.ranks.index(rank), signal.SIGKILL)
            log(f"worker rank {rank} (pid {w.pids[w.ranks.index(rank)]}) was declared "
                f"{failed[rank].cause} by {failed[rank].reporter}; killed it")

    def store_clock(self) -> float:
        """Now, less the time the store was too busy to take this agent's own heartbeats
        (written from this thread every hb_interval): heartbeat ages are judged as of then. A
        stalled store holds every heartbeat back alike (measured: 5 s while 8 ranks built
        their groups on 2 loaded cores); by the wall clock, every worker and every other node
        would then look silent."""
        now = time.time()
        own = self.guard.call(self.members.store.get, key_agent_hb(self.node))
        try:
            lag = now - float(own) - self.hb_interval
        except (TypeError, ValueError):
            return now
        return now - max(0.0, lag)

    def _stalled(self, ranks: list[int]) -> dict[int, str]:
        """Local ranks whose published progress has not moved for longer than their phase
        allows (by this agent's clock) while some peer waits."""
        everyone = self.guard.call(self.members.heartbeat.progress_of, self._job_ranks()) or {}
        now = time.monotonic()
        out = {}
        for rank in ranks:
            p = everyone.get(rank)
            if p is None:
                continue
            seen = self._progress_seen.get(rank)
            if seen is None or seen[0] != p.seq:
                self._progress_seen[rank] = (p.seq, now)
                continue
            stalled = now - seen[1]
            if p.waiting or p.allow_s <= 0 or stalled <= p.allow_s:
                continue
            waiting = sorted(r for r, q in everyone.items() if r != rank and q.waiting)
            if waiting:
                out[rank] = (f"no progress for {stalled:.1f} s in {p.phase} of iteration "
                             f"{p.iteration} (allowed {p.allow_s:g} s) while rank(s) "
                             f"{waiting} wait")
        return out

    def _job_ranks(self) -> list[int]:
        done = set(self._done())
        restarted = self.guard.call(self.members.store.add, KEY_NEXT_MEMBER, 0) or 0
        return [r for r in range(self.config.world_size + restarted) if r not in done]

    def _done(self) -> set[int]:
        """Ranks reported failed or exited, as far as the store answers."""
        records = self.members.failure_log
        return set(self.guard.call(records.failures) or {}) \
            | set(self.guard.call(records.exited) or [])

    def _kill_lost(self, rank: int, why: str) -> None:
        w = self.workers
        lr = w.ranks.index(rank)
        rec = self.guard.call(self.members.failure_log.report_failure, rank, "hang", why,
                              reporter=self._reporter)
        w.reported.add(rank)
        w.signal(lr, signal.SIGKILL)
        log(f"worker rank {rank} (pid {w.pids[lr]}) hung: {why}; "
            + ("reported to the store" if rec else "NOT reported") + "; killed it")

    # --- the other nodes

    def _node_ranks(self, node: int) -> list[int]:
        info = self.guard.call(node_info, self.members.store, node)
        if info:
            return [int(r) for r in info["ranks"]]
        nproc = self.config.nproc_per_node
        return list(range(node * nproc, (node + 1) * nproc))

    def check_nodes(self, start: float, clock: float) -> None:
        c, store = self.config, self.members.store
        others = [n for n in range(c.nnodes) if n != self.node and n not in self.lost_nodes]
        if not others:
            return
        stale = self.guard.call(self.members.heartbeat.stale_nodes, clock, nodes=others)
        if stale is None:
            return
        now = time.time()
        for n in others:
            reason = None
            if n in stale:
                reason = f"node {n} agent heartbeat silent for more than " \
                         f"{c.heartbeat_timeout_s:g} s"
            elif now - start > c.join_timeout_s and not self.guard.call(
                    store.check, [key_agent_hb(n)]):
                reason = f"node {n} agent never joined within {c.join_timeout_s:g} s"
            if reason is None:
                continue
            self.lost_nodes.add(n)
            done = self._done()
            lost = [r for r in self._node_ranks(n) if r not in done]
            # The node died after its agent's last heartbeat: its age bounds the detection.
            last_beat = self.guard.call(store.get, key_agent_hb(n)) if n in stale else None
            since = None if last_beat is None else round((now - float(last_beat)) * 1e3, 3)
            for r in lost:
                self.guard.call(self.members.failure_log.report_failure, r, "node", reason,
                                when=now, detect_ms=since, reporter=self._reporter)
            log(f"{reason}: ranks {lost} reported lost" if lost
                else f"{reason}: its ranks were reported already")
