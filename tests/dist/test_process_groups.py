"""The plan's groups reach megatron-core as a ProcessGroupCollection; what is left in its globals
and the one private timeout call are each needed. Two gloo processes, a TP 2 stage model:

- with only parallel_state.install()'s globals, megatron-core's GPTModel, DistributedDataParallel
  and optimizer run a training step; without either global the step fails in the megatron-core
  function that reads it (once megatron-core takes a group there, this test fails: the global
  can go);
- parallel_state.bound_operations: a group's rendezvous must wait for a member that is late by
  more than an operation may wait for a silent peer, and gloo takes one timeout for both."""

from __future__ import annotations

import pickle
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.launch import spawn_ranks

pytestmark = pytest.mark.slow

SEQ, VOCAB, BATCH = 16, 64, 2
# each global install() sets, and the megatron-core function (file, function) that reads it
READERS = {
    "_GLOBAL_MEMORY_BUFFER": ("dot_product_attention.py", "forward"),
    "_TENSOR_MODEL_PARALLEL_GROUP": ("cross_entropy.py", "forward"),
}


def _step(rank: int, drop: str | None) -> str | tuple[str, str]:
    """One training step of a TP 2 stage model on megatron-core, with install()'s globals less
    `drop`: "ok", or the (file, function) of megatron-core's frame that failed."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from chameleon_ext.plan.execution_plan import ExecutionPlan
    from megatron.elastic import parallel_state

    plan = ExecutionPlan.failure_free(2, 2, 1, 2, BATCH, BATCH)
    groups = parallel_state.initialize(plan, rank)
    if drop is not None:
        setattr(mps, drop, None)
    pgs = parallel_state.collection(groups)
    tensor_parallel.model_parallel_cuda_manual_seed(1, tp_rank=rank, ep_rank=0, etp_rank=rank,
                                                    force_reset_rng=True)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    module = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                      vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=True,
                      post_process=True, pg_collection=pgs)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    module, pg_collection=pgs)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0), [model],
                                       use_gloo_process_groups=False, pg_collection=pgs)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    try:
        model(tokens, positions, mask, labels=torch.roll(tokens, -1, dims=1)).sum().backward()
        model.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok
        return "ok"
    except AssertionError as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if "megatron/core" in f.filename and "parallel_state" not in f.filename]
        return (Path(frames[-1].filename).name, frames[-1].name)
    finally:
        parallel_state.destroy()
        dist.barrier()


def _timeouts(rank: int) -> dict:
    """A member 2 s late at a group's creation, with operations bounded by 0.5 s."""
    import torch.distributed as dist

    from megatron.elastic import parallel_state

    out = {}
    # one timeout for both: the rendezvous gives up on the late member
    if rank == 1:
        time.sleep(2.0)
    try:
        dist.new_group([0, 1], timeout=timedelta(seconds=0.5))
        out["short rendezvous"] = "created"
    except RuntimeError:
        out["short rendezvous"] = "failed"
    dist.barrier()
    # a long rendezvous, then the operations bounded: the late member is waited for, and a
    # silent peer fails an operation within its bound
    if rank == 1:
        time.sleep(2.0)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    parallel_state.bound_operations(group, timedelta(seconds=0.5))
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(1), group=group)
            out["silent peer"] = "completed"
        except RuntimeError:
            out["silent peer"] = time.monotonic() - start
    else:
        time.sleep(3.0)
    dist.barrier()
    return out


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron.elastic import cpu_compat
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    cpu_compat.apply()
    results = {"steps": {drop: _step(rank, drop) for drop in (None, *READERS)},
               "timeouts": _timeouts(rank)}
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    # 120 s: imports and three small models on a shared 2-core host
    return list(spawn_ranks(_worker, range(2), timeout_s=120).values())


def test_megatron_core_needs_exactly_the_installed_globals(results):
    for r in results:
        assert r["steps"][None] == "ok"
        for name, reader in READERS.items():
            assert r["steps"][name] == reader, name


def test_a_group_needs_a_rendezvous_bound_longer_than_its_operations(results):
    assert results[0]["timeouts"]["short rendezvous"] == "failed"
    waited = results[0]["timeouts"]["silent peer"]
    assert isinstance(waited, float) and waited < 2.0, waited
