"""The job's store on a 3-member etcd cluster: the same answers as a TCPStore for every operation
membership and the launcher use; blocking reads that wait and time out like c10d's; gloo worlds
that rendezvous on a PrefixStore over it; the loss of a member (the leader, the one the client
talks to) in the middle of a job, after which every operation still works and no add is applied
twice; bad addresses refused in one line; a chameleon-launch job on it that finishes."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_ext.control.membership import Membership
from chameleon_ext.control.store import (MembershipError, check_store_spec, connect_store,
                                         generation_store, job_info, parse_etcd_spec)
from chameleon_ext.control.etcd_store import EtcdStore
from tests.etcd_cluster import EtcdCluster
from tests.launch import REPO, SMALL_MODEL, run_chameleon

pytestmark = pytest.mark.slow


def _ops(store) -> list:
    """Every store operation membership and the launcher use, with the edge cases TCPStore
    defines; returns what each answered."""
    out = []
    store.set("a", "x")
    out += [store.get("a"), store.check(["a"]), store.check(["a", "nope"])]
    out += [store.compare_set("first", "", "v1"), store.compare_set("first", "", "v2"),
            store.compare_set("first", "v1", "v3"), store.compare_set("first", "v1", "v4"),
            store.compare_set("absent", "e", "d"), store.check(["absent"])]
    store.set("empty", "")
    out += [store.compare_set("empty", "", "filled")]
    out += [store.add("n", 1), store.add("n", 5), store.add("n", 0), store.add("z", 0),
            store.add("n", -2)]
    store.append("log", "1,")
    store.append("log", b"2,")
    out += [store.get("log"), store.multi_get(["a", "first", "log", "n"])]
    out += [store.delete_key("a"), store.delete_key("a"), store.check(["a"])]
    store.set("a", b"\x00\xffbinary")
    out += [store.get("a")]
    clone = store.clone()
    clone.set("from_clone", "c")
    out += [store.get("from_clone"), clone.get("n")]
    return out


def test_every_operation_answers_as_a_tcpstore_does(etcd):
    tcp = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                        wait_for_workers=False)
    on_etcd = connect_store(etcd.url("parity"), timeout_s=10)
    assert isinstance(on_etcd, EtcdStore)
    assert _ops(on_etcd) == _ops(tcp)
    assert on_etcd.num_keys() == len({"a", "first", "empty", "n", "z", "log", "from_clone"})
    other = connect_store(etcd.url("parity-other"), timeout_s=10)
    assert not other.check(["first"])    # namespaces do not see each other


@pytest.mark.timeout(60)
def test_blocking_reads_wait_for_the_key_and_time_out_naming_it(etcd):
    store = connect_store(etcd.url("blocking"), timeout_s=10)
    writer = store.clone()
    threading.Timer(0.3, lambda: writer.set("late", "here")).start()
    t0 = time.monotonic()
    assert store.get("late") == b"here"
    assert 0.25 < time.monotonic() - t0 < 5
    threading.Timer(0.3, lambda: writer.set("later", "1")).start()
    store.wait(["late", "later"], timedelta(seconds=5))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"0.5 s waiting for keys \['never'\]"):
        store.wait(["late", "never"], timedelta(seconds=0.5))
    assert 0.45 < time.monotonic() - t0 < 3
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="never"):
        store.get("never")


# ----------------------------------------------------------------------------- gloo on etcd

def _gloo_member(rank: int, world: int, url: str, generation: int) -> None:
    import torch
    torch.set_num_threads(1)
    store = connect_store(url, timeout_s=60)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", store=generation_store(store, generation), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=60))
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=group)
    ms = (time.perf_counter() - t0) * 1e3
    dist.destroy_process_group()
    store.set(f"test/sum/{generation}/{rank}", json.dumps({"sum": x.item(), "ms": ms}))


def _gloo_world(url: str, world: int, generation: int) -> list[dict]:
    """`world` processes meet on PrefixStore(f"gen{generation}", etcd) and all-reduce rank+1."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_gloo_member, args=(r, world, url, generation), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(90)
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    store = connect_store(url, timeout_s=10)
    return [json.loads(store.get(f"test/sum/{generation}/{r}")) for r in range(world)]


@pytest.mark.timeout(120)
def test_gloo_world_rendezvous_on_a_prefix_store_over_etcd(etcd):
    results = _gloo_world(etcd.url("gloo"), 2, generation=1)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    keys = connect_store(etcd.url("gloo"), timeout_s=10)
    assert keys.num_keys() > 2            # the rendezvous wrote under gen1/, not elsewhere
    print(f"\ngloo world of 2 on etcd, init + new_group + all_reduce: "
          f"{max(r['ms'] for r in results):.0f} ms")


