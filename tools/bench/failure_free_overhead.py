"""Failure-free overhead of the schedule-IR executor against megatron-core's own 1F1B.

Same model, same batches, pipeline 2 x data 2 on 4 processes; the two executors run alternately
(ABAB...) so machine noise hits both alike. Prints the median iteration time of each (warm-up
iterations dropped) and the ratio ours / megatron-core. Target: <= 1.02.

    python tools/bench/failure_free_overhead.py [--rounds 5] [--iters 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.launch import SMALL_MODEL, run_job  # noqa: E402

EXECUTORS = ("ir", "megatron-core")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="iterations dropped from each run")
    args = p.parse_args(argv)
    data = ensure_builtin_dataset(quiet=True, progress=False)
    times: dict[str, list[float]] = {e: [] for e in EXECUTORS}
    run_medians: dict[str, list[float]] = {e: [] for e in EXECUTORS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for exe in EXECUTORS if r % 2 == 0 else EXECUTORS[::-1]:
                run = run_job(4, SMALL_MODEL + [
                    "--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                    "--train-iters", str(args.iters), "--data-path", data, "--split", "100,0,0",
                    "--log-interval", str(args.iters), "--chameleon-executor", exe],
                    Path(tmp), name=exe, timeout=600)
                if run.returncode != 0:
                    print(run.stderr[-2000:], file=sys.stderr)
                    return 1
                ms = [e["elapsed_ms"] for e in run.metrics if e["event"] == "iteration"]
                ms = ms[args.warmup:]
                times[exe] += ms
                run_medians[exe].append(statistics.median(ms))
                print(f"round {r + 1}/{args.rounds} {exe:>13}: median {statistics.median(ms):7.1f} ms"
                      f" per iteration", flush=True)
    ours, ref = statistics.median(times["ir"]), statistics.median(times["megatron-core"])
    print()
    print("pipeline 2 x data 2, 4 gloo processes, 4 layers, hidden 64, seq 32, 8 micro-batches of 2")
    print(f"{'executor':>22} | median ms/iter | run medians")
    for exe, med in (("schedule IR (ours)", ours), ("megatron-core 1F1B", ref)):
        key = "ir" if exe.startswith("schedule") else "megatron-core"
        print(f"{exe:>22} | {med:14.1f} | " + " ".join(f"{m:.1f}" for m in run_medians[key]))
    paired = [a / b for a, b in zip(run_medians["ir"], run_medians["megatron-core"])]
    print(f"ratio ours / megatron-core: {ours / ref:.3f} pooled, "
          f"{statistics.median(paired):.3f} median of per-round ratios (target <= 1.02)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
