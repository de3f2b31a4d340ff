"""Run pretrain_gpt.py under torchrun for tests: own session, a deadline, cleanup by PID."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]

# 4 layers, hidden 64: the small model every multi-process test uses.
SMALL_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "2", "--no-progress-bar"]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (each socket is held until all are chosen: a port released
    at once may be handed out again)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn_ranks(worker: Callable, ranks, *args, timeout_s: float = 180) -> dict:
    """`worker(rank, port, out, *args)` in a spawned process per rank of `ranks` (they meet on
    127.0.0.1:port); each pickles its result to out/{rank}.pkl. Returns rank -> result. Each
    process gets `timeout_s` to finish: spawned workers import torch and megatron-core first,
    which alone has taken most of a minute on a shared 2-core host under load. A process still
    alive then is killed by its PID."""
    ctx = multiprocessing.get_context("spawn")
    ranks = list(ranks)
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, out, *args)) for r in ranks]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout=timeout_s)
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
        return {r: pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in ranks}


# Flags that change the layout, not the losses (tests/dist/test_layout_equivalence.py), and how
# many values each takes; and --log-interval (every iteration's loss is in the metrics file).
_NOT_IN_LOSSES = {"--pipeline-model-parallel-size": 1, "--tensor-model-parallel-size": 1,
                  "--sequence-parallel": 0, "--log-interval": 1}
_REFERENCES: dict[tuple[str, ...], list[float]] = {}


def failure_free(args: list[str], tmp_path_factory) -> list[float]:
    """The losses of `args` without a failure, on one process under plain torchrun (no
    --chameleon): the independent reference that every layout of the same training is compared
    with, since the losses do not depend on the layout. Run once per session for each training
    and shared by the test modules that train alike."""
    key = tuple(_without_layout(args))
    if key not in _REFERENCES:
        iterations = int(args[args.index("--train-iters") + 1])
        _REFERENCES[key] = reference_run(1, list(key), tmp_path_factory.mktemp("ref"),
                                         iterations, "ref").losses()
    return _REFERENCES[key]


def _without_layout(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        skip = _NOT_IN_LOSSES.get(args[i])
        if skip is None:
            out.append(args[i])
            i += 1
        else:
            i += 1 + skip
    return out


def failure_free_losses(args_of: Callable[[int], list[str]],
                        tmp_path_factory) -> Callable[[int], list[float]]:
    """k -> failure_free(args_of(k)): a module's references of several data-parallel widths."""
    return lambda k: failure_free(args_of(k), tmp_path_factory)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    metrics: list[dict]

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.metrics if e["event"] == "iteration"]

    def iterations(self) -> list[int]:
        return [e["iteration"] for e in self.metrics if e["event"] == "iteration"]