# ----------------------------------------------------------------------------- a member lost

@pytest.mark.timeout(180)
def test_operations_go_on_when_the_leader_is_sigkilled_midway(tmp_path):
    cluster = EtcdCluster(tmp_path)
    try:
        leader = cluster.leader()
        # The client talks to the leader first: its loss is the worst case (an election too).
        order = [leader] + [i for i in range(3) if i != leader]
        url = f"etcd://{','.join(cluster.endpoints[i] for i in order)}/failover"
        store = connect_store(url, timeout_s=30)
        m = Membership(store, None, 4, heartbeat_timeout=30)
        adds, stop, errors = 0, threading.Event(), []

        def load():                    # a second client writing all along
            nonlocal adds
            other = store.clone()
            while not stop.is_set():
                try:
                    other.add("counter", 1)
                    adds += 1
                    other.append("log", "x")
                except Exception as e:    # noqa: BLE001 - the test reports any
                    errors.append(repr(e))
                    return
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        time.sleep(0.5)
        m.failure_log.report_failure(1, "signal", "SIGKILL")
        t0 = time.monotonic()
        cluster.kill(leader)
        store.set("after", "1")                      # the first operation after the loss
        failover_ms = (time.monotonic() - t0) * 1e3
        m.failure_log.report_failure(2, "exit", "exit code 1")
        # compare_set: the first report wins
        assert m.failure_log.report_failure(1, "comm").cause == "signal"
        assert sorted(m.failure_log.failures()) == [1, 2]
        assert store.get("after") == b"1" and store.check(["after"])
        writer = store.clone()
        threading.Timer(0.2, lambda: writer.set("late", "1")).start()
        store.wait(["late"], timedelta(seconds=10))
        time.sleep(0.5)
        stop.set()
        worker.join(30)
        assert errors == []
        assert int(store.get("counter")) == adds               # no add applied twice
        assert store.get("log") == b"x" * adds
        results = _gloo_world(url, 2, generation=1)            # rendezvous on 2 members
        assert [r["sum"] for r in results] == [3.0, 3.0]
        print(f"\nleader killed: first operation after it took {failover_ms:.0f} ms; "
              f"{adds} adds by the other client, none lost or doubled")
    finally:
        cluster.stop()


# ----------------------------------------------------------------------------- addresses

def test_bad_addresses_are_one_line_errors(tmp_path):
    assert parse_etcd_spec("etcd://h1:1,[::1]:2/job/7") == ([("h1", 1), ("::1", 2)], "job/7")
    assert parse_etcd_spec("etcd://h:5") == ([("h", 5)], "default")
    for bad, words in [("etcd://", "names no etcd endpoint"), ("etcd://h", "not host:port"),
                       ("etcd://h:1,h:x", "not an integer"), ("etcd://h:1/a b", "namespace")]:
        with pytest.raises(ValueError, match=words):
            check_store_spec(bad)
    t0 = time.monotonic()
    with pytest.raises(MembershipError, match="cannot reach the etcd store"):
        connect_store("etcd://127.0.0.1:1", timeout_s=1)
    assert time.monotonic() - t0 < 5
    for bad in ("etcd://", "etcd://127.0.0.1:port", "127.0.0.1"):
        p = subprocess.run([sys.executable, "-m", "chameleon_ext.control.launcher", "--store", bad,
                            "train.py"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith("chameleon-launch: error: --store: ")
        assert p.stderr.count("\n") == 1, p.stderr


# ----------------------------------------------------------------------------- a job on etcd

@pytest.mark.timeout(400)
def test_chameleon_job_on_etcd_finishes(etcd, small_data, tmp_path):
    url = etcd.url("job")
    args = SMALL_MODEL + ["--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
                          "--data-path", small_data, "--split", "100,0,0", "--log-interval", "1",
                          "--pipeline-model-parallel-size", "2", "--chameleon"]
    run = run_chameleon(2, args, tmp_path, launcher_args=["--store", url])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.iterations() == [1, 2, 3]
    store = connect_store(url, timeout_s=10)
    assert job_info(store)["world_size"] == 2
    assert Membership(store, None, 2).failure_log.exited() == [0, 1]
    assert store.check(["gen0/0//cpu//0/0"])          # the first world met on etcd
    # The same namespace again: refused, its old records would be read as the new job's.
    again = run_chameleon(2, args, tmp_path, launcher_args=["--store", url], name="again")
    assert again.returncode == 2
    assert "holds a job that has finished" in again.stderr.splitlines()[-1]
