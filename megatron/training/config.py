"""One typed configuration of a job: Megatron-LM's flags (megatron.training.arguments) are
parsed and turned into a JobConfig once, and every part of the job takes its own part of it.

Every field says the flag it comes from; derived defaults (the FFN size, the data-parallel
size, the LR decay span, the backend) are filled in before it is built. Times are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron.elastic.config import ElasticConfig
from megatron.training.batch_ramp import BatchRamp
from megatron.training.tokenizer import TokenizerType

PositionEmbedding = Literal["learned_absolute", "rope"]
Normalization = Literal["LayerNorm", "RMSNorm"]
TransformerImpl = Literal["local", "transformer_engine"]
Backend = Literal["nccl", "gloo"]
Placement = Literal["spread", "megatron"]
LRDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSDDecayStyle = Literal["exponential", "linear", "cosine", "minus_sqrt"]
WDIncrStyle = Literal["constant", "linear", "cosine"]
TimingLogOption = Literal["max", "minmax", "all"]
CrossEntropyFusion = Literal["native", "te"]
# --attention-backend: megatron-core's AttnBackend names; flash and fused are CUDA kernels
AttentionBackend = Literal["auto", "local", "unfused", "flash", "fused"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
LoadBalancing = Literal["aux_loss", "seq_aux_loss", "sinkhorn", "none"]
# --moe-token-dispatcher-type: megatron-core's dispatchers that need no CUDA-only library
TokenDispatcher = Literal["allgather", "alltoall"]
MoERouterDtype = Literal["fp32", "fp64"]
MoEScoreFunction = Literal["softmax", "sigmoid"]
DataloaderType = Literal["single", "cyclic"]
# TrainingConfig's --fp16 loss-scaling fields: the flags' destinations and megatron-core's
# OptimizerConfig fields of the same names
LOSS_SCALING = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                "hysteresis")


@dataclass(frozen=True)
class ModelConfig:
    """The GPT model (the "network size" flags)."""

    num_layers: int                          # --num-layers
    hidden_size: int                         # --hidden-size
    num_attention_heads: int                 # --num-attention-heads
    ffn_hidden_size: int                     # --ffn-hidden-size (default 4 x hidden size)
    seq_length: int                          # --seq-length
    max_position_embeddings: int             # --max-position-embeddings (default seq length)
    make_vocab_size_divisible_by: int        # --make-vocab-size-divisible-by
    position_embedding_type: PositionEmbedding = "learned_absolute"
    normalization: Normalization = "LayerNorm"
    tied_embeddings: bool = True             # not --untie-embeddings-and-output-weights
    hidden_dropout: float = 0.1              # --hidden-dropout
    attention_dropout: float = 0.1           # --attention-dropout
    init_method_std: float = 0.02            # --init-method-std
    transformer_impl: TransformerImpl = "local"   # --transformer-impl (default: TE with CUDA)
    # Llama-style shapes
    swiglu: bool = False                     # --swiglu: a gated fc1 ([gate, up]) with SiLU
    squared_relu: bool = False               # --squared-relu: relu(x)^2 instead of GELU
    quick_geglu: bool = False                # --quick-geglu: a gated fc1 with quick GELU
    num_query_groups: int | None = None      # --num-query-groups with --group-query-attention
    add_bias_linear: bool = True             # not --disable-bias-linear
    kv_channels: int | None = None           # --kv-channels (default hidden / heads)
    rotary_base: int = 10000                 # --rotary-base
    rotary_percent: float = 1.0              # --rotary-percent
    rope_scaling: bool = False               # --use-rope-scaling: Llama 3.x's RoPE scaling
    rope_scaling_factor: float = 8.0         # --rope-scaling-factor
    # --rotary-seq-len-interpolation-factor: positions divided by it (None: not interpolated)
    rotary_interpolation: int | None = None
    qk_layernorm: bool = False               # --qk-layernorm
    apply_layernorm_1p: bool = False         # --apply-layernorm-1p: norm weights centred on 0
    norm_epsilon: float = 1e-5               # --norm-epsilon
    attention_backend: AttentionBackend = "auto"    # --attention-backend
    apply_query_key_layer_scaling: bool = False     # --apply-query-key-layer-scaling
    attention_softmax_in_fp32: bool = False  # --attention-softmax-in-fp32
    # Mixture of experts (expert parallel 1): None is a dense MLP
    num_experts: int | None = None           # --num-experts
    moe_ffn_hidden_size: int | None = None   # --moe-ffn-hidden-size (default --ffn-hidden-size)
    moe_router_topk: int = 2                 # --moe-router-topk
    moe_router_load_balancing_type: LoadBalancing = "aux_loss"  # --moe-router-load-balancing-type
    moe_aux_loss_coeff: float = 0.0          # --moe-aux-loss-coeff
    moe_router_pre_softmax: bool = False     # --moe-router-pre-softmax
    moe_token_dispatcher: TokenDispatcher = "allgather"  # --moe-token-dispatcher-type
    moe_router_dtype: MoERouterDtype | None = None        # --moe-router-dtype (None: params')
    moe_z_loss_coeff: float | None = None    # --moe-z-loss-coeff
    # DeepSeek-style routing: --moe-router-score-function, --moe-router-topk-scaling-factor,
    # --moe-router-num-groups / --moe-router-group-topk (group-limited), and a shared expert
    moe_router_score_function: MoEScoreFunction = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    # Activation recompute: None keeps every activation
    recompute_granularity: RecomputeGranularity | None = None   # --recompute-granularity
    recompute_method: RecomputeMethod | None = None             # --recompute-method
    recompute_num_layers: int | None = None                     # --recompute-num-layers
    bf16: bool = False                       # --bf16
    fp16: bool = False                       # --fp16
    # --cross-entropy-loss-fusion with --cross-entropy-fusion-impl (None: unfused)
    cross_entropy_fusion: CrossEntropyFusion | None = None
    deterministic: bool = False              # --deterministic-mode
    # The tokenizer's vocabulary padded to a multiple of --make-vocab-size-divisible-by; known
    # once the tokenizer is built (training.pretrain), 0 until then.
    padded_vocab_size: int = 0

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 gives [gate, up] (a third matrix's worth of parameters and FLOPs)."""
        return self.swiglu or self.quick_geglu

    def shape_args(self) -> dict:
        """The fields that shape the parameters, as a checkpoint records them for
        --use-checkpoint-args (each named as its flag's destination, but tied_embeddings,
        add_bias_linear and num_query_groups, which arguments._apply_checkpoint_args maps)."""
        return {name: getattr(self, name) for name in _SHAPE_FIELDS}


