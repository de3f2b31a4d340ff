"""Inject failures into a running chameleon-launch job from outside.

    python tools/inject_failure.py --store ADDRESS --kill RANK        SIGKILL one worker
    python tools/inject_failure.py --store ADDRESS --stop RANK        SIGSTOP one (a hang)
    python tools/inject_failure.py --store ADDRESS --term RANK        SIGTERM one (a scheduler's
                                                                      preemption: with
                                                                      --exit-signal-handler and
                                                                      --chameleon, a planned leave)
        [--after-iteration N [--delay-ms D]]  ... (any of the three) once the worker works past
                                              iteration N
                                              (its published progress), D ms later
    python tools/inject_failure.py --store ADDRESS --node NODE_RANK   SIGKILL a node: its agent
                                                                      and all of its workers
        [--after-iteration N [--delay-ms D]]  ... once its first worker works past iteration N
    python tools/inject_failure.py --store ADDRESS --trace FILE       timed kills
        [--after-iteration N [--delay-ms D]]  ... timed from when rank 0 works past iteration N

ADDRESS is the job's store, HOST:PORT or etcd://HOST:PORT,... (as given to chameleon-launch).
Workers are found through the launcher's records in the store (``chameleon/worker/{rank}``:
pid, process group, host; ``chameleon/node/{node}``: its ranks and agent pid). Signals go to the
worker's process group (each worker leads its own), so its children go with it. Only processes on
this host can be signalled: run the tool on the worker's node.

--node loses a whole node at once, as a machine that goes down would: its agent is killed first,
so that nobody on that node reports the workers' deaths; the other agents then see the node's
heartbeat go silent and report its ranks with cause "node". Killing node 0's agent ends a job
whose store that agent hosts; with an etcd store (--store etcd://...) the job goes on.

With --after-iteration the tool waits (up to --wait seconds) until the worker's (for --node: the
node's first worker's) progress,
published with its heartbeat (``chameleon/progress/{rank}``, within half a second), shows an
iteration above N, then sleeps D milliseconds: a kill at an arbitrary instant of the iteration
that follows, whatever the worker is doing then (a step, a save, an evaluation, a recovery).

A trace file has one event per line, ``SECONDS RANK [RANK ...]``: at SECONDS after the tool
starts (with --after-iteration: after rank 0 works past iteration N, and D ms more), SIGKILL
those ranks: failures at wall-clock instants, whatever the job is doing then. Blank lines and
``#`` comments are ignored.

--store defaults to $CHAMELEON_STORE. Bad input (a bad address, an unknown rank or node, a bad
trace line, a rank on another host) prints one line on stderr and exits 2; a worker that is no
longer running exits 1 (for --trace it is reported and the trace goes on).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

try:
    from chameleon_ext.control.keys import STORE_ENV, key_dying
    from chameleon_ext.control.membership import Membership
    from chameleon_ext.control.store import (ETCD_SCHEME, MembershipError, check_store_spec,
                                             connect_store, job_info, node_info,
                                             parse_store_spec, worker_info)
except ImportError:          # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from chameleon_ext.control.keys import STORE_ENV, key_dying
    from chameleon_ext.control.membership import Membership
    from chameleon_ext.control.store import (ETCD_SCHEME, MembershipError, check_store_spec,
                                             connect_store, job_info, node_info,
                                             parse_store_spec, worker_info)

PROG = "inject_failure.py"


class InputError(Exception):
    """Bad input: one line on stderr, exit 2."""


def log(msg: str) -> None:
    print(f"[inject_failure] {msg}", flush=True)


def parse_trace(path: str) -> list[tuple[float, list[int]]]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InputError(f"cannot read trace {path}: {e.strerror}") from None
    events = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            t = float(parts[0])
        except ValueError:
            raise InputError(f"{path}:{n}: {parts[0]!r} is not a number of seconds") from None
        if not t >= 0 or t == float("inf"):
            raise InputError(f"{path}:{n}: time {parts[0]} must be >= 0")
        if len(parts) < 2:
            raise InputError(f"{path}:{n}: no rank after the time")
        try:
            ranks = [int(p) for p in parts[1:]]
        except ValueError:
            raise InputError(f"{path}:{n}: ranks must be integers: {' '.join(parts[1:])!r}") \
                from None
        if any(r < 0 for r in ranks):
            raise InputError(f"{path}:{n}: ranks must be >= 0")
        events.append((t, ranks))
    if not events:
        raise InputError(f"{path}: no events")
    return sorted(events, key=lambda e: e[0])


def _is_local(host: str) -> bool:
    return host in (socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (dead, not yet reaped by its agent) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def worker(store, rank: int, world: int | None) -> dict:
    info = worker_info(store, rank)
    if info is None:
        size = f" (world size {world})" if world else ""
        raise InputError(f"rank {rank} is not in the store{size}")
    if not _is_local(info["host"]):
        raise InputError(f"rank {rank} runs on host {info['host']}, not on "
                         f"{socket.gethostname()}: run {PROG} there")
    return info


def await_iteration(store, rank: int, world: int | None, iteration: int, wait_s: float,
                    poll_s: float = 0.02) -> bool:
    """Wait until `rank`'s published progress is past `iteration`; False after `wait_s` or
    once the rank is no longer running."""
    m = Membership(store, None, world or 0)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        progress = m.heartbeat.progress_of([rank]).get(rank)
        if progress is not None and progress.iteration > iteration:
            return True
        if rank in m.failure_log.failures() or rank in m.failure_log.exited():
            return False
        time.sleep(poll_s)
    return False


def signal_worker(info: dict, sig: signal.Signals) -> bool:
    """Signal a worker's process group; False when it is no longer running."""
    pid, pgid = int(info["pid"]), int(info.get("pgid", info["pid"]))
    if not _alive(pid):
        print(f"{PROG}: rank {info['rank']} (pid {pid}) is not running", file=sys.stderr,
              flush=True)
        return False
    try:
        if pgid == pid:
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        print(f"{PROG}: rank {info['rank']} (pid {pid}) is not running", file=sys.stderr,
              flush=True)
        return False
    log(f"sent {sig.name} to rank {info['rank']} (pid {pid}) on {info['host']} at "
        f"{time.time():.3f}")
    return True


