"""Plan search time of the planner (every candidate predicted, the choice made) for clusters of
32, 1,024 and 16,384 GPUs with the analytical H200 profile of a GPT model, 1 to 8 failed GPUs,
and the time of each strategy's candidate alone (a rerouted plan's list schedules included).

    python tools/bench/plan_search.py [--sizes 32 1024 16384] [--failures 1 2 4 8] [--repeats 3]

Targets (issue 4): <= 50 ms, <= 1 s, <= 10 s for the whole search. The failed ranks are spread
over different pipelines and stages (a deterministic pseudo-random pick per size and count);
with tensor parallelism each takes its whole group out. Times are wall-clock medians; the CPU
time of the whole search is printed beside it, since other processes on the machine stretch
the wall time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chameleon_ext.plan.execution_plan import ExecutionPlan  # noqa: E402
from chameleon_ext.planning.perf_model import ModelShape, analytical_profile  # noqa: E402
from chameleon_ext.planning.planner import STRATEGIES, Situation, candidates, choose  # noqa: E402

# (GPUs, tensor parallel, pipeline parallel, global batch in sequences, model)
CLUSTERS = {
    32: (1, 4, 128, ModelShape(32, 2560, 32, 2048, 1, 51200, bytes_per_element=2)),
    1024: (8, 8, 1024, ModelShape(40, 5120, 40, 2048, 1, 51200, bytes_per_element=2)),
    16384: (8, 16, 8192, ModelShape(96, 12288, 96, 2048, 1, 51200, bytes_per_element=2)),
}
TARGET_MS = {32: 50.0, 1024: 1000.0, 16384: 10000.0}


@dataclass(frozen=True)
class Search:
    median_ms: float                   # the whole search (every strategy), wall clock
    cpu_ms: float                      # its CPU time (median)
    chosen: str
    strategy_ms: dict[str, float]      # each strategy's candidates alone, wall clock


def _case(gpus: int, failures: int):
    tp, pp, gbs, shape = CLUSTERS[gpus]
    profile = analytical_profile(shape, "H200")
    plan = ExecutionPlan.failure_free(gpus, tp, pp, shape.num_layers, 1, gbs)
    lost = set(random.Random(gpus * 100 + failures).sample(range(gpus), failures))
    situation = Situation(iteration=1000, checkpoint_iteration=900, remaining_iterations=10_000,
                          failure_free_ms=1000.0, save_interval=100)
    return plan, lost, profile, situation


def _timed(repeats: int, run) -> tuple[float, float, object]:
    """Median wall and CPU milliseconds of `repeats` runs, and the last result."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = run()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu), out


def one(gpus: int, failures: int, repeats: int, per_strategy: bool = True) -> Search:
    plan, lost, profile, situation = _case(gpus, failures)
    each = {}
    for s in STRATEGIES if per_strategy else ():
        each[s] = _timed(repeats, lambda: candidates(plan, lost, profile, situation, (s,)))[0]
    ms, cpu, best = _timed(repeats, lambda: choose(candidates(plan, lost, profile, situation)))
    what = f"{best.strategy} ({len(best.plan.pipelines)} pipelines, {best.plan.world_size} " \
           f"GPUs, {best.iteration_ms:.0f} ms/iter)" if best else "none"
    return Search(ms, cpu, what, each)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(CLUSTERS))
    p.add_argument("--failures", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    unknown = sorted(set(args.sizes) - set(CLUSTERS))
    if unknown:
        print(f"plan_search.py: error: unknown sizes {unknown} (known: {sorted(CLUSTERS)})",
              file=sys.stderr)
        return 2
    print(f"{'GPUs':>6} | {'tp x pp x dp':<12} | {'failed':>6} | "
          + " | ".join(f"{s:>15}" for s in STRATEGIES)
          + f" | {'all ms':>8} | {'all CPU ms':>10} | {'target ms':>9} | chosen")
    for gpus in args.sizes:
        tp, pp, _, _ = CLUSTERS[gpus]
        for f in args.failures:
            found = one(gpus, f, args.repeats)
            print(f"{gpus:>6} | {f'{tp} x {pp} x {gpus // (tp * pp)}':<12} | {f:>6} | "
                  + " | ".join(f"{found.strategy_ms[s]:15.1f}" for s in STRATEGIES)
                  + f" | {found.median_ms:8.1f} | {found.cpu_ms:10.1f} | "
                  f"{TARGET_MS[gpus]:9.0f} | {found.chosen}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
