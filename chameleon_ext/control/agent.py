"""The per-node agent of chameleon-launch: it starts this node's workers, reports each death to
the store instead of stopping the others, watches for hangs and lost nodes (watch.py), restarts
failed workers under new ranks, stops the job past --max-failures, and ends once every worker of
the job is accounted for. chameleon_ext.control.launcher says what it does, flag by flag."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time

from chameleon_ext.control.agent_log import log
from chameleon_ext.control.agent_store import (AgentStore, StoreGuard, open_store,
                                               refuse_finished_job)
from chameleon_ext.control.forkserver import ForkServer, WorkerStartError
from chameleon_ext.control.keys import (KEY_ABORT, KEY_NEXT_MEMBER, key_agent_done, key_agent_hb,
                                        key_agent_left, key_job)
from chameleon_ext.control.launch_config import LaunchConfig
from chameleon_ext.control.membership import Membership
from chameleon_ext.control.poll import poll
from chameleon_ext.control.watch import Watch
from chameleon_ext.control.workers import Workers

# Between looks at the workers and the store when no signal wakes the agent: a worker's exit
# wakes it at once (SIGCHLD), so this bounds only what has no signal (heartbeats, records).
POLL_S = 0.05
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _describe_exit(rc: int) -> tuple[str, str]:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return "signal", name
    return "exit", f"exit code {rc}"


class Agent:
    """One node's agent; `server` is its workers' fork server, started by the caller as early
    as it can be (launcher.main), and closed by `run`."""

    def __init__(self, config: LaunchConfig, server: ForkServer):
        self.config = config
        self.node = config.node_rank
        self.world_size = config.world_size
        self.opened: AgentStore | None = None
        self.guard = StoreGuard("")
        self.members: Membership | None = None
        self.workers: Workers | None = None
        self.server = server
        self.watch: Watch | None = None
        # local rank -> (monotonic time of its restart, time.time() it may join from or None)
        self.due: dict[int, tuple[float, float | None]] = {}
        self.stop_signal: int | None = None
        self.aborted: str | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._last_wake = time.time()
        self._last_loop = time.time()
        self._woken_by_signal = False

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum, frame) -> None:
        if signum in STOP_SIGNALS:
            if self.stop_signal is not None and self.workers is not None:
                self.workers.signal_all(signal.SIGKILL)     # a second Ctrl-C: no more grace
            self.stop_signal = self.stop_signal or signum

    def _install_signals(self) -> None:
        for s in (*STOP_SIGNALS, signal.SIGCHLD):
            signal.signal(s, self._on_signal)

    def _wait(self, timeout: float) -> None:
        """Sleep until a signal arrives (SIGCHLD: a worker changed state) or `timeout`."""
        ready, _, _ = select.select([self._wake_r], [], [], timeout)
        if ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
            self._woken_by_signal = True
            self._last_wake = time.time()
        else:
            self._woken_by_signal = False

    # ------------------------------------------------------------------ store

    def _open_store(self) -> None:
        c = self.config
        self.opened = open_store(c, lambda: bool(self.stop_signal), self._wait)
        if self.opened is None:
            return
        self.guard.addr = self.opened.addr
        self.members = Membership(self.opened.store, None, self.world_size,
                                  c.heartbeat_timeout_s)
        if c.store:
            refuse_finished_job(self.opened.store, self.opened.addr)

    def _beat(self) -> None:
        self.guard.call(self.opened.store.set, key_agent_hb(self.node), f"{time.time():.6f}")

    # ------------------------------------------------------------------ exits

    def _handle_exit(self, lr: int, rc: int, *, stopping: str | None = None) -> None:
        w = self.workers
        rank, pid = w.ranks[lr], w.pids[lr]
        if rc == 0:
            self.guard.call(self.members.failure_log.record_exit, rank, 0)
            log(f"worker rank {rank} (pid {pid}) exited 0")
            return
        if self.aborted is not None and stopping is None:
            return                     # stopped by us on --max-failures: not a new failure
        cause, detail = _describe_exit(rc)
        if stopping:
            detail = f"{detail} ({stopping})"
        if rank in w.reported:         # already reported (a hang we killed)
            return
        # An upper bound of death -> record: from the SIGCHLD wake-up (or the previous poll).
        t0 = self._last_wake if self._woken_by_signal else self._last_loop
        rec = self.guard.call(self.members.failure_log.report_failure, rank, cause, detail,
                              detect_ms=round((time.time() - t0) * 1000.0, 3),
                              reporter=f"agent node {self.node} pid {os.getpid()}")
        w.reported.add(rank)
        what = f"signal {detail}" if cause == "signal" else detail
        where = "reported to the store" if rec is not None else "store unreachable: NOT reported"
        log(f"worker rank {rank} (pid {pid}) died: {what}; {where}")

    def _check_failure_budget(self) -> None:
        if self.aborted is not None:
            return
        store = self.opened.store
        if self.guard.call(store.check, [KEY_ABORT]):
            self.aborted = (self.guard.call(store.get, KEY_ABORT) or b"").decode()
            log(f"the job is being stopped: {self.aborted}")
            self._stop_workers(reason="job stopped", report=False)
            return
        fails = self.guard.call(self.members.failure_log.failures)
        if fails is not None and len(fails) > self.config.max_failures:
            reason = (f"{len(fails)} worker failures exceed --max-failures "
                      f"{self.config.max_failures}")
            self.guard.call(store.compare_set, KEY_ABORT, "", reason)
            self.aborted = reason
            log(f"{reason}: stopping the job")
            self._stop_workers(reason="job stopped", report=False)

    def _stop_workers(self, reason: str, report: bool) -> None:
        """SIGTERM every running worker, SIGKILL after --grace, reap them all."""
        w = self.workers
        if w is None or not w.running:
            return

        def reaped() -> bool | None:
            for lr, rc in w.reap():
                if report:
                    self._handle_exit(lr, rc, stopping=reason)
            return True if not w.running else None

        w.signal_all(signal.SIGTERM)
        if poll(reaped, self.config.grace_s, 0.02, sleep=self._wait) is None:
            w.signal_all(signal.SIGKILL)
            # A SIGKILLed process is reaped within milliseconds unless it is in the kernel
            # (uninterruptible): 10 s tells such a worker from a slow one.
            poll(reaped, 10.0, 0.02, sleep=self._wait)
        for lr in list(w.running):
            log(f"worker pid {w.pids[lr]} could not be reaped (uninterruptible?)")

    def _accounted(self) -> bool:
        fails = self.guard.call(self.members.failure_log.failures)
        exits = self.guard.call(self.members.failure_log.exited)
        restarted = self.guard.call(self.opened.store.add, KEY_NEXT_MEMBER, 0)
        if fails is None or exits is None or restarted is None:
            return True                 # no store: nothing more to wait for
        return set(range(self.world_size + restarted)) <= set(fails) | set(exits)

    # ------------------------------------------------------------------ main

    def run(self) -> int:
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._install_signals()
        try:
            return self._run()
        except WorkerStartError as e:
            log(f"node {self.node}: {e}; exit 1")
            self._stop_workers(reason="no fork server", report=self.members is not None)
            return 1
        finally:
            if self.workers is not None:
                # what still runs after an error would outlive its agent
                self._stop_workers(reason="the agent is ending", report=False)
                self.workers.close()
            self.server.close()

    def _run(self) -> int:
        c = self.config
        self._open_store()
        if self.stop_signal or self.opened is None:
            return self._interrupted()
        store = self.opened.store
        start = time.time()
        if self.node == 0 or c.store:
            self.guard.call(store.compare_set, key_job(), "", json.dumps(
                {"world_size": self.world_size, "nnodes": c.nnodes,
                 "nproc_per_node": c.nproc_per_node, "heartbeat_timeout": c.heartbeat_timeout_s,
                 "started": start}))
        hb_interval = min(1.0, max(0.05, c.heartbeat_timeout_s / 5))
        self._beat()
        w = self.workers = Workers(c, self.opened, self.guard, self.server)
        self.watch = Watch(c, self.members, self.guard, w, hb_interval)
        while not self.server.ready(hb_interval):      # the node stays heartbeating meanwhile
            if self.stop_signal:
                return self._interrupted()
            self._beat()
        w.start()
        last_hb = time.monotonic()
        last_watch = 0.0
        while w.running:
            if self.stop_signal:
                return self._interrupted()
            for lr, rc in w.reap():
                self._handle_exit(lr, rc)
                if rc != 0 and self.aborted is None and \
                        w.restarts + len(self.due) < c.max_restarts:
                    ahead = min(c.start_ahead_s, c.restart_delay_s)
                    self.due[lr] = (time.monotonic() + c.restart_delay_s - ahead,
                                    time.time() + c.restart_delay_s if ahead else None)
            for lr in [lr for lr, (at, _) in self.due.items() if at <= time.monotonic()]:
                _, join_at = self.due.pop(lr)
                if w.running and self.aborted is None:
                    w.restart(lr, join_at)
            self._last_loop = time.time()
            if not w.running:
                if self.due:
                    log(f"{len(self.due)} restart(s) still due when the node's last worker "
                        "ended: dropped")
                break
            mono = time.monotonic()
            if mono - last_hb >= hb_interval:
                self._beat()
                last_hb = mono
            if mono - last_watch >= min(hb_interval, 0.25):
                clock = self.watch.store_clock()
                self.watch.check_hangs(clock)
                self.watch.check_nodes(start, clock)
                last_watch = mono
            self._check_failure_budget()
            if w.running:
                self._wait(POLL_S)
        # All local workers are done. Say so, then wait for the rest of the job (this store and
        # the heartbeat may still be needed by the other nodes).
        self._beat()
        self.guard.call(store.set, key_agent_done(self.node), f"{time.time():.6f}")
        while not self.guard.broken and self.aborted is None and not self._accounted():
            if self.stop_signal:
                return self._interrupted()
            if time.monotonic() - last_hb >= hb_interval:
                self._beat()
                last_hb = time.monotonic()
            self.watch.check_nodes(start, self.watch.store_clock())
            self._check_failure_budget()
            self._wait(POLL_S)
        code = self._summary()
        if self.opened.server is not None:
            self._wait_for_agents(c.grace_s + 5.0)
        return code

    def _wait_for_agents(self, limit_s: float) -> None:
        """The store host lingers until the other agents have read the store for the last time
        (or are gone): they see the job's end within a poll of it, so `limit_s` is ample."""
        others = [n for n in range(self.config.nnodes) if n != self.node]

        def gone() -> bool | None:
            nonlocal others
            if not others or self.guard.broken:
                return True
            lost = self.guard.call(self.members.heartbeat.stale_nodes, nodes=others) or set()
            others = [n for n in others if n not in lost and not self.guard.call(
                self.opened.store.check, [key_agent_left(n)])]
            return None

        poll(gone, limit_s, POLL_S, sleep=self._wait)

    def _summary(self) -> int:
        store, w = self.opened.store, self.workers
        fails = self.guard.call(self.members.failure_log.failures) or {}
        exits = self.guard.call(self.members.failure_log.exited)
        if exits is None or self.guard.broken:
            exits = [w.ranks[lr] for lr, rc in w.outcome.items() if rc == 0]
        if self.aborted is None and not self.guard.broken:
            if self.guard.call(store.check, [KEY_ABORT]):
                self.aborted = (self.guard.call(store.get, KEY_ABORT) or b"").decode()
        if not self.guard.broken:    # the last read: a store host may go
            self.guard.call(store.set, key_agent_left(self.node), f"{time.time():.6f}")
        ok = bool(exits) and self.aborted is None and not self.guard.broken
        same = self._same_exit_code(fails)
        if same is not None:
            log(f"node {self.node} done: all {w.nproc} worker(s) exited with code {same}"
                + (" (bad arguments?)" if same == 2 else "")
                + (f"; stopped: {self.aborted}" if self.aborted else "") + f"; exit {same}")
            return same
        failed = ", ".join(f"rank {r}: {f.cause}" + (f" ({f.detail})" if f.detail else "")
                           for r, f in sorted(fails.items()))
        code = 0 if ok else 1
        log(f"node {self.node} done: {len(exits)} worker(s) finished, {len(fails)} failed"
            + (f" ({failed})" if failed else "")
            + (f"; stopped: {self.aborted}" if self.aborted else "") + f"; exit {code}")
        return code

    def _same_exit_code(self, fails: dict) -> int | None:
        """The code every worker of this node exited with by itself (the same, non-zero), when
        nothing else failed in the job: the workers' own verdict (2: their arguments), which
        the agent passes on. None otherwise (a signal, a hang, a lost node, mixed codes)."""
        outcome = self.workers.outcome
        codes = set(outcome.values())
        if len(codes) != 1 or len(outcome) != self.config.nproc_per_node:
            return None
        code = codes.pop()
        if code <= 0 or any(f.cause != "exit" for f in fails.values()):
            return None
        return code

    def _interrupted(self) -> int:
        sig = self.stop_signal or signal.SIGTERM
        name = signal.Signals(sig).name
        if self.workers is not None and self.workers.running:
            log(f"got {name}: stopping {len(self.workers.running)} worker(s)")
        self._stop_workers(reason=f"stopped by the agent on {name}",
                           report=self.members is not None and not self.guard.broken)
        if self.opened is not None and not self.guard.broken:
            store = self.opened.store
            self.guard.call(store.set, key_agent_done(self.node), f"{time.time():.6f}")
            self.guard.call(store.set, key_agent_left(self.node), f"{time.time():.6f}")
        return 128 + int(sig)
