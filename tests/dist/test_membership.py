"""Membership over the store: worker processes (each a client of a store hosted here, or of an
etcd cluster) agree on the survivors after a SIGKILL (reported) and a SIGSTOP (seen as a stale
heartbeat); a second failure during agreement (the leader's) still gives one list that every
survivor reads; a rank that never arrives makes agree() time out naming it. Every test that uses a
store runs on a TCPStore and on a 3-member etcd cluster."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chameleon_ext.control.agreement import (Agreement, AgreementTimeout, Boundary, DivergedSteps,
                                             ExcludedFromAgreement)
from chameleon_ext.control.generations import PublishTimeout
from chameleon_ext.control.keys import (KEY_GENERATION, gen_prefix, key_agent_done, key_agent_hb,
                                        key_hb, key_worker)
from chameleon_ext.control.membership import Membership
from chameleon_ext.control.store import MembershipError, connect_store, parse_log, parse_store_spec
from chameleon_ext.control.world import PeerLost, rebuild_world

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- the worker process

def _member(rank: int, world: int, addr: str, hb_timeout: float) -> None:
    """Agree on each generation the controller opens with test/go/{g}; results go to the store."""
    import torch
    torch.set_num_threads(1)
    store = connect_store(addr, timeout_s=60)
    m = Membership(store, rank, world, hb_timeout)
    m.heartbeat.start(0.05)
    store.set(f"test/ready/{rank}", str(os.getpid()))
    cand, g = list(range(world)), 1
    while True:
        store.wait([f"test/go/{g}"])      # blocks this thread; heartbeats go on (own connection)
        go = json.loads(store.get(f"test/go/{g}"))
        if go.get("stop"):
            m.heartbeat.stop()
            return
        if rank in go.get("hold", []):
            store.wait([f"test/release/{g}/{rank}"])
        t0 = time.perf_counter()
        try:
            ag = m.agreements.agree(g, cand, timeout_s=go.get("timeout", 20))
            out = {"agreement": json.loads(ag.to_json()), "ms": (time.perf_counter() - t0) * 1e3}
            cand = ag.alive
        except MembershipError as e:
            out = {"error": type(e).__name__, "msg": str(e)}
        store.set(f"test/result/{g}/{rank}", json.dumps(out))
        g += 1


class Job:
    """`world` member processes on the store at `addr`; every pid is killed at the end."""

    def __init__(self, addr: str, world: int, hb_timeout: float):
        self.world = world
        self.store = connect_store(addr, timeout_s=60)
        self.m = Membership(self.store, None, world, hb_timeout)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_member, args=(r, world, addr, hb_timeout),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.wait_keys([f"test/ready/{r}" for r in range(world)], 60)

    def wait_keys(self, keys, timeout):
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            assert time.monotonic() < deadline, f"timed out waiting for {keys}"
            assert all(p.is_alive() or p.exitcode == -9 for p in self.procs), \
                [p.exitcode for p in self.procs]
            time.sleep(0.01)

    def go(self, g, **kw):
        self.store.set(f"test/go/{g}", json.dumps(kw))

    def results(self, g, ranks, timeout=30):
        self.wait_keys([f"test/result/{g}/{r}" for r in ranks], timeout)
        return {r: json.loads(self.store.get(f"test/result/{g}/{r}")) for r in ranks}

    def kill(self, rank, sig=signal.SIGKILL):
        os.kill(self.procs[rank].pid, sig)

    def close(self):
        for p in self.procs:
            if p.pid is not None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in self.procs:
            p.join(10)
        assert all(not p.is_alive() for p in self.procs)


@pytest.fixture(params=["tcp", "etcd"])
def store_addr(request):
    """The address of an empty store: a TCPStore hosted here, or a fresh etcd namespace."""
    if request.param == "etcd":
        yield request.getfixturevalue("etcd").url(request.node.name.replace("[", "-")[:-1])
        return
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60),
                           wait_for_workers=False)
    yield f"127.0.0.1:{server.port}"


@pytest.fixture
def job_factory(store_addr):
    jobs = []

    def make(world, hb_timeout):
        jobs.append(Job(store_addr, world, hb_timeout))
        return jobs[-1]
    yield make
    for j in jobs:
        j.close()


def _same_agreement(results):
    ags = [r["agreement"] for r in results.values()]
    assert all("agreement" in r for r in results.values()), results
    assert all(a == ags[0] for a in ags), ags
    return ags[0]


@pytest.mark.timeout(120)   # etcd answers in ~5 ms where a TCPStore takes ~0.1; a loaded host
def test_agree_after_sigkill_report_and_sigstop_staleness(job_factory):
    job = job_factory(4, hb_timeout=1.0)
    # SIGKILL rank 3; its agent (here: the test) reports it.
    job.kill(3)
    job.m.failure_log.report_failure(3, "signal", "SIGKILL", reporter="test")
    job.go(1)
    res = job.results(1, [0, 1, 2])
    ag = _same_agreement(res)
    assert ag["generation"] == 1 and ag["alive"] == [0, 1, 2] and ag["failed"] == [3]
    assert ag["leader"] == 0 and ag["causes"] == {"3": "signal"}
    assert job.store.get(KEY_GENERATION) == b"1"
    print(f"agree among 3 survivors: {max(r['ms'] for r in res.values()):.1f} ms")
    # SIGSTOP rank 2: nobody reports it; its heartbeat goes stale after 1 s.
    job.kill(2, signal.SIGSTOP)
    t0 = time.monotonic()
    job.go(2)
    res = job.results(2, [0, 1])
    waited = time.monotonic() - t0
    ag = _same_agreement(res)
    assert ag["alive"] == [0, 1] and ag["failed"] == [2] and ag["causes"] == {"2": "stale"}
    assert 0.5 < waited < 5, waited
    assert job.m.heartbeat.unreported_losses([0, 1, 2]) == {2: "stale"}
    job.go(3, stop=True)


@pytest.mark.timeout(120)   # etcd answers in ~5 ms where a TCPStore takes ~0.1; a loaded host
def test_leader_failing_during_agreement_still_converges(job_factory):
    job = job_factory(4, hb_timeout=30.0)
    job.kill(3)
    job.m.failure_log.report_failure(3, "signal", "SIGKILL", reporter="test")
    job.go(1, hold=[2])                # rank 2 arrives late: no list can be published yet
    arrivals = f"{gen_prefix(1)}/arrivals"
    deadline = time.monotonic() + 30
    while not (job.store.check([arrivals])
               and {0, 1} <= set(parse_log(job.store.get(arrivals)))):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not job.store.check([f"{gen_prefix(1)}/final"])
    job.kill(0)                        # the would-be leader dies during agreement
    job.m.failure_log.report_failure(0, "signal", "SIGKILL", reporter="test")
    job.store.set("test/release/1/2", "1")
    ag = _same_agreement(job.results(1, [1, 2]))
    assert ag["alive"] == [1, 2] and ag["failed"] == [0, 3] and ag["leader"] == 1
    # The next generation works on the new list.
    job.go(2)
    ag2 = _same_agreement(job.results(2, [1, 2]))
    assert ag2["generation"] == 2 and ag2["alive"] == [1, 2] and ag2["failed"] == []
    job.go(3, stop=True)


# ----------------------------------------------------------------------------- in-process checks

@pytest.fixture
def store(store_addr):
    return store_addr


def _client(addr):
    return connect_store(addr, timeout_s=30)


def _run_threads(fns):
    out, threads = {}, []
    for k, fn in fns.items():
        def body(k=k, fn=fn):
            try:
                out[k] = fn()
            except Exception as e:
                out[k] = e
        threads.append(threading.Thread(target=body, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.timeout(30)
def test_timeout_names_the_missing_ranks(store):
    ms = {r: Membership(_client(store), r, 3, heartbeat_timeout=30) for r in range(3)}
    ms[2].heartbeat.start(0.05)        # alive but never arrives
    try:
        out = _run_threads({r: (lambda r=r: ms[r].agreements.agree(1, [0, 1, 2], timeout_s=0.5))
                            for r in (0, 1)})
    finally:
        ms[2].heartbeat.stop()
    for r in (0, 1):
        e = out[r]
        assert isinstance(e, AgreementTimeout), e
        assert e.missing == [2] and "ranks [2] never arrived" in str(e)
        assert "generation 1" in str(e) and "0.5 s" in str(e)


@pytest.mark.timeout(30)
def test_failure_records_publish_read_and_exclusion(store):
    obs = Membership(_client(store), None, 4, heartbeat_timeout=30)
    first = obs.failure_log.report_failure(2, "exit", "exit code 1", detect_ms=3.5)
    again = obs.failure_log.report_failure(2, "comm", "later report")
    assert again.cause == "exit" and again.detail == "exit code 1"   # the first report wins
    assert first.detect_ms == 3.5
    with pytest.raises(ValueError, match="unknown failure cause"):
        obs.failure_log.report_failure(1, "gremlins")
    fresh = Membership(_client(store), None, 4, heartbeat_timeout=30)
    assert list(fresh.failure_log.failures()) == [2]
    assert fresh.failure_log.failures()[2].cause == "exit"
    # a reported rank calling agree() is told it is out
    m2 = Membership(_client(store), 2, 4, heartbeat_timeout=30)
    with pytest.raises(ExcludedFromAgreement):
        m2.agreements.agree(1, [0, 1, 2, 3], timeout_s=1)
    # clean exits are not failures, but are not expected at agreement either
    obs.failure_log.record_exit(3)
    assert obs.failure_log.exited() == [3] and 3 not in obs.failure_log.failures()
    ms = {r: Membership(_client(store), r, 4, heartbeat_timeout=30) for r in (0, 1)}
    out = _run_threads({r: (lambda r=r: ms[r].agreements.agree(1, [0, 1, 2, 3], timeout_s=5))
                        for r in (0, 1)})
    assert out[0] == out[1] and out[0].alive == [0, 1]
    assert out[0].causes == {2: "exit", 3: "exited"} and out[0].new_rank(1) == 1
    # the leader publishes a plan; the others read it
    ms[0].generations.publish(1, "plan", json.dumps({"pipelines": 1}))
    assert json.loads(ms[1].generations.read(1, "plan", timeout_s=1)) == {"pipelines": 1}
    with pytest.raises(PublishTimeout, match="within 0.2 s"):
        ms[1].generations.read(1, "nothing", timeout_s=0.2)
    obs.failure_log.report_failure(0, "signal", "SIGKILL")
    with pytest.raises(PublishTimeout, match="publisher rank 0 failed"):
        ms[1].generations.read(1, "other", timeout_s=5, publisher=0)


@pytest.mark.timeout(30)
def test_heartbeat_staleness_and_node_agents(store):
    c = _client(store)
    obs = Membership(c, None, 4, heartbeat_timeout=1.0)
    now = time.time()
    c.set(key_hb(0), f"{now:.6f}")
    c.set(key_hb(1), f"{now - 5:.6f}")
    c.set(key_hb(2), f"off:{now - 5:.6f}")        # retired on purpose: not stale
    assert obs.heartbeat.unreported_losses([0, 1, 2, 3]) == {1: "stale"}   # 3: no heartbeat ever
    # rank 3 runs on node 1 whose agent went silent: stale through its node
    c.set(key_worker(3), json.dumps({"rank": 3, "node": 1, "pid": 1, "host": "h"}))
    c.set(key_agent_hb(1), f"{now - 5:.6f}")
    assert obs.heartbeat.unreported_losses([0, 3]) == {3: "node"}
    c.set(key_agent_done(1), "1")                   # ...unless that agent finished
    assert obs.heartbeat.unreported_losses([0, 3]) == {}
    m = Membership(_client(store), 0, 4, heartbeat_timeout=1.0)
    m.heartbeat.start(0.05)
    try:
        time.sleep(0.2)
        assert m.heartbeat.ages([0])[0] < 0.5
    finally:
        m.heartbeat.stop()
    assert m.heartbeat.ages([0]) == {}                  # retired


@pytest.mark.timeout(30)
def test_a_lost_node_is_told_apart_from_a_silent_worker(store):
    """Ranks nobody reported: a node whose agent went silent takes its ranks as "node"; a silent
    worker whose agent lives is left to that agent (it kills and reports it); a silent worker
    with no agent watching is "stale"."""
    c = _client(store)
    obs = Membership(c, None, 6, heartbeat_timeout=1.0)
    now = time.time()
    for r in range(6):
        c.set(key_worker(r), json.dumps({"rank": r, "node": r // 2, "pid": 1, "host": "h"}))
    c.set(key_agent_hb(0), f"{now:.6f}")             # node 0: its agent lives
    c.set(key_agent_hb(1), f"{now - 5:.6f}")         # node 1: lost
    c.set(key_hb(0), f"{now:.6f}")
    c.set(key_hb(1), f"{now - 5:.6f}")               # silent, watched by node 0's agent
    c.set(key_hb(2), f"{now:.6f}")                   # last beat before its node went
    c.set(key_hb(3), f"{now - 5:.6f}")
    c.set(key_hb(4), f"{now - 5:.6f}")               # node 2: no agent heartbeat at all
    assert obs.heartbeat.unreported_losses(list(range(6))) == {2: "node", 3: "node", 4: "stale"}


def test_store_spec_errors(monkeypatch):
    assert parse_store_spec("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_store_spec("[::1]:5") == ("::1", 5)
    for bad, words in [("nohost", "not host:port"), ("h:x", "not an integer"),
                       ("h:70000", "out of range")]:
        with pytest.raises(ValueError, match=words):
            parse_store_spec(bad)
    monkeypatch.delenv("CHAMELEON_STORE", raising=False)
    with pytest.raises(MembershipError, match="CHAMELEON_STORE is not set"):
        connect_store()


def test_detection_is_timed_from_the_death_to_the_first_notice(store_addr):
    """The first survivor's notice wins; a death is timed by the victim's own announcement
    where it made one, else by the agent's record less the agent's latency."""
    store = _client(store_addr)
    a, b = Membership(store, 0, 3, 5.0), Membership(store, 1, 3, 5.0)
    assert a.agreements.notice(1, when=100.25) == 100.25
    assert b.agreements.notice(1, when=100.5) == 100.25
    rec = a.failure_log.report_failure(2, "signal", "SIGKILL", when=100.3, detect_ms=40.0)
    assert a.failure_log.death_time(2, rec) == pytest.approx(100.26)
    victim = Membership(store, 2, 3, 5.0)
    victim.failure_log.announce_death()
    assert abs(a.failure_log.death_time(2, rec) - time.time()) < 5


@pytest.mark.timeout(30)
def test_a_step_commits_only_with_every_vote(store):
    """The step's vote: all three ranks vote, all commit; in the next iteration rank 2 dies
    before voting, so the two that voted read "abort", also after the fact."""
    ms = {r: Membership(_client(store), r, 3, heartbeat_timeout=30) for r in range(3)}
    out = _run_threads({r: (lambda r=r: ms[r].step_vote.commit(1, 7, [0, 1, 2], timeout_s=10))
                        for r in range(3)})
    assert out == {0: True, 1: True, 2: True}
    ms[0].failure_log.report_failure(2, "signal", "SIGKILL")
    out = _run_threads({r: (lambda r=r: ms[r].step_vote.commit(1, 8, [0, 1, 2], timeout_s=10))
                        for r in (0, 1)})
    assert out == {0: False, 1: False}
    # a late vote cannot turn the decision: it is written once
    assert ms[2].step_vote.commit(1, 8, [0, 1, 2], timeout_s=1) is False


@pytest.mark.timeout(30)
def test_a_vote_aborts_when_a_peer_gives_up_on_the_world(store):
    """A rank whose collective failed goes into recovery without voting (it notices the
    broken world): the voters abort at once instead of waiting out their timeout."""
    ms = {r: Membership(_client(store), r, 2, heartbeat_timeout=30) for r in range(2)}
    ms[1].agreements.notice(2)
    t0 = time.monotonic()
    assert ms[0].step_vote.commit(1, 3, [0, 1], timeout_s=20) is False
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_the_agreement_proves_the_survivors_applied_the_same_steps(store):
    ms = {r: Membership(_client(store), r, 3, heartbeat_timeout=30) for r in range(3)}
    out = _run_threads({r: (lambda r=r: ms[r].agreements.agree(1, [0, 1, 2], timeout_s=5,
                                                               iteration=9))
                        for r in range(3)})
    assert all(ag.iteration == 9 for ag in out.values())
    out = _run_threads({r: (lambda r=r: ms[r].agreements.agree(2, [0, 1, 2], timeout_s=2,
                                                               iteration=9 + (r == 2)))
                        for r in range(3)})
    assert isinstance(out[0], DivergedSteps), out
    assert "{0: 9, 1: 9, 2: 10}" in str(out[0])


@pytest.mark.timeout(30)
def test_every_survivor_resumes_the_boundary_where_the_least_advanced_stood(store):
    """A loss in a save's collectives let ranks 0 and 1 finish it and start the final reports
    while rank 2 stayed in it: all three agree on rank 2's place (the save, then the final
    actions), whoever leads; a joiner (no state) has none."""
    ms = {r: Membership(_client(store), r, 4, heartbeat_timeout=30) for r in range(4)}
    ahead = Boundary(("memory", "replicas"), finishing=True)
    behind = Boundary(("checkpoint",))
    out = _run_threads({r: (lambda r=r: ms[r].agreements.agree(
        1, [0, 1, 2, 3], timeout_s=5, iteration=None if r == 3 else 10,
        boundary=None if r == 3 else behind if r == 2 else ahead)) for r in range(4)})
    assert all(ag.boundary == behind for ag in out.values()), out
    assert Agreement.from_json(out[0].to_json()).boundary == behind


def _rendezvous(rank: int, addr: str, world: int, generation: int, queue) -> None:
    import torch
    store = connect_store(addr, timeout_s=30)
    m = Membership(store, rank, world, heartbeat_timeout=30)
    ag = Agreement(generation, list(range(world)), [], 0)
    t0 = time.monotonic()
    try:
        rebuild_world(store, ag, rank, "gloo", timeout_s=20, members=m)
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t)
        queue.put((rank, "ok", t.tolist(), time.monotonic() - t0))
        dist.destroy_process_group()
    except PeerLost as e:
        queue.put((rank, "lost", str(e), time.monotonic() - t0))


@pytest.mark.timeout(120)   # etcd answers in ~5 ms where a TCPStore takes ~0.1; a loaded host
def test_a_rendezvous_gives_up_at_once_when_a_member_is_lost(store):
    """Two of three ranks build a world on the job's store; the third is reported failed
    instead of arriving: both give up within a second, not after the 20 s timeout. The same
    rendezvous with every rank present builds a working world."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rendezvous, args=(r, store, 2, 1, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ok = sorted(queue.get(timeout=40) for _ in procs)
    assert [(r, what, t) for r, what, t, _ in ok] == [(0, "ok", [3.0, 3.0]), (1, "ok", [3.0, 3.0])]
    for p in procs:
        p.join(10)
    procs = [ctx.Process(target=_rendezvous, args=(r, store, 3, 2, queue)) for r in range(2)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    Membership(_client(store), None, 3).failure_log.report_failure(2, "signal", "SIGKILL")
    lost = sorted(queue.get(timeout=40) for _ in procs)
    for p in procs:
        p.join(10)
    assert [what for _, what, _, _ in lost] == ["lost", "lost"], lost
    assert all("rank(s) [2]" in msg and elapsed < 10 for _, _, msg, elapsed in lost), lost
