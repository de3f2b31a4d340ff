"""Accuracy of the performance model on CPU: predicted vs measured iteration time after a failure.

Each case trains under chameleon-launch with one worker killed mid-iteration; the leader of the
recovery predicts the new plan's iteration time with the profile calibrated from the job's own
timers, and rank 0 logs that prediction beside the median of the iterations measured after it
(the metrics file's "prediction" event). Prints every case, then the median and maximum relative
error.

    python tools/bench/perf_model_accuracy.py [--runs 1] [--iters 30]
    python tools/bench/perf_model_accuracy.py --emulate PROFILE.json --dilation X [--max-ranks 8]

Target (issue 4): median <= 5%, max <= 10%. With --emulate, the cases run 8 to 16 ranks (every
strategy at 8, a tensor-parallel group's loss under reroute and takeover, a Llama-style model
under reroute and a tensor-parallel takeover, a node of 4 lost under auto) on emulated devices
of the profile (--chameleon-emulate: each rank as if it had a device to itself,
`dilation` times slower) and each line adds the run's overrun share (an invalid emulation, over
1%, is marked); target (issue 17): median <= 3%, max <= 8%. The Llama-style cases (MODELS:
SwiGLU, grouped-query attention, RMSNorm, RoPE, an untied output layer, no biases; one without
--emulate too) check the costing of those shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.launch import SMALL_MODEL, LateKill, free_port, run_chameleon, run_nodes  # noqa: E402



# Model flags beyond tests.launch.SMALL_MODEL's sizes (hidden 64, 4 heads), by name
MODELS = {
    "gpt": [],
    # Llama-style: SwiGLU (Megatron-LM's default FFN, 128 here), 2 query groups, RMSNorm, RoPE,
    # an untied output layer, no biases
    "llama": ["--swiglu", "--group-query-attention", "--num-query-groups", "2",
              "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type",
              "rope", "--untie-embeddings-and-output-weights"],
}


@dataclass(frozen=True)
class Case:
    pp: int
    dp: int
    kill: int
    strategy: str
    tp: int = 1
    nodes: int = 1                     # above 1: `kill` names a node, lost whole
    model: str = "gpt"                 # a key of MODELS

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> str:
        return (f"{self.model} " if self.model != "gpt" else "") + \
            (f"TP{self.tp} x " if self.tp > 1 else "") + f"PP{self.pp} x DP{self.dp}" + \
            (f" on {self.nodes} nodes" if self.nodes > 1 else "")

    @property
    def killed(self) -> str:
        return f"node {self.kill}" if self.nodes > 1 else f"{self.kill}"


CASES = [Case(2, 2, 3, "reroute"), Case(2, 2, 0, "reroute"), Case(2, 3, 4, "reroute"),
         Case(2, 3, 0, "reroute"), Case(1, 4, 2, "reroute"), Case(2, 2, 3, "restart"),
         Case(2, 3, 5, "restart"), Case(2, 2, 3, "reroute", model="llama")]
# 8 to 16 workers starting on a few shared cores hold the agent's store back for seconds (5 s
# measured at 8 ranks). The agent now judges heartbeats by the store's clock, but the emulated
# cases were not re-run with the launcher's 5 s default, so the margin stays; a lost worker is
# still seen at once by its exit.
HEARTBEAT = ["--heartbeat-timeout", "30"]
# Every strategy at 8 ranks, a tensor-parallel group's loss, a Llama-style model, then 12 and
# 16 ranks.
EMULATED_CASES = [
    Case(2, 4, 7, "reroute"), Case(2, 4, 0, "reroute"), Case(4, 2, 7, "reroute"),
    Case(2, 4, 7, "restart"), Case(2, 4, 7, "takeover"), Case(2, 4, 7, "reparallelize"),
    Case(2, 2, 7, "reroute", tp=2), Case(2, 2, 7, "takeover", tp=2),
    Case(2, 4, 7, "reroute", model="llama"), Case(2, 2, 7, "takeover", tp=2, model="llama"),
    Case(2, 4, 1, "auto", nodes=2),
    Case(2, 6, 11, "reroute"), Case(4, 3, 11, "reroute"), Case(4, 4, 15, "reroute"),
    Case(2, 8, 15, "restart"),
]


def _job_args(case: Case, iters: int, data: str, emulate: list[str]) -> list[str]:
    return SMALL_MODEL + MODELS[case.model] + [
        "--tensor-model-parallel-size", str(case.tp),
        "--pipeline-model-parallel-size", str(case.pp), "--global-batch-size",
        str(8 * case.dp), "--train-iters", str(iters), "--data-path", data, "--split",
        "100,0,0", "--log-interval", str(iters), "--chameleon", "--chameleon-strategy",
        case.strategy, *emulate]


def one(case: Case, iters: int, data: str, tmp: Path, name: str,
        emulate: list[str]) -> tuple[dict, dict | None]:
    """The run's prediction event, and its emulation event (None when not emulating)."""
    kill_at = iters // 3
    if case.nodes > 1:
        return _node_case(case, kill_at, iters, data, tmp, name, emulate)
    # Bounds one job of up to 16 processes on a few shared cores (start-up alone takes
    # minutes there); a run that long is stuck.
    run = run_chameleon(case.ranks, _job_args(case, iters, data, emulate) + [
        "--chameleon-inject", f"kill:rank={case.kill},iter={kill_at},phase=backward"], tmp,
        name=name, timeout=900, launcher_args=HEARTBEAT if emulate else ())
    if run.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{run.stderr[-2000:]}")
    pred = next((e for e in run.metrics if e["event"] == "prediction"), None)
    if pred is None:
        raise SystemExit(f"run {name} logged no prediction:\n{run.stdout[-2000:]}")
    return pred, next((e for e in run.metrics if e["event"] == "emulation"), None)


