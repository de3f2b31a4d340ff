"""The job's store: where it is (an address, parsed and checked), a connection to it, the
records the launcher keeps on it, and the small value formats every protocol shares.

The store is a TCPStore (hosted by the node-0 ``chameleon-launch`` agent, or an external one at
``host:port``) or an etcd cluster (``etcd://host:port,host:port,.../namespace``,
chameleon_ext.control.etcd_store), which survives the loss of any one node, node 0 included.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from datetime import timedelta

import torch.distributed as dist

from chameleon_ext.control.etcd_store import EtcdStore
from chameleon_ext.control.keys import (DEFAULT_HEARTBEAT_TIMEOUT, HEARTBEAT_ENV, STORE_ENV,
                                        key_job, key_node, key_worker)


class MembershipError(RuntimeError):
    """A membership operation that cannot complete; the message names the cause."""


class Member:
    """Who speaks on the job's store: a worker (rank >= 0) or an observer (rank None, an agent
    or a tool), the launch world size, and the heartbeat timeout every judgement of liveness
    uses. Its store connection is used from the calling thread only."""

    def __init__(self, store: dist.Store, rank: int | None, world_size: int,
                 heartbeat_timeout: float | None = None):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        if heartbeat_timeout is None:
            heartbeat_timeout = float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_TIMEOUT))
        self.heartbeat_timeout = float(heartbeat_timeout)

    def require_rank(self, what: str) -> int:
        if self.rank is None:
            raise MembershipError(f"{what} needs a worker rank (this member is an observer)")
        return self.rank


class JsonRecord:
    """The JSON round-trip of a flat dataclass on the store; keys it does not know are left
    out (a record written by a newer version)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes):
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def as_text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def parse_log(v: bytes | str) -> list[int]:
    out: list[int] = []
    for tok in as_text(v).split(","):
        tok = tok.strip()
        if tok:
            r = int(tok)
            if r not in out:
                out.append(r)
    return out


def read_log(store: dist.Store, key: str) -> list[int]:
    return parse_log(store.get(key)) if store.check([key]) else []



# ----------------------------------------------------------------------------------- the store

def parse_store_spec(spec: str) -> tuple[str, int]:
    """'host:port' (or '[v6addr]:port') -> (host, port); ValueError naming the problem."""
    spec = spec.strip()
    host, sep, port = spec.rpartition(":")
    if not sep or not host:
        raise ValueError(f"store address {spec!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port_n = int(port)
    except ValueError:
        raise ValueError(f"store address {spec!r}: port {port!r} is not an integer") from None
    if not 0 < port_n < 65536:
        raise ValueError(f"store address {spec!r}: port {port_n} is out of range")
    return host, port_n


ETCD_SCHEME = "etcd://"


def parse_etcd_spec(spec: str) -> tuple[list[tuple[str, int]], str]:
    """'etcd://h:p[,h:p...][/namespace]' -> ([(host, port), ...], namespace); ValueError naming
    the problem. The namespace (default 'default') holds this job's keys."""
    rest = spec.strip()[len(ETCD_SCHEME):]
    hosts, _, namespace = rest.partition("/")
    if not hosts:
        raise ValueError(f"store address {spec!r} names no etcd endpoint (etcd://HOST:PORT,...)")
    endpoints = [parse_store_spec(h) for h in hosts.split(",")]
    namespace = namespace.strip("/")
    if namespace and not all(c.isalnum() or c in "-_./" for c in namespace):
        raise ValueError(f"store address {spec!r}: namespace {namespace!r} may hold only letters, "
                         "digits, '-', '_', '.' and '/'")
    return endpoints, namespace or "default"


def check_store_spec(spec: str) -> None:
    """ValueError naming the problem unless `spec` is 'host:port' or an etcd:// address."""
    if spec.strip().startswith(ETCD_SCHEME):
        parse_etcd_spec(spec)
    else:
        parse_store_spec(spec)


def connect_store(spec: str | None = None, timeout_s: float = 60.0) -> dist.Store:
    """A client of the job's store: 'host:port' (a TCPStore) or 'etcd://h:p,.../ns' (an
    EtcdStore); default: $CHAMELEON_STORE.

    `timeout_s` is the store's timeout: how long connecting retries and how long a blocking
    get/wait on an absent key waits. The protocols never block on absent keys (they test with
    check).
    """
    if spec is None:
        spec = os.environ.get(STORE_ENV)
        if not spec:
            raise MembershipError(f"no store address: ${STORE_ENV} is not set "
                                  "(start the job with chameleon-launch, or pass host:port)")
    if spec.strip().startswith(ETCD_SCHEME):
        endpoints, namespace = parse_etcd_spec(spec)
        try:
            return EtcdStore(endpoints, namespace, timeout=timedelta(seconds=timeout_s),
                             connect_timeout_s=timeout_s)
        except RuntimeError as e:      # EtcdUnavailable, EtcdRequestError
            raise MembershipError(f"cannot reach the etcd store {spec}: {e}") from e
    host, port = parse_store_spec(spec)
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as e:   # DistStoreError, RuntimeError
        raise MembershipError(f"cannot connect to the store at {host}:{port} "
                              f"within {timeout_s:g} s: {e}") from e


def generation_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    """The rendezvous store of generation `generation`'s process groups."""
    return dist.PrefixStore(f"gen{generation}", store)


# ----------------------------------------------------------------------------------- job records

def worker_info(store: dist.Store, rank: int) -> dict | None:
    """The launcher's record of `rank` (pid, host, node, ...), or None."""
    k = key_worker(rank)
    return json.loads(store.get(k)) if store.check([k]) else None


def node_info(store: dist.Store, node: int) -> dict | None:
    k = key_node(node)
    return json.loads(store.get(k)) if store.check([k]) else None


def job_info(store: dist.Store) -> dict | None:
    k = key_job()
    return json.loads(store.get(k)) if store.check([k]) else None


def nodes_from_store(store, ranks: int | list[int], timeout_s: float = 60.0) -> dict[int, int]:
    """rank -> node for `ranks` (a list of launch ranks, or a world size: ranks 0..n-1), from
    the launcher's worker records.

    Each agent publishes its workers' records as it starts them, so a worker may ask before
    another node's agent has started: this waits up to `timeout_s` (the first rendezvous would
    wait for that node as long), then raises MembershipError naming the ranks still unknown."""
    ranks = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
    keys = [key_worker(r) for r in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:     # DistStoreError: some never appeared
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise MembershipError(f"ranks {missing} have no worker record on the store after "
                        f"{timeout_s:g} s: their nodes are unknown") from None
    return {r: int(json.loads(v)["node"]) for r, v in zip(ranks, store.multi_get(keys))}
