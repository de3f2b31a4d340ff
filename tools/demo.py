"""make demo: a small GPT loses a worker mid-run, recovers in-process, and its losses stay the
failure-free ones.

    python -m tools.demo [--iters N] [--kill-iter K] [--out runs/demo] [--data-path PREFIX]
                         [--cache-dir data/demo] [--timeout SECONDS]

1. Pipeline 2 x data 2 (4 workers; GPT of 4 layers, hidden 64; the built-in dataset of
   `make data`) under chameleon-launch with --chameleon: --chameleon-inject SIGKILLs launch
   rank 3 (pipeline 1's last stage) in the backward of iteration K; the survivors agree on the
   store, --chameleon-strategy auto chooses how to go on, and training continues in the same
   processes. The training log streams to the terminal.
2. The same job without a failure, under plain torchrun and without --chameleon: the reference.
   Its losses are cached in --cache-dir, keyed by everything that determines them (the training
   arguments, the dataset's bytes, this repository's Python code, the library versions), so the
   next demo reuses them.
3. A summary from the metrics file's `failure` and `recovery` events: the losses beside the
   reference's (largest relative difference), detection and reconfiguration times, the strategy
   and the candidates it was chosen from; OUT/losses.png plots both loss curves.

N: --iters, else $DEMO_ITERS, else 60 (at least 6). K: --kill-iter, else 2/5 of the way and at
least 5 (after the live calibration's warm-up, so that auto ranks every strategy). Exit status:
0 when the job recovered and every loss equals the reference's within relative 1e-5, 1 when
not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

PROG = "python -m tools.demo"
REPO = Path(__file__).resolve().parents[1]
NPROC = 4
VICTIM = 3                         # launch rank 3: pipeline 1's last stage
TOLERANCE = 1e-5                   # fp32 losses under any plan (ARCHITECTURE.md's invariant)
DEFAULT_ITERS = 60
# The code that computes the losses (part of the reference's cache key).
SOURCES = ("pretrain_gpt.py", "megatron", "chameleon_ext")
# A launcher asked to stop (SIGINT) reaps its workers; past this it is killed.
STOP_GRACE_S = 30.0


class DemoError(RuntimeError):
    """A run that failed or did not recover: one line for the user, exit 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:      # one line, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> _Parser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--iters", type=int, default=None,
                   help=f"training iterations (default $DEMO_ITERS, else {DEFAULT_ITERS})")
    p.add_argument("--kill-iter", type=int, default=None,
                   help="the iteration whose backward the kill interrupts (default: 2/5 of "
                        "the way, at least 5)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"),
                   help="metrics files, tensorboard logs and losses.png (default runs/demo)")
    p.add_argument("--data-path", default=None,
                   help="dataset prefix (default: the one in data/builtin.prefix)")
    p.add_argument("--cache-dir", type=Path, default=Path("data/demo"),
                   help="where the reference's losses are kept (default data/demo)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds each of the two runs may take (default 900)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.iters is None:
        env = os.environ.get("DEMO_ITERS", str(DEFAULT_ITERS))
        try:
            args.iters = int(env)
        except ValueError:
            p.error(f"DEMO_ITERS={env!r} is not an integer")
    if args.iters < 6:
        p.error(f"--iters (or DEMO_ITERS) must be at least 6 (the LR warm-up), got {args.iters}")
    if args.kill_iter is None:
        args.kill_iter = min(max(5, 2 * args.iters // 5), args.iters - 1)
    if not 1 <= args.kill_iter < args.iters:
        p.error(f"--kill-iter must be in 1..{args.iters - 1} (some training after the "
                f"recovery), got {args.kill_iter}")
    if args.data_path is None:
        prefix_file = REPO / "data" / "builtin.prefix"
        if not prefix_file.exists():
            p.error(f"no --data-path and no {prefix_file.relative_to(REPO)}: run `make data`")
        args.data_path = prefix_file.read_text().strip()
    if not Path(args.data_path + ".bin").exists() or not Path(args.data_path + ".idx").exists():
        p.error(f"no dataset at {args.data_path} (.bin and .idx)")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


def training_args(iters: int, data_path: str) -> list[str]:
    """pretrain_gpt.py's arguments, the same for the demo and its reference."""
    return ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4",
            "--global-batch-size", "32", "--train-iters", str(iters), "--lr", "3e-3",
            "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
            "--seed", "1234", "--data-path", data_path, "--split", "98,2,0",
            "--eval-interval", str(max(iters // 3, 1)), "--eval-iters", "2",
            "--log-interval", str(max(iters // 12, 1)), "--no-progress-bar"]


# ---------------------------------------------------------------------------- runs

def launch(cmd: list[str], what: str, timeout_s: float) -> None:
    """Run a launcher in a session of its own, its output streaming to ours. On a timeout or
    Ctrl-C it is asked to stop (SIGINT: it reaps its workers), then killed."""
    print(f"$ python -m {shlex.join(cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", *cmd], cwd=REPO, env=env,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise DemoError(f"{what} did not finish in {timeout_s:g} s (--timeout)") from None
    except KeyboardInterrupt:
        _stop(proc)
        raise
    if rc != 0:
        raise DemoError(f"{what} exited with {rc} (its log is above)")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses_by_iteration(events: list[dict]) -> dict[int, float]:
    """The last loss of each iteration (a restart runs some again)."""
    return {e["iteration"]: e["loss"] for e in events if e["event"] == "iteration"}


def run_with_kill(args: argparse.Namespace, train: list[str]) -> list[dict]:
    metrics = args.out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # the metrics file is appended to
    inject = f"kill:rank={VICTIM},iter={args.kill_iter},phase=backward"
    _heading(f"1/2  {NPROC} workers, pipeline 2 x data 2, under chameleon-launch; worker "
             f"{VICTIM} is killed (SIGKILL) in the backward of iteration {args.kill_iter} "
             f"of {args.iters}: --chameleon-inject {inject}")
    launch(["chameleon_ext.control.launcher", "--nproc-per-node", str(NPROC), "--master-port", "0",
            "pretrain_gpt.py", *train, "--chameleon", "--chameleon-strategy", "auto",
            "--chameleon-inject", inject, "--chameleon-metrics-file", str(metrics),
            "--tensorboard-dir", str(args.out / "tensorboard")],
           "the job with the kill", args.timeout)
    return read_events(metrics)


def reference_losses(args: argparse.Namespace, train: list[str]) -> tuple[dict[int, float], str]:
    """The failure-free run's losses, from the cache or a run now; and where they came from."""
    metrics = args.out / "reference.jsonl"
    metrics.unlink(missing_ok=True)  # an earlier demo's, maybe of other arguments
    key = reference_key(train, args.data_path)
    cached = args.cache_dir / f"reference-{key[:16]}.json"
    if cached.exists():
        record = json.loads(cached.read_text())
        if record.get("key") == key:
            _heading(f"2/2  the failure-free reference: cached in {cached} (same arguments, "
                     "data, code and libraries)")
            return {int(i): loss for i, loss in record["losses"].items()}, f"cached {cached}"
    _heading("2/2  the failure-free reference: the same job under plain torchrun, without "
             "--chameleon")
    launch(["torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
            "pretrain_gpt.py", *train, "--chameleon-metrics-file", str(metrics)],
           "the failure-free reference", args.timeout)
    losses = losses_by_iteration(read_events(metrics))
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "losses": losses}, indent=1))
    tmp.rename(cached)
    return losses, f"run now, cached in {cached}"


def reference_key(train: list[str], data_path: str) -> str:
    """sha256 of what determines the reference's losses: the arguments (the dataset by its
    bytes, not its path), the Python code of SOURCES, the library versions, the threads."""
    h = hashlib.sha256()
    data = hashlib.sha256()
    for suffix in (".idx", ".bin"):
        data.update(Path(data_path + suffix).read_bytes())
    args = [data.hexdigest() if a == data_path else a for a in train]
    versions = {name: importlib.metadata.version(name)
                for name in ("torch", "megatron-core", "numpy")}
    h.update(json.dumps({"nproc": NPROC, "args": args, "versions": versions,
                         "python": sys.version, "omp_threads": 1}).encode())
    for path in _sources():
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _sources() -> list[Path]:
    paths = []
    for name in SOURCES:
        p = REPO / name
        paths += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return paths


# ---------------------------------------------------------------------------- summary

def summarize(args: argparse.Namespace, events: list[dict], reference: dict[int, float],
              origin: str) -> list[str]:
    """The summary's lines; DemoError where the job did not recover or its losses differ."""
    failure = next((e for e in events if e["event"] == "failure"), None)
    recovery = next((e for e in events if e["event"] == "recovery"), None)
    if failure is None or recovery is None:
        raise DemoError(f"the metrics file {args.out / 'metrics.jsonl'} has no failure and "
                        "recovery events: the job did not recover in-process")
    losses = losses_by_iteration(events)
    if sorted(losses) != sorted(reference):
        raise DemoError(f"the job logged iterations {_span(losses)}, the reference "
                        f"{_span(reference)}")
    diffs = {i: abs(losses[i] - reference[i]) / abs(reference[i]) for i in sorted(losses)}
    worst = max(diffs, key=diffs.get)
    png = plot(args.out / "losses.png", losses, reference, args.kill_iter, recovery["strategy"])
    worlds = [e["world"] for e in events if e["event"] == "iteration"]
    lines = [
        f"killed      launch rank(s) {failure['ranks']} ({failure['cause']}) in iteration "
        f"{args.kill_iter}; the job went on with {worlds[-1]} of its {worlds[0]} workers",
        f"detected    {_ms(failure.get('detect_ms'))} after the death, by the survivors",
        f"recovered   by {recovery['strategy']} in {_ms(recovery['reconfigure_ms'])} "
        f"(reconfiguration), in the same processes; training went on from iteration "
        f"{recovery.get('resume_iteration', args.kill_iter)} "
        f"({recovery['lost_iterations']} iteration(s) run again)",
        *why(recovery),
        *prediction(events),
        f"losses      {len(losses)} iterations against the failure-free reference ({origin}): "
        f"largest relative difference {diffs[worst]:.1e} (iteration {worst}), "
        + ("within" if diffs[worst] <= TOLERANCE else "NOT within") + f" {TOLERANCE:g}",
        f"plot        {png}",
    ]
    if diffs[worst] > TOLERANCE:
        raise DemoError("\n".join(lines) + f"\nthe losses differ from the reference's by more "
                        f"than {TOLERANCE:g}")
    return lines


def why(recovery: dict) -> list[str]:
    """How the strategy was chosen: the candidates the leader ranked, with their predictions."""
    candidates = recovery.get("candidates") or []
    if not candidates:
        return [f"why         no candidates were ranked (no calibration yet: the failure came "
                f"in the first iterations), so {recovery['strategy']} was taken by rule"]
    chosen = next((c for c in candidates if c["strategy"] == recovery["strategy"]), None)
    horizon = "horizon"
    if chosen and chosen.get("total_ms") is not None and chosen["predicted_iter_ms"] > 0:
        n = (chosen["total_ms"] - chosen["transition_ms"]) / chosen["predicted_iter_ms"]
        horizon = f"{n:.1f} iterations"
    lines = ["why         auto predicted each candidate plan over the survivors with the live "
             f"calibration and took the lowest total: transition + {horizon} (those expected "
             "before the next failure, at most the ones left) x iteration time"]
    for c in candidates:
        total = "" if c.get("total_ms") is None else f", total {c['total_ms']:8.1f} ms"
        lines.append(
            f"              {c['strategy']:<16} {c['layout']:<26} {c['predicted_iter_ms']:7.1f} "
            f"ms/iteration, transition {c['transition_ms']:7.1f} ms{total}"
            + ("" if c.get("feasible", True) else ", does not fit in memory")
            + ("   <- chosen" if c is chosen else ""))
    return lines


def prediction(events: list[dict]) -> list[str]:
    p = next((e for e in events if e["event"] == "prediction"), None)
    if p is None:
        return []
    return [f"measured    {p['measured_iter_ms']:.1f} ms/iteration after the recovery, "
            f"predicted {p['predicted_iter_ms']:.1f} ({100 * p['relative_error']:.0f}% off)"]


def plot(path: Path, losses: dict[int, float], reference: dict[int, float], kill_iter: int,
         strategy: str) -> Path:
    from tools.reproduce.plots import loss_curves
    ref_label = "failure-free reference"
    curves = {ref_label: [reference[i] for i in sorted(reference)],
              f"worker {VICTIM} killed, recovered by {strategy}": [losses[i] for i in
                                                                   sorted(losses)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    loss_curves(path, curves, ref_label, kill_iter)
    return path


def _span(losses: dict[int, float]) -> str:
    return f"{min(losses)}..{max(losses)} ({len(losses)})" if losses else "none"


def _ms(value) -> str:
    return "unknown" if value is None else f"{value:.0f} ms"


def _heading(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train = training_args(args.iters, args.data_path)
    start = time.monotonic()
    try:
        events = run_with_kill(args, train)
        reference, origin = reference_losses(args, train)
        lines = summarize(args, events, reference, origin)
    except DemoError as e:
        print(f"{PROG}: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    bar = "=" * 100
    print(f"\n{bar}\n demo summary ({time.monotonic() - start:.0f} s)", flush=True)
    for line in lines:
        print(f"   {line}")
    print(bar, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