def _node_case(case: Case, kill_at: int, iters: int, data: str, tmp: Path, name: str,
               emulate: list[str]) -> tuple[dict, dict | None]:
    """The job on `case.nodes` chameleon-launch agents; node `case.kill` (agent and workers)
    SIGKILLed once its first worker works past iteration kill_at - 1. The agents judge
    heartbeats by the store's clock, so the launcher's 5 s heartbeat timeout holds here."""
    port = free_port()
    kill = LateKill(port, case.kill, kill_at - 1, 100, node=True).start()
    run = run_nodes(case.nodes, case.ranks // case.nodes, _job_args(case, iters, data, emulate),
                    tmp, name=name, port=port, timeout=900)
    kill.join()
    if kill.signalled_at is None or any(a.returncode != 0 for i, a in enumerate(run.agents)
                                        if i != case.kill):
        raise SystemExit(f"run {name} failed:\n{kill.stderr}\n"
                         + "".join(a.stderr[-1500:] for a in run.agents))
    pred = next((e for e in run.metrics if e["event"] == "prediction"), None)
    if pred is None:
        raise SystemExit(f"run {name} logged no prediction")
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
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="run only the cases of this model (default: every model)")
    p.add_argument("--only-nodes", action="store_true",
                   help="run only the node-loss cases (with --emulate)")
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
             if c.ranks <= args.max_ranks and args.model in (None, c.model)]
    if not cases:
        print(f"perf_model_accuracy.py: error: no case of at most {args.max_ranks} ranks"
              + (f" of model {args.model}" if args.model else ""), file=sys.stderr)
        return 2
    data = ensure_builtin_dataset(quiet=True, progress=False)
    errors = []
    print(f"{'layout':>25} | {'killed':>6} | {'strategy':>13} | {'predicted ms':>12} | "
          f"{'measured ms':>11} | error" + (" | overruns" if emulate else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            if args.only_nodes and case.nodes == 1:
                continue
            for i in range(args.runs):
                r, emu = one(case, args.iters, data, Path(tmp),
                             f"{case.model}tp{case.tp}pp{case.pp}dp{case.dp}k{case.kill}"
                             f"{case.strategy}{i}",
                             emulate)
                errors.append(r["relative_error"])
                over = "" if emu is None else f" | {100 * emu['share']:6.2f}%" + \
                    ("" if emu["valid"] else " INVALID (raise --dilation)")
                print(f"{case.layout:>25} | {case.killed:>6} | {case.strategy:>13} | "
                      f"{r['predicted_iter_ms']:12.1f} | {r['measured_iter_ms']:11.1f} | "
                      f"{100 * r['relative_error']:5.1f}%{over}", flush=True)
    targets = "median <= 3%, max <= 8%" if emulate else "median <= 5%, max <= 10%"
    print(f"\n{len(errors)} predictions: median error {100 * statistics.median(errors):.1f}%, "
          f"max {100 * max(errors):.1f}% (targets: {targets})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