def node_workers(store, node: int, record: dict, world: int | None) -> list[dict]:
    """The records of a node's workers (InputError when it runs on another host)."""
    if not _is_local(record["host"]):
        raise InputError(f"node {node} runs on host {record['host']}, not on "
                         f"{socket.gethostname()}: run {PROG} there")
    return [worker(store, r, world) for r in record["ranks"]]


def kill_node(store, node: int, record: dict, infos: list[dict]) -> bool:
    """SIGKILL a node's agent, then its workers' process groups; False when none was running.
    The moment goes on the store as each worker's death announcement (what an injected fault
    inside a worker writes), so that the job measures its detection from the kill itself."""
    agent = int(record["agent_pid"])
    killed = _alive(agent)
    if killed:
        now = time.time()
        for info in infos:
            store.set(key_dying(int(info["rank"])), f"{now:.6f}")
        os.kill(agent, signal.SIGKILL)
        log(f"sent SIGKILL to the agent of node {node} (pid {agent}) at {now:.3f}")
    else:
        print(f"{PROG}: the agent of node {node} (pid {agent}) is not running", file=sys.stderr,
              flush=True)
    return any([signal_worker(i, signal.SIGKILL) for i in infos]) or killed


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):          # one line, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog=PROG, allow_abbrev=False,
                                description="kill or stop workers of a chameleon-launch job")
    p.add_argument("--store", default=os.environ.get(STORE_ENV),
                   help="the job's store, host:port or etcd://host:port,... "
                        "(default: $CHAMELEON_STORE)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to reach the store")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--kill", type=int, metavar="RANK", help="SIGKILL this worker")
    g.add_argument("--stop", type=int, metavar="RANK", help="SIGSTOP this worker (a hang)")
    g.add_argument("--term", type=int, metavar="RANK",
                   help="SIGTERM this worker (a preemption)")
    g.add_argument("--node", type=int, metavar="NODE_RANK",
                   help="SIGKILL a node's agent and all of its workers (a lost node)")
    g.add_argument("--trace", metavar="FILE", help="lines 'SECONDS RANK...' of timed kills")
    p.add_argument("--after-iteration", type=int, metavar="N", default=None,
                   help="with --kill/--stop/--node: wait until the worker (the node's first) "
                        "works past iteration N; with --trace: its times count from when rank "
                        "0 does")
    p.add_argument("--delay-ms", type=float, metavar="D", default=0.0,
                   help="with --after-iteration: then wait D more milliseconds")
    p.add_argument("--wait", type=float, metavar="SECONDS", default=600.0,
                   help="with --after-iteration: how long to wait for it (default 600)")
    try:
        a = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        return run(a)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except MembershipError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2