_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
                 "position_embedding_type", "normalization", "tied_embeddings", "swiglu",
                 "squared_relu", "quick_geglu", "apply_layernorm_1p",
                 "num_query_groups", "add_bias_linear", "kv_channels", "rotary_base",
                 "rotary_percent", "qk_layernorm", "norm_epsilon", "num_experts",
                 "moe_ffn_hidden_size", "moe_router_topk",
                 "moe_shared_expert_intermediate_size")


@dataclass(frozen=True)
class ParallelConfig:
    """The world and its failure-free layout."""

    world_size: int                          # WORLD_SIZE of the launcher
    tensor_parallel: int = 1                 # --tensor-model-parallel-size
    # --sequence-parallel (only with tensor_parallel > 1): the activations outside the attention
    # and MLP, those sent between stages included, are split over the sequence, [s/tp, b, h]
    sequence_parallel: bool = False
    pipeline_parallel: int = 1               # --pipeline-model-parallel-size
    # world / (TP x PP); None with --chameleon-plan, whose pipelines set it
    data_parallel: int | None = 1
    backend: Backend = "gloo"                # --distributed-backend (default: nccl with CUDA)
    # Generation 0's rendezvous and the world's operations until training starts (the dataset
    # builder holds every rank in a barrier while rank 0 writes its index cache):
    # --distributed-timeout-minutes, converted once. Megatron-LM's default, 10 minutes.
    distributed_timeout_s: float = 600.0
    plan_file: str | None = None             # --chameleon-plan: an ExecutionPlan (JSON) to run
    # --chameleon-placement under chameleon-launch: spread (each stage's replicas on different
    # nodes; the default with --chameleon) or megatron (Megatron's rank order)
    placement: Placement = "megatron"
    distributed_optimizer: bool = False      # --use-distributed-optimizer
    optimizer_instances: int = 1             # --num-distributed-optimizer-instances
    overlap_grad_reduce: bool = False        # --overlap-grad-reduce
    overlap_param_gather: bool = False       # --overlap-param-gather
    # --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the first and
    # last stages' layers; the stages between split the rest evenly (None: an even split)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    ddp_bucket_size: int | None = None       # --ddp-bucket-size (None: megatron-core's)
    # --num-virtual-stages-per-pipeline-rank (or from --num-layers-per-virtual-pipeline-stage):
    # model chunks per rank of an interleaved pipeline (1: not interleaved)
    virtual_stages: int = 1


