"""Membership over torch's c10d store: heartbeats, failure records, agreement, generations.

Everything here talks to the job's store, never to a process group: a broken process group cannot
be used to agree on how to replace it. The store is a TCPStore (hosted by the node-0
``chameleon-launch`` agent, or an external one at ``host:port``) or an etcd cluster
(``etcd://host:port,host:port,.../namespace``, chameleon_ext.control.etcd_store), which survives the loss
of any one node, node 0 included. Workers and agents use the same functions.

Store key layout (all keys below the ``chameleon/`` root; values are UTF-8 text or JSON)::

    chameleon/job                      JSON {"world_size", "nnodes", "nproc_per_node",
                                       "heartbeat_timeout", "started"}       (node-0 agent)
    chameleon/worker/{rank}            JSON {"rank", "local_rank", "node", "host", "pid", "pgid",
                                       "agent_pid", "started"}   (set by the agent when it starts
                                       the worker; inject_failure.py reads it)
    chameleon/node/{node}              JSON {"node", "host", "agent_pid", "ranks", "started"}
    chameleon/agent_hb/{node}          wall time (time.time()) of the node agent's last heartbeat
    chameleon/agent_done/{node}        set when that agent has finished (not a node loss)
    chameleon/agent_left/{node}        set when that agent has read the store for the last time
                                       (an agent that hosts the store waits for it)
    chameleon/hb/{rank}                wall time of the worker's last heartbeat; "off:<time>" once
                                       it stopped heartbeating on purpose (Membership.stop)
    chameleon/progress/{rank}          JSON Progress: what the worker's main thread is doing
                                       (iteration, a counter bumped at every op, phase, whether it
                                       waits on peers), written with each heartbeat
    chameleon/failure/{rank}           JSON FailureRecord; the first report wins (compare_set)
    chameleon/failures                 append log "r,r,..." of reported ranks (may repeat)
    chameleon/exit/{rank}              JSON {"rank", "exitcode": 0, "time"}: a clean exit
    chameleon/exits                    append log "r,r,..." of cleanly exited ranks
    chameleon/abort                    reason text: the job is being stopped (--max-failures)
    chameleon/generation               the latest agreed generation (set by its leader)
    chameleon/gen/{g}/arrived/{rank}   JSON {"time", "iteration"}: a rank's arrival at agreement g
                                       and the last iteration whose step it applied
    chameleon/gen/{g}/arrivals         append log "r,r,..." of arrived ranks
    chameleon/gen/{g}/final            JSON Agreement, written once (compare_set) by the leader
    chameleon/gen/{g}/pub/{key}        bytes published for generation g (e.g. the plan JSON)
    chameleon/gen/{g}/ready/{rank}     the rank is about to build generation g's world
    chameleon/gen/{g}/noticed          wall time the first rank saw generation g - 1's world break
    chameleon/gen/{g}/retry            JSON next generation: g's world could not be built (a
                                       participant failed meanwhile); everyone agrees again there
    chameleon/gen/{g}/committed        g's world is built and holds the state (its leader, after
                                       the first collective); ranks g's plan left out may go
    chameleon/gen/{g}/commit/{i}/votes counter: ranks of generation g ready to apply step i
    chameleon/gen/{g}/commit/{i}/decision  "commit" or "abort", written once (compare_set)
    chameleon/next_member              counter: a restarted worker's rank is world_size + its
                                       value (set by the agent that restarts it)
    chameleon/joins                    append log "r,r,..." of ranks asking to join
    chameleon/admission/{n}            JSON {"after": iteration, "joiners": [...]}: the n-th
                                       admission, at the end of that iteration (its leader)
    chameleon/admit/{rank}             JSON {"generation", "candidates", "admission"}: where a
                                       joiner meets the others
    chameleon/trained                  the last iteration, once the job trained it (its lead): no
                                       boundary is left to admit a joiner at

Process groups of generation g rendezvous on ``PrefixStore(f"gen{g}", store)`` (see
``generation_store`` and ``rebuild_world``); the first world is generation 0 (pretrain_gpt.py
meets on ``gen0``; a script may use ``env://`` on a TCPStore instead, whose keys live under
``default_pg/``), so no prefix is ever reused.

A survivor's recovery, in order (what tests/dist/test_launcher.py runs)::

    store = connect_store(); m = Membership.from_env(store); m.start_heartbeat()
    ...
    except RuntimeError:                      # a collective failed ("Connection reset by peer")
        dist.destroy_process_group()          # FIRST: closing our sockets makes peers that are
                                              # still blocked in the collective fail at once
        ag = m.agree(generation + 1, alive)   # on the store, never on the broken group
        new_rank = rebuild_world(store, ag, old_rank)   # PrefixStore(f"gen{g}", store)
        generation, alive = ag.generation, ag.alive

Without the destroy, a survivor that is not a TCP neighbour of the dead rank may wait in the
collective until another survivor exits (or the group timeout), and agreement times out on it.

Heartbeat ages compare wall clocks (``time.time()``): across nodes the clocks must agree to well
within the heartbeat timeout (NTP). A rank that never wrote a heartbeat is never heartbeat-stale;
it can still be stale through its node agent (a node agent whose heartbeat is stale and that did
not say it finished takes all of its ranks with it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch.distributed as dist

from chameleon_ext.control.etcd_store import EtcdStore

STORE_ENV = "CHAMELEON_STORE"
HEARTBEAT_ENV = "CHAMELEON_HEARTBEAT_TIMEOUT"
JOIN_ENV = "CHAMELEON_JOIN"     # "1": a restarted worker, joining a running job
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
ROOT = "chameleon"

CAUSES = ("exit", "signal", "hang", "comm", "node")


# ----------------------------------------------------------------------------------- key layout

def key_job() -> str:
    return f"{ROOT}/job"


def key_worker(rank: int) -> str:
    return f"{ROOT}/worker/{rank}"


def key_node(node: int) -> str:
    return f"{ROOT}/node/{node}"


def key_agent_hb(node: int) -> str:
    return f"{ROOT}/agent_hb/{node}"


def key_agent_done(node: int) -> str:
    return f"{ROOT}/agent_done/{node}"


def key_agent_left(node: int) -> str:
    return f"{ROOT}/agent_left/{node}"


def key_hb(rank: int) -> str:
    return f"{ROOT}/hb/{rank}"


def key_failure(rank: int) -> str:
    return f"{ROOT}/failure/{rank}"


KEY_FAILURES = f"{ROOT}/failures"
KEY_EXITS = f"{ROOT}/exits"
KEY_ABORT = f"{ROOT}/abort"
KEY_GENERATION = f"{ROOT}/generation"


KEY_NEXT_MEMBER = f"{ROOT}/next_member"
KEY_JOINS = f"{ROOT}/joins"
KEY_TRAINED = f"{ROOT}/trained"


def key_admission(n: int) -> str:
    return f"{ROOT}/admission/{n}"


def key_admit(rank: int) -> str:
    return f"{ROOT}/admit/{rank}"


def key_dying(rank: int) -> str:
    return f"{ROOT}/dying/{rank}"


def key_exit(rank: int) -> str:
    return f"{ROOT}/exit/{rank}"


def key_progress(rank: int) -> str:
    return f"{ROOT}/progress/{rank}"


def gen_prefix(generation: int) -> str:
    return f"{ROOT}/gen/{generation}"


# ----------------------------------------------------------------------------------- errors, data

class MembershipError(RuntimeError):
    """A membership operation that cannot complete; the message names the cause."""


class AgreementTimeout(MembershipError, TimeoutError):
    """agree() did not converge in time; `missing` are the expected ranks that never arrived."""

    def __init__(self, generation: int, timeout_s: float, missing: list[int], arrived: list[int],
                 failed: list[int]):
        self.generation, self.timeout_s = generation, timeout_s
        self.missing, self.arrived, self.failed = missing, arrived, failed
        super().__init__(
            f"agreement on generation {generation} timed out after {timeout_s:g} s: "
            f"ranks {missing} never arrived (arrived: {arrived}; failed or stale: {failed})")


class ExcludedFromAgreement(MembershipError):
    """This rank was declared failed (or stale) and is not in the agreed alive list."""


class PublishTimeout(MembershipError, TimeoutError):
    """read() found nothing published under the key in time (or its publisher failed)."""


class _JsonRecord:
    """The JSON round-trip of a flat dataclass on the store; keys it does not know are left
    out (a record written by a newer version)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes):
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class FailureRecord(_JsonRecord):
    rank: int
    cause: str                  # one of CAUSES
    detail: str = ""
    time: float = 0.0           # wall time the failure was observed
    detect_ms: float | None = None   # failure -> record latency, when the reporter knows it
    reporter: str = ""          # "agent node 0 pid 123", "rank 2 pid 456", ...


