"""State transfer between ranks: a rank that needs layers it does not carry receives them, with
their optimizer state, from the lowest rank that carries them, bit for bit, over gloo."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from megatron.elastic.state_transfer import CarriedState, fetch_missing

pytestmark = pytest.mark.slow


def _value(name: str, what: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{what}".encode()))
    return torch.randn(3, 5, generator=g)


def _state(names: list[str], stepped: bool) -> CarriedState:
    opt = {n: ({"exp_avg": _value(n, "m"), "exp_avg_sq": _value(n, "v"),
                "step": torch.tensor(7.0)} if stepped else {}) for n in names}
    return CarriedState({n: _value(n, "p") for n in names}, opt, {})


# rank -> (what it carries, what its new stage needs)
LAYOUT = {0: (["a", "b"], ["a", "b", "c"]), 1: (["c"], ["c", "a"]), 2: (["a", "c"], ["a"])}


def _worker(rank: int, port: int, out: str, stepped: bool) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(LAYOUT), timeout=timedelta(seconds=30))
    carried, needed = LAYOUT[rank]
    state = _state(carried, stepped)
    received = fetch_missing(state, {n: torch.empty(3, 5) for n in needed})
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps((state, received)))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stepped", [True, False], ids=["after-a-step", "before-any-step"])
def test_missing_parameters_and_their_adam_state_arrive_intact(stepped):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, out, stepped)) for r in LAYOUT]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout=60)
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, 9)
        results = {r: pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in LAYOUT}
    state0, got0 = results[0]
    assert torch.equal(state0.params["c"], _value("c", "p"))  # from rank 1, the lowest with c
    state1, got1 = results[1]
    assert torch.equal(state1.params["a"], _value("a", "p"))  # from rank 0
    if stepped:
        assert torch.equal(state0.optimizer["c"]["exp_avg_sq"], _value("c", "v"))
        assert state1.optimizer["a"]["step"].item() == 7.0
        assert got0 == got1 == 3 * 15 * 4 + 4  # a param and two moments, fp32, and the step
    else:
        assert state0.optimizer["c"] == {} and got0 == 15 * 4
    assert results[2][1] == 0  # needed nothing