@dataclass(frozen=True)
class TrainingConfig:
    """Batches, iterations, the learning-rate schedule, the optimizer and evaluation."""

    micro_batch_size: int                    # --micro-batch-size
    global_batch_size: int                   # --global-batch-size (a --chameleon-plan's own)
    train_iters: int                         # --train-iters (or from --train-samples)
    ramp: BatchRamp | None = None            # --rampup-batch-size (with --train-samples)
    seed: int = 1234                         # --seed
    lr: float = 1e-3                         # --lr
    min_lr: float = 0.0                      # --min-lr
    lr_decay_style: LRDecayStyle = "linear"  # --lr-decay-style
    lr_warmup_iters: int = 0                 # --lr-warmup-iters (or --lr-warmup-fraction)
    lr_decay_iters: int = 0                  # --lr-decay-iters (default --train-iters)
    # --lr-warmup-samples / --lr-decay-samples (with --train-samples): when given, the schedule
    # counts these samples instead of the iterations above times the global batch
    lr_warmup_samples: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None  # --lr-warmup-fraction: of the decay span
    weight_decay: float = 0.01               # --weight-decay
    # --lr-decay-style WSD: the annealing phase, the decay span's last iterations or samples
    # (--lr-wsd-decay-iters, --lr-wsd-decay-samples), and its shape
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    lr_wsd_decay_style: WSDDecayStyle = "exponential"
    # --start-weight-decay / --end-weight-decay, --weight-decay-incr-style: the weight decay
    # from start to end over the training span (constant: both --weight-decay)
    start_weight_decay: float = 0.01
    end_weight_decay: float = 0.01
    weight_decay_incr_style: WDIncrStyle = "constant"
    train_samples: int | None = None         # --train-samples (None: --train-iters counts)
    # A loaded checkpoint's schedule settings against the flags: by default they must be
    # equal; --override-opt_param-scheduler keeps the flags', --use-checkpoint-opt_param-
    # scheduler the checkpoint's
    override_schedule: bool = False
    checkpoint_schedule: bool = False
    # --fp16's loss scaling: --loss-scale (static) or the dynamic scaler's --initial-loss-scale,
    # --min-loss-scale, --loss-scale-window, --hysteresis (None: megatron-core's defaults)
    loss_scale: float | None = None
    initial_loss_scale: float | None = None
    min_loss_scale: float | None = None
    loss_scale_window: float | None = None
    hysteresis: int | None = None
    clip_grad: float = 1.0                   # --clip-grad
    # --decoupled-lr / --decoupled-min-lr: the embedding's and output layer's own schedule
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    adam_beta1: float = 0.9                  # --adam-beta1
    adam_beta2: float = 0.999                # --adam-beta2
    adam_eps: float = 1e-8                   # --adam-eps
    eval_interval: int | None = None         # --eval-interval (None: no evaluation)
    eval_iters: int = 2                      # --eval-iters: batches per evaluation
    exit_interval: int | None = None         # --exit-interval: stop after a multiple of it
    exit_duration_s: float | None = None     # --exit-duration-in-mins, converted
    exit_signal_handler: bool = False        # --exit-signal-handler: SIGTERM saves and exits 0
    manual_gc: bool = False                  # --manual-gc: no automatic garbage collection
    manual_gc_interval: int = 0              # --manual-gc-interval (0: at evals and saves only)
    empty_unused_memory_level: int = 0       # --empty-unused-memory-level: CUDA cache release
    grad_reduce_in_bf16: bool = False        # --grad-reduce-in-bf16 (with --bf16)
    check_for_nan: bool = True               # not --no-check-for-nan-in-loss-and-grad
    # --calculate-per-token-loss: the loss is the batch's token mean, not the mean of its
    # micro-batches' token means (they differ where --eod-mask-loss masks tokens)
    per_token_loss: bool = False
    # --check-weight-hash-across-dp-replicas-interval: every copy of the state compared
    check_replicas_interval: int | None = None
    skip_train: bool = False                 # --skip-train: evaluate once, train nothing

    @property
    def evaluates(self) -> bool:
        """Whether the job evaluates on the validation split (and so builds it)."""
        return self.eval_interval is not None or self.skip_train

    @property
    def first_global_batch(self) -> int:
        """The global batch of the first iteration (the ramp's start)."""
        return self.ramp.global_batch(0) if self.ramp else self.global_batch_size

    def schedule_samples(self) -> tuple[int, int]:
        """(warm-up, decay) of the LR schedule in samples, as megatron-core's scheduler counts."""
        gbs = self.global_batch_size
        decay = self.lr_decay_samples if self.lr_decay_samples is not None \
            else self.lr_decay_iters * gbs
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * decay), decay
        warmup = self.lr_warmup_samples if self.lr_warmup_samples is not None \
            else self.lr_warmup_iters * gbs
        return warmup, decay

    @property
    def wsd_samples(self) -> int | None:
        """WSD's annealing phase in samples (None: not WSD)."""
        if self.lr_wsd_decay_samples is not None:
            return self.lr_wsd_decay_samples
        return None if self.lr_wsd_decay_iters is None \
            else self.lr_wsd_decay_iters * self.global_batch_size

    @property
    def wd_incr_samples(self) -> int:
        """The span in samples over which the weight decay goes from start to end: the
        training span, as Megatron-LM's wd_incr_steps. A constant weight decay never reads it
        and gets the LR decay span instead, so that a run extended under the same LR schedule
        resumes from its checkpoint without a schedule mismatch."""
        if self.weight_decay_incr_style == "constant":
            return self.schedule_samples()[1]
        return self.train_samples if self.train_samples is not None \
            else self.train_iters * self.global_batch_size