@dataclass
class Agreement:
    generation: int             # the new generation this agreement opens
    alive: list[int]            # sorted old ranks that continue; new rank = alive.index(old rank)
    failed: list[int]           # candidates not in `alive` (failed, stale or exited cleanly)
    leader: int                 # lowest alive rank: it published this list
    causes: dict[int, str] = field(default_factory=dict)   # failed rank -> cause / "stale" / "exited"
    # The last iteration whose optimizer step every rank of `alive` applied: the leader checked
    # that they all report the same one (None: nobody reported one, e.g. only joiners).
    iteration: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.alive)

    def new_rank(self, old_rank: int) -> int:
        return self.alive.index(old_rank)

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "alive": self.alive,
                           "failed": self.failed, "leader": self.leader,
                           "causes": {str(k): v for k, v in self.causes.items()},
                           "iteration": self.iteration})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Agreement":
        d = json.loads(text)
        return cls(int(d["generation"]), [int(r) for r in d["alive"]],
                   [int(r) for r in d["failed"]], int(d["leader"]),
                   {int(k): v for k, v in d.get("causes", {}).items()}, d.get("iteration"))


class DivergedSteps(MembershipError):
    """Survivors report different last applied iterations: the step commit was not atomic."""


@dataclass(frozen=True)
class Progress(_JsonRecord):
    """What a worker's main thread is doing, published with its heartbeat. A hang shows as a
    `seq` that stops moving while the heartbeat thread lives on; `waiting` phases (a receive, a
    collective, an agreement) are those of a hang's victims, never of its cause."""

    iteration: int = 0
    seq: int = 0                # bumped at every op and every step of a transition
    phase: str = "start"
    waiting: bool = False
    allow_s: float = 0.0        # how long this phase may go without a bump (0: no limit)


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
    get/wait on an absent key waits. This module never blocks on absent keys (it tests with check).
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


