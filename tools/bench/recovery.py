"""Recovery by rerouting on CPU: one worker killed mid-iteration under chameleon-launch, and a
whole node lost.

For pipeline 2 x data 2 and pipeline 2 x data 3, several runs each; prints the medians of
detection latency (the death -> its first sign: a survivor's failed operation or the agent's
failure record), reconfiguration time (first notice -> new world and runtime built),
failure-to-next-completed-iteration, lost work, and post-recovery over failure-free iteration
time (medians before and after the failure within the same run).

Node rows: two chameleon-launch agents of 2 workers (pipeline 2 x data 2, spread placement: one
pipeline per node); tools/inject_failure.py --node SIGKILLs a node's agent and workers once they
work past a chosen iteration. On the node-0 agent's TCPStore node 1 is lost; on a 3-member etcd
cluster (tests/etcd_cluster.py) node 0, which the TCPStore could not survive. A lost node's ranks
are known once its agent's heartbeat is --heartbeat-timeout old, so its reconfiguration holds
that wait; failure to next iteration runs from the kill to the wall-clock `time` of the first
iteration completed after the recovery.

    python tools/bench/recovery.py [--runs 3] [--iters 24] [--node-runs 3] [--heartbeat-timeout 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.etcd_cluster import EtcdCluster  # noqa: E402
from tests.launch import SMALL_MODEL, LateKill, free_port, run_chameleon, run_nodes  # noqa: E402


def one_run(dp: int, iters: int, kill_at: int, data: str, tmp: Path, name: str) -> dict:
    world = 2 * dp
    run = run_chameleon(world, SMALL_MODEL + [
        "--pipeline-model-parallel-size", "2", "--global-batch-size", str(8 * dp),
        "--train-iters", str(iters), "--data-path", data, "--split", "100,0,0",
        "--log-interval", str(iters), "--chameleon", "--chameleon-strategy", "reroute",
        "--chameleon-inject", f"kill:rank={world - 1},iter={kill_at},phase=backward"], tmp,
        name=name, timeout=600)
    if run.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{run.stderr[-2000:]}")
    events = run.metrics
    its = [e for e in events if e["event"] == "iteration"]
    fail = next(e for e in events if e["event"] == "failure")
    rec = next(e for e in events if e["event"] == "recovery")
    before = [e["elapsed_ms"] for e in its if 2 < e["iteration"] < kill_at]
    rerun = next(e for e in its if e["iteration"] == kill_at)
    after = [e["elapsed_ms"] for e in its if e["iteration"] > kill_at + 1]
    return {"detect_ms": fail["detect_ms"], "reconfigure_ms": rec["reconfigure_ms"],
            "to_next_ms": fail["detect_ms"] + rec["reconfigure_ms"] + rerun["elapsed_ms"],
            "lost": rec["lost_iterations"],
            "ratio": statistics.median(after) / statistics.median(before),
            "complete": [e["iteration"] for e in its] == list(range(1, iters + 1))}


def node_run(store: str | None, victim: int, iters: int, kill_after: int, heartbeat_s: float,
             data: str, tmp: Path, name: str) -> dict:
    """Pipeline 2 x data 2 on 2 agents; node `victim` lost once it works past `kill_after`;
    `store`: an etcd address, or None for the node-0 agent's TCPStore."""
    port = free_port()
    kill = LateKill(port, victim, kill_after, 100, node=True, store=store).start()
    run = run_nodes(2, 2, SMALL_MODEL + [
        "--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--train-iters",
        str(iters), "--data-path", data, "--split", "100,0,0", "--log-interval", str(iters),
        "--chameleon", "--chameleon-strategy", "reroute"], tmp, name=name, port=port,
        store=store, launcher_args=["--heartbeat-timeout", str(heartbeat_s)], timeout=600)
    kill.join()
    survivor = run.agents[1 - victim]
    if survivor.returncode != 0 or kill.signalled_at is None:
        raise SystemExit(f"run {name} failed:\n{survivor.stderr[-2000:]}\n{kill.stderr}")
    its = run.events("iteration")
    fail, rec = run.events("failure")[0], run.events("recovery")[0]
    recovered = next(e for e in its if e["time"] >= rec["time"])
    killed_at = next(e["iteration"] for e in its if e["time"] >= kill.signalled_at)
    before = [e["elapsed_ms"] for e in its if 2 < e["iteration"] < killed_at]
    after = [e["elapsed_ms"] for e in its if e["time"] > recovered["time"]]
    return {"detect_ms": fail["detect_ms"], "reconfigure_ms": rec["reconfigure_ms"],
            "to_next_ms": 1e3 * (recovered["time"] - kill.signalled_at),
            "lost": rec["lost_iterations"], "cause": fail["cause"],
            "ratio": statistics.median(after) / statistics.median(before),
            "complete": sorted({e["iteration"] for e in its}) == list(range(1, iters + 1))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--node-runs", type=int, default=3, help="runs of each node-loss row (0: none)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="chameleon-launch's, for the node-loss rows (seconds)")
    args = p.parse_args(argv)
    data = ensure_builtin_dataset(quiet=True, progress=False)
    kill_at = args.iters // 2
    rows = []

    def row(label: str, res: list[dict]) -> None:
        for r in res:
            # a failure event has no detection time when no failure record timed the death
            detect = "n/a" if r["detect_ms"] is None else f"{r['detect_ms']:.0f}"
            print(f"{label}: detect {detect} ms, reconfigure "
                  f"{r['reconfigure_ms']:.0f} ms, to next iteration {r['to_next_ms']:.0f} ms, "
                  f"after/before {r['ratio']:.2f}"
                  + (f", cause {r['cause']}" if "cause" in r else ""), flush=True)
        med = {k: statistics.median([r[k] for r in res if r[k] is not None] or [float("nan")])
               for k in ("detect_ms", "reconfigure_ms", "to_next_ms", "ratio")}
        rows.append((label, med, max(r["lost"] for r in res), all(r["complete"] for r in res)))

    with tempfile.TemporaryDirectory() as tmp:
        for dp in (2, 3):
            row(f"PP2 x DP{dp}, rank {2 * dp - 1}",
                [one_run(dp, args.iters, kill_at, data, Path(tmp), f"dp{dp}-{i}")
                 for i in range(args.runs)])
        if args.node_runs:
            row("PP2 x DP2, node 1 (TCPStore)",
                [node_run(None, 1, args.iters, kill_at, args.heartbeat_timeout, data, Path(tmp),
                          f"tcp-node-{i}") for i in range(args.node_runs)])
            (Path(tmp) / "etcd").mkdir()
            cluster = EtcdCluster(Path(tmp) / "etcd")
            try:
                row("PP2 x DP2, node 0 (etcd)",
                    [node_run(cluster.url(f"node-{i}"), 0, args.iters, kill_at,
                              args.heartbeat_timeout, data, Path(tmp), f"etcd-node-{i}")
                     for i in range(args.node_runs)])
            finally:
                cluster.stop()
    print()
    print(f"one kill (the last rank, in a backward) at iteration {kill_at} of {args.iters}, or a "
          f"node (2 workers) lost once it works past iteration {kill_at}; medians of "
          f"{args.runs} / {args.node_runs} runs; reroute; 4 layers, hidden 64, 2 CPU cores; "
          f"node rows: heartbeat timeout {args.heartbeat_timeout:g} s")
    print(f"{'layout, lost':>30} | detect ms | reconfigure ms | to next iteration ms | "
          f"lost iterations | post/pre iteration time | all iterations done")
    for label, m, lost, ok in rows:
        print(f"{label:>30} | {m['detect_ms']:9.0f} | {m['reconfigure_ms']:14.0f} | "
              f"{m['to_next_ms']:20.0f} | {lost:15d} | {m['ratio']:23.2f} | {ok}")
    print("targets: detection < 1000 ms for an exit, failure to next completed iteration "
          "< 5000 ms, lost work <= the interrupted iteration; a node's reconfiguration holds the "
          "heartbeat timeout (its ranks are known lost only then)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
