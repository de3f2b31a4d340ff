"""What eager redundancy costs during failure-free training on CPU, measured beside predicted.

Pipeline 2 x data 2 (4 layers, hidden 64) under chameleon-launch, failure-free, with
--chameleon-redundancy none and eager, in one run: median iteration time of each and their
ratio; the largest holder's shadow copies (measured buffers) and the refresh time per iteration
(the shadow-sync timer, slowest rank), beside the performance model's estimate
(chameleon_ext.planning.strategies.redundancy.eager_cost with the profile the eager job calibrated: its
point-to-point model alone, and with the refresh factor calibration fitted).

    python tools/bench/eager_redundancy.py [--iters 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chameleon_ext.plan.execution_plan import ExecutionPlan  # noqa: E402
from chameleon_ext.planning.perf_model import Profile  # noqa: E402
from chameleon_ext.planning.strategies.redundancy import eager_cost  # noqa: E402
from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.launch import SMALL_MODEL, run_chameleon  # noqa: E402

PP, DP, GBS = 2, 2, 16


def one(redundancy: str, iters: int, data: str, tmp: Path) -> tuple[float, dict]:
    run = run_chameleon(PP * DP, SMALL_MODEL + [
        "--pipeline-model-parallel-size", str(PP), "--global-batch-size", str(GBS),
        "--train-iters", str(iters), "--data-path", data, "--split", "100,0,0",
        "--log-interval", str(iters), "--chameleon", "--chameleon-redundancy", redundancy,
        "--save", str(tmp / redundancy)], tmp, name=redundancy, timeout=900)
    if run.returncode != 0:
        raise SystemExit(f"--chameleon-redundancy {redundancy} failed:\n{run.stderr[-2000:]}")
    times = [e["elapsed_ms"] for e in run.metrics if e["event"] == "iteration"][2:]
    shadows = next((e for e in run.metrics if e["event"] == "redundancy"), {})
    return statistics.median(times), shadows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    if args.iters < 10:
        print("eager_redundancy.py: error: --iters must be at least 10", file=sys.stderr)
        return 2
    data = ensure_builtin_dataset(quiet=True, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        none_ms, _ = one("none", args.iters, data, Path(tmp))
        eager_ms, shadows = one("eager", args.iters, data, Path(tmp))
        profile = Profile.load(Path(tmp) / "eager" / "profile.json")
    plan = ExecutionPlan.failure_free(PP * DP, 1, PP, 4, 2, GBS)
    cost = eager_cost(plan, profile)
    alone = eager_cost(plan, dataclasses.replace(profile, shadow_sync_factor=1.0))
    print(f"pipeline {PP} x data {DP}, failure-free, {args.iters} iterations")
    print(f"  iteration time: none {none_ms:.1f} ms, eager {eager_ms:.1f} ms "
          f"({eager_ms / none_ms:.3f}x)")
    print(f"  shadow copies on the largest holder: measured {shadows['held_bytes'] / 2**20:.3f} "
          f"MiB, predicted {cost.memory_bytes / 2**20:.3f} MiB")
    print(f"  refresh per iteration: measured {shadows['sync_ms']:.2f} ms (slowest rank), "
          f"point-to-point model {alone.refresh_ms:.2f} ms, calibrated {cost.refresh_ms:.2f} "
          f"ms (factor {profile.shadow_sync_factor:.2f}); added to the iteration: measured "
          f"{eager_ms - none_ms:.2f} ms, predicted {cost.sync_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
