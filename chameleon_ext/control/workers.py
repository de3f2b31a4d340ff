"""One node's worker processes: their environment, starting and restarting them (forked by the
node's fork server, each in a session of its own, so its whole process group can be signalled),
signalling and reaping them. Every worker's pid and host are published at
``chameleon/worker/{rank}`` as it starts."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from chameleon_ext.control.agent_log import log
from chameleon_ext.control.agent_store import AgentStore, StoreGuard
from chameleon_ext.control.forkserver import ForkServer, StartRequest, WorkerProcess, omp_threads
from chameleon_ext.control.keys import (HEARTBEAT_ENV, JOIN_AT_ENV, JOIN_ENV, KEY_NEXT_MEMBER,
                                        RESTART_DELAY_ENV, STORE_ENV, key_node, key_worker)
from chameleon_ext.control.launch_config import LaunchConfig


class Workers:
    """The workers of node `config.node_rank`, by local rank, forked by `server`
    (Workers.fork_server), restarts included."""

    def __init__(self, config: LaunchConfig, opened: AgentStore, guard: StoreGuard,
                 server: ForkServer | None):
        self.server = server
        self.config = config
        self.opened = opened
        self.guard = guard
        self.nproc = config.nproc_per_node
        self.node = config.node_rank
        self.world_size = config.world_size
        self.ranks = [self.node * self.nproc + lr for lr in range(self.nproc)]
        self.running: dict[int, WorkerProcess] = {}     # local rank -> its process
        self.pids: dict[int, int] = {}
        self.outcome: dict[int, int] = {}         # local rank -> return code
        self.reported: set[int] = set()           # global ranks reported failed by this agent
        self.restarts = 0
        self.tails: list[TailLog] = []            # --log-dir: the files echoed, per start

    def _envs(self, join_at: float | None = None) -> dict[int, dict[str, str]]:
        """Every local rank's environment; a restarted one asks to join from `join_at` on."""
        c, opened = self.config, self.opened
        envs = {}
        for lr, rank in enumerate(self.ranks):
            restarted = rank >= self.world_size
            e = {
                "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(self.nproc),
                "GROUP_RANK": str(self.node), "GROUP_WORLD_SIZE": str(c.nnodes),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world_size),
                "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "chameleon",
                "TORCHELASTIC_RESTART_COUNT": str(self.restarts if restarted else 0),
                "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts),
                STORE_ENV: opened.addr,
                HEARTBEAT_ENV: repr(float(c.heartbeat_timeout_s)),
                "CHAMELEON_NODE_RANK": str(self.node),
            }
            if c.max_restarts > 0 and c.restart_delay_s > 0:
                # a lost slot comes back after the delay: the repair time the planner weighs
                # (a zero delay says no more than the start-up, which the job measures)
                e[RESTART_DELAY_ENV] = repr(float(c.restart_delay_s))
            if opened.host is not None:     # a TCPStore: env:// can rendezvous on it
                e.update({"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": opened.host,
                          "MASTER_PORT": str(opened.port)})
            e["OMP_NUM_THREADS"] = omp_threads()
            if restarted:
                e[JOIN_ENV] = "1"
                if join_at is not None:
                    e[JOIN_AT_ENV] = f"{join_at:.6f}"
            envs[lr] = e
        return envs

    def _entry(self) -> tuple[str, list[str]]:
        """The fork server's kind of start and the worker's argv."""
        c = self.config
        kind = "exec" if c.no_python else "module" if c.module else "script"
        return kind, [c.training_script, *c.training_script_args]

    def _log_files(self, rank: int) -> tuple[str | None, str | None]:
        """--log-dir: the worker's stdout and stderr files, echoed with a [rankN]: prefix."""
        if not self.config.log_dir:
            return None, None
        where = os.path.join(self.config.log_dir, f"rank{rank}")
        os.makedirs(where, exist_ok=True)
        files = tuple(os.path.join(where, name) for name in ("stdout.log", "stderr.log"))
        for path, dst in zip(files, (sys.stdout, sys.stderr)):
            open(path, "a").close()         # TailLog waits for a file that does not exist
            self.tails.append(TailLog("chameleon", {rank: path}, dst,
                                      log_line_prefixes={rank: f"[rank{rank}]:"}).start())
        return files

    def _launch(self, local_ranks: list[int], join_at: float | None = None) -> None:
        """Fork these local ranks' workers (their ranks and environment as now; a restarted
        one asks to join from `join_at` on)."""
        kind, argv = self._entry()
        envs = self._envs(join_at)
        hostname = socket.gethostname()
        for lr in local_ranks:
            rank = self.ranks[lr]
            stdout, stderr = self._log_files(rank)
            proc = self.server.start(StartRequest(kind, argv, {**os.environ, **envs[lr]},
                                                     stdout, stderr))
            self.running[lr] = proc
            self.pids[lr] = proc.pid
            self.guard.call(self.opened.store.set, key_worker(rank), json.dumps(
                {"rank": rank, "local_rank": lr, "node": self.node, "host": hostname,
                 "pid": proc.pid, "pgid": proc.pid, "agent_pid": os.getpid(),
                 "started": time.time()}))

    def start(self) -> None:
        self._launch(list(range(self.nproc)))
        self.guard.call(self.opened.store.set, key_node(self.node), json.dumps(
            {"node": self.node, "host": socket.gethostname(), "agent_pid": os.getpid(),
             "ranks": self.ranks, "started": time.time()}))
        pids = ", ".join(str(self.pids[lr]) for lr in range(self.nproc))
        span = (f"rank {self.ranks[0]}" if self.nproc == 1
                else f"ranks {self.ranks[0]}-{self.ranks[-1]}")
        log(f"node {self.node}: started {self.nproc} worker(s), {span} of {self.world_size} "
            f"(pids {pids}); store {self.opened.addr}")

    def restart(self, lr: int, join_at: float | None = None) -> None:
        """Start a failed worker's slot again under a new rank (world_size + the job's count of
        restarts so far): its old rank stays failed on the store; the new one joins, not
        before `join_at` (time.time() seconds) when given."""
        count = self.guard.call(self.opened.store.add, KEY_NEXT_MEMBER, 1)
        if count is None:
            return
        old, self.restarts = self.ranks[lr], self.restarts + 1
        self.ranks[lr] = self.world_size + count - 1
        self._launch([lr], join_at)
        log(f"restarted worker rank {old} as rank {self.ranks[lr]} (pid {self.pids[lr]}), "
            f"restart {self.restarts} of --max-restarts {self.config.max_restarts}; it joins "
            "the running job")

    def signal(self, lr: int, sig: int) -> None:
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

    def signal_all(self, sig: int) -> None:
        for lr in list(self.running):
            self.signal(lr, sig)

    def reap(self) -> list[tuple[int, int]]:
        """(local rank, return code) of each worker that ended since the last look."""
        done = []
        for lr, proc in list(self.running.items()):
            rc = proc.poll()
            if rc is not None:
                del self.running[lr]
                self.outcome[lr] = rc
                done.append((lr, rc))
        return done

    def close(self) -> None:
        """End the echoes of --log-dir (the agent has stopped the workers)."""
        for tail in self.tails:
            tail.stop()