def run_job(nproc: int, args: list[str], workdir: Path, *, timeout: float = 240,
            name: str = "job") -> Run:
    """torchrun --nproc-per-node nproc pretrain_gpt.py args; metrics go to workdir/name.jsonl."""
    return _run(["torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                 "127.0.0.1", "--master-port", str(free_port())], args, workdir, timeout, name)


def reference_run(nproc: int, args: list[str], workdir: Path, iterations: int,
                  name: str = "reference") -> Run:
    """run_job that must train iterations 1..`iterations`: a reference the cases compare with."""
    run = run_job(nproc, args, workdir, name=name)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.iterations() == list(range(1, iterations + 1))
    return run


def run_chameleon(nproc: int, args: list[str], workdir: Path, *, timeout: float = 300,
                  name: str = "job", launcher_args: list[str] = (), port: int | None = None
                  ) -> Run:
    """The same under chameleon-launch, whose workers survive a peer's death; its store on
    127.0.0.1:`port` (default: a free one)."""
    return _run(["chameleon_ext.control.launcher", "--nproc-per-node", str(nproc), "--master-port",
                 str(port or free_port()), *launcher_args], args, workdir, timeout, name)


def _run(launcher: list[str], args: list[str], workdir: Path, timeout: float, name: str) -> Run:
    """The job's output is written to `name`.stdout.log and .stderr.log in `workdir` (kept
    for a failure's post-mortem with pytest's temporary directories) and read back."""
    metrics = workdir / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", *launcher, str(REPO / "pretrain_gpt.py"), *args,
           "--chameleon-metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    logs = [workdir / f"{name}.{stream}.log" for stream in ("stdout", "stderr")]
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr,
                                text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Where each worker is stuck (pretrain's SIGUSR2 handler prints its threads'
            # stacks), then Ctrl-C: both launchers then reap their workers (chameleon-launch
            # starts each in a session of its own, out of reach of a signal to the launcher's
            # group).
            for pid in _children(proc.pid):
                try:
                    os.kill(pid, signal.SIGUSR2)
                except ProcessLookupError:
                    pass
            time.sleep(2)    # the dumps reach the launcher's stderr
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(proc.pid)
                proc.wait()
            raise AssertionError(f"{name} did not finish in {timeout} s\n"
                                 f"{logs[1].read_text()[-12000:]}")
        finally:
            kill_group(proc.pid)
    out, err = (path.read_text() for path in logs)
    events = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.exists() else []
    return Run(proc.returncode, out, err, events)


@dataclass
class NodesRun:
    """A job of several chameleon-launch agents: each node's agent (its exit code, its output
    and its workers') and the job's metrics (written by whichever rank leads)."""

    agents: list[Run]
    metrics: list[dict]

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.metrics if e["event"] == "iteration"]

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.metrics if e["event"] == kind]

    @property
    def stdout(self) -> str:
        return "".join(a.stdout for a in self.agents)


def run_nodes(nnodes: int, nproc: int, args: list[str], workdir: Path, *, timeout: float = 300,
              name: str = "job", port: int | None = None, store: str | None = None,
              launcher_args: list[str] = ()) -> NodesRun:
    """`nnodes` chameleon-launch agents on this host as the nodes of one job (node 0 hosts the
    TCPStore on `port` unless `store` names one), `nproc` workers each; metrics go to
    workdir/name.jsonl. Every agent and every worker it started is killed by PID / process
    group at the end."""
    metrics = workdir / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs, outs = [], []
    for node in range(nnodes):
        out = [open(workdir / f"{name}.node{node}.{s}", "w+") for s in ("out", "err")]
        cmd = [sys.executable, "-m", "chameleon_ext.control.launcher", "--nnodes", str(nnodes),
               "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(port),
               *(["--store", store] if store else []), *launcher_args,
               str(REPO / "pretrain_gpt.py"), *args, "--chameleon-metrics-file", str(metrics)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out[0], stderr=out[1],
                                      text=True, start_new_session=True))
        outs.append(out)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                # Ctrl-C first: each agent then reaps its workers.
                for q in procs:
                    if q.poll() is None:
                        q.send_signal(signal.SIGINT)
                for q in procs:
                    try:
                        q.wait(30)
                    except subprocess.TimeoutExpired:
                        pass
                raise AssertionError(f"{name} did not finish in {timeout} s\n"
                                     + "".join(_read(e)[-2000:] for _, e in outs)) from None
    finally:
        for p, (_, err) in zip(procs, outs):
            # The workers run in sessions of their own: by the PIDs their agent logged.
            for pids in re.findall(r"\(pids ([\d, ]+)\)", _read(err)):
                for pid in pids.split(","):
                    kill_group(int(pid))
            kill_group(p.pid)
            p.wait(10)
    agents = [Run(p.returncode, _read(o), _read(e), []) for p, (o, e) in zip(procs, outs)]
    for o, e in outs:
        o.close()
        e.close()
    events = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.exists() else []
    return NodesRun(agents, events)


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()