def rebuild_world(store: dist.Store, agreement: Agreement, old_rank: int, backend: str = "gloo",
                  timeout_s: float = 60.0, members: "Membership | None" = None) -> int:
    """Destroy the current default group (if any) and create the agreement's world on
    PrefixStore(f"gen{g}", store); returns this rank's new rank. With `members`, the
    rendezvous (of this world and of every group created in it later) gives up at once when a
    rank of the agreement is lost meanwhile (RendezvousStore), instead of after `timeout_s`."""
    global _rendezvous
    if dist.is_initialized():
        dist.destroy_process_group()
    new_rank = agreement.new_rank(old_rank)
    rdzv = generation_store(store, agreement.generation) if members is None else \
        RendezvousStore(members, agreement.generation, agreement.alive, timeout_s)
    # A Python store must outlive the groups that hold it (they keep only its C++ half).
    _rendezvous = rdzv
    dist.init_process_group(backend, store=rdzv, rank=new_rank,
                            world_size=agreement.world_size, timeout=timedelta(seconds=timeout_s))
    return new_rank


_rendezvous: dist.Store | None = None


# Between looks at the failure records while a rendezvous key or a barrier is awaited. A look
# is a few store operations per rank; at 0.05 s, 8 ranks creating their groups on 2 loaded cores
# queued enough of them on the agent's TCPStore to stall it for seconds (measured: a get waited
# 5 s). A loss during a rendezvous is rare (a second failure); 0.25 s more to notice it is cheap.
LOSS_CHECK_S = 0.25


class PeerLost(MembershipError):
    """A rendezvous gave up: a rank it waits for was reported failed or exited, the
    generation was abandoned, or its time ran out."""


