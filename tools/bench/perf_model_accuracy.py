"""Accuracy of the performance model on CPU: predicted vs measured iteration time after a failure.

Each case trains under chameleon-launch with one worker killed mid-iteration; the leader of the
recovery predicts the new plan's iteration time with the profile calibrated from the job's own
timers, and rank 0 logs that prediction beside the median of the iterations measured after it
(the metrics file's "prediction" event). Prints every case, then the median and maximum relative
error.

    python tools/bench/perf_model_accuracy.py [--runs 1] [--iters 30]

Target (issue 4): median <= 5%, max <= 10%.
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

# (pipeline depth, data-parallel width, killed rank, strategy)
CASES = [
    (2, 2, 3, "reroute"), (2, 2, 0, "reroute"), (2, 3, 4, "reroute"), (2, 3, 0, "reroute"),
    (1, 4, 2, "reroute"), (2, 2, 3, "restart"), (2, 3, 5, "restart"),
]


def one(case: tuple, iters: int, data: str, tmp: Path, name: str) -> dict:
    pp, dp, kill, strategy = case
    kill_at = iters // 3
    run = run_chameleon(pp * dp, SMALL_MODEL + [
        "--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(8 * dp),
        "--train-iters", str(iters), "--data-path", data, "--split", "100,0,0",
        "--log-interval", str(iters), "--chameleon", "--chameleon-strategy", strategy,
        "--chameleon-inject", f"kill:rank={kill},iter={kill_at},phase=backward"], tmp,
        name=name, timeout=600)
    if run.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{run.stderr[-2000:]}")
    pred = next((e for e in run.metrics if e["event"] == "prediction"), None)
    if pred is None:
        raise SystemExit(f"run {name} logged no prediction:\n{run.stdout[-2000:]}")
    return pred


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    if args.iters < 12:
        print("perf_model_accuracy.py: error: --iters must be at least 12 (a warm-up, the "
              "calibration, the failure and the measured iterations after it)", file=sys.stderr)
        return 2
    data = ensure_builtin_dataset(quiet=True, progress=False)
    errors = []
    print(f"{'layout':>10} | {'killed':>6} | {'strategy':>8} | {'predicted ms':>12} | "
          f"{'measured ms':>11} | error")
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            pp, dp, kill, strategy = case
            for i in range(args.runs):
                r = one(case, args.iters, data, Path(tmp), f"pp{pp}dp{dp}k{kill}{strategy}{i}")
                errors.append(r["relative_error"])
                print(f"{f'PP{pp} x DP{dp}':>10} | {kill:>6} | {strategy:>8} | "
                      f"{r['predicted_iter_ms']:12.1f} | {r['measured_iter_ms']:11.1f} | "
                      f"{100 * r['relative_error']:5.1f}%", flush=True)
    print(f"\n{len(errors)} predictions: median error {100 * statistics.median(errors):.1f}%, "
          f"max {100 * max(errors):.1f}% (targets: median <= 5%, max <= 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
