"""State transfer between ranks: a rank that needs layers it does not carry receives them, with
their optimizer state, from the lowest rank that carries them, bit for bit, over gloo. Tensor-
parallel shards (named `/tpXofY`) go between ranks of the same shard index of groups of the same
size; a shard of another size is found nowhere, and every rank says which."""

from __future__ import annotations

import pickle
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from megatron.elastic.state_transfer import CarriedState, StateLost, fetch_missing
from tests.launch import spawn_ranks

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


# Two TP 2 groups: ranks 0 and 1 carry both shards of layer x, ranks 2 and 3 take it over.
TP_LAYOUT = {0: (["x/tp0of2"], ["x/tp0of2"]), 1: (["x/tp1of2"], ["x/tp1of2"]),
             2: (["y/tp0of2"], ["y/tp0of2", "x/tp0of2"]),
             3: (["y/tp1of2"], ["y/tp1of2", "x/tp1of2"])}
# A TP 4 shard wanted where only TP 2 shards exist.
OTHER_SIZE = {0: (["x/tp0of2"], ["x/tp0of2"]), 1: (["x/tp1of2"], ["x/tp0of4"])}


def _worker(rank: int, port: int, out: str, layout: dict, stepped: bool) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    # The rendezvous waits for the last worker's imports (see _run).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(layout), timeout=timedelta(seconds=120))
    carried, needed = layout[rank]
    state = _state(carried, stepped)
    try:
        result = (state, fetch_missing(state, {n: torch.empty(3, 5) for n in needed}))
    except StateLost as e:
        result = str(e)
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def _run(layout: dict, stepped: bool) -> dict:
    """Each rank's (state, bytes received) after fetch_missing, or the error it raised."""
    return spawn_ranks(_worker, layout, layout, stepped)


@pytest.mark.parametrize("stepped", [True, False], ids=["after-a-step", "before-any-step"])
def test_missing_parameters_and_their_adam_state_arrive_intact(stepped):
    results = _run(LAYOUT, stepped)
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


def test_tensor_parallel_shards_go_to_the_same_shard_of_the_group_taking_over():
    results = _run(TP_LAYOUT, stepped=True)
    for t in (0, 1):
        state, got = results[2 + t]
        name = f"x/tp{t}of2"
        assert torch.equal(state.params[name], _value(name, "p"))  # rank t's shard, not the other
        assert torch.equal(state.optimizer[name]["exp_avg"], _value(name, "m"))
        assert got == 3 * 15 * 4 + 4
    assert results[0][1] == results[1][1] == 0


def test_a_shard_of_another_tensor_parallel_size_is_reported_by_every_rank():
    results = _run(OTHER_SIZE, stepped=False)
    assert results == {r: "rank 1 needs x/tp0of4, which no surviving rank holds" for r in (0, 1)}
