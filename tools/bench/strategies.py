"""The same failure under each recovery strategy on CPU, side by side in one run.

Pipeline 2 x data 2, pipeline 4 x data 2 and tensor 2 x pipeline 2 x data 2 (4 layers, hidden
64) under chameleon-launch, one worker killed in the backward of iteration 10 of 30 (at TP 2,
one shard of a group: the group leaves whole), a checkpoint every 8 iterations; for each
of --chameleon-strategy reroute, takeover, reparallelize, restart and auto, and takeover with
--chameleon-redundancy eager: post-recovery over
failure-free iteration time (medians within the run), reconfiguration time, bytes of state
moved between ranks, iterations lost, and what auto chose.

    python tools/bench/strategies.py [--iters 30] [--layouts pp2xdp2 pp4xdp2 tp2xpp2xdp2]
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

# name -> (tensor parallel, pipeline depth, killed rank)
LAYOUTS = {"pp2xdp2": (1, 2, 3), "pp4xdp2": (1, 4, 5), "tp2xpp2xdp2": (2, 2, 3)}
# name -> flags: the forced strategies, takeover with eager redundancy (Bamboo-like), auto
STRATEGIES = {s: ["--chameleon-strategy", s]
              for s in ("reroute", "takeover", "reparallelize", "restart", "auto")}
STRATEGIES["takeover-eager"] = ["--chameleon-strategy", "takeover",
                                "--chameleon-redundancy", "eager"]


def one(tp: int, pp: int, victim: int, strategy: str, iters: int, data: str,
        tmp: Path) -> dict:
    kill_at = iters // 3
    run = run_chameleon(2 * tp * pp, SMALL_MODEL + [
        "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp), "--global-batch-size", "16",
        "--train-iters", str(iters), "--data-path", data, "--split", "100,0,0",
        "--log-interval", str(iters), "--chameleon", *STRATEGIES[strategy],
        "--save", str(tmp / f"ckpt-{tp}-{pp}-{strategy}"), "--save-interval", "8",
        "--chameleon-inject", f"kill:rank={victim},iter={kill_at},phase=backward"], tmp,
        name=f"{tp}-{pp}-{strategy}", timeout=900)
    if run.returncode != 0:
        raise SystemExit(f"tp{tp} pp{pp} {strategy} failed:\n{run.stderr[-2000:]}")
    events = run.metrics
    rec = next(e for e in events if e["event"] == "recovery")
    its = [e for e in events if e["event"] == "iteration"]
    cut = next(i for i, e in enumerate(its) if e["generation"] > 0)
    before = [e["elapsed_ms"] for e in its[2:cut]]
    after = [e["elapsed_ms"] for e in its[cut + 1:]]
    return {"strategy": rec["strategy"], "ratio": statistics.median(after) /
            statistics.median(before), "reconfigure_ms": rec["reconfigure_ms"],
            "moved_mib": rec.get("moved_bytes", 0) / 2 ** 20, "lost": rec["lost_iterations"],
            "world": rec["world"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = p.parse_args(argv)
    if args.iters < 15:
        print("strategies.py: error: --iters must be at least 15", file=sys.stderr)
        return 2
    data = ensure_builtin_dataset(quiet=True, progress=False)
    print(f"{'layout':>11} | {'strategy':>14} | {'ran':>9} | {'post/pre':>8} | "
          f"{'reconfigure ms':>14} | {'moved MiB':>9} | {'lost its':>8} | world")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            tp, pp, victim = LAYOUTS[layout]
            for strategy in STRATEGIES:
                r = one(tp, pp, victim, strategy, args.iters, data, Path(tmp))
                print(f"{layout:>11} | {strategy:>14} | {r['strategy']:>9} | {r['ratio']:8.2f} | "
                      f"{r['reconfigure_ms']:14.0f} | {r['moved_mib']:9.2f} | {r['lost']:8d} | "
                      f"{r['world']}", flush=True)
    print("post/pre: median iteration time after the recovery over before it (the physical "
          "limit of losing 1 of N workers is N / (N - 1))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
