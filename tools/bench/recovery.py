"""Recovery by rerouting on CPU: one worker killed mid-iteration under chameleon-launch.

For pipeline 2 x data 2 and pipeline 2 x data 3, several runs each; prints the medians of
detection latency (the agent's failure record -> a survivor notices), reconfiguration time
(notice -> new world and runtime built), failure-to-next-completed-iteration (detection +
reconfiguration + the re-run iteration), lost work, and post-recovery over failure-free
iteration time (medians before and after the failure within the same run).

    python tools/bench/recovery.py [--runs 3] [--iters 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.launch import SMALL_MODEL, run_chameleon  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--iters", type=int, default=24)
    args = p.parse_args(argv)
    data = ensure_builtin_dataset(quiet=True, progress=False)
    kill_at = args.iters // 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in (2, 3):
            res = [one_run(dp, args.iters, kill_at, data, Path(tmp), f"dp{dp}-{i}")
                   for i in range(args.runs)]
            for r in res:
                print(f"pipeline 2 x data {dp}: detect {r['detect_ms']:.0f} ms, reconfigure "
                      f"{r['reconfigure_ms']:.0f} ms, to next iteration {r['to_next_ms']:.0f} ms, "
                      f"after/before {r['ratio']:.2f}", flush=True)
            med = {k: statistics.median(r[k] for r in res)
                   for k in ("detect_ms", "reconfigure_ms", "to_next_ms", "ratio")}
            rows.append((dp, med, max(r["lost"] for r in res), all(r["complete"] for r in res)))
    print()
    print(f"one kill (last rank, backward) at iteration {kill_at} of {args.iters}; medians of "
          f"{args.runs} runs; 4 layers, hidden 64, 2 CPU cores")
    print(f"{'layout':>16} | detect ms | reconfigure ms | to next iteration ms | lost iterations"
          f" | post/pre iteration time | all iterations done")
    for dp, m, lost, ok in rows:
        print(f"{'PP2 x DP' + str(dp):>16} | {m['detect_ms']:9.0f} | {m['reconfigure_ms']:14.0f} | "
              f"{m['to_next_ms']:20.0f} | {lost:15d} | {m['ratio']:23.2f} | {ok}")
    print("targets: detection < 1000 ms for an exit, failure to next completed iteration "
          "< 5000 ms, lost work <= the interrupted iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