def run_script(args: list[str], *, env: dict | None = None, timeout: float = 120
               ) -> subprocess.CompletedProcess:
    """A single process of pretrain_gpt.py (for flag errors), no torchrun."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (a launcher's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            # the fields after the command's closing parenthesis: state, then the parent's pid
            if entry.name.isdigit() and \
                    int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def assert_close(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    assert len(a) == len(b), f"{len(a)} vs {len(b)} iterations"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"iteration {i + 1}: loss {x} vs {y}"


def assert_memory_within_estimates(events: list[dict]) -> None:
    """Each rank's measured memory (state, shadow copies, the most activations held at once)
    is within 10% of the final plan's estimate, and the largest within 10% of what the
    recovery predicted for the plan it chose, before it ran."""
    ranks = next(e for e in events if e["event"] == "memory")["ranks"]
    for r in ranks:
        assert r["measured_bytes"] <= 1.1 * r["estimated_bytes"], r
    rec = next(e for e in events if e["event"] == "recovery")
    chosen = [c for c in rec["candidates"] if c["strategy"] == rec["strategy"]]
    if chosen:
        assert max(r["measured_bytes"] for r in ranks) <= 1.1 * chosen[0]["memory_mib"] * 2**20


def last_losses(events: list[dict]) -> list[float]:
    """Loss per iteration, the last run of each (a restart runs some iterations again)."""
    by_it = {e["iteration"]: e["loss"] for e in events if e["event"] == "iteration"}
    return [by_it[i] for i in sorted(by_it)]


def read_csv(path: Path) -> list[dict]:
    """A CSV written by tools/reproduce, one dict per row."""
    import csv
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# How long a tool started beside a job waits for the job's store and worker records: the
# agent's start-up, its fork server's imports (up to 16 s measured) on 2 loaded cores.
JOB_UP_S = 120
# The tools started beside jobs: what a test leaves running (it failed before `join`) is
# killed when it ends (tests/conftest.py).
BESIDE: list[subprocess.Popen] = []


class _BesideJob:
    """tools/inject_failure.py beside a job: `start` it before the job (tests/inject_beside.py
    imports the tool at once, then tries until the job's agent has put the store and its workers
    up, within JOB_UP_S), `join` it after: the tool's exit code and output (`_done`); one still
    running `timeout` seconds into `join` is killed, its returncode left None."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _done(self, returncode: int, stdout: str, stderr: str) -> None:
        raise NotImplementedError

    def start(self):
        self._proc = subprocess.Popen([sys.executable, "tests/inject_beside.py", str(JOB_UP_S),
                                       *self._command()], cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        BESIDE.append(self._proc)
        return self

    def join(self, timeout: float = 60) -> None:
        try:
            out, err = self._proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return
        self._done(self._proc.returncode, out, err)


@dataclass
class TimedKills(_BesideJob):
    """tools/inject_failure.py --trace run beside a job on `port`: SIGKILLs of launch ranks
    at wall-clock instants, whatever the job does then. `after`: the instants are seconds from
    when rank 0 works past that iteration; None: they are epoch times (time.time()), the trace
    rewritten relative to the tool's start at each of its tries."""

    port: int
    path: Path                           # the trace file the tool reads
    kills: list[tuple[float, int]]       # (instant, launch rank)
    after: int | None = None
    returncode: int | None = None
    stdout: str = ""

    def _command(self) -> list[str]:
        trace = ["--trace", str(self.path)]
        if self.after is None:
            epochs = self.path.with_name(self.path.name + ".epochs.json")
            epochs.write_text(json.dumps(self.kills))
            return ["--epochs", str(epochs), f"127.0.0.1:{self.port}", *trace]
        self.path.write_text("".join(f"{t:.3f} {r}\n" for t, r in self.kills))
        return [f"127.0.0.1:{self.port}", *trace, "--after-iteration", str(self.after),
                "--wait", "180"]

    def _done(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout = returncode, stdout

    @property
    def signalled_at(self) -> list[float]:
        """The wall time of each kill sent, from the tool's log lines."""
        return [float(t) for t in re.findall(r"sent SIGKILL .* at (\d+\.\d+)$", self.stdout,
                                             re.MULTILINE)]


@dataclass
class LateKill(_BesideJob):
    """tools/inject_failure.py run beside a job: it signals `rank` `delay_ms` after the rank
    works past iteration `after` (a SIGKILL, or a SIGSTOP: a hang that stops heartbeats too).
    With `node`, `rank` names a node: its agent and all its workers are SIGKILLed once its first
    worker works past `after`. `store`: the job's store address when it is not the node-0
    agent's TCPStore on `port`."""

    port: int
    rank: int
    after: int
    delay_ms: float
    stop: bool = False
    term: bool = False                   # a SIGTERM (a preemption) instead of a SIGKILL
    node: bool = False
    store: str | None = None
    returncode: int | None = None
    stderr: str = ""
    signalled_at: float | None = None    # wall time of the signal, from the tool's log line

    def _command(self) -> list[str]:
        what = ("--node" if self.node else "--stop" if self.stop else "--term" if self.term
                else "--kill")
        return [self.store or f"127.0.0.1:{self.port}", what, str(self.rank),
                "--after-iteration", str(self.after), "--delay-ms", str(self.delay_ms),
                "--wait", "180"]

    def _done(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stderr = returncode, stderr
        found = re.search(r" at (\d+\.\d+)$", stdout.strip())
        self.signalled_at = float(found.group(1)) if found else None
