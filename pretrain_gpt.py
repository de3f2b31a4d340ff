"""Pretrain a GPT model with megatron-core, in Megatron-LM's shape: a model provider, a forward
step, a datasets provider, and pretrain(). Launch with torchrun (or chameleon-launch)."""

from __future__ import annotations

from megatron.training.known_warnings import silence_known_warnings

silence_known_warnings()  # before megatron-core's imports, which raise most of them

from megatron.training.deferred_compile import deferred_compile  # noqa: E402

with deferred_compile():  # megatron-core's imports, without TorchDynamo (the module says why)
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.elastic.stage_model import torch_norm_block
    from megatron.training.config import JobConfig, ModelConfig
    from megatron.training.data import build_gpt_datasets
    from megatron.training.training import pretrain


def model_provider(model: ModelConfig, config, pre_process: bool, post_process: bool,
                   pg_collection: ProcessGroupCollection) -> GPTModel:
    if model.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=model.num_experts,
                                                          qk_layernorm=model.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=model.num_experts,
                                        qk_layernorm=model.qk_layernorm,
                                        normalization=model.normalization)
        if config.sequence_parallel or model.apply_layernorm_1p:
            # megatron-core's torch norms refuse both (stage_model.TorchNorm says why)
            spec = torch_norm_block(spec, config.num_layers,
                                    sequence_parallel=config.sequence_parallel,
                                    zero_centered=model.apply_layernorm_1p)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=model.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, share_embeddings_and_output_weights=model.tied_embeddings,
        position_embedding_type=model.position_embedding_type, rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base, rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        seq_len_interpolation_factor=model.rotary_interpolation, pg_collection=pg_collection)


def forward_step(batch: dict | None, model) -> torch.Tensor:
    """Per-token losses on the last stage, hidden states elsewhere; `batch` is None on stages
    that need no data."""
    if batch is None:
        return model(None, None, None)
    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                 labels=batch["labels"])


def loss_func(batch: dict, output_tensor: torch.Tensor) -> torch.Tensor:
    """Token-mean language-model loss of one micro-batch."""
    mask = batch["loss_mask"].float()
    return (output_tensor.float() * mask).sum() / mask.sum().clamp(min=1.0)


def train_valid_test_datasets_provider(job: JobConfig, tokenizer):
    data, training = job.data, job.training
    gbs = training.global_batch_size
    return build_gpt_datasets(
        data_path=data.data_path, mock_data=data.mock_data, split=data.split,
        seq_length=job.model.seq_length, seed=training.seed, tokenizer=tokenizer,
        train_samples=training.train_iters * gbs,
        # the same batches each time
        valid_samples=training.eval_iters * gbs if training.evaluates else 0,
        test_samples=0, data_cache_path=data.cache_path, eod_mask_loss=data.eod_mask_loss,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, mmap_bin_files=data.mmap_bin_files,
        builder_threads=data.builder_threads)


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, loss_func)
