"""The agent's side of the job's store: opening it (the node-0 agent hosts a TCPStore unless
--store names one), refusing a store that still holds a finished job, and guarding every
operation on it (a broken store is logged once; the agent then watches its own workers only)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from chameleon_ext.control.agent_log import log
from chameleon_ext.control.keys import KEY_ABORT, key_agent_done
from chameleon_ext.control.launch_config import LaunchConfig
from chameleon_ext.control.poll import poll
from chameleon_ext.control.store import (ETCD_SCHEME, MembershipError, connect_store, job_info,
                                         parse_etcd_spec, parse_store_spec)


class StoreInUse(MembershipError):
    """The external store still holds a finished job (bad input: exit 2)."""


@dataclass
class AgentStore:
    store: dist.Store
    addr: str                           # what the workers get in CHAMELEON_STORE
    host: str | None = None             # a TCPStore's host and port (env:// can meet on it);
    port: int | None = None             # None with etcd
    server: dist.TCPStore | None = None  # the TCPStore this agent hosts, if it does


class StoreGuard:
    """Runs the agent's store operations; the first failure marks the store broken (logged
    once) and every failed operation returns None."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.broken = False

    def call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:
            if not self.broken:
                self.broken = True
                log(f"the store at {self.addr} is unreachable ({str(e).splitlines()[0]}); "
                    "monitoring the local workers only")
            return None


def open_store(config: LaunchConfig, stopped: Callable[[], bool],
               sleep: Callable[[float], object]) -> AgentStore | None:
    """This node's connection to the job's store, or None when `stopped` (a signal) first.
    `sleep` pauses between attempts to reach it (the agent's wakes on signals)."""
    timeout_s = config.store_timeout_s
    if config.store and config.store.startswith(ETCD_SCHEME):
        if not _wait_for_port(parse_etcd_spec(config.store)[0], config, stopped, sleep):
            return None
        return AgentStore(connect_store(config.store, timeout_s=timeout_s), config.store)
    if config.store:
        host, port = parse_store_spec(config.store)
        if not _wait_for_port([(host, port)], config, stopped, sleep):
            return None
        opened = AgentStore(connect_store(config.store, timeout_s=timeout_s), "", host, port)
    elif config.node_rank == 0:
        host = config.master_addr
        try:
            server = dist.TCPStore(host, config.master_port, None, True,
                                   timedelta(seconds=timeout_s), wait_for_workers=False)
        except Exception as e:
            raise MembershipError(f"cannot host the store at {host}:{config.master_port}: "
                                  f"{str(e).splitlines()[0]}") from e
        opened = AgentStore(server, "", host, server.port, server)
    else:
        host, port = config.master_addr, config.master_port
        if not _wait_for_port([(host, port)], config, stopped, sleep):
            return None
        opened = AgentStore(connect_store(f"{host}:{port}", timeout_s=timeout_s), "", host, port)
    opened.addr = (f"[{opened.host}]:{opened.port}" if ":" in opened.host
                   else f"{opened.host}:{opened.port}")
    return opened


def refuse_finished_job(store: dist.Store, addr: str) -> None:
    """An external store (an etcd namespace, say) that still holds a job that has finished:
    its records (failures, exits, generations) would be read as this job's."""
    job = job_info(store)
    if job is None:
        return
    done = all(store.check([key_agent_done(n)]) for n in range(int(job["nnodes"])))
    if done or store.check([KEY_ABORT]):
        raise StoreInUse(
            f"the store {addr} holds a job that has finished (started "
            f"{time.ctime(job['started'])}): give each job its own store or etcd namespace "
            "(etcd://HOST:PORT,.../NEW_NAME)")


def _wait_for_port(addrs: list[tuple[str, int]], config: LaunchConfig,
                   stopped: Callable[[], bool], sleep: Callable[[float], object]) -> bool:
    """Wait until one of `addrs` accepts connections, in Python (a c10d connect would not
    see Ctrl-C); False when `stopped` first."""
    err: OSError | None = None

    def look() -> bool | None:
        nonlocal err
        if stopped():
            return False
        for host, port in addrs:
            try:
                socket.create_connection((host, port), timeout=1).close()
                return True
            except OSError as e:
                err = e
        return None

    reached = poll(look, config.store_timeout_s, 0.2, sleep=sleep)
    if reached is None:
        where = ", ".join(f"{h}:{p}" for h, p in addrs)
        raise MembershipError(f"no store at {where} after {config.store_timeout_s:g} s "
                              f"({err.strerror or err}): is "
                              + ("the node-0 agent" if not config.store else "it")
                              + " running?") from None
    return reached
