"""Post-recovery throughput on emulated devices: one of N ranks lost under auto.

N ranks (default 16: pipeline 4 x data 4, an 8-layer GPT, its layers split over the stages as
the planner's fastest failure-free plan has them) each emulate a dedicated device of
the analytical H200 profile of a 1.3B GPT's shape (--chameleon-emulate, dilation X); one rank
is killed in the backward of an iteration and the job recovers in-process under
--chameleon-strategy auto. Prints the measured post-recovery over failure-free iteration
throughput (medians within the run, the first iteration under each plan left out as a warm-up)
beside the planner's prediction and the limit (N - 1) / N, and the run's overrun share (above
1% the emulation is invalid: raise --dilation). With --distributed-optimizer N the job runs
--use-distributed-optimizer with N instances (--num-distributed-optimizer-instances): the lost
rank's shard comes from its copy in another instance (N >= 2), or from the checkpoint (N = 1).

    python tools/bench/post_recovery.py [--pipeline 4] [--data 4] [--dilation 80]
                                        [--distributed-optimizer N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chameleon_ext.plan.execution_plan import ExecutionPlan  # noqa: E402
from chameleon_ext.planning.perf_model import Profile, predict_plan  # noqa: E402
from chameleon_ext.planning.planner import replan  # noqa: E402
from megatron.elastic.emulation import emulated_profile  # noqa: E402
from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.launch import SMALL_MODEL, run_chameleon  # noqa: E402
from tools.reproduce import executed  # noqa: E402

LAYERS = 8
MICRO_BATCHES = 4                      # per pipeline, of SMALL_MODEL's 2 samples
PROG = "post_recovery.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", type=int, default=4)
    p.add_argument("--data", type=int, default=4)
    p.add_argument("--dilation", type=float, default=80.0,
                   help="default 80: valid at 16 ranks on 2 cores here")
    p.add_argument("--iters", type=int, default=18)
    p.add_argument("--kill-at", type=int, default=7)
    p.add_argument("--distributed-optimizer", type=int, metavar="INSTANCES",
                   help="--use-distributed-optimizer with this many instances (default: the "
                        "optimizer's state replicated whole)")
    a = p.parse_args(argv)
    ranks = a.pipeline * a.data
    if ranks < 2 or a.dilation <= 0 or not 4 <= a.kill_at <= a.iters - 4:
        print(f"{PROG}: error: need 2+ ranks, a positive --dilation and 4 <= --kill-at <= "
              "--iters - 4 (warm-up and measured iterations on both sides)", file=sys.stderr)
        return 2
    sharded = a.distributed_optimizer
    if sharded is not None and (sharded < 1 or a.data % sharded):
        print(f"{PROG}: error: --distributed-optimizer {sharded} must divide --data {a.data}",
              file=sys.stderr)
        return 2
    gbs = 2 * MICRO_BATCHES * a.data
    model = SMALL_MODEL[:]
    model[model.index("--num-layers") + 1] = str(LAYERS)
    data = ensure_builtin_dataset(quiet=True, progress=False)
    with tempfile.TemporaryDirectory(prefix="post-recovery-") as tmp:
        work = Path(tmp)
        profile = executed.default_profile(work / "device.json")
        plan = ExecutionPlan.failure_free(ranks, 1, a.pipeline, LAYERS, 2, gbs)
        device = emulated_profile(Profile.load(profile), a.dilation)
        # As table 1 does: the failure-free plan is the planner's fastest homogeneous one over
        # all N devices (layers split by cost), so that a recovery cannot look fast merely by
        # finding a better layout than the baseline's.
        best = replan(plan, set(), device)
        flags = []
        if best is not None and best.world_size == ranks and \
                predict_plan(best, device).iteration_ms < predict_plan(plan, device).iteration_ms:
            plan = best
            plan.save(work / "plan.json")
            flags = ["--chameleon-plan", str(work / "plan.json")]
        ff_ms = predict_plan(plan, device).iteration_ms
        layout = " ".join(f"{s.layer_end - s.layer_start}" for s in plan.pipelines[0].stages)
        victim = ranks - 1
        if sharded is not None:   # a checkpoint before the kill, for a shard without a copy
            flags += ["--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                      str(sharded), "--save", str(work / "ckpt"),
                      "--save-interval", str(a.kill_at - 2)]
        run = run_chameleon(ranks, model + [
            "--pipeline-model-parallel-size", str(a.pipeline), "--global-batch-size", str(gbs),
            "--train-iters", str(a.iters), "--data-path", data, "--split", "100,0,0",
            "--log-interval", str(a.iters), "--chameleon", "--chameleon-strategy", "auto",
            "--chameleon-emulate", str(profile), "--chameleon-emulate-dilation",
            str(a.dilation), "--chameleon-inject",
            f"kill:rank={victim},iter={a.kill_at},phase=backward", *flags], work, name="job",
            # Bounds the job: its iterations at 4x the emulated time, plus 5 minutes for 16
            # processes to start and one recovery on 2 shared cores; beyond, it is stuck.
            timeout=4 * a.iters * ff_ms / 1e3 + 300, launcher_args=executed.LAUNCHER)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"{PROG}: error: the job exited with {run.returncode}: {last}", file=sys.stderr)
        return 1
    rec = next(e for e in run.metrics if e["event"] == "recovery")
    its = [e for e in run.metrics if e["event"] == "iteration"]
    before = [e["elapsed_ms"] for e in its if 2 < e["iteration"] < rec["resume_iteration"]]
    after = [e["elapsed_ms"] for e in its if e["iteration"] > rec["resume_iteration"]]
    emu = next(e for e in run.metrics if e["event"] == "emulation")
    pre, post = statistics.median(before), statistics.median(after)
    print(f"{ranks} emulated ranks (pipeline {a.pipeline} x data {a.data}, {LAYERS} layers "
          f"per stage {layout}, dilation {a.dilation:g}"
          + ("" if sharded is None else f", distributed optimizer with {sharded} instance(s)")
          + f"), rank {victim} killed in iteration {a.kill_at}: auto chose "
          f"{rec['strategy']} onto {rec['world']} ranks"
          + (f" ({rec['why']})" if rec.get("why") else ""))
    print(f"failure-free iteration {pre:.0f} ms (predicted {ff_ms:.0f}), after the recovery "
          f"{post:.0f} ms (predicted {rec['predicted_iter_ms']:.0f})")
    print(f"post-recovery / failure-free throughput: measured {pre / post:.3f}, predicted "
          f"{ff_ms / rec['predicted_iter_ms']:.3f}, limit {(ranks - 1) / ranks:.4f}")
    print(f"overruns: {emu['overruns']} of {emu['ops']} padded ops ({100 * emu['share']:.2f}%)"
          + ("" if emu["valid"] else ": INVALID emulation, raise --dilation"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
