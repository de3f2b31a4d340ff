"""Accuracy of the performance model on CPU: predicted vs measured iteration time after a failure.

Each case trains under chameleon-launch with one worker killed mid-iteration; the leader of the
recovery predicts the new plan's iteration time with the profile calibrated from the job's own
timers, and rank 0 logs that prediction beside the median of the iterations measured after it
(the metrics file's "prediction" event). Prints every case, then the median and maximum relative
error.

    python tools/bench/perf_model_accuracy.py [--runs 1] [--iters 30]
    python tools/bench/perf_model_accuracy.py --emulate PROFILE.json --dilation X [--max-ranks 8]

Target (issue 4): median <= 5%, max <= 10%. With --emulate, the cases run 8 to 16 ranks on
emulated devices of the profile (--chameleon-emulate: each rank as if it had a device to itself,
`dilation` times slower) and each line adds the run's overrun share (an invalid emulation, over
1%, is marked); target (issue 17): median <= 3%, max <= 8%.
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
# 8 to 16 workers starting on a few shared cores hold the agent's store back for seconds (5 s
# measured at 8 ranks). The agent now judges heartbeats by the store's clock, but the emulated
# cases were not re-run with the launcher's 5 s default, so the margin stays; a lost worker is
# still seen at once by its exit.
HEARTBEAT = ["--heartbeat-timeout", "30"]
EMULATED_CASES = [
    (2, 4, 7, "reroute"), (2, 4, 0, "reroute"), (4, 2, 7, "reroute"), (2, 4, 7, "restart"),
    (2, 6, 11, "reroute"), (4, 3, 11, "reroute"), (4, 4, 15, "reroute"), (2, 8, 15, "restart"),
]


def one(case: tuple, iters: int, data: str, tmp: Path, name: str,
        emulate: list[str]) -> tuple[dict, dict | None]:
    """The run's prediction event, and its emulation event (None when not emulating)."""
    pp, dp, kill, strategy = case
    kill_at = iters // 3
    # Bounds one job of up to 16 processes on a few shared cores (start-up alone takes
    # minutes there); a run that long is stuck.
    run = run_chameleon(pp * dp, SMALL_MODEL + [
        "--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(8 * dp),
        "--train-iters", str(iters), "--data-path", data, "--split", "100,0,0",
        "--log-interval", str(iters), "--chameleon", "--chameleon-strategy", strategy,
        "--chameleon-inject", f"kill:rank={kill},iter={kill_at},phase=backward", *emulate],
        tmp, name=name, timeout=900, launcher_args=HEARTBEAT if emulate else ())
    if run.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{run.stderr[-2000:]}")
    pred = next((e for e in run.metrics if e["event"] == "prediction"), None)
    if pred is None:
        raise SystemExit(f"run {name} logged no prediction:\n{run.stdout[-2000:]}")
    return pred, next((e for e in run.metrics if e["event"] == "emulation"), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--emulate", metavar="PROFILE", default=None,
                   help="run the 8- to 16-rank cases on emulated devices of this profile")
    p.add_argument("--dilation", type=float, default=1.0,
                   help="--chameleon-emulate-dilation of the emulated runs")
    p.add_argument("--max-ranks", type=int, default=16,
                   help="run only the cases of at most this many ranks")
    args = p.parse_args(argv)
    if args.iters < 12:
        print("perf_model_accuracy.py: error: --iters must be at least 12 (a warm-up, the "
              "calibration, the failure and the measured iterations after it)", file=sys.stderr)
        return 2
    if args.dilation <= 0:
        print("perf_model_accuracy.py: error: --dilation must be positive", file=sys.stderr)
        return 2
    emulate = ["--chameleon-emulate", args.emulate, "--chameleon-emulate-dilation",
               str(args.dilation)] if args.emulate else []
    cases = [c for c in (EMULATED_CASES if args.emulate else CASES)
             if c[0] * c[1] <= args.max_ranks]
    if not cases:
        print(f"perf_model_accuracy.py: error: no case of at most {args.max_ranks} ranks",
              file=sys.stderr)
        return 2
    data = ensure_builtin_dataset(quiet=True, progress=False)
    errors = []
    print(f"{'layout':>10} | {'killed':>6} | {'strategy':>8} | {'predicted ms':>12} | "
          f"{'measured ms':>11} | error" + (" | overruns" if emulate else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            pp, dp, kill, strategy = case
            for i in range(args.runs):
                r, emu = one(case, args.iters, data, Path(tmp),
                             f"pp{pp}dp{dp}k{kill}{strategy}{i}", emulate)
                errors.append(r["relative_error"])
                over = "" if emu is None else f" | {100 * emu['share']:6.2f}%" + \
                    ("" if emu["valid"] else " INVALID (raise --dilation)")
                print(f"{f'PP{pp} x DP{dp}':>10} | {kill:>6} | {strategy:>8} | "
                      f"{r['predicted_iter_ms']:12.1f} | {r['measured_iter_ms']:11.1f} | "
                      f"{100 * r['relative_error']:5.1f}%{over}", flush=True)
    targets = "median <= 3%, max <= 8%" if emulate else "median <= 5%, max <= 10%"
    print(f"\n{len(errors)} predictions: median error {100 * statistics.median(errors):.1f}%, "
          f"max {100 * max(errors):.1f}% (targets: {targets})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