class RendezvousStore(dist.Store):
    """The rendezvous store of generation g's process groups: PrefixStore(f"gen{g}", store)
    whose blocking reads (gloo's connection set-up, every new_group) poll, and raise PeerLost
    as soon as a rank of the generation is lost or the generation is abandoned, so a failure
    during a reconfiguration costs milliseconds, not the rendezvous timeout. Used from the
    thread that builds the world (it shares that thread's store connection). Only reported
    losses count (failure records, exits): every lost rank gets a record from an agent (its own
    for a death or a hang, another node's for a lost node). Heartbeat ages are no evidence
    here: creating the groups of 8 ranks on 2 loaded cores stalled the agent's TCPStore for
    5 s (measured), which made every heartbeat, node 0's agent's included, look old and ended
    generation 0, which has no earlier world to go back to."""

    def __init__(self, members: "Membership", generation: int, ranks: list[int],
                 timeout_s: float) -> None:
        super().__init__()
        self._m, self._generation, self._ranks = members, generation, list(ranks)
        self._inner = generation_store(members.store, generation)
        self._timeout_s = timeout_s

    def _await(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self._timeout_s
        next_check = time.monotonic() + LOSS_CHECK_S   # most keys come within it: no look
        sleep = 0.001
        while not self._inner.check(keys):
            now = time.monotonic()
            if now >= next_check:
                self._check(keys)
                next_check = now + LOSS_CHECK_S
            if now > deadline:
                raise PeerLost(f"rendezvous of generation {self._generation}: keys {keys} not "
                               f"set within {self._timeout_s:g} s")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.01)

    def _check(self, keys: list[str]) -> None:
        m = self._m
        if m.store.check([f"{gen_prefix(self._generation)}/retry"]):
            raise PeerLost(f"generation {self._generation} was abandoned while its groups "
                           "were being created")
        failed = m.failures()
        exits = set(m.exited())
        gone = [r for r in self._ranks if r in failed or r in exits]
        if gone:
            raise PeerLost(f"rank(s) {sorted(gone)} of generation {self._generation} lost "
                           f"while its groups were being created (waiting for {keys})")

    def set(self, key, value):
        self._inner.set(key, value)

    def get(self, key):
        self._await([key])
        return self._inner.get(key)

    def wait(self, keys, timeout=None):
        self._await(list(keys))

    def check(self, keys):
        return self._inner.check(keys)

    def add(self, key, value):
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        pass   # every blocking read is bounded by the reconfiguration's timeout instead


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _parse_log(v: bytes | str) -> list[int]:
    out: list[int] = []
    for tok in _text(v).split(","):
        tok = tok.strip()
        if tok:
            r = int(tok)
            if r not in out:
                out.append(r)
    return out


def _read_log(store: dist.Store, key: str) -> list[int]:
    return _parse_log(store.get(key)) if store.check([key]) else []


def _hb_age(value: bytes | str, now: float) -> float | None:
    """Age in seconds of a heartbeat value; None when it was switched off on purpose."""
    v = _text(value)
    if v.startswith("off"):
        return None
    try:
        return now - float(v)
    except ValueError:
        return None


# ----------------------------------------------------------------------------------- Membership