@dataclass(frozen=True)
class LoggingConfig:
    """What the job tells its user (megatron.training.reporting)."""

    log_interval: int = 1                    # --log-interval: iterations per log line
    timing_log_level: Literal[0, 1, 2] = 0   # --timing-log-level: timers in the log lines
    tensorboard_dir: str | None = None       # --tensorboard-dir
    progress_bar: bool = True                # not --no-progress-bar
    metrics_file: str | None = None          # --chameleon-metrics-file: JSON-lines events
    log_throughput: bool = False             # --log-throughput: model TFLOP/s per GPU
    log_timers_to_tensorboard: bool = False  # --log-timers-to-tensorboard
    log_num_zeros_in_grad: bool = False      # --log-num-zeros-in-grad
    log_params_norm: bool = False            # --log-params-norm
    timing_log_option: TimingLogOption = "minmax"   # --timing-log-option
    tensorboard_log_interval: int = 1        # --tensorboard-log-interval
    tensorboard_queue_size: int = 1000       # --tensorboard-queue-size
    log_loss_scale: bool = True              # not --no-log-loss-scale-to-tensorboard
    log_validation_ppl: bool = False         # --log-validation-ppl-to-tensorboard
    log_world_size: bool = False             # --log-world-size-to-tensorboard
    log_memory: bool = False                 # --log-memory-to-tensorboard (CUDA)
    # --profile --use-pytorch-profiler: torch.profiler over iterations profile_start + 1 ..
    # profile_end (--profile-step-start/end) on --profile-ranks (empty: every rank)
    profile: bool = False
    profile_start: int = 10
    profile_end: int = 12
    profile_ranks: tuple[int, ...] = ()
    profile_shapes: bool = False             # --pytorch-profiler-collect-shapes
    profile_stack: bool = False              # --pytorch-profiler-collect-callstack


@dataclass(frozen=True)
class DataConfig:
    """The training data and its tokenizer."""

    # --data-path: one prefix, or weight prefix pairs to blend; empty with --mock-data
    data_path: tuple[str, ...] = ()
    split: str = "969,30,1"                  # --split: train, valid, test weights
    mock_data: bool = False                  # --mock-data
    cache_path: str | None = None            # --data-cache-path
    tokenizer_type: TokenizerType = "ByteLevelTokenizer"     # --tokenizer-type
    vocab_file: str | None = None            # --vocab-file
    merge_file: str | None = None            # --merge-file
    tokenizer_model: str | None = None       # --tokenizer-model
    vocab_size: int | None = None            # --vocab-size (NullTokenizer)
    eod_mask_loss: bool = False              # --eod-mask-loss
    reset_position_ids: bool = False         # --reset-position-ids
    reset_attention_mask: bool = False       # --reset-attention-mask
    num_workers: int = 2                     # --num-workers: threads reading a micro-batch
    mmap_bin_files: bool = True              # not --no-mmap-bin-files
    dataloader_type: DataloaderType = "single"   # --dataloader-type
    builder_threads: int = 1                 # --num-dataset-builder-threads


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and come from (megatron.training.checkpointing)."""

    save: str | None = None                  # --save: where checkpoints are written
    load: str | None = None                  # --load: where the first one is read from
    save_interval: int | None = None         # --save-interval: iterations between saves
    load_optim: bool = True                  # not --no-load-optim (nor --finetune)
    finetune: bool = False                   # --finetune: parameters only, from iteration 0
    # --save-retain-interval: a checkpoint is kept when it is the latest or its iteration is a
    # multiple of this (None: every checkpoint is kept)
    retain_interval: int | None = None


@dataclass(frozen=True)
class JobConfig:
    """The whole job; the Trainer takes it and hands each part below it its own part."""

    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
