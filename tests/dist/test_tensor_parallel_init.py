"""A stage model computes the same function at tensor-parallel size 1 and 2: the same
initial weights (megatron-core's partition layouts: the fused QKV with grouped-query attention, a
gated MLP's fc1 [gate, up] halves, row-parallel biases), the same dropout masks, the same losses
and the same gradients of the parameters every tensor-parallel rank holds whole, with sequence
parallelism too (each rank's rows of the sequence, their dropout masks cut from the whole
sequence's, the partial gradients of norms and row-parallel biases summed over the TP group as
the executor sums them). Two gloo processes; each builds the model once as a data-parallel
replica (TP 1) and as one shard of a TP 2 group, without and with sequence parallelism. The
flags expose neither gated MLPs nor grouped-query attention, so the end-to-end layout tests
cannot reach these layouts; this test builds them directly."""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.launch import spawn_ranks

pytestmark = pytest.mark.slow

SEQ, VOCAB, BATCH = 16, 64, 2
# Replicated on every tensor-parallel rank: their gradients must not depend on the TP size.
WHOLE = ("embedding.position_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
         "decoder.layers.1.self_attention.linear_proj.bias", "decoder.layers.1.mlp.linear_fc2.bias",
         "decoder.final_layernorm.bias")


def _losses_and_grads(tp: int, rank: int, sp: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-token losses of a training pass (dropout on), of a plain pass (off), and the
    gradients of WHOLE after the training pass (`sp`: sequence parallelism)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    import torch.distributed as dist

    from chameleon_ext.plan.execution_plan import ExecutionPlan
    from megatron.elastic import parallel_state, stage_model

    plan = ExecutionPlan.failure_free(2, tp, 1, 2, BATCH, BATCH * (2 // tp))
    groups = parallel_state.initialize(plan, rank)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, gated_linear_unit=True, activation_func=F.silu,
        tensor_model_parallel_size=tp, sequence_parallel=sp, hidden_dropout=0.1,
        attention_dropout=0.1,
        init_method_std=0.02, use_cpu_initialization=True, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec()
    if sp:
        spec = stage_model.torch_norm_block(spec, config.num_layers, sequence_parallel=True,
                                            zero_centered=False)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=True,
                     pg_collection=parallel_state.collection(groups))
    tp_rank = plan.position(rank).tp_rank
    stage_model.init_parameters(model, seed=7, layer_offset=0, pre_process=True, total_layers=2,
                                init_std=0.02, tp_rank=tp_rank, tp_size=tp, tied_output=True)
    seeder = stage_model.DropoutSeeder(seed=7)
    seeder.attach(model, 0, True, tp_rank, tp, sp)
    seeder.at(iteration=3, microbatch=1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True: masked out
    model.eval()
    with torch.no_grad():
        plain = model(tokens, positions, mask, labels=labels)
    model.train()
    losses = model(tokens, positions, mask, labels=labels)
    losses.sum().backward()
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False):  # the executor's sum over the TP group
            dist.all_reduce(p.grad, group=groups.tp)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if n in WHOLE}
    parallel_state.destroy()
    return losses.detach(), plain, grads


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.elastic import cpu_compat
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    cpu_compat.apply()
    results = {layout: _losses_and_grads(layout[0], rank, layout[1])
               for layout in ((1, False), (2, False), (2, True))}
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(results))
    dist.destroy_process_group()


def test_tensor_parallel_2_computes_what_one_rank_computes():
    # 120 s: imports and six small models on a shared 2-core host
    results = spawn_ranks(_worker, range(2), timeout_s=120).values()
    for by_tp in results:
        loss1, plain1, grads1 = by_tp[1, False]
        # Dropout is on: the training pass differs from the plain one, at both sizes alike.
        assert (loss1 - plain1).abs().max() > 1e-3
        for layout in ((2, False), (2, True)):
            loss2, plain2, grads2 = by_tp[layout]
            torch.testing.assert_close(plain2, plain1, rtol=1e-5, atol=0)
            torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=0)
            assert sorted(grads2) == sorted(WHOLE)
            for name in WHOLE:
                # Sums taken in another order differ by float32 rounding, which is absolute for
                # an element near zero: the tolerance is scaled to the gradient's largest one.
                scale = grads1[name].abs().max().item()
                torch.testing.assert_close(grads2[name], grads1[name], rtol=1e-4,
                                           atol=1e-5 * scale,
                                           msg=lambda m, n=name, lay=layout: f"{lay} {n}: {m}")
