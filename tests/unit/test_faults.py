"""Failure-injection specs: parsing, errors, and an Injector that fires each spec exactly once."""

import os
import signal
import subprocess
import sys
import time

import pytest

from chameleon_ext.control import faults
from chameleon_ext.control.faults import FaultSpec, FaultSpecError, Injector, parse_inject, parse_injects

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_kill_with_phase():
    s = parse_inject("kill:rank=3,iter=5,phase=backward")
    assert (s.kind, s.rank, s.iteration, s.phase) == ("kill", 3, 5, "backward")


def test_defaults():
    assert parse_inject("exit:rank=0,iter=2").phase == "between-iterations"
    assert parse_inject("exit:rank=0,iter=2").code == 1
    assert parse_inject("exit:rank=0,iter=2,code=7").code == 7
    h = parse_inject("hang:rank=1,iter=0")
    assert (h.mode, h.phase) == ("stop", "between-iterations")
    assert parse_inject("hang:rank=1,iter=0,mode=sleep").mode == "sleep"
    s = parse_inject("slow:rank=1,factor=2")
    assert (s.kind, s.rank, s.factor, s.iteration, s.phase) == ("slow", 1, 2.0, None, None)
    assert parse_inject(" KILL : rank = 2 , iter = 1 , phase = grad_reduce ").phase == "grad-reduce"


def test_several_specs():
    specs = parse_injects("kill:rank=3,iter=5;slow:rank=1,factor=1.5")
    assert [s.kind for s in specs] == ["kill", "slow"]
    assert parse_injects(["exit:rank=0,iter=1", "hang:rank=2,iter=3"])[1].kind == "hang"
    assert parse_injects("") == [] and parse_injects(None) == []


@pytest.mark.parametrize("spec, words", [
    ("explode:rank=1,iter=2", "unknown kind"),
    ("kill:iter=2", "missing rank"),
    ("kill:rank=1", "missing iter"),
    ("kill:rank=1,iter=2,phase=sideways", "bad phase"),
    ("kill:rank=x,iter=2", "not an integer"),
    ("kill:rank=1,iter=2.5", "not an integer"),
    ("kill:rank=-1,iter=2", "must be >= 0"),
    ("exit:rank=1,iter=2,code=0", "must be in 1..255"),
    ("kill:rank=1,iter=2,code=3", "unknown key"),
    ("kill:rank=1,rank=2,iter=2", "given twice"),
    ("kill:rank=1,iter", "not key=value"),
    ("slow:rank=1,factor=fast", "not a number"),
    ("slow:rank=1,factor=0.5", ">= 1"),
    ("hang:rank=1,iter=1,mode=nap", "bad mode"),
    ("", "empty"),
])
def test_bad_specs(spec, words):
    with pytest.raises(FaultSpecError) as e:
        parse_inject(spec)
    msg = str(e.value)
    assert words in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_injector_fires_once(monkeypatch, capsys):
    fired = []
    monkeypatch.setattr(FaultSpec, "fire", lambda self: fired.append(self.describe()))
    inj = Injector("kill:rank=3,iter=5,phase=backward;exit:rank=2,iter=1", rank=3)
    assert len(inj.specs) == 1              # rank 2's spec is not ours
    for it in range(10):
        for ph in faults.PHASES:
            inj.maybe_fire(it, ph)
    assert fired == ["kill on rank 3 at iteration 5 (backward)"]
    # deterministic: a fresh injector over the same calls fires at the same point
    fired.clear()
    inj2 = Injector([parse_inject("kill:rank=3,iter=5,phase=backward")], rank=3)
    assert inj2.maybe_fire(5, "forward") == [] and fired == []
    assert [s.kind for s in inj2.maybe_fire(5, "backward")] == ["kill"]
    assert inj2.maybe_fire(5, "backward") == [] and len(fired) == 1


def test_injector_late_iteration_still_fires_once(monkeypatch):
    fired = []
    monkeypatch.setattr(FaultSpec, "fire", lambda self: fired.append(1))
    inj = Injector("exit:rank=0,iter=3", rank=0)
    inj.maybe_fire(2)
    inj.maybe_fire(4)          # iteration 3 was skipped (e.g. a resumed run): still fires
    inj.maybe_fire(5)
    assert fired == [1]


def test_slow_stretches_every_matching_phase(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", lambda s: slept.append(s))
    inj = Injector("slow:rank=1,factor=3,iter=2,phase=forward", rank=1)
    inj.maybe_fire(1, "forward", elapsed_s=0.1)
    assert slept == []
    inj.maybe_fire(2, "forward", elapsed_s=0.1)
    inj.maybe_fire(2, "backward", elapsed_s=0.1)
    inj.maybe_fire(3, "forward", elapsed_s=0.2)
    assert slept == pytest.approx([0.2, 0.4])
    assert inj.slow_factor(3, "forward") == 3.0 and inj.slow_factor(3, "backward") == 1.0


def test_from_env(monkeypatch):
    monkeypatch.setenv("CHAMELEON_INJECT", "kill:rank=2,iter=1;kill:rank=1,iter=1")
    monkeypatch.setenv("RANK", "2")
    assert [s.rank for s in Injector.from_env().specs] == [2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec, check", [
    ("kill:rank=0,iter=1,phase=backward", lambda rc: rc == -signal.SIGKILL),
    ("exit:rank=0,iter=1,code=3", lambda rc: rc == 3),
])
def test_fire_for_real(spec, check):
    """fire() in a child process: the log line first, then the fault."""
    code = ("import sys; from chameleon_ext.control.faults import Injector\n"
            f"inj = Injector({spec!r}, rank=0)\n"
            "for it in range(3):\n"
            "    for ph in ('forward', 'backward', 'between-iterations'): inj.maybe_fire(it, ph)\n"
            "print('survived')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=50, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert check(p.returncode), (p.returncode, p.stderr)
    assert "survived" not in p.stdout
    kind = spec.split(":")[0]
    phase = "backward" if "backward" in spec else "between-iterations"
    assert f"[chameleon] injecting {kind} on rank 0 at iteration 1 ({phase})" in p.stderr


@pytest.mark.timeout(60)
def test_fire_hang_stops_the_process():
    p = subprocess.Popen([sys.executable, "-c",
                          "from chameleon_ext.control.faults import parse_inject\n"
                          "parse_inject('hang:rank=0,iter=0').fire()\n"
                          "print('resumed', flush=True)\n"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            with open(f"/proc/{p.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state == "T":
                break
            time.sleep(0.05)
        assert state == "T"
        os.kill(p.pid, signal.SIGCONT)
        out, err = p.communicate(timeout=30)
        assert "resumed" in out and "injecting hang on rank 0 at iteration 0" in err
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
