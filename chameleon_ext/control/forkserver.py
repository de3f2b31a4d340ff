"""The workers' fork server: one process per agent that imports the workers' libraries once and
forks each of the node's workers, restarts included, from itself.

Every worker of every launch and restart otherwise pays its own imports, about 3 s of a core
here (torch; megatron-core through DTensor and sympy); forked from a process that holds them, a
worker starts in milliseconds. The server imports the agent's ``--preload`` modules (as
multiprocessing's forkserver preload does, by name) before it forks anything, from its one
thread, and nothing it imports has touched a device or a process group.

A worker is the agent's own child to all that matters: the agent is a child subreaper
(PR_SET_CHILD_SUBREAPER); the server forks a go-between that forks the worker and exits, so the
kernel hands the worker to the agent, which gets its SIGCHLD and its exit status from waitpid as
for a process it had started itself. The server answers a start only once it has reaped the
go-between, when the worker already is the agent's and leads a session of its own (so its whole
process group can be signalled, as before).

A worker begins as a fresh interpreter would: its own session, the environment it was given,
stdout and stderr where it was told (unbuffered, as ``python -u``), the server's untouched signal
dispositions (a fresh interpreter's); then the script runs as ``__main__`` (runpy), a module as
``python -m`` runs it, or an executable through exec. Python's own shutdown follows: threads
joined, atexit, SystemExit's code, a traceback and 1 for an uncaught exception.

    python -m chameleon_ext.control.forkserver FD [MODULE ...]     (started by ForkServer)
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import runpy
import select
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

PR_SET_CHILD_SUBREAPER = 36       # linux/prctl.h
READY = b"ready\n"                # the server's first line: its imports are done

# How long the server's imports may take: 3-16 s measured here, the most on a loaded 2-core
# host. A server not ready by then is stuck: the node cannot start workers.
READY_TIMEOUT_S = 120.0
# How long the agent waits for a ready server to answer a start: a fork takes milliseconds.
START_TIMEOUT_S = 30.0


def omp_threads() -> str:
    """The workers' OMP_NUM_THREADS: the agent's, else 1 (torchrun's default)."""
    return os.environ.get("OMP_NUM_THREADS", "1")


class WorkerStartError(RuntimeError):
    """The fork server could not start a worker (it ended, or it is stuck)."""


@dataclass(frozen=True)
class StartRequest:
    """One worker to start: `kind` is "script" (python FILE), "module" (python -m) or "exec"
    (an executable, --no-python); `argv[0]` names it. None for stdout/stderr: the server's own
    (the agent's)."""

    kind: str
    argv: list[str]
    env: dict[str, str]
    stdout: str | None = None
    stderr: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @staticmethod
    def from_json(line: bytes) -> "StartRequest":
        return StartRequest(**json.loads(line))


class WorkerProcess:
    """A started worker, as the agent sees it: `pid` and `poll()` (None while it runs, then its
    exit code, minus the signal's number for a signal), Popen's answers."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def become_subreaper() -> None:
    """Orphaned descendants of this process are re-parented to it (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


class ForkServer:
    """The agent's handle on its fork server, started at once so that its imports overlap the
    agent's own set-up (`ready` tells when they are done, without blocking the agent's
    heartbeat); `env` is the server's environment (what libraries read as they load,
    OMP_NUM_THREADS above all, must be the workers')."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]):
        become_subreaper()
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), *preload],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            # out of the agent's process group: a Ctrl-C of the agent's terminal is the
            # agent's to handle; the server ends when the agent's end of the socket closes
            start_new_session=True)
        theirs.close()
        self.sock = ours
        self.reader = ours.makefile("rb")
        self.started = time.monotonic()
        self.is_ready = False

    @classmethod
    def for_workers(cls, preload: tuple[str, ...]) -> "ForkServer":
        """The node's fork server, importing what the workers will (nothing for --no-python),
        with the workers' thread count."""
        return cls(preload, {**os.environ, "OMP_NUM_THREADS": omp_threads()})

    def _answer(self, timeout_s: float) -> bytes:
        self.sock.settimeout(timeout_s)
        try:
            line = self.reader.readline()
        except OSError as e:     # socket.timeout is one
            raise WorkerStartError(f"the workers' fork server did not answer: {e}") from None
        if not line:
            raise WorkerStartError(f"the workers' fork server ended (exit {self.proc.poll()})")
        return line

    def ready(self, timeout_s: float) -> bool:
        """Whether the server has done its imports, waiting up to `timeout_s` for it; raises
        WorkerStartError once it has taken READY_TIMEOUT_S or ended."""
        if not self.is_ready:
            if not select.select([self.sock], [], [], timeout_s)[0]:
                if time.monotonic() - self.started > READY_TIMEOUT_S:
                    raise WorkerStartError("the workers' fork server did not finish its "
                                           f"imports in {READY_TIMEOUT_S:g} s")
                return False
            self.is_ready = self._answer(START_TIMEOUT_S) == READY
        return self.is_ready

    def start(self, request: StartRequest) -> WorkerProcess:
        """Fork a worker (the server ready, see `ready`)."""
        try:
            self.sock.sendall(request.to_json())
        except OSError as e:
            raise WorkerStartError(f"the workers' fork server is gone: {e}") from None
        return WorkerProcess(json.loads(self._answer(START_TIMEOUT_S))["pid"])

    def close(self) -> None:
        """End the server: a ready one reads the end of its socket and exits; one still
        importing is killed (it has started nothing)."""
        self.reader.close()
        self.sock.close()
        if not self.is_ready:
            self.proc.kill()
        try:
            # a ready server exits within milliseconds; 5 s tells that from a stuck one
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------- the server side

def _preload(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:      # the workers import it themselves and meet the error there
            print(f"chameleon-launch: the fork server could not preload {name}: {e}",
                  file=sys.stderr, flush=True)


def _serve(sock: socket.socket) -> StartRequest | None:
    """Start workers until the agent closes its end (None); in a started worker, its request."""
    reader = sock.makefile("rb")
    for line in reader:
        request = StartRequest.from_json(line)
        r, w = os.pipe()
        if os.fork() == 0:                           # the go-between
            os.close(r)
            if os.fork() == 0:                       # the worker
                reader.close()
                sock.close()
                os.setsid()
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                return request
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            pid = int(pipe.read())                   # the worker's, after its setsid()
        os.wait()                                    # the go-between: the worker is the agent's
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return None


def _redirect(fd: int, path: str | None) -> io.TextIOWrapper:
    if path is not None:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors="backslashreplace", write_through=True)


def _run_worker(request: StartRequest) -> None:
    os.environ.clear()
    os.environ.update(request.env)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout, sys.stderr = _redirect(1, request.stdout), _redirect(2, request.stderr)
    if request.kind == "exec":
        try:
            os.execvpe(request.argv[0], request.argv, request.env)
        except OSError as e:
            print(f"chameleon-launch: cannot run {request.argv[0]}: {e}", file=sys.stderr)
            sys.exit(127)
    sys.argv = list(request.argv)
    if request.kind == "module":
        sys.path[0] = os.getcwd()
        runpy.run_module(request.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(request.argv[0]))
        runpy.run_path(request.argv[0], run_name="__main__")


def main() -> int:
    fd, preload = int(sys.argv[1]), sys.argv[2:]
    _preload(preload)
    sock = socket.socket(fileno=fd)
    sock.sendall(READY)
    request = _serve(sock)
    if request is not None:
        _run_worker(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())
