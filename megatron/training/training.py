"""pretrain(): Megatron-LM's training entry: arguments, the plan and the model's configs, then
the Trainer (megatron.training.trainer) runs the job."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from chameleon_ext.control import membership
from chameleon_ext.control.faults import FaultSpecError, Injector, parse_injects
from chameleon_ext.plan import placement
from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError
from megatron.elastic import parallel_state
from megatron.elastic.manager import ElasticManager
from megatron.training.arguments import ArgumentError, parse_args
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
    if dist.is_initialized():
        dist.destroy_process_group()
    # The groups go while the interpreter is whole: gloo's threads joined at its teardown end
    # in std::terminate (SIGABRT instead of this exit code).
    gc.collect()
    if silent:
        time.sleep(_SILENT_EXIT_DELAY_S)
    sys.exit(code)


def transformer_config(args):
    from megatron.core.transformer import TransformerConfig
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, normalization=args.normalization,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,  # gradients are summed over replicas, never averaged
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
    )


def optimizer_config(args):
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=torch.float32, use_distributed_optimizer=False)


def make_plan(args, world: int) -> ExecutionPlan:
    if args.chameleon_plan:
        plan = ExecutionPlan.load(args.chameleon_plan)
        if plan.ranks != list(range(world)):
            raise PlanError(f"plan {args.chameleon_plan} uses ranks {plan.ranks}, the world is "
                            f"0..{world - 1}")
        if plan.num_layers != args.num_layers:
            raise PlanError(f"plan has {plan.num_layers} layers, --num-layers is {args.num_layers}")
        if plan.tensor_parallel != args.tensor_model_parallel_size:
            raise PlanError("plan's tensor_parallel differs from --tensor-model-parallel-size")
        if plan.micro_batch_size != args.micro_batch_size:
            raise PlanError("plan's micro_batch_size differs from --micro-batch-size")
        # Pipelines may split the layers at different points (misaligned stages): their
        # gradients are then summed per segment of layers (megatron.elastic.grad_reduction).
        args.global_batch_size = plan.global_batch_size
        return plan
    return ExecutionPlan.failure_free(world, args.tensor_model_parallel_size,
                                      args.pipeline_model_parallel_size, args.num_layers,
                                      args.micro_batch_size, args.global_batch_size)


def place_on_nodes(args, plan: ExecutionPlan) -> tuple[ExecutionPlan, str | None]:
    """Under chameleon-launch, the failure-free plan with its places taken by --chameleon-placement
    over the nodes the launcher recorded, and a line that says what a node's loss would take;
    a --chameleon-plan runs as given. Only ranks are renamed: the losses do not change."""
    if args.chameleon_plan or not os.environ.get(membership.STORE_ENV):
        return plan, None
    nodes = membership.nodes_from_store(membership.connect_store(), plan.world_size)
    placed = placement.place(args.chameleon_placement, nodes, args.tensor_model_parallel_size,
                             args.pipeline_model_parallel_size, args.num_layers,
                             args.micro_batch_size, args.global_batch_size)
    return placed, placement.describe(args.chameleon_placement, placed, nodes)


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step, loss_func,
             argv: list[str] | None = None) -> dict:
    """Train; returns a summary dict (rank 0 also prints it)."""
    silence_known_warnings()
    logging.basicConfig(level=logging.INFO if _first_on_node() else logging.WARNING,
                        format="%(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)  # per-bucket parameter lists
    try:
        args = parse_args(argv)
        plan, placement_line = place_on_nodes(args, make_plan(args, args.world_size))
        tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                                    merge_file=args.merge_file,
                                    tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
        injector = Injector(parse_injects(args.chameleon_inject), int(os.environ.get("RANK", "0")))
    except (ArgumentError, PlanError, TokenizerError, FaultSpecError) as e:
        _fail(str(e))
    except membership.MembershipError as e:    # the launcher's store is unreachable
        _fail(str(e), code=1)
    if args.chameleon and not ElasticManager.available():
        _fail("--chameleon needs the job to run under chameleon-launch (no CHAMELEON_STORE)")
    args.padded_vocab_size = _pad_vocab(tokenizer.vocab_size, args)
    try:
        trainer = Trainer(args, plan, tokenizer, injector,
                          Providers(train_valid_test_datasets_provider, model_provider,
                                    forward_step, loss_func),
                          transformer_config(args), optimizer_config(args), placement_line)
        return trainer.train()
    except JobError as e:
        _fail(str(e), e.exit_code)


def _pad_vocab(vocab_size: int, args) -> int:
    # A multiple of --make-vocab-size-divisible-by alone, not of it times the tensor-parallel
    # size as in Megatron-LM: the padded logits take part in the softmax, so a padding that
    # grows with TP would make the losses (and the checkpoint's shapes) depend on the layout.
    # validate() requires the multiple to be divisible by TP: the vocabulary still splits evenly.
    multiple = args.make_vocab_size_divisible_by
    return ((vocab_size + multiple - 1) // multiple) * multiple
