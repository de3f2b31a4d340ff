"""pretrain(): Megatron-LM's training entry: the job's configuration from its flags, the plan and
the model's configs, then the Trainer (megatron.training.trainer) runs the job."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Callable

import torch

from chameleon_ext.control.faults import Injector
from chameleon_ext.control.keys import STORE_ENV
from chameleon_ext.control.store import MembershipError, connect_store, nodes_from_store
from chameleon_ext.control.world import destroy_world
from chameleon_ext.plan import placement
from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError
from megatron.elastic import parallel_state
from megatron.elastic.manager import ElasticManager
from megatron.elastic.config import ConfigError
from megatron.training.arguments import parse_config
from megatron.training.config import LOSS_SCALING, JobConfig, ModelConfig, TrainingConfig
from megatron.training.known_warnings import silence_known_warnings
from megatron.training.tokenizer import TokenizerError, build_tokenizer
from megatron.training.trainer import JobError, Providers, Trainer

log = logging.getLogger("megatron.training")


# How long a rank that stays silent about a job-wide error waits before it exits: its node's
# first rank finds the same error and must print it before a launcher stops it (torchrun stops
# every worker ~0.1 s after one exits). 3 s covers the ranks' skew in reaching the set-up's
# checks (their imports, on a loaded machine).
_SILENT_EXIT_DELAY_S = 3.0


def _first_on_node() -> bool:
    """Launch rank 0 on one node; each node's first worker on several; a process without a
    launcher."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


def _fail(msg: str, code: int = 2) -> None:
    """One line on stderr, then exit `code`. Code 2 is bad input that every rank finds (the
    job's arguments, plan, data): only each node's first worker prints it, once per node's log."""
    silent = code == 2 and not _first_on_node()
    if not silent:
        print(f"{os.path.basename(sys.argv[0])}: error: {msg}", file=sys.stderr, flush=True)
    parallel_state.destroy()
    destroy_world()     # while the interpreter is whole: SIGABRT instead of this exit code else
    if silent:
        time.sleep(_SILENT_EXIT_DELAY_S)
    sys.exit(code)


def activation_func(swiglu: bool, squared_relu: bool, quick_geglu: bool) -> Callable:
    """The MLP's activation for Megatron-LM's activation flags (GELU without any)."""
    import torch.nn.functional as F
    from megatron.core.activations import quick_gelu, squared_relu as relu2
    return (F.silu if swiglu else relu2 if squared_relu else quick_gelu if quick_geglu
            else F.gelu)


def transformer_config(model: ModelConfig, tensor_parallel: int,
                       sequence_parallel: bool = False):
    """megatron-core's TransformerConfig for the model flags, as Megatron-LM builds it."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend
    dtype = torch.bfloat16 if model.bf16 else torch.float16 if model.fp16 else torch.float32
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
        num_query_groups=model.num_query_groups, kv_channels=model.kv_channels,
        gated_linear_unit=model.gated_linear_unit,
        activation_func=activation_func(model.swiglu, model.squared_relu, model.quick_geglu),
        add_bias_linear=model.add_bias_linear, qk_layernorm=model.qk_layernorm,
        layernorm_epsilon=model.norm_epsilon,
        # transformer-engine's norms centre the weight themselves; the local ones are
        # stage_model.TorchNorm (megatron-core's torch norms refuse the flag)
        layernorm_zero_centered_gamma=(model.apply_layernorm_1p
                                       and model.transformer_impl == "transformer_engine"),
        attention_backend=AttnBackend[model.attention_backend],
        apply_query_key_layer_scaling=model.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=model.attention_softmax_in_fp32,
        num_moe_experts=model.num_experts, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_token_dispatcher_type=model.moe_token_dispatcher,
        moe_router_dtype=model.moe_router_dtype, moe_z_loss_coeff=model.moe_z_loss_coeff,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method, recompute_num_layers=model.recompute_num_layers,
        tensor_model_parallel_size=tensor_parallel, sequence_parallel=sequence_parallel,
        hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std, normalization=model.normalization,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=model.bf16, fp16=model.fp16,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,  # gradients are summed over replicas, never averaged
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
        cross_entropy_loss_fusion=model.cross_entropy_fusion is not None,
        cross_entropy_fusion_impl=model.cross_entropy_fusion or "native",
        deterministic_mode=model.deterministic,
    )


def optimizer_config(training: TrainingConfig, model: ModelConfig):
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(
        optimizer="adam", lr=training.lr, min_lr=training.min_lr,
        weight_decay=training.weight_decay, adam_beta1=training.adam_beta1,
        adam_beta2=training.adam_beta2, adam_eps=training.adam_eps,
        clip_grad=training.clip_grad, bf16=model.bf16, fp16=model.fp16,
        # megatron-core gives the parameters marked is_embedding_or_output_parameter (the word
        # embeddings, the output layer) a param group of their own schedule
        decoupled_lr=training.decoupled_lr, decoupled_min_lr=training.decoupled_min_lr,
        params_dtype=torch.float32, use_distributed_optimizer=False,
        **{name: getattr(training, name) for name in LOSS_SCALING
           if getattr(training, name) is not None})


def make_plan(config: JobConfig) -> ExecutionPlan:
    """The failure-free plan, or --chameleon-plan's checked against the flags."""
    par, model, training = config.parallel, config.model, config.training
    world = par.world_size
    if par.plan_file:
        plan = ExecutionPlan.load(par.plan_file)
        if plan.ranks != list(range(world)):
            raise PlanError(f"plan {par.plan_file} uses ranks {plan.ranks}, the world is "
                            f"0..{world - 1}")
        if plan.num_layers != model.num_layers:
            raise PlanError(f"plan has {plan.num_layers} layers, --num-layers is "
                            f"{model.num_layers}")
        if plan.tensor_parallel != par.tensor_parallel:
            raise PlanError("plan's tensor_parallel differs from --tensor-model-parallel-size")
        if plan.micro_batch_size != training.micro_batch_size:
            raise PlanError("plan's micro_batch_size differs from --micro-batch-size")
        if plan.interleaved and config.elastic.enabled:
            raise PlanError(f"plan {par.plan_file} is interleaved (a rank holds several "
                            "stages): --chameleon recovers plans of one stage per rank only")
        # Pipelines may split the layers at different points (misaligned stages): their
        # gradients are then summed per segment of layers (megatron.elastic.grad_reduction).
        return plan
    return ExecutionPlan.failure_free(world, par.tensor_parallel, par.pipeline_parallel,
                                      model.num_layers, training.micro_batch_size,
                                      training.first_global_batch, par.first_stage_layers,
                                      par.last_stage_layers, par.virtual_stages)