class Membership:
    """One process's view of the job's membership (a worker: rank >= 0; an observer: rank None).

    The caller's store is used from the calling thread only; the heartbeat thread uses its own
    connection (``store.clone()``), so a main thread blocked in a store get (a gloo rendezvous, for
    example) never delays heartbeats.
    """

    def __init__(self, store: dist.Store, rank: int | None, world_size: int,
                 heartbeat_timeout: float | None = None):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        if heartbeat_timeout is None:
            heartbeat_timeout = float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_TIMEOUT))
        self.heartbeat_timeout = float(heartbeat_timeout)
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._failure_cache: dict[int, FailureRecord] = {}
        self._worker_nodes: dict[int, int] = {}
        # Set by the main thread (tick), read by the heartbeat thread: a new immutable record
        # each time, so the thread always writes a whole one.
        self.progress = Progress()

    @classmethod
    def from_env(cls, store: dist.Store | None = None) -> "Membership":
        """RANK, WORLD_SIZE, CHAMELEON_HEARTBEAT_TIMEOUT and CHAMELEON_STORE of a launched worker."""
        return cls(store if store is not None else connect_store(),
                   int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))

    # --- heartbeats

    def heartbeat_once(self, store: dist.Store | None = None) -> None:
        self._require_rank("heartbeat")
        store = store or self.store
        store.set(key_hb(self.rank), f"{time.time():.6f}")
        store.set(key_progress(self.rank), self.progress.to_json())

    def tick(self, iteration: int, phase: str, waiting: bool = False,
             allow_s: float | None = None) -> None:
        """The main thread moved on: to `phase` of `iteration` (published with the next
        heartbeat). `allow_s`: how long the phase may go without another tick before its agent
        takes it for a hang while peers wait (default: the previous phase's)."""
        prev = self.progress
        self.progress = Progress(iteration, prev.seq + 1, phase, waiting,
                                 prev.allow_s if allow_s is None else allow_s)

    def progress_of(self, ranks: list[int]) -> dict[int, Progress]:
        """The published progress of each rank that has one."""
        present = [r for r in ranks if self.store.check([key_progress(r)])]
        if not present:
            return {}
        values = self.store.multi_get([key_progress(r) for r in present])
        return {r: Progress.from_json(v) for r, v in zip(present, values)}

    def start_heartbeat(self, interval: float | None = None) -> None:
        """A daemon thread writing this rank's timestamp every `interval` s (default timeout/4)."""
        self._require_rank("heartbeat")
        if self._hb_thread is not None:
            return
        if interval is None:
            # Progress rides on the heartbeat: a hang is seen within this interval of its
            # allowance running out (half a second is ample against allowances of seconds).
            interval = min(0.5, max(0.05, self.heartbeat_timeout / 4))
        try:
            hb_store = self.store.clone()
        except Exception:       # a store type without clone: share it (and its lock)
            hb_store = self.store
        self.heartbeat_once(hb_store)
        self._hb_stop.clear()

        def beat() -> None:
            failures = 0
            while not self._hb_stop.wait(interval):
                try:
                    self.heartbeat_once(hb_store)
                    failures = 0
                except Exception as e:   # the store is gone: nothing to report to
                    failures += 1
                    if failures == 3:
                        print(f"[chameleon] rank {self.rank}: heartbeat to the store failing: {e}",
                              file=sys.stderr, flush=True)

        self._hb_thread = threading.Thread(target=beat, name=f"chameleon-hb-{self.rank}",
                                           daemon=True)
        self._hb_thread.start()

    def stop(self, retire: bool = True) -> None:
        """Stop the heartbeat thread; with `retire`, mark the heartbeat off so that this rank is
        not seen as stale (or hung) for no longer heartbeating."""
        if self._hb_thread is not None:
            self._hb_stop.set()
            self._hb_thread.join(timeout=5)
            self._hb_thread = None
        if retire and self.rank is not None:
            # done on purpose: neither stale nor, while the process exits, hung
            self.progress = Progress(self.progress.iteration, self.progress.seq + 1, "done")
            try:
                self.store.set(key_progress(self.rank), self.progress.to_json())
                self.store.set(key_hb(self.rank), f"off:{time.time():.6f}")
            except Exception:
                pass

    def heartbeat_ages(self, ranks: list[int], now: float | None = None) -> dict[int, float]:
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
        for r, age in self.heartbeat_ages([r for r in ranks if r not in out], now).items():
            if age > self.heartbeat_timeout and not self._watched(self._worker_nodes.get(r)):
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
            if age is not None and age > self.heartbeat_timeout:
                out.add(n)
        return out

    # --- failures and exits

    def report_failure(self, rank: int, cause: str, detail: str = "", *,
                       when: float | None = None, detect_ms: float | None = None,
                       reporter: str | None = None) -> FailureRecord:
        """Record that `rank` failed; returns the record in the store (the first report wins)."""
        if cause not in CAUSES:
            raise ValueError(f"unknown failure cause {cause!r} (one of {', '.join(CAUSES)})")
        if reporter is None:
            reporter = (f"rank {self.rank} pid {os.getpid()}" if self.rank is not None
                        else f"pid {os.getpid()} on {socket.gethostname()}")
        rec = FailureRecord(int(rank), cause, detail, time.time() if when is None else when,
                            detect_ms, reporter)
        stored = self.store.compare_set(key_failure(rank), "", rec.to_json())
        self.store.append(KEY_FAILURES, f"{int(rank)},")
        return FailureRecord.from_json(stored)

    def failures(self) -> dict[int, FailureRecord]:
        """Every reported failure of the job, by rank."""
        ranks = _read_log(self.store, KEY_FAILURES)
        new = [r for r in ranks if r not in self._failure_cache]
        if new:
            for r, v in zip(new, self.store.multi_get([key_failure(r) for r in new])):
                self._failure_cache[r] = FailureRecord.from_json(v)
        return dict(self._failure_cache)

    def record_exit(self, rank: int, exitcode: int = 0) -> None:
        """Record a deliberate (clean) exit of `rank`: not a failure, but it will not come back."""
        self.store.set(key_exit(rank), json.dumps({"rank": rank, "exitcode": exitcode,
                                                   "time": time.time()}))
        self.store.append(KEY_EXITS, f"{int(rank)},")

    def exited(self) -> list[int]:
        """Ranks that exited cleanly (exit code 0)."""
        return sorted(_read_log(self.store, KEY_EXITS))

    # --- rejoin: a restarted or new rank asks, the leader schedules, everyone admits

    def request_join(self) -> None:
        """This (restarted or new) rank asks to be admitted at the next iteration boundary."""
        self.store.append(KEY_JOINS, f"{self._require_rank('join')},")

    def joins(self) -> list[int]:
        """Every rank that ever asked to join."""
        return sorted(_read_log(self.store, KEY_JOINS))

    def schedule_admission(self, n: int, after: int, alive: list[int], admitted: set[int],
                           unit: int = 1) -> None:
        """The leader: make the n-th admission, at the end of iteration `after`, of the
        ranks asking to join (not yet admitted, not failed), unless it is made already; in
        whole `unit`s (a tensor-parallel group: a lone shard has no place in any plan), the
        lowest ranks first."""
        key = key_admission(n)
        if self.store.check([key]):
            return
        waiting = [r for r in self.joins() if r not in alive and r not in admitted]
        if waiting:
            failed = self.failures()
            waiting = [r for r in waiting if r not in failed]
            waiting = waiting[:len(waiting) // unit * unit]
        if waiting:
            self.store.set(key, json.dumps({"after": after, "joiners": waiting}))

    def admission_due(self, n: int, iteration: int) -> bool:
        """Whether the n-th admission is made and due at the end of `iteration`."""
        key = key_admission(n)
        return self.store.check([key]) and iteration >= json.loads(self.store.get(key))["after"]

    def admission(self, n: int) -> dict:
        """The n-th admission: {"after": iteration, "joiners": [...]}."""
        return json.loads(self.store.get(key_admission(n)))

    def admit(self, rank: int, generation: int, candidates: list[int], n: int) -> None:
        """Tell joiner `rank` where to meet the others: agreement `generation` among
        `candidates`, as the n-th admission."""
        self.store.set(key_admit(rank), json.dumps(
            {"generation": generation, "candidates": candidates, "admission": n}))

    def admitted_to(self, timeout_s: float, poll_s: float = 0.05) -> dict | None:
        """A joiner: where it meets the others (admit's record), once it is admitted; None
        after `timeout_s`, or once the job has trained its last iteration (`trained`)."""
        key = key_admit(self._require_rank("join"))
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline or self.trained():
                return None
            time.sleep(poll_s)
        return json.loads(self.store.get(key))

    def mark_trained(self, iteration: int) -> None:
        """The job has trained its last iteration: a joiner has nothing left to join."""
        self.store.set(KEY_TRAINED, str(iteration))

    def trained(self) -> bool:
        return self.store.check([KEY_TRAINED])

    def announce_death(self) -> None:
        """An injected fault is about to stop this rank: its exact time, to measure detection."""
        self.store.set(key_dying(self._require_rank("announce a death")), f"{time.time():.6f}")

    def death_time(self, rank: int, record: FailureRecord) -> float:
        """When `rank` stopped: its own announcement if it made one, else the agent's record
        less the agent's latency (an upper bound: the agent may wake late on a busy host)."""
        if self.store.check([key_dying(rank)]):
            return float(self.store.get(key_dying(rank)))
        return record.time - (record.detect_ms or 0.0) / 1e3

    def notice(self, generation: int, when: float | None = None) -> float:
        """Record that this rank saw the world of `generation - 1` break; returns the first
        survivor's notice time (the job's moment of detection: the others may still have been
        busy with work the failure did not block)."""
        t = f"{time.time() if when is None else when:.6f}"
        return float(self.store.compare_set(f"{gen_prefix(generation)}/noticed", "", t))

    # --- agreement

    def agree(self, generation: int, candidates: list[int], timeout_s: float = 60.0,
              poll_s: float = 0.005, iteration: int | None = None) -> Agreement:
        """Agree with the other survivors among `candidates` on the alive set of `generation`.

        Each rank writes its arrival under gen/{generation}, with `iteration`, the last
        iteration whose optimizer step it applied (None for a rank with no state, a joiner); a
        candidate is expected unless it is reported failed, exited cleanly or is lost unreported
        (`unreported_losses`: its node's agent or, unwatched, its own heartbeat went silent;
        re-checked while waiting). Once every expected rank has arrived, the lowest of them (the
        leader) checks that they applied the same steps and writes the final list with
        compare_set, so exactly one list is ever published and every survivor reads that one. A
        leader that dies before publishing is dropped like any other rank and the next one
        publishes. Raises AgreementTimeout naming the ranks that never arrived,
        ExcludedFromAgreement when this rank itself is reported failed or is not in the
        published list, and DivergedSteps when the survivors' iterations differ. A rank of the
        list that fails afterwards is handled by the next agree() call (generation + 1,
        candidates = this agreement's alive list). Destroy the broken process group before
        calling this (see the module docstring).
        """
        me = self._require_rank("agree")
        cand = sorted({int(r) for r in candidates})
        if me not in cand:
            raise ValueError(f"rank {me} is not among the candidates {cand}")
        ns = gen_prefix(generation)
        final_key, arrivals_key = f"{ns}/final", f"{ns}/arrivals"
        self.store.set(f"{ns}/arrived/{me}", json.dumps({"time": time.time(),
                                                         "iteration": iteration}))
        self.store.append(arrivals_key, f"{me},")
        start = time.monotonic()
        deadline = start + timeout_s
        sleep = poll_s
        arrived: set[int] = {me}
        dropped: dict[int, str] = {}
        while True:
            if self.store.check([final_key]):
                ag = Agreement.from_json(self.store.get(final_key))
                if me not in ag.alive:
                    raise ExcludedFromAgreement(
                        f"rank {me} is not in the alive list {ag.alive} agreed for generation "
                        f"{generation} (declared {ag.causes.get(me, 'failed')} by leader "
                        f"{ag.leader})")
                if iteration is not None and ag.iteration is not None \
                        and iteration != ag.iteration:
                    raise DivergedSteps(f"rank {me} applied the steps up to iteration "
                                        f"{iteration}, generation {generation} agreed on "
                                        f"{ag.iteration}")
                return ag
            arrived = set(_parse_log(self.store.get(arrivals_key))) & set(cand)
            fails = self.failures()
            exits = set(self.exited())
            dropped = {r: fails[r].cause for r in cand if r in fails}
            dropped.update({r: "exited" for r in cand if r in exits and r not in dropped})
            rest = [r for r in cand if r not in dropped and r != me]
            dropped.update(self.unreported_losses(rest))
            if me in dropped:
                raise ExcludedFromAgreement(
                    f"rank {me} has been reported {dropped[me]} and cannot join generation "
                    f"{generation}")
            expected = [r for r in cand if r not in dropped]
            missing = [r for r in expected if r not in arrived]
            if not missing and expected[0] == me:
                ag = Agreement(generation, expected, sorted(dropped), me,
                               {r: dropped[r] for r in sorted(dropped)},
                               self._agreed_iteration(ns, expected))
                won = self.store.compare_set(final_key, "", ag.to_json())
                if Agreement.from_json(won).leader == me:
                    self.store.set(KEY_GENERATION, str(generation))
                continue
            if time.monotonic() > deadline:
                raise AgreementTimeout(generation, timeout_s, missing, sorted(arrived),
                                       sorted(dropped))
            time.sleep(sleep)
            sleep = min(sleep * 1.5, 0.05)

    def _agreed_iteration(self, ns: str, ranks: list[int]) -> int | None:
        """The one last applied iteration of `ranks` (arrived at agreement `ns`), or
        DivergedSteps naming who applied what."""
        arrivals = self.store.multi_get([f"{ns}/arrived/{r}" for r in ranks])
        applied = {r: json.loads(v).get("iteration") for r, v in zip(ranks, arrivals)}
        steps = {it for it in applied.values() if it is not None}
        if len(steps) > 1:
            raise DivergedSteps(f"survivors applied different steps: {applied} (rank: last "
                                "applied iteration)")
        return steps.pop() if steps else None

    # --- the step commit

    def commit(self, generation: int, iteration: int, world: list[int], timeout_s: float,
               poll_s: float = 0.0005) -> bool:
        """Vote to apply the optimizer step of `iteration` in the world of `generation` (its
        launch ranks `world`); True when every rank of it applies the step, False when none
        does. The step is applied iff all of them voted: the decision is written once
        (compare_set) by the rank that sees the last vote, or as "abort" by a rank that sees a
        member fail, a failure noticed in this world, or `timeout_s` pass first, so every rank
        reads the same outcome whenever it looks (torchft's should_commit). A rank that never
        votes guarantees an abort; one that dies after voting cannot make the others differ."""
        ns = f"{gen_prefix(generation)}/commit/{iteration}"
        decision_key, votes_key = f"{ns}/decision", f"{ns}/votes"
        broken_key = f"{gen_prefix(generation + 1)}/noticed"
        votes = self.store.add(votes_key, 1)
        deadline = time.monotonic() + timeout_s
        sleep = poll_s
        while True:
            if votes >= len(world):
                return self._decide(decision_key, "commit")
            if self.store.check([decision_key]):
                return _text(self.store.get(decision_key)) == "commit"
            failed = self.failures()
            if any(r in failed for r in world) or self.store.check([broken_key]) \
                    or time.monotonic() > deadline:
                return self._decide(decision_key, "abort")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.01)
            votes = self.store.add(votes_key, 0)

    def _decide(self, key: str, outcome: str) -> bool:
        return _text(self.store.compare_set(key, "", outcome)) == "commit"

    def forget_commit(self, generation: int, iteration: int) -> None:
        """Drop a decided step's keys (every rank has read the decision of an iteration once
        all of them voted for the next one)."""
        ns = f"{gen_prefix(generation)}/commit/{iteration}"
        for key in (f"{ns}/votes", f"{ns}/decision"):
            self.store.delete_key(key)

    # --- the outcome of a generation's reconfiguration

    def abandon(self, generation: int) -> int:
        """`generation`'s world could not be built: everyone agrees again one generation up.
        Returns that generation (the first rank to abandon it names it)."""
        won = self.store.compare_set(f"{gen_prefix(generation)}/retry", "",
                                     str(generation + 1))
        return int(_text(won))

    def committed(self, generation: int) -> None:
        """`generation`'s world is built and holds the job's state (its leader says so)."""
        self.store.set(f"{gen_prefix(generation)}/committed", f"{time.time():.6f}")

    def outcome(self, generation: int, timeout_s: float, poll_s: float = 0.01) -> int | None:
        """For a rank the plan of `generation` left out: None once that world is committed
        (the rank may leave), or the generation to agree again in (it was abandoned)."""
        ns = gen_prefix(generation)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.store.check([f"{ns}/committed"]):
                return None
            if self.store.check([f"{ns}/retry"]):
                return int(_text(self.store.get(f"{ns}/retry")))
            if time.monotonic() > deadline:
                raise MembershipError(f"generation {generation}'s world was neither built nor "
                                      f"abandoned within {timeout_s:g} s")
            time.sleep(poll_s)

    def ready(self, generation: int, ranks: list[int], timeout_s: float = 60.0,
              poll_s: float = 0.005) -> list[int]:
        """Barrier of `ranks` on the store before they build the world of `generation`: returns
        [] once all are ready, or the ranks among them reported failed or exited while
        waiting (a failure during reconfiguration; the caller agrees again, one generation up).
        A process-group rendezvous would instead wait for a dead member until its timeout."""
        me = self._require_rank("ready")
        ns = gen_prefix(generation)
        self.store.set(f"{ns}/ready/{me}", "1")
        others = [r for r in ranks if r != me]
        deadline = time.monotonic() + timeout_s
        sleep = poll_s
        next_look = time.monotonic() + LOSS_CHECK_S
        while True:
            waiting = [r for r in others if not self.store.check([f"{ns}/ready/{r}"])]
            if not waiting:
                return []
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + LOSS_CHECK_S
                fails, exits = self.failures(), set(self.exited())
                gone = sorted(r for r in waiting if r in fails or r in exits)
                if gone:
                    return gone
            if time.monotonic() > deadline:
                raise AgreementTimeout(generation, timeout_s, waiting, [me], [])
            time.sleep(sleep)
            sleep = min(sleep * 1.5, 0.05)

    def agreement(self, generation: int) -> Agreement | None:
        """The published agreement of `generation`, if any (no waiting)."""
        key = f"{gen_prefix(generation)}/final"
        return Agreement.from_json(self.store.get(key)) if self.store.check([key]) else None

    # --- publish / read (e.g. the leader's plan)

    def publish(self, generation: int, key: str, data: bytes | str) -> None:
        self.store.set(f"{gen_prefix(generation)}/pub/{key}", data)

    def read(self, generation: int, key: str, timeout_s: float = 60.0,
             publisher: int | None = None, poll_s: float = 0.005) -> bytes:
        """What was published under `key` for `generation`; waits up to timeout_s. With
        `publisher`, gives up early when that rank is reported failed."""
        full = f"{gen_prefix(generation)}/pub/{key}"
        deadline = time.monotonic() + timeout_s
        sleep = poll_s
        while not self.store.check([full]):
            if publisher is not None and publisher in self.failures():
                if self.store.check([full]):
                    break
                raise PublishTimeout(f"publisher rank {publisher} failed before publishing "
                                     f"{key!r} for generation {generation}")
            if time.monotonic() > deadline:
                raise PublishTimeout(f"nothing published under {key!r} for generation "
                                     f"{generation} within {timeout_s:g} s"
                                     + (f" (publisher: rank {publisher})"
                                        if publisher is not None else ""))
            time.sleep(sleep)
            sleep = min(sleep * 1.5, 0.05)
        return self.store.get(full)

    def _require_rank(self, what: str) -> int:
        if self.rank is None:
            raise MembershipError(f"{what} needs a worker rank (this Membership is an observer)")
        return self.rank


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
