"""chameleon-launch with tiny gloo workers (no megatron): a worker's SIGKILL is in the store
within a second and its peers live on, re-create a gloo world on PrefixStore("gen1") and
all-reduce correctly; exit codes; Ctrl-C leaves no process behind; --max-failures stops the
job; inject_failure.py kills (and stops) the right pid; a silent heartbeat is reported as a hang;
inject_failure.py --node takes a node's agent and workers at once and the other node's agent
reports the node lost (node 1 on the agent's TCPStore, node 0 on an etcd store). And
pretrain_gpt.py workers that all reject their arguments: the job exits with their code 2, the
error said once."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from chameleon_ext.control.failures import FailureRecord
from chameleon_ext.control.keys import key_agent_hb, key_failure, key_worker
from chameleon_ext.control.store import ETCD_SCHEME, connect_store, node_info, worker_info
from tests.launch import SMALL_MODEL, run_chameleon

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

WORKER = r'''
import json, os, signal, subprocess, sys, time
from datetime import timedelta
mode = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if mode == "exit":                       # no torch: rank 0 fails once the test has read the pids
    if rank == 0:
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        sys.exit(1)
    time.sleep(120)
    sys.exit(0)
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from chameleon_ext.control.membership import Membership
from chameleon_ext.control.store import connect_store
from chameleon_ext.control.world import rebuild_world
store = connect_store()
def put(key, value):
    store.set("test/" + key, json.dumps(value))
put(f"env/{rank}", {k: os.environ.get(k) for k in (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "CHAMELEON_STORE", "CHAMELEON_HEARTBEAT_TIMEOUT", "OMP_NUM_THREADS")})

if mode == "gloo":
    victim = int(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))     # env:// on the agent store
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    m = Membership.from_env(store)
    m.heartbeat.start()
    dist.barrier()
    if rank == victim:
        put("kill_time", time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(1))
        err = "no error"
    except RuntimeError as e:
        err = str(e).splitlines()[0]
    t0 = time.perf_counter()
    dist.destroy_process_group()         # closes our sockets: peers still waiting error out too
    t1 = time.perf_counter()
    ag = m.agreements.agree(1, list(range(world)), timeout_s=20)
    t2 = time.perf_counter()
    new_rank = rebuild_world(store, ag, rank, timeout_s=30)      # PrefixStore("gen1", store)
    t3 = time.perf_counter()
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    t4 = time.perf_counter()
    put(f"result/{rank}", {"alive": ag.alive, "failed": ag.failed, "new_rank": new_rank,
                           "world": dist.get_world_size(), "sum": x.item(), "error": err,
                           "destroy_ms": (t1 - t0) * 1e3, "agree_ms": (t2 - t1) * 1e3,
                           "rebuild_ms": (t3 - t2) * 1e3, "first_allreduce_ms": (t4 - t3) * 1e3})
    dist.destroy_process_group()
    m.heartbeat.stop()
    sys.exit(0)

if mode == "sleep":                      # for Ctrl-C: a stubborn worker and a grandchild
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0:
        put("grandchild", subprocess.Popen(["sleep", "300"]).pid)
    put(f"ready/{rank}", os.getpid())
    while True:
        time.sleep(1)

if mode == "heartbeat":                  # heartbeats; finishes when the test says so
    m = Membership.from_env(store)
    m.heartbeat.start(0.1)
    put(f"ready/{rank}", os.getpid())
    while not store.check(["test/finish"]):
        time.sleep(0.05)
    m.heartbeat.stop()
    sys.exit(0)
'''


def inject(*args: str) -> subprocess.CompletedProcess:
    """tools/inject_failure.py with this checkout's packages (not an installed copy's)."""
    return subprocess.run([sys.executable, str(REPO / "tools" / "inject_failure.py"), *args],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Launch:
    """chameleon-launch in its own session; every pid it reports is killed at the end."""

    def __init__(self, tmp: Path, nproc: int, mode: str, *extra: str, flags=(),
                 port: int | None = None, store: str | None = None):
        self.tmp = tmp
        script = tmp / "worker.py"
        script.write_text(WORKER)
        self.port = port or free_port()
        self.addr = store or f"127.0.0.1:{self.port}"     # where the test reads the store
        self.err_path = tmp / "agent.err"
        cmd = [sys.executable, "-m", "chameleon_ext.control.launcher", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(self.port), *flags,
               str(script), mode, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(tmp / "agent.out", "w"),
                                     stderr=open(self.err_path, "w"), start_new_session=True)
        self.pids: set[int] = set()
        self.store = None

    def stderr(self) -> str:
        return self.err_path.read_text()

    def connect(self, timeout=60):
        if self.store is None and self.addr.startswith(ETCD_SCHEME):
            self.store = connect_store(self.addr, timeout_s=30)
        deadline = time.monotonic() + timeout
        while self.store is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                           timeout=timedelta(seconds=30))
            except OSError:
                assert self.proc.poll() is None, self.stderr()
                assert time.monotonic() < deadline, "the agent's store never came up"
                time.sleep(0.05)
        return self.store

    def wait_keys(self, keys, timeout=60):
        store = self.connect()
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            assert time.monotonic() < deadline, f"timed out waiting for {keys}\n{self.stderr()}"
            assert self.proc.poll() is None, f"agent exited early\n{self.stderr()}"
            time.sleep(0.01)

    def workers(self, n) -> dict[int, dict]:
        self.wait_keys([key_worker(r) for r in range(n)])
        info = {r: worker_info(self.store, r) for r in range(n)}
        self.pids.update(i["pid"] for i in info.values())
        return info

    def wait(self, timeout=60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not finish in {timeout} s\n{self.stderr()}")

    def close(self):
        m = re.search(r"\(pids ([\d, ]+)\)", self.stderr() if self.err_path.exists() else "")
        if m:
            self.pids.update(int(p) for p in m.group(1).split(","))
        for pid in self.pids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def launch(tmp_path):
    runs = []

    def make(*args, **kw):
        d = tmp_path / f"run{len(runs)}"
        d.mkdir()
        runs.append(Launch(d, *args, **kw))
        return runs[-1]
    yield make
    for r in runs:
        r.close()


@pytest.mark.timeout(90)
def test_sigkilled_worker_is_reported_and_survivors_rebuild_gloo_on_gen1(launch):
    run = launch(4, "gloo", "3", flags=["--heartbeat-timeout", "5"])
    info = run.workers(4)
    run.wait_keys([key_failure(3), "test/kill_time"], timeout=60)
    rec = FailureRecord.from_json(run.store.get(key_failure(3)))
    kill_time = json.loads(run.store.get("test/kill_time"))
    latency = rec.time - kill_time
    assert rec.rank == 3 and rec.cause == "signal" and rec.detail == "SIGKILL"
    assert 0 <= latency < 1.0, latency
    run.wait_keys([f"test/result/{r}" for r in range(3)], timeout=60)
    results = {r: json.loads(run.store.get(f"test/result/{r}")) for r in range(3)}
    keys = run.store.list_keys()
    assert any(k.startswith("gen1/") for k in keys), keys       # the new world's rendezvous
    assert any(k.startswith("default_pg/") for k in keys)       # the first world's (env://)
    env0 = json.loads(run.store.get("test/env/0"))
    assert run.wait() == 0, run.stderr()
    err = run.stderr()
    assert f"worker rank 3 (pid {info[3]['pid']}) died: signal SIGKILL; reported to the store" \
        in err
    for r in range(3):                                     # nobody else was killed
        assert f"worker rank {r} (pid {info[r]['pid']}) exited 0" in err
        res = results[r]
        assert res["alive"] == [0, 1, 2] and res["failed"] == [3]
        assert res["world"] == 3 and res["new_rank"] == r and res["sum"] == 0 + 1 + 2
    assert "exit 0" in err.splitlines()[-1]
    assert env0["WORLD_SIZE"] == "4" and env0["LOCAL_WORLD_SIZE"] == "4"
    assert env0["GROUP_RANK"] == "0" and env0["MASTER_PORT"] == str(run.port)
    assert env0["CHAMELEON_STORE"] == run.addr and env0["CHAMELEON_HEARTBEAT_TIMEOUT"] == "5.0"
    assert info[3]["host"] == socket.gethostname() and info[3]["pgid"] == info[3]["pid"]
    worst = {k: max(res[k] for res in results.values())
             for k in ("destroy_ms", "agree_ms", "rebuild_ms", "first_allreduce_ms")}
    print(f"\nSIGKILL -> failure record: {latency * 1e3:.1f} ms (agent's detect_ms "
          f"{rec.detect_ms}); survivors' error: {results[0]['error'][:60]}; "
          + ", ".join(f"{k} {v:.1f}" for k, v in worst.items()))


@pytest.mark.timeout(60)
def test_ctrl_c_reaps_every_process(launch):
    run = launch(3, "sleep", flags=["--grace", "1"])
    info = run.workers(3)
    run.wait_keys([f"test/ready/{r}" for r in range(3)] + ["test/grandchild"])
    grandchild = json.loads(run.store.get("test/grandchild"))
    pids = [i["pid"] for i in info.values()] + [grandchild]
    run.pids.update(pids)
    assert all(alive(p) for p in pids)
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(30) == 130, run.stderr()
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5             # the grandchild is reaped by init, not by us
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == [], run.stderr()
    assert "got SIGINT: stopping 3 worker(s)" in run.stderr()


@pytest.mark.timeout(60)
def test_failures_beyond_max_failures_stop_the_job(launch, tmp_path):
    go = str(tmp_path / "go")
    run = launch(3, "exit", go, flags=["--max-failures", "0", "--grace", "1"])
    info = run.workers(3)
    # the agent's store closes with the job: read the pids before rank 0 fails
    Path(go).touch()
    assert run.wait(30) == 1, run.stderr()
    err = run.stderr()
    assert f"worker rank 0 (pid {info[0]['pid']}) died: exit code 1; reported" in err
    assert "1 worker failures exceed --max-failures 0: stopping the job" in err
    assert not any(alive(i["pid"]) for i in info.values())


@pytest.mark.timeout(60)
def test_inject_failure_stop_and_kill_hit_the_right_pids(launch):
    run = launch(3, "heartbeat", flags=["--heartbeat-timeout", "2"])
    info = run.workers(3)
    run.wait_keys([f"test/ready/{r}" for r in range(3)])
    tool = ["--store", run.addr]
    # bad input: one line, exit 2
    bad = inject(*tool, "--kill", "7")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "rank 7 is not in the store (world size 3)" in bad.stderr
    # --stop: a hang; the agent sees the silent heartbeat, reports it and kills it
    p = inject(*tool, "--stop", "1")
    assert p.returncode == 0, p.stderr
    assert f"sent SIGSTOP to rank 1 (pid {info[1]['pid']})" in p.stdout
    run.wait_keys([key_failure(1)], timeout=20)
    rec = FailureRecord.from_json(run.store.get(key_failure(1)))
    assert rec.cause == "hang" and "heartbeat silent" in rec.detail
    # --kill: exactly that pid dies
    p = inject(*tool, "--kill", "2")
    assert p.returncode == 0, p.stderr
    run.wait_keys([key_failure(2)], timeout=15)
    rec = FailureRecord.from_json(run.store.get(key_failure(2)))
    assert rec.cause == "signal" and rec.detail == "SIGKILL"
    assert not alive(info[2]["pid"]) and alive(info[0]["pid"])
    again = inject(*tool, "--kill", "2")
    assert again.returncode == 1 and "is not running" in again.stderr
    run.store.set("test/finish", "1")
    assert run.wait(30) == 0, run.stderr()
    err = run.stderr()
    assert f"worker rank 1 (pid {info[1]['pid']}) hung" in err
    assert f"worker rank 2 (pid {info[2]['pid']}) died: signal SIGKILL" in err
    assert f"worker rank 0 (pid {info[0]['pid']}) exited 0" in err


@pytest.mark.timeout(120)
def test_workers_that_reject_their_arguments_end_the_job_with_their_code_and_one_error(tmp_path):
    # pretrain_gpt.py's workers: world 3 cannot hold pipelines of 2 stages
    run = run_chameleon(3, SMALL_MODEL + ["--pipeline-model-parallel-size", "2",
                                          "--global-batch-size", "8", "--mock-data"],
                        tmp_path, timeout=90)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == ["pretrain_gpt.py: error: world size 3 is not divisible by "
                      "--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 2"], \
        run.stderr
    assert run.stderr.count("exited with code 2") == 1
    assert "all 3 worker(s) exited with code 2 (bad arguments?); exit 2" in \
        run.stderr.splitlines()[-1]


@pytest.mark.timeout(60)
def test_forked_workers_log_to_their_files_echoed_and_are_the_agents_children(tmp_path):
    """--no-python --log-dir: each forked worker execs the executable with its own rank's
    environment, in a session of its own and as the agent's child (the agent reaps it);
    its stdout and stderr land in log-dir/rankN/ and are echoed with a [rankN]: prefix;
    its exit code is the one it chose."""
    script = ('echo "rank $RANK of $WORLD_SIZE"; echo "to stderr $RANK" >&2; '
              'ps -o pid=,ppid=,sid= -p $$; [ "$RANK" = 1 ] && exit 3; exit 0')
    proc = subprocess.Popen(
        [sys.executable, "-m", "chameleon_ext.control.launcher", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "--max-failures", "1", "--log-dir",
         str(tmp_path / "logs"), "--no-python", "sh", "-c", script],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=50)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    agent = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert agent.returncode == 0, agent.stderr
    for rank in (0, 1):
        out = (tmp_path / "logs" / f"rank{rank}" / "stdout.log").read_text().splitlines()
        assert out[0] == f"rank {rank} of 2"
        pid, ppid, sid = map(int, out[1].split())
        assert pid == sid and ppid == proc.pid
        assert f"[rank{rank}]:rank {rank} of 2" in agent.stdout
        assert (tmp_path / "logs" / f"rank{rank}" / "stderr.log").read_text() == \
            f"to stderr {rank}\n"
        assert f"[rank{rank}]:to stderr {rank}" in agent.stderr
    assert re.search(r"worker rank 0 \(pid \d+\) exited 0", agent.stderr)
    assert re.search(r"worker rank 1 \(pid \d+\) died: exit code 3", agent.stderr)


def test_trace_file_errors(tmp_path):
    sys.path.insert(0, str(REPO))
    from tools import inject_failure as tool
    good = tmp_path / "good.txt"
    good.write_text("# seconds ranks\n2.5 3\n\n0.5 1 2  # two at once\n")
    assert tool.parse_trace(str(good)) == [(0.5, [1, 2]), (2.5, [3])]
    for text, words in [("x 1", "is not a number"), ("1", "no rank"), ("1 a", "integers"),
                        ("-1 2", ">= 0"), ("# nothing", "no events")]:
        f = tmp_path / "bad.txt"
        f.write_text(text + "\n")
        with pytest.raises(tool.InputError, match=words):
            tool.parse_trace(str(f))
    assert tool.main(["--store", "127.0.0.1:1", "--trace", str(tmp_path / "missing")]) == 2
    assert tool.main(["--store", "nohost", "--kill", "1"]) == 2
    assert tool.main(["--kill", "1", "--stop", "2", "--store", "h:1"]) == 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("store,victim", [("tcp", 1), ("etcd", 0)])
def test_inject_failure_node_takes_agent_and_workers_and_the_other_agent_reports_it(
        launch, request, store, victim):
    port = free_port()
    addr = request.getfixturevalue("etcd").url(f"node-loss-{victim}") if store == "etcd" \
        else f"127.0.0.1:{port}"
    flags = ["--nnodes", "2", "--heartbeat-timeout", "2", "--grace", "1"]
    if store == "etcd":
        flags += ["--store", addr]
    runs = [launch(2, "heartbeat", flags=[*flags, "--node-rank", str(n)], port=port, store=addr)
            for n in (0, 1)]
    survivor = runs[1 - victim]
    info = survivor.workers(4)
    for run in runs:
        run.pids.update(i["pid"] for i in info.values())
    survivor.wait_keys([f"test/ready/{r}" for r in range(4)])
    node = node_info(survivor.store, victim)
    assert node["agent_pid"] == runs[victim].proc.pid
    lost = [r for r in range(4) if info[r]["node"] == victim]
    assert lost == node["ranks"] == [2 * victim, 2 * victim + 1]
    p = inject("--store", addr, "--node", str(victim))
    assert p.returncode == 0, p.stderr
    assert f"sent SIGKILL to the agent of node {victim} (pid {node['agent_pid']})" in p.stdout
    assert runs[victim].proc.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10            # orphaned zombies are reaped by init
    while any(alive(info[r]["pid"]) for r in lost) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(info[r]["pid"]) for r in lost)
    survivor.wait_keys([key_failure(r) for r in lost], timeout=30)
    last_beat = float(survivor.store.get(key_agent_hb(victim)))    # within 0.4 s of the kill
    for r in lost:
        rec = FailureRecord.from_json(survivor.store.get(key_failure(r)))
        reported = rec.time - last_beat
        assert rec.cause == "node" and f"node {victim} agent heartbeat silent" in rec.detail
        assert rec.reporter.startswith(f"agent node {1 - victim} ")
    assert all(alive(info[r]["pid"]) for r in range(4) if r not in lost)
    survivor.store.set("test/finish", "1")
    assert survivor.wait(60) == 0, survivor.stderr()
    err = survivor.stderr()
    assert f"ranks {lost} reported lost" in err
    for r in range(4):
        if r not in lost:
            assert f"worker rank {r} (pid {info[r]['pid']}) exited 0" in err
    print(f"\n{store}: node {victim}'s last agent heartbeat -> its ranks reported lost: "
          f"{reported:.1f} s (heartbeat timeout 2 s)")