def place_on_nodes(config: JobConfig, plan: ExecutionPlan) -> tuple[ExecutionPlan, str | None]:
    """Under chameleon-launch, the failure-free plan with its places taken by --chameleon-placement
    over the nodes the launcher recorded, and a line that says what a node's loss would take;
    a --chameleon-plan runs as given. Only ranks are renamed: the losses do not change."""
    par = config.parallel
    if par.plan_file or not os.environ.get(STORE_ENV):
        return plan, None
    nodes = nodes_from_store(connect_store(), plan.world_size)
    placed = placement.place(par.placement, nodes, plan)
    return placed, placement.describe(par.placement, placed, nodes)


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step, loss_func,
             argv: list[str] | None = None) -> dict:
    """Train; returns a summary dict (rank 0 also prints it)."""
    silence_known_warnings()
    # `kill -USR2 <pid>`: a stuck worker prints every thread's Python stack to its stderr and
    # goes on (the test harness asks each worker of a job that overran its bound).
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    logging.basicConfig(level=logging.INFO if _first_on_node() else logging.WARNING,
                        format="%(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)  # per-bucket parameter lists
    try:
        config = parse_config(argv)
        plan = make_plan(config)
        plan, placement_line = place_on_nodes(config, plan)
        data = config.data
        tokenizer = build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file,
                                    merge_file=data.merge_file,
                                    tokenizer_model=data.tokenizer_model,
                                    vocab_size=data.vocab_size)
        model_config = transformer_config(config.model, config.parallel.tensor_parallel,
                                          config.parallel.sequence_parallel)
    except (ConfigError, PlanError, TokenizerError) as e:
        _fail(str(e))
    except (ValueError, AssertionError) as e:   # megatron-core's own checks of the model flags
        _fail(f"megatron-core refuses the model flags: {_first_line(e)}")
    except MembershipError as e:    # the launcher's store is unreachable
        _fail(str(e), code=1)
    if config.model.deterministic:
        torch.use_deterministic_algorithms(True)
    if config.elastic.enabled and not ElasticManager.available():
        _fail("--chameleon needs the job to run under chameleon-launch (no CHAMELEON_STORE)")
    # What only the plan and the tokenizer know: a --chameleon-plan's batch, the padded vocabulary.
    gbs = plan.global_batch_size if config.parallel.plan_file else \
        config.training.global_batch_size
    config = replace(
        config, training=replace(config.training, global_batch_size=gbs),
        model=replace(config.model, padded_vocab_size=_pad_vocab(tokenizer.vocab_size,
                                                                 config.model)))
    injector = Injector(list(config.elastic.inject), int(os.environ.get("RANK", "0")))
    try:
        trainer = Trainer(config, plan, tokenizer, injector,
                          Providers(train_valid_test_datasets_provider, model_provider,
                                    forward_step, loss_func),
                          model_config,
                          optimizer_config(config.training, config.model), placement_line)
        return trainer.train()
    except JobError as e:
        _fail(str(e), e.exit_code)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _pad_vocab(vocab_size: int, model: ModelConfig) -> int:
    # A multiple of --make-vocab-size-divisible-by alone, not of it times the tensor-parallel
    # size as in Megatron-LM: the padded logits take part in the softmax, so a padding that
    # grows with TP would make the losses (and the checkpoint's shapes) depend on the layout.
    # validate() requires the multiple to be divisible by TP: the vocabulary still splits evenly.
    multiple = model.make_vocab_size_divisible_by
    return ((vocab_size + multiple - 1) // multiple) * multiple
