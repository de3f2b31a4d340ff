"""chameleon-launch: a torchrun-compatible per-node agent that does not kill survivors.

    chameleon-launch --nproc-per-node 4 [--nnodes 2 --node-rank 0] --master-addr HOST \\
        --master-port PORT [--max-failures 4] [--heartbeat-timeout 5] \\
        [--store HOST:PORT | --store etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE]] \\
        train.py --its --args
    python -m chameleon_ext.control.launcher ...            (the same)

One agent runs per node. The node-0 agent hosts the job's c10d TCPStore at master-addr:master-port
unless --store names an external one: a TCPStore at HOST:PORT, or an etcd cluster
(chameleon_ext.control.etcd_store), the one choice with which the job survives the loss of node 0 (a
TCPStore dies with the process that hosts it). Workers are started with
torch.distributed.elastic.multiprocessing.start_processes (each in its own session, so its whole
process group can be signalled); their environment:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (= node rank), GROUP_WORLD_SIZE,
    ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT (0),
    TORCHELASTIC_MAX_RESTARTS (0), OMP_NUM_THREADS (1 unless set),
    CHAMELEON_STORE              the store's address, host:port or etcd://...
                                 (membership.connect_store reads it)
    CHAMELEON_HEARTBEAT_TIMEOUT  seconds (membership.Membership reads it)
    CHAMELEON_NODE_RANK          the node rank
  with a TCPStore only:
    MASTER_ADDR, MASTER_PORT     the store's host and port: the worker rendezvous
    TORCHELASTIC_USE_AGENT_STORE "True": env:// connects to that store as a client

Worker rendezvous: there is no second port. Workers connect to the store as clients, so the store
outlives any worker. With a TCPStore, a plain ``init_process_group("gloo")`` (env://) works for
the first world (its keys go under ``default_pg/``, as under torchrun); with etcd there is no
TCPStore for env://: the first world meets on ``membership.generation_store(connect_store(), 0)``
(pretrain_gpt.py does so under any store). After an agreement on generation g, the survivors
create the new world on ``PrefixStore(f"gen{g}", connect_store())`` (membership.rebuild_world), so
keys of an old world are never reused.

Unlike torchrun, when a worker dies the agent does not stop the others: it records the failure in
the store (membership.report_failure: rank, cause "signal"/"exit", detail, wall time) as soon as it
sees the exit (SIGCHLD wakes it; a 50 ms poll backs it up) and goes on monitoring. A worker that
exits 0 is recorded as a clean exit, not a failure. A worker whose heartbeat (if it writes one) is
older than --heartbeat-timeout is reported as a "hang" and then SIGKILLed (it has been declared
dead; it must not come back). Every agent writes a heartbeat for its node; when another node's
agent heartbeat goes stale (and that agent did not say it finished) its workers are reported with
cause "node". More than --max-failures failures stop the whole job (exit 1).

With --max-restarts N, the agent starts up to N failed workers of its node again, each under a
new rank (world size + the job's restart count, from the store's ``chameleon/next_member``) with
CHAMELEON_JOIN=1: the failed rank stays failed, and the new one asks to join the running job
(pretrain_gpt.py --chameleon admits it at an iteration boundary; see megatron.elastic.manager).
--restart-delay S keeps the slot empty for S seconds first (a repair time, as a failure trace
states one); a restart still due when the node's last worker ends is dropped.

The agent ends when every worker of the job has exited or been reported failed. Exit status: the
workers' own code when every worker of the node exited with the same non-zero code and nothing
else failed in the job (no signal, hang or lost node: 2 from workers that rejected their
arguments); else 0 when at least one worker finished with 0 and the job was not stopped for
--max-failures, else 1; on SIGINT/SIGTERM (SIGHUP, SIGQUIT) it terminates its workers (SIGTERM,
then SIGKILL after --grace seconds, reaping each by PID/process group), reports them, and exits
130 / 143. Killing the node-0 agent takes a hosted store with it: the job cannot survive that
(use --store etcd://...).

Every worker's pid and host are published at ``chameleon/worker/{rank}`` (see membership's key
layout) when it starts; tools/inject_failure.py uses them.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
from torch.distributed.elastic.multiprocessing.api import SignalException

from chameleon_ext.control import membership as mb

PROG = "chameleon-launch"
POLL_S = 0.05
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class StoreInUse(mb.MembershipError):
    """The external store still holds a finished job (bad input: exit 2)."""


def log(msg: str) -> None:
    print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


def _describe_exit(rc: int) -> tuple[str, str]:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return "signal", name
    return "exit", f"exit code {rc}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="torchrun-compatible launcher whose workers survive the loss of a peer")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="workers on this node (the same on every node)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (a fixed number)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                   help="host of the node-0 agent's store")
    p.add_argument("--master-port", "--master_port", type=int, default=29500,
                   help="port of the node-0 agent's store (0: any free port, one node only)")
    p.add_argument("--max-failures", type=int, default=4,
                   help="worker failures the job tolerates before it is stopped (default 4)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="failed workers this node's agent starts again (default 0); a "
                        "restarted worker gets a new rank and joins the running job "
                        "(CHAMELEON_JOIN=1: pretrain_gpt.py --chameleon is admitted at an "
                        "iteration boundary)")
    p.add_argument("--restart-delay", type=float, default=0.0, metavar="SECONDS",
                   help="seconds a failed worker's slot stays empty before --max-restarts "
                        "starts it again (default 0: at once)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds after which a silent heartbeat means a lost worker or node")
    p.add_argument("--store", metavar="ADDRESS", default=None,
                   help="use this external store instead of hosting one: HOST:PORT (a TCPStore) "
                        "or etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE] (an etcd cluster: the "
                        "job survives the loss of any node, node 0 included; one namespace per "
                        "job)")
    p.add_argument("--store-timeout", type=float, default=60.0,
                   help="seconds to wait for the store (connecting)")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="seconds after which a node whose agent never appeared counts as lost")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers")
    p.add_argument("--log-dir", default=None,
                   help="write each worker's stdout/stderr under this directory (and echo them)")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the training script as an executable, not with python")
    p.add_argument("-m", "--module", action="store_true",
                   help="the training script is a python module (python -m)")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


class Agent:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.nproc = args.nproc_per_node
        self.world_size = self.nproc * args.nnodes
        self.node = args.node_rank
        self.ranks = [self.node * self.nproc + lr for lr in range(self.nproc)]
        self.server: dist.TCPStore | None = None
        self.store: dist.TCPStore | None = None
        self.store_addr = ""
        self.m: mb.Membership | None = None
        self.ctx = None
        self.running: dict[int, object] = {}     # local rank -> Popen
        self.restarts = 0
        self.due: dict[int, float] = {}           # local rank -> monotonic time of its restart
        self.contexts: list = []                  # of the workers restarted
        self.pids: dict[int, int] = {}
        self.outcome: dict[int, int] = {}         # local rank -> return code
        self.reported: set[int] = set()           # global ranks reported failed by this agent
        self._progress_seen: dict[int, tuple[int, float]] = {}  # rank -> (seq, first seen)
        self.lost_nodes: set[int] = set()
        self.stop_signal: int | None = None
        self.aborted: str | None = None
        self.store_broken = False
        self.tmp_log_dir: str | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._last_wake = time.time()
        self._last_loop = time.time()
        self._woken_by_signal = False

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum, frame) -> None:
        if signum in STOP_SIGNALS:
            if self.stop_signal is not None and self.ctx is not None:
                self._kill_all(signal.SIGKILL)     # a second Ctrl-C: no more grace
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
        a = self.a
        self.host, self.port = a.master_addr, a.master_port
        if a.store and a.store.startswith(mb.ETCD_SCHEME):
            self._wait_for_port(mb.parse_etcd_spec(a.store)[0], a.store_timeout)
            if self.stop_signal:
                return
            self.store = mb.connect_store(a.store, timeout_s=a.store_timeout)
            self.store_addr, self.host, self.port = a.store, None, None
        elif a.store:
            host, port = mb.parse_store_spec(a.store)
            self._wait_for_port([(host, port)], a.store_timeout)
            if self.stop_signal:
                return
            self.store = mb.connect_store(a.store, timeout_s=a.store_timeout)
            self.host, self.port = host, port
        elif self.node == 0:
            try:
                self.server = dist.TCPStore(self.host, self.port, None, True,
                                            timedelta(seconds=a.store_timeout),
                                            wait_for_workers=False)
            except Exception as e:
                raise mb.MembershipError(f"cannot host the store at {self.host}:{self.port}: "
                                         f"{str(e).splitlines()[0]}") from e
            self.port = self.server.port
            self.store = self.server
        else:
            self._wait_for_port([(self.host, self.port)], a.store_timeout)
            if self.stop_signal:
                return
            self.store = mb.connect_store(f"{self.host}:{self.port}", timeout_s=a.store_timeout)
        if self.host is not None:
            self.store_addr = (f"[{self.host}]:{self.port}" if ":" in self.host
                               else f"{self.host}:{self.port}")
        self.m = mb.Membership(self.store, None, self.world_size, a.heartbeat_timeout)
        if a.store:
            self._refuse_finished_job()

    def _refuse_finished_job(self) -> None:
        """An external store (an etcd namespace, say) that still holds a job that has finished:
        its records (failures, exits, generations) would be read as this job's."""
        job = mb.job_info(self.store)
        if job is None:
            return
        done = all(self.store.check([mb.key_agent_done(n)]) for n in range(int(job["nnodes"])))
        if done or self.store.check([mb.KEY_ABORT]):
            raise StoreInUse(
                f"the store {self.store_addr} holds a job that has finished (started "
                f"{time.ctime(job['started'])}): give each job its own store or etcd namespace "
                "(etcd://HOST:PORT,.../NEW_NAME)")

    def _wait_for_port(self, addrs: list[tuple[str, int]], timeout_s: float) -> None:
        """Wait until one of `addrs` accepts connections, in Python (a c10d connect would not
        see Ctrl-C)."""
        deadline = time.monotonic() + timeout_s
        while not self.stop_signal:
            for host, port in addrs:
                try:
                    socket.create_connection((host, port), timeout=1).close()
                    return
                except OSError as e:
                    err = e
            if time.monotonic() > deadline:
                where = ", ".join(f"{h}:{p}" for h, p in addrs)
                raise mb.MembershipError(f"no store at {where} after {timeout_s:g} s "
                                         f"({err.strerror or err}): is "
                                         + ("the node-0 agent" if not self.a.store else "it")
                                         + " running?") from None
            self._wait(0.2)

    def _safe(self, fn, *args, **kw):
        """Run a store operation; a broken store is logged once and makes the job fail."""
        try:
            return fn(*args, **kw)
        except Exception as e:
            if not self.store_broken:
                self.store_broken = True
                log(f"the store at {self.store_addr} is unreachable ({str(e).splitlines()[0]}); "
                    "monitoring the local workers only")
            return None

    # ------------------------------------------------------------------ workers

    def _worker_envs(self) -> dict[int, dict[str, str]]:
        a = self.a
        envs = {}
        for lr, rank in enumerate(self.ranks):
            restarted = rank >= self.world_size
            e = {
                "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(self.nproc),
                "GROUP_RANK": str(self.node), "GROUP_WORLD_SIZE": str(a.nnodes),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world_size),
                "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "chameleon",
                "TORCHELASTIC_RESTART_COUNT": str(self.restarts if restarted else 0),
                "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
                mb.STORE_ENV: self.store_addr,
                mb.HEARTBEAT_ENV: repr(float(a.heartbeat_timeout)),
                "CHAMELEON_NODE_RANK": str(self.node),
            }
            if self.host is not None:     # a TCPStore: env:// can rendezvous on it
                e.update({"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": self.host,
                          "MASTER_PORT": str(self.port)})
            if "OMP_NUM_THREADS" not in os.environ:
                e["OMP_NUM_THREADS"] = "1"
            if restarted:
                e[mb.JOIN_ENV] = "1"
            envs[lr] = e
        return envs

    def _entry(self) -> tuple[str, tuple[str, ...]]:
        a = self.a
        if a.no_python:
            return a.training_script, tuple(a.training_script_args)
        if a.module:
            return sys.executable, ("-u", "-m", a.training_script, *a.training_script_args)
        return sys.executable, ("-u", a.training_script, *a.training_script_args)

    def _launch(self, local_ranks: list[int]):
        """start_processes for these local ranks (their ranks and environment as now)."""
        a = self.a
        entry, args = self._entry()
        envs = self._worker_envs()
        if a.log_dir:
            specs = DefaultLogsSpecs(log_dir=a.log_dir, redirects=Std.ALL, tee=Std.ALL)
            prefixes = {i: f"[rank{self.ranks[lr]}]:" for i, lr in enumerate(local_ranks)}
        else:
            if self.tmp_log_dir is None:
                self.tmp_log_dir = tempfile.mkdtemp(prefix="chameleon_launch_")
            specs, prefixes = DefaultLogsSpecs(log_dir=self.tmp_log_dir), None
        ctx = start_processes(name="chameleon", entrypoint=entry,
                              args={i: args for i in range(len(local_ranks))},
                              envs={i: envs[lr] for i, lr in enumerate(local_ranks)},
                              logs_specs=specs, log_line_prefixes=prefixes)
        # start_processes installs handlers that raise SignalException; use ours instead.
        self._install_signals()
        now = time.time()
        hostname = socket.gethostname()
        for i, lr in enumerate(local_ranks):
            proc = ctx.subprocess_handlers[i].proc
            self.running[lr] = proc
            self.pids[lr] = proc.pid
            try:
                pgid = os.getpgid(proc.pid)
            except ProcessLookupError:
                pgid = proc.pid
            rank = self.ranks[lr]
            self._safe(self.store.set, mb.key_worker(rank), json.dumps(
                {"rank": rank, "local_rank": lr, "node": self.node, "host": hostname,
                 "pid": proc.pid, "pgid": pgid, "agent_pid": os.getpid(), "started": now}))
        return ctx

    def _start_workers(self) -> None:
        self.ctx = self._launch(list(range(self.nproc)))
        hostname = socket.gethostname()
        self._safe(self.store.set, mb.key_node(self.node), json.dumps(
            {"node": self.node, "host": hostname, "agent_pid": os.getpid(),
             "ranks": self.ranks, "started": time.time()}))
        pids = ", ".join(str(self.pids[lr]) for lr in range(self.nproc))
        span = (f"rank {self.ranks[0]}" if self.nproc == 1
                else f"ranks {self.ranks[0]}-{self.ranks[-1]}")
        log(f"node {self.node}: started {self.nproc} worker(s), {span} of {self.world_size} "
            f"(pids {pids}); store {self.store_addr}")

    def _restart(self, lr: int) -> None:
        """Start a failed worker's slot again under a new rank (world_size + the job's count of
        restarts so far): its old rank stays failed on the store; the new one joins."""
        count = self._safe(self.store.add, mb.KEY_NEXT_MEMBER, 1)
        if count is None:
            return
        old, self.restarts = self.ranks[lr], self.restarts + 1
        self.ranks[lr] = self.world_size + count - 1
        self.contexts.append(self._launch([lr]))
        log(f"restarted worker rank {old} as rank {self.ranks[lr]} (pid {self.pids[lr]}), "
            f"restart {self.restarts} of --max-restarts {self.a.max_restarts}; it joins the "
            "running job")

    def _signal_worker(self, lr: int, sig: int) -> None:
        pid = self.pids[lr]
        try:
            os.killpg(pid, sig)       # each worker leads its own session / process group
        except ProcessLookupError:
            pass
        except PermissionError:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _kill_all(self, sig: int) -> None:
        for lr in list(self.running):
            self._signal_worker(lr, sig)

    def _reap(self) -> list[tuple[int, int]]:
        done = []
        for lr, proc in list(self.running.items()):
            rc = proc.poll()
            if rc is not None:
                del self.running[lr]
                self.outcome[lr] = rc
                done.append((lr, rc))
        return done

    def _handle_exit(self, lr: int, rc: int, *, stopping: str | None = None) -> None:
        rank, pid = self.ranks[lr], self.pids[lr]
        if rc == 0:
            self._safe(self.m.record_exit, rank, 0)
            log(f"worker rank {rank} (pid {pid}) exited 0")
            return
        if self.aborted is not None and stopping is None:
            return                     # stopped by us on --max-failures: not a new failure
        cause, detail = _describe_exit(rc)
        if stopping:
            detail = f"{detail} ({stopping})"
        if rank in self.reported:      # already reported (a hang we killed)
            return
        # An upper bound of death -> record: from the SIGCHLD wake-up (or the previous poll).
        t0 = self._last_wake if self._woken_by_signal else self._last_loop
        rec = self._safe(self.m.report_failure, rank, cause, detail,
                         detect_ms=round((time.time() - t0) * 1000.0, 3),
                         reporter=f"agent node {self.node} pid {os.getpid()}")
        self.reported.add(rank)
        what = f"signal {detail}" if cause == "signal" else detail
        where = "reported to the store" if rec is not None else "store unreachable: NOT reported"
        log(f"worker rank {rank} (pid {pid}) died: {what}; {where}")

    # ------------------------------------------------------------------ watching others

    def _check_hangs(self, clock: float) -> None:
        """Kill the local workers that are lost although their process lives: a silent
        heartbeat (the whole process stopped), progress that stalled past its phase's allowance
        while peers wait on them (a main thread stuck with its heartbeat thread alive), or a
        failure record someone else wrote (a rank declared failed must never come back)."""
        ranks = [self.ranks[lr] for lr in self.running if self.ranks[lr] not in self.reported]
        if not ranks:
            return
        ages = self._safe(self.m.heartbeat_ages, ranks, clock) or {}
        for rank, age in ages.items():
            if age > self.a.heartbeat_timeout:
                self._kill_lost(rank, f"heartbeat silent for {age:.1f} s")
        ranks = [r for r in ranks if r not in self.reported]
        for rank, why in self._stalled(ranks).items():
            self._kill_lost(rank, why)
        failed = self._safe(self.m.failures) or {}
        for rank in [r for r in ranks if r in failed and r not in self.reported]:
            self.reported.add(rank)
            self._signal_worker(self.ranks.index(rank), signal.SIGKILL)
            log(f"worker rank {rank} (pid {self.pids[self.ranks.index(rank)]}) was declared "
                f"{failed[rank].cause} by {failed[rank].reporter}; killed it")

    def _store_clock(self) -> float:
        """Now, less the time the store was too busy to take this agent's own heartbeats
        (written from this thread every hb_interval): heartbeat ages are judged as of then. A
        stalled store holds every heartbeat back alike (measured: 5 s while 8 ranks built
        their groups on 2 loaded cores); by the wall clock, every worker and every other node
        would then look silent."""
        now = time.time()
        own = self._safe(self.store.get, mb.key_agent_hb(self.node))
        try:
            lag = now - float(own) - self.hb_interval
        except (TypeError, ValueError):
            return now
        return now - max(0.0, lag)

    def _stalled(self, ranks: list[int]) -> dict[int, str]:
        """Local ranks whose published progress has not moved for longer than their phase
        allows (by this agent's clock) while some peer waits."""
        everyone = self._safe(self.m.progress_of, self._job_ranks()) or {}
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
        done = set(self._safe(self.m.failures) or {}) | set(self._safe(self.m.exited) or [])
        restarted = self._safe(self.store.add, mb.KEY_NEXT_MEMBER, 0) or 0
        return [r for r in range(self.world_size + restarted) if r not in done]

    def _kill_lost(self, rank: int, why: str) -> None:
        lr = self.ranks.index(rank)
        rec = self._safe(self.m.report_failure, rank, "hang", why,
                         reporter=f"agent node {self.node} pid {os.getpid()}")
        self.reported.add(rank)
        self._signal_worker(lr, signal.SIGKILL)
        log(f"worker rank {rank} (pid {self.pids[lr]}) hung: {why}; "
            + ("reported to the store" if rec else "NOT reported") + "; killed it")

    def _node_ranks(self, node: int) -> list[int]:
        info = self._safe(mb.node_info, self.store, node)
        if info:
            return [int(r) for r in info["ranks"]]
        return list(range(node * self.nproc, (node + 1) * self.nproc))

    def _check_nodes(self, start: float, clock: float) -> None:
        others = [n for n in range(self.a.nnodes) if n != self.node and n not in self.lost_nodes]
        if not others:
            return
        stale = self._safe(self.m.stale_nodes, clock, nodes=others)
        if stale is None:
            return
        now = time.time()
        for n in others:
            reason = None
            if n in stale:
                reason = f"node {n} agent heartbeat silent for more than " \
                         f"{self.a.heartbeat_timeout:g} s"
            elif now - start > self.a.join_timeout and not self._safe(
                    self.store.check, [mb.key_agent_hb(n)]):
                reason = f"node {n} agent never joined within {self.a.join_timeout:g} s"
            if reason is None:
                continue
            self.lost_nodes.add(n)
            done = set((self._safe(self.m.failures) or {})) | set(self._safe(self.m.exited) or [])
            lost = [r for r in self._node_ranks(n) if r not in done]
            # The node died after its agent's last heartbeat: its age bounds the detection.
            last_beat = self._safe(self.store.get, mb.key_agent_hb(n)) if n in stale else None
            since = None if last_beat is None else round((now - float(last_beat)) * 1e3, 3)
            for r in lost:
                self._safe(self.m.report_failure, r, "node", reason, when=now, detect_ms=since,
                           reporter=f"agent node {self.node} pid {os.getpid()}")
            log(f"{reason}: ranks {lost} reported lost" if lost
                else f"{reason}: its ranks were reported already")

    def _check_failure_budget(self) -> None:
        if self.aborted is not None:
            return
        if self._safe(self.store.check, [mb.KEY_ABORT]):
            self.aborted = (self._safe(self.store.get, mb.KEY_ABORT) or b"").decode()
            log(f"the job is being stopped: {self.aborted}")
            self._stop_workers(reason="job stopped", report=False)
            return
        fails = self._safe(self.m.failures)
        if fails is not None and len(fails) > self.a.max_failures:
            reason = (f"{len(fails)} worker failures exceed --max-failures "
                      f"{self.a.max_failures}")
            self._safe(self.store.compare_set, mb.KEY_ABORT, "", reason)
            self.aborted = reason
            log(f"{reason}: stopping the job")
            self._stop_workers(reason="job stopped", report=False)

    def _stop_workers(self, reason: str, report: bool) -> None:
        """SIGTERM every running worker, SIGKILL after --grace, reap them all."""
        if self.running:
            self._kill_all(signal.SIGTERM)
            deadline = time.monotonic() + self.a.grace
            while self.running and time.monotonic() < deadline:
                for lr, rc in self._reap():
                    self._finish_stopped(lr, rc, reason, report)
                if self.running:
                    self._wait(0.02)
            if self.running:
                self._kill_all(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self.running and time.monotonic() < deadline:
                for lr, rc in self._reap():
                    self._finish_stopped(lr, rc, reason, report)
                if self.running:
                    self._wait(0.02)
            for lr in list(self.running):
                log(f"worker pid {self.pids[lr]} could not be reaped (uninterruptible?)")

    def _finish_stopped(self, lr: int, rc: int, reason: str, report: bool) -> None:
        if report:
            self._handle_exit(lr, rc, stopping=reason)

    def _accounted(self) -> bool:
        fails = self._safe(self.m.failures)
        exits = self._safe(self.m.exited)
        restarted = self._safe(self.store.add, mb.KEY_NEXT_MEMBER, 0)
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
        except SignalException as e:     # a signal inside start_processes
            self.stop_signal = self.stop_signal or int(e.sigval)
            return self._interrupted()
        finally:
            for ctx in [self.ctx, *self.contexts]:
                if ctx is not None:
                    try:
                        ctx.close(timeout=1)
                    except Exception:
                        pass
            if self.tmp_log_dir:
                shutil.rmtree(self.tmp_log_dir, ignore_errors=True)

    def _run(self) -> int:
        a = self.a
        self._open_store()
        if self.stop_signal or self.store is None:
            return self._interrupted()
        start = time.time()
        if self.node == 0 or a.store:
            self._safe(self.store.compare_set, mb.key_job(), "", json.dumps(
                {"world_size": self.world_size, "nnodes": a.nnodes, "nproc_per_node": self.nproc,
                 "heartbeat_timeout": a.heartbeat_timeout, "started": start}))
        hb_interval = self.hb_interval = min(1.0, max(0.05, a.heartbeat_timeout / 5))
        self._safe(self.store.set, mb.key_agent_hb(self.node), f"{time.time():.6f}")
        self._start_workers()
        last_hb = time.monotonic()
        last_watch = 0.0
        while self.running:
            if self.stop_signal:
                return self._interrupted()
            for lr, rc in self._reap():
                self._handle_exit(lr, rc)
                if rc != 0 and self.aborted is None and \
                        self.restarts + len(self.due) < a.max_restarts:
                    self.due[lr] = time.monotonic() + a.restart_delay
            for lr in [lr for lr, at in self.due.items() if at <= time.monotonic()]:
                del self.due[lr]
                if self.running and self.aborted is None:
                    self._restart(lr)
            self._last_loop = time.time()
            if not self.running:
                if self.due:
                    log(f"{len(self.due)} restart(s) still due when the node's last worker "
                        "ended: dropped")
                break
            mono = time.monotonic()
            if mono - last_hb >= hb_interval:
                self._safe(self.store.set, mb.key_agent_hb(self.node), f"{time.time():.6f}")
                last_hb = mono
            if mono - last_watch >= min(hb_interval, 0.25):
                clock = self._store_clock()
                self._check_hangs(clock)
                self._check_nodes(start, clock)
                last_watch = mono
            self._check_failure_budget()
            if self.running:
                self._wait(POLL_S)
        # All local workers are done. Say so, then wait for the rest of the job (this store and
        # the heartbeat may still be needed by the other nodes).
        self._safe(self.store.set, mb.key_agent_hb(self.node), f"{time.time():.6f}")
        self._safe(self.store.set, mb.key_agent_done(self.node), f"{time.time():.6f}")
        while not self.store_broken and self.aborted is None and not self._accounted():
            if self.stop_signal:
                return self._interrupted()
            if time.monotonic() - last_hb >= hb_interval:
                self._safe(self.store.set, mb.key_agent_hb(self.node), f"{time.time():.6f}")
                last_hb = time.monotonic()
            self._check_nodes(start, self._store_clock())
            self._check_failure_budget()
            self._wait(POLL_S)
        code = self._summary()
        if self.server is not None:
            self._wait_for_agents(self.a.grace + 5.0)
        return code

    def _wait_for_agents(self, limit_s: float) -> None:
        """The store host lingers until the other agents have read the store for the last time
        (or are gone): they see the job's end within a poll of it, so `limit_s` is ample."""
        deadline = time.monotonic() + limit_s
        others = [n for n in range(self.a.nnodes) if n != self.node]
        while others and time.monotonic() < deadline and not self.store_broken:
            lost = self._safe(self.m.stale_nodes, nodes=others) or set()
            others = [n for n in others if n not in lost
                      and not self._safe(self.store.check, [mb.key_agent_left(n)])]
            self._wait(POLL_S)

    def _summary(self) -> int:
        fails = self._safe(self.m.failures) or {}
        exits = self._safe(self.m.exited)
        if exits is None or self.store_broken:
            exits = [self.ranks[lr] for lr, rc in self.outcome.items() if rc == 0]
        if self.aborted is None and not self.store_broken:
            abort = self._safe(self.store.check, [mb.KEY_ABORT])
            if abort:
                self.aborted = (self._safe(self.store.get, mb.KEY_ABORT) or b"").decode()
        if not self.store_broken:    # the last read: a store host may go
            self._safe(self.store.set, mb.key_agent_left(self.node), f"{time.time():.6f}")
        ok = bool(exits) and self.aborted is None and not self.store_broken
        same = self._same_exit_code(fails)
        if same is not None:
            log(f"node {self.node} done: all {self.nproc} worker(s) exited with code {same}"
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
        codes = set(self.outcome.values())
        if len(codes) != 1 or len(self.outcome) != self.nproc:
            return None
        code = codes.pop()
        if code <= 0 or any(f.cause != "exit" for f in fails.values()):
            return None
        return code

    def _interrupted(self) -> int:
        sig = self.stop_signal or signal.SIGTERM
        name = signal.Signals(sig).name
        if self.running:
            log(f"got {name}: stopping {len(self.running)} worker(s)")
        self._stop_workers(reason=f"stopped by the agent on {name}",
                           report=self.m is not None and not self.store_broken)
        if self.store is not None and not self.store_broken:
            self._safe(self.store.set, mb.key_agent_done(self.node), f"{time.time():.6f}")
            self._safe(self.store.set, mb.key_agent_left(self.node), f"{time.time():.6f}")
        return 128 + int(sig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            print(f"{PROG}: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if not 0 <= args.node_rank < args.nnodes:
        print(f"{PROG}: error: --node-rank {args.node_rank} is not in 0..{args.nnodes - 1}",
              file=sys.stderr)
        return 2
    if args.max_failures < 0 or args.max_restarts < 0 or args.restart_delay < 0 or \
            args.heartbeat_timeout <= 0:
        print(f"{PROG}: error: --max-failures, --max-restarts and --restart-delay must be >= 0 "
              "and --heartbeat-timeout > 0", file=sys.stderr)
        return 2
    if args.store:
        try:
            mb.check_store_spec(args.store)
        except ValueError as e:
            print(f"{PROG}: error: --store: {e}", file=sys.stderr)
            return 2
    agent = Agent(args)
    try:
        return agent.run()
    except mb.MembershipError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, StoreInUse) else 1


if __name__ == "__main__":
    sys.exit(main())