def run(a: argparse.Namespace) -> int:
    if not a.store:
        raise InputError(f"no store: pass --store HOST:PORT or set ${STORE_ENV}")
    try:
        check_store_spec(a.store)
    except ValueError as e:
        raise InputError(str(e)) from None
    if not a.store.startswith(ETCD_SCHEME):
        host, port = parse_store_spec(a.store)
        try:   # a plain TCP probe first: fails in one line, without c10d's retry noise
            socket.create_connection((host, port), timeout=a.timeout).close()
        except OSError as e:
            raise InputError(f"no store at {a.store}: {e.strerror or e}") from None
    for name in ("kill", "stop", "term", "node"):
        v = getattr(a, name)
        if v is not None and v < 0:
            raise InputError(f"--{name} {v}: must be >= 0")
    if a.after_iteration is not None and a.after_iteration < 0:
        raise InputError(f"--after-iteration {a.after_iteration}: must be >= 0")
    if not a.delay_ms >= 0 or a.delay_ms == float("inf"):
        raise InputError(f"--delay-ms {a.delay_ms}: must be a number >= 0")
    events = parse_trace(a.trace) if a.trace else None
    t_start = time.monotonic()
    store = connect_store(a.store, timeout_s=a.timeout)
    job = job_info(store)
    world = int(job["world_size"]) if job else None

    def after_iteration(rank: int) -> bool:
        if a.after_iteration is None:
            return True
        if not await_iteration(store, rank, world, a.after_iteration, a.wait):
            print(f"{PROG}: rank {rank} did not work past iteration {a.after_iteration} "
                  f"within {a.wait:g} s", file=sys.stderr, flush=True)
            return False
        time.sleep(a.delay_ms / 1e3)
        return True

    for flag, sig in (("kill", signal.SIGKILL), ("stop", signal.SIGSTOP),
                      ("term", signal.SIGTERM)):
        rank = getattr(a, flag)
        if rank is None:
            continue
        info = worker(store, rank, world)
        if not after_iteration(rank):
            return 1
        return 0 if signal_worker(info, sig) else 1

    if a.node is not None:
        node = node_info(store, a.node)
        if node is None:
            nn = f" (nodes: {job['nnodes']})" if job else ""
            raise InputError(f"node {a.node} is not in the store{nn}")
        infos = node_workers(store, a.node, node, world)
        if not after_iteration(int(node["ranks"][0])):
            return 1
        return 0 if kill_node(store, a.node, node, infos) else 1

    # --trace: check every rank first (with --after-iteration, once rank 0 works past it: the
    # trace's clock starts then, and every worker has long registered), then play the events.
    if a.after_iteration is not None:
        if not after_iteration(0):
            return 1
        t_start = time.monotonic()
    for _, ranks in events:
        for r in ranks:
            worker(store, r, world)
    status = 0
    for t, ranks in events:
        delay = t - (time.monotonic() - t_start)
        if delay > 0:
            time.sleep(delay)
        for r in ranks:
            if not signal_worker(worker(store, r, world), signal.SIGKILL):
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
