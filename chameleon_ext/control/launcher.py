"""chameleon-launch: a torchrun-compatible per-node agent that does not kill survivors.

    chameleon-launch --nproc-per-node 4 [--nnodes 2 --node-rank 0] --master-addr HOST \\
        --master-port PORT [--max-failures 4] [--heartbeat-timeout 5] \\
        [--store HOST:PORT | --store etcd://HOST:PORT[,HOST:PORT...][/NAMESPACE]] \\
        train.py --its --args
    python -m chameleon_ext.control.launcher ...            (the same)

One agent runs per node. The node-0 agent hosts the job's c10d TCPStore at master-addr:master-port
unless --store names an external one: a TCPStore at HOST:PORT, or an etcd cluster
(chameleon_ext.control.etcd_store), the one choice with which the job survives the loss of node 0 (a
TCPStore dies with the process that hosts it). Workers are forked by the agent's fork server
(forkserver.py: it imports the --preload modules once; each worker leads its own session, so
its whole process group can be signalled, and is the agent's child for SIGCHLD and waitpid);
their environment:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (= node rank), GROUP_WORLD_SIZE,
    ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT (0),
    TORCHELASTIC_MAX_RESTARTS (0), OMP_NUM_THREADS (1 unless set),
    CHAMELEON_STORE              the store's address, host:port or etcd://...
                                 (store.connect_store reads it)
    CHAMELEON_HEARTBEAT_TIMEOUT  seconds (store.Member reads it)
    CHAMELEON_NODE_RANK          the node rank
  with a TCPStore only:
    MASTER_ADDR, MASTER_PORT     the store's host and port: the worker rendezvous
    TORCHELASTIC_USE_AGENT_STORE "True": env:// connects to that store as a client

Worker rendezvous: there is no second port. Workers connect to the store as clients, so the store
outlives any worker. With a TCPStore, a plain ``init_process_group("gloo")`` (env://) works for
the first world (its keys go under ``default_pg/``, as under torchrun); with etcd there is no
TCPStore for env://: the first world meets on ``generation_store(connect_store(), 0)``
(pretrain_gpt.py does so under any store). After an agreement on generation g, the survivors
create the new world on ``PrefixStore(f"gen{g}", connect_store())`` (world.rebuild_world), so
keys of an old world are never reused.

Unlike torchrun, when a worker dies the agent does not stop the others: it records the failure in
the store (FailureLog.report_failure: rank, cause "signal"/"exit", detail, wall time) as soon as it
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
states one; the workers read it, CHAMELEON_RESTART_DELAY, as the planner's repair time until the
job has measured a rejoin); a restart still due when the node's last worker ends is dropped. With
--start-ahead A the replacement starts A seconds before the delay ends (at once if A >= S) and
asks to join only when the delay has passed (CHAMELEON_JOIN_AT), so its start-up is not counted
in the repair time; it exits 0 if the job ends first.

The agent ends when every worker of the job has exited or been reported failed. Exit status: the
workers' own code when every worker of the node exited with the same non-zero code and nothing
else failed in the job (no signal, hang or lost node: 2 from workers that rejected their
arguments); else 0 when at least one worker finished with 0 and the job was not stopped for
--max-failures, else 1; on SIGINT/SIGTERM (SIGHUP, SIGQUIT) it terminates its workers (SIGTERM,
then SIGKILL after --grace seconds, reaping each by PID/process group), reports them, and exits
130 / 143. Killing the node-0 agent takes a hosted store with it: the job cannot survive that
(use --store etcd://...).

Every worker's pid and host are published at ``chameleon/worker/{rank}`` (see keys.py's key
layout) when it starts; tools/inject_failure.py uses them.

This module is the command line: it parses and checks the flags into a LaunchConfig and runs
the Agent (chameleon_ext.control.agent) on it.
"""

from __future__ import annotations

import argparse
import sys

from chameleon_ext.control.agent_log import PROG
from chameleon_ext.control.forkserver import ForkServer
from chameleon_ext.control.launch_config import LaunchConfig


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
    p.add_argument("--start-ahead", type=float, default=0.0, metavar="SECONDS",
                   help="start a replacement this many seconds before --restart-delay ends; "
                        "it asks to join only when the delay has passed, so its start-up is "
                        "not counted in the delay (default 0)")
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
    p.add_argument("--preload", default=",".join(LaunchConfig.preload), metavar="MODULES",
                   help="comma-separated modules the workers' fork server imports once before "
                        "it forks each worker (default: %(default)s, pretrain_gpt.py's "
                        "libraries; '' for none)")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _config(args: argparse.Namespace) -> LaunchConfig:
    return LaunchConfig(
        training_script=args.training_script,
        training_script_args=tuple(args.training_script_args),
        nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port,
        max_failures=args.max_failures, max_restarts=args.max_restarts,
        restart_delay_s=args.restart_delay, start_ahead_s=args.start_ahead,
        heartbeat_timeout_s=args.heartbeat_timeout,
        store=args.store, store_timeout_s=args.store_timeout, join_timeout_s=args.join_timeout,
        grace_s=args.grace, log_dir=args.log_dir, no_python=args.no_python, module=args.module,
        preload=tuple(m.strip() for m in args.preload.split(",") if m.strip()))


def main(argv: list[str] | None = None) -> int:
    try:
        config = _config(build_parser().parse_args(argv))
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    # The workers' fork server starts before this agent imports torch (through the agent and
    # the store): its own imports, about 4 s of a core, then overlap the agent's 1.2 s instead
    # of following them, and every launch starts its workers that much sooner.
    server = ForkServer.for_workers(() if config.no_python else config.preload)
    try:
        from chameleon_ext.control.agent import Agent
        from chameleon_ext.control.agent_store import StoreInUse
        from chameleon_ext.control.store import MembershipError
    except BaseException:
        server.close()
        raise
    try:
        return Agent(config, server).run()
    except MembershipError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, StoreInUse) else 1


if __name__ == "__main__":
    sys.exit(main())
