"""Failures at random instants: seeded kills and hangs from outside a running job.

Pipeline 2 x data 3 on 6 CPU processes under chameleon-launch (`--chameleon`, strategy auto,
a checkpoint every 2 to 5 iterations, drawn per trial). In each trial tools/inject_failure.py
signals a random rank a random delay after it works past a random iteration: SIGKILL (a lost
worker) or SIGSTOP (a hang: its heartbeat stops with it, so its agent reports and kills it).
A trial survives when the job exits 0 with the losses of an independent failure-free run
(relative 1e-5), the samples its loader delivered, and bit-identical replicas. Prints survived /
tried and the distribution of the time from the signal to the next completed iteration.

    python tools/bench/chaos.py [--trials 10] [--seed 0] [--iters 14] [--hangs 0.3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.launch import (SMALL_MODEL, LateKill, free_port, last_losses,  # noqa: E402
                          run_chameleon, run_job)


def args_for(data: str, iters: int) -> list[str]:
    return SMALL_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "24",
                          "--train-iters", str(iters), "--lr-decay-iters", str(iters),
                          "--lr", "3e-3", "--data-path", data, "--split", "100,0,0",
                          "--log-interval", str(iters)]


def trial(rng: random.Random, n: int, data: str, iters: int, hangs: float, reference: list[float],
          tmp: Path) -> dict:
    case = {"rank": rng.randrange(6), "after": rng.randint(1, iters - 4),
            "delay_ms": rng.randint(0, 500), "save_interval": rng.randint(2, 5),
            "hang": rng.random() < hangs}
    port = free_port()
    kill = LateKill(port, case["rank"], case["after"], case["delay_ms"], stop=case["hang"])
    kill.start()
    run = run_chameleon(6, args_for(data, iters) + [
        "--chameleon", "--save", str(tmp / f"ckpt{n}"),
        "--save-interval", str(case["save_interval"])], tmp, name=f"trial{n}", timeout=600,
        launcher_args=["--master-port", str(port)])
    kill.join()
    events = run.metrics
    losses = last_losses(events)
    its = [e for e in events if e["event"] == "iteration"]
    after = [e["time"] for e in its if kill.signalled_at and e["time"] > kill.signalled_at]
    replicas = [e["identical"] for e in events if e["event"] == "replicas"]
    fail = next((e for e in events if e["event"] == "failure"), None)
    problems = []
    if run.returncode != 0:
        problems.append(f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")
    if len(losses) != len(reference) or any(abs(a - b) > 1e-5 * abs(b)
                                            for a, b in zip(losses, reference)):
        problems.append("losses differ from the failure-free run")
    if any(e["consumed_samples"] != 24 * e["iteration"] for e in its):
        problems.append("the samples delivered differ from the global batches")
    if replicas != [True]:
        problems.append(f"replicas {replicas}")
    if kill.returncode != 0:
        problems.append(f"the signal was not sent: {kill.stderr.strip()[-200:]}")
    return {**case, "problems": problems, "during": fail["during"] if fail else None,
            "strategy": next((e["strategy"] for e in events if e["event"] == "recovery"), None),
            "to_next_ms": 1e3 * (min(after) - kill.signalled_at) if after else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=14)
    p.add_argument("--hangs", type=float, default=0.3, help="share of trials that SIGSTOP")
    a = p.parse_args(argv)
    if a.trials < 1 or a.iters < 6 or not 0 <= a.hangs <= 1:
        p.error("--trials >= 1, --iters >= 6 and 0 <= --hangs <= 1")
    data = ensure_builtin_dataset(quiet=True, progress=False)
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_job(6, args_for(data, a.iters), Path(tmp), name="reference")
        if ref.returncode != 0:
            raise SystemExit(f"the failure-free run failed:\n{ref.stderr[-2000:]}")
        rows = []
        for n in range(a.trials):
            r = trial(rng, n, data, a.iters, a.hangs, ref.losses(), Path(tmp))
            rows.append(r)
            what = "SIGSTOP" if r["hang"] else "SIGKILL"
            to_next = "-" if r["to_next_ms"] is None else f"{r['to_next_ms']:.0f} ms"
            print(f"trial {n}: {what} rank {r['rank']} {r['delay_ms']} ms after iteration "
                  f"{r['after']} (saves every {r['save_interval']}): noticed during "
                  f"{r['during']}, {r['strategy']}, next iteration after {to_next}: "
                  + ("survived" if not r["problems"] else "FAILED " + "; ".join(r["problems"])),
                  flush=True)
    survived = sum(not r["problems"] for r in rows)
    print()
    print(f"survived {survived} / {a.trials} (seed {a.seed}; pipeline 2 x data 3, 6 processes "
          "on this machine's cores; 4 layers, hidden 64)")
    for kind, hang in (("SIGKILL", False), ("SIGSTOP", True)):
        times = sorted(r["to_next_ms"] for r in rows if r["hang"] == hang
                       and r["to_next_ms"] is not None)
        if times:
            q = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
            print(f"  {kind}: signal -> next completed iteration over {len(times)} trial(s): "
                  f"min {times[0]:.0f} ms, quartiles {q[0]:.0f} / {q[1]:.0f} / {q[2]:.0f} ms, "
                  f"max {times[-1]:.0f} ms")
    print("target: every trial survives")
    return 0 if survived == a.trials else 1


if __name__ == "__main__":
    sys.exit(main())
