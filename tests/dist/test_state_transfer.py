"""State transfer between ranks: a rank that needs layers it does not carry receives them, with
their optimizer state, from the lowest rank that carries them, bit for bit, over gloo. Tensor-
parallel shards (named `/tpXofY`) go between ranks of the same shard index of groups of the same
size; a shard of another size is found nowhere, and every rank says which. The distributed
optimizer's slices (parts of a flattened parameter) are put together from the ranks that hold
them, whatever the new slices' boundaries; a part nobody holds is reported by every rank."""

from __future__ import annotations

import pickle
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from megatron.elastic.state_transfer import (OPTIM, PARAM, CarriedState, Piece, StateLost,
                                             assemble, fetch_missing, holdings)
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


def _sliced(slices: list[tuple[int, int]]) -> CarriedState:
    """A distributed optimizer's rank after a step left its replicas' shards ungathered: the
    parameter "x" (15 elements) and its moments, only over `slices`."""
    pieces = []
    for a, b in slices:
        pieces.append(Piece(PARAM, a, b, {"param": _value("x", "p").view(-1)[a:b]}))
        pieces.append(Piece(OPTIM, a, b, {"exp_avg": _value("x", "m").view(-1)[a:b],
                                          "exp_avg_sq": _value("x", "v").view(-1)[a:b],
                                          "step": torch.tensor(7.0)}))
    return CarriedState({}, {}, {}, {"x": pieces})


# Two instances of DP 2 sharded [0, 8) and [8, 15): rank 1 (holding [8, 15)) was lost; the new
# DP 3 wants [0, 5), [5, 10), [10, 15), and everyone the whole parameter.
SLICES = {0: ([(0, 8)], [(0, 5)]), 1: ([(0, 8)], [(5, 10)]), 2: ([(8, 15)], [(10, 15)])}
SLICE_LOST = {0: ([(0, 8)], [(0, 8)]), 1: ([(0, 8)], [(8, 15)])}


def _worker(rank: int, port: int, out: str, layout: dict, stepped: bool | None) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    # The rendezvous waits for the last worker's imports (see _run).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(layout), timeout=timedelta(seconds=120))
    carried, needed = layout[rank]
    if stepped is None:   # slices
        state = _sliced(carried)
        wanted = {"x": [(PARAM, 0, 15), *((OPTIM, a, b) for a, b in needed)]}
    else:
        state = _state(carried, stepped)
        wanted = {n: [(PARAM, 0, 15), (OPTIM, 0, 15)] for n in needed}
    try:
        result = (state, fetch_missing(state, wanted, {n: torch.float32 for n in wanted},
                                       torch.device("cpu")))
    except StateLost as e:
        result = str(e)
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def _run(layout: dict, stepped: bool | None) -> dict:
    """Each rank's (state, bytes received per name) after fetch_missing, or the error it
    raised."""
    return spawn_ranks(_worker, layout, layout, stepped)


def _param(state: CarriedState, name: str) -> torch.Tensor:
    return assemble(holdings(state).get(name, []), name, PARAM, 0, 15)["param"].view(3, 5)


def _optim(state: CarriedState, name: str, a: int = 0, b: int = 15) -> dict:
    return assemble(holdings(state).get(name, []), name, OPTIM, a, b)


@pytest.mark.parametrize("stepped", [True, False], ids=["after-a-step", "before-any-step"])
def test_missing_parameters_and_their_adam_state_arrive_intact(stepped):
    results = _run(LAYOUT, stepped)
    state0, got0 = results[0]
    assert torch.equal(_param(state0, "c"), _value("c", "p"))  # from rank 1, the lowest with c
    state1, got1 = results[1]
    assert torch.equal(_param(state1, "a"), _value("a", "p"))  # from rank 0
    if stepped:
        assert torch.equal(_optim(state0, "c")["exp_avg_sq"].view(3, 5), _value("c", "v"))
        assert _optim(state1, "a")["step"].item() == 7.0
        # a param and two moments, fp32, and the step
        assert (got0, got1) == ({"c": 3 * 15 * 4 + 4}, {"a": 3 * 15 * 4 + 4})
    else:
        assert _optim(state0, "c") is None and got0 == {"c": 15 * 4}
    assert results[2][1] == {}  # needed nothing


def test_tensor_parallel_shards_go_to_the_same_shard_of_the_group_taking_over():
    results = _run(TP_LAYOUT, stepped=True)
    for t in (0, 1):
        state, got = results[2 + t]
        name = f"x/tp{t}of2"
        assert torch.equal(_param(state, name), _value(name, "p"))  # rank t's shard, not the other
        assert torch.equal(_optim(state, name)["exp_avg"].view(3, 5), _value(name, "m"))
        assert got == {name: 3 * 15 * 4 + 4}
    assert results[0][1] == results[1][1] == {}


def test_a_shard_of_another_tensor_parallel_size_is_reported_by_every_rank():
    results = _run(OTHER_SIZE, stepped=False)
    assert results == {r: "rank 1 needs elements [0, 15) of x/tp0of4's param state, which no "
                          "surviving rank holds" for r in (0, 1)}


def test_distributed_optimizer_slices_are_put_together_across_new_boundaries():
    results = _run(SLICES, stepped=None)
    whole = {"exp_avg": _value("x", "m").view(-1), "exp_avg_sq": _value("x", "v").view(-1)}
    for rank, (_, new) in SLICES.items():
        state, _ = results[rank]
        assert torch.equal(_param(state, "x"), _value("x", "p"))
        for a, b in new:
            got = _optim(state, "x", a, b)
            assert all(torch.equal(got[k], whole[k][a:b]) for k in whole)
            assert got["step"].item() == 7.0
    # rank 1 needs [8, 10) of the moments, and [8, 15) of the parameter, from rank 2 alone
    assert results[1][1] == {"x": (2 * 2 + 7) * 4 + 4}


def test_a_slice_whose_every_holder_is_lost_is_reported_by_every_rank():
    results = _run(SLICE_LOST, stepped=None)
    assert results == {r: "rank 0 needs elements [8, 15) of x's param state, which no "
                          "surviving rank holds" for r in (0, 1)}
