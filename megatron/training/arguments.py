"""Command-line arguments: Megatron-LM's flag names, plus the --chameleon-* group, turned once
into the job's typed configuration (megatron.training.config.JobConfig).

Every problem with the flags (including those that need the world size, and the relations
between the timeouts) is reported as one line on stderr with exit code 2, before any process
group or file is touched.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Callable, get_args

from chameleon_ext.control.keys import DEFAULT_HEARTBEAT_TIMEOUT, HEARTBEAT_ENV, RESTART_DELAY_ENV
from chameleon_ext.control.faults import FaultSpecError, parse_injects
from chameleon_ext.planning.perf_model import Profile, ProfileError
from megatron.elastic.config import (ConfigError, ElasticConfig, Executor, Redundancy,
                                     ShardRedundancy, Strategy, Timeouts)
from megatron.elastic.emulation import STORAGE_MIB_PER_S
from megatron.training.batch_ramp import BatchRamp
from chameleon_ext.plan.execution_plan import PlanError, stage_bounds
from megatron.training.config import (LOSS_SCALING, AttentionBackend, Backend, CheckpointConfig, DataConfig, JobConfig,
                                      DataloaderType, LoadBalancing, LoggingConfig,
                                      LRDecayStyle, ModelConfig, MoERouterDtype,
                                      MoEScoreFunction, Normalization,
                                      ParallelConfig, Placement, PositionEmbedding,
                                      RecomputeGranularity, RecomputeMethod, TimingLogOption,
                                      TrainingConfig, TransformerImpl, WDIncrStyle,
                                      WSDDecayStyle)
from megatron.training.tokenizer import TOKENIZER_TYPES


class ArgumentError(ConfigError):
    """A bad flag or flag combination; main() turns it into one line and exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        raise ArgumentError(message)


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Megatron-style GPT pretraining with in-process recovery.",
                allow_abbrev=False)

    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default: 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: the sequence length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=get_args(PositionEmbedding),
                   default="learned_absolute")
    g.add_argument("--normalization", choices=get_args(Normalization), default="LayerNorm")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--transformer-impl", choices=get_args(TransformerImpl), default=None,
                   help="default: transformer_engine where it is importable with CUDA, else local")
    g.add_argument("--swiglu", action="store_true",
                   help="a gated MLP with SiLU (default --ffn-hidden-size then: 2/3 of 4 x hidden, "
                        "rounded down to a multiple of 64, as Megatron-LM)")
    g.add_argument("--squared-relu", action="store_true",
                   help="relu(x)^2 in the MLP instead of GELU")
    g.add_argument("--quick-geglu", action="store_true",
                   help="a gated MLP with quick GELU (x * sigmoid(1.702 x))")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="key/value heads with --group-query-attention")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="projection size per head (default: hidden size / heads)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="the same as --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="RoPE positions divided by this factor (position interpolation)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x's scaling of the RoPE frequencies")
    g.add_argument("--rope-scaling-factor", type=float, default=None,
                   help="with --use-rope-scaling (default 8)")
    g.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                   help="rope (yarn is refused: it goes with multi-latent attention)")
    g.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding",
                   help="deprecated in Megatron-LM: with --position-embedding-type rope there is "
                        "no learned position embedding; refused with any other type")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise queries and keys per head")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--attention-backend", choices=get_args(AttentionBackend), default="auto",
                   help="megatron-core's attention implementation (flash and fused are "
                        "transformer-engine kernels, CUDA only)")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q x K^T by 1 / layer number (softmax in fp32)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="the same as --attention-backend flash")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="refused: only standard and grouped-query attention")
    g.add_argument("--window-size", default=None,
                   help="refused: no sliding-window attention in the local layers")
    # Flags of features refused above, each refused with its feature's reason (a user's
    # DeepSeek or gpt-oss recipe names them beside it)
    for flag, (takes_value, _) in _FEATURE_FLAGS.items():
        if takes_value:
            g.add_argument(flag, default=None, help="refused")
        else:
            g.add_argument(flag, action="store_true", help="refused")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted: every model here is megatron-core's")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights stored centred on 0, scaling by 1 + weight")

    g = p.add_argument_group(
        "fusions", "megatron-core's fused kernels are not used here (every fusion but "
        "--cross-entropy-loss-fusion is off), so each of these holds as given")
    for flag, what in (("masked-softmax", "scaling, masking and softmax"),
                       ("bias-gelu", "bias and GELU"), ("bias-swiglu", "bias and SwiGLU"),
                       ("bias-dropout", "bias, dropout and residual add"),
                       ("rope", "rotary embedding"),
                       ("gradient-accumulation", "weight-gradient accumulation")):
        g.add_argument(f"--no-{flag}-fusion", action="store_true",
                       help=f"unfused {what}")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="apex's persistent layer-norm kernel is not used")

    g = p.add_argument_group("moe", "mixture of experts (expert parallel 1)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (default: a dense MLP)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's hidden size (default: --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-load-balancing-type", choices=get_args(LoadBalancing),
                   default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (needed for top-1)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="only 1: experts are replicated like any layer")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="refused: a CUDA kernel")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"),
                   default=None, help="how tokens reach their experts (default allgather; flex "
                                      "is refused: it needs DeepEP)")
    g.add_argument("--moe-router-dtype", choices=get_args(MoERouterDtype), default=None,
                   help="the router's logits and probabilities in this precision")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="the router's z-loss (ST-MoE) at this weight")
    g.add_argument("--moe-router-score-function", choices=get_args(MoEScoreFunction),
                   default=None, help="the router's scores: softmax (the default) or sigmoid "
                                      "(DeepSeek-V3)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="the top-k scores times this factor")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing: the experts in this many groups")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="with --moe-router-num-groups: each token's experts from this many "
                        "groups")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert (an MLP of this size every token also passes)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="refused: the expert bias is updated outside the optimizer")
    g.add_argument("--moe-layer-freq", default="1",
                   help="only 1: every layer is an MoE layer")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="refused: a CUDA kernel")

    g = p.add_argument_group("activation recompute")
    g.add_argument("--recompute-activations", action="store_true",
                   help="the same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=get_args(RecomputeGranularity),
                   default=None, help="full: whole layers; selective: the attention core")
    g.add_argument("--recompute-method", choices=get_args(RecomputeMethod), default=None,
                   help="with full: uniform (groups of --recompute-num-layers) or block (the "
                        "first --recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="refused, as in Megatron-LM: use --recompute-activations")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data parallel size")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: the global batch starts at START and grows by "
                        "INCREMENT over SAMPLES samples up to --global-batch-size")
    g.add_argument("--train-iters", type=int, default=None, help="default 20")
    g.add_argument("--train-samples", type=int, default=None,
                   help="instead of --train-iters: samples to train on (iterations: rounded up)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--fp8-format", default=None, help="refused: fp8 needs transformer-engine "
                                                      "on Hopper GPUs")
    g.add_argument("--fp8-param-gather", action="store_true", help="refused: fp8")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit (saving a checkpoint with --save) after an iteration divisible by it")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="exit (saving a checkpoint with --save) once training has run this long")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: save a checkpoint at the next step boundary and exit 0 "
                        "(with --chameleon, a SIGTERM of one worker is its planned leave)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn off Python's automatic garbage collection; collect every "
                        "--manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="0: only at evaluations and checkpoints")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="1 or 2: release the CUDA caching allocator's unused blocks after each "
                        "step (nothing to release on CPU)")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations: every copy of every parameter and its optimizer "
                        "state must be bit-identical, else the job stops")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss is the mean over the global batch's tokens (default: the mean "
                        "of each micro-batch's token mean)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused vocab-parallel cross entropy (compiled by "
                        "torch.compile at its first call; its gradient comes back in bf16, "
                        "as the kernel returns it)")
    g.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default=None,
                   help="with --cross-entropy-loss-fusion: native (default) or te "
                        "(transformer-engine's, CUDA)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="torch's deterministic algorithms only (torch.use_deterministic_"
                        "algorithms)")
    g.add_argument("--rerun-mode", choices=("disabled", "validate_results", "report_stats"),
                   default=None,
                   help="only disabled: an iteration is never re-run to tell a transient fault "
                        "from a reproducible one (a non-finite loss stops the job, see "
                        "--no-check-for-nan-in-loss-and-grad)")
    g.add_argument("--use-legacy-models", action="store_true",
                   help="refused: megatron-core models only")
    for flag in ("--log-straggler", "--log-energy", "--record-memory-history", "--test-mode",
                 "--full-validation", "--ckpt-assume-constant-structure"):
        g.add_argument(flag, action="store_true", help="refused")
    g.add_argument("--profile", action="store_true",
                   help="with --use-pytorch-profiler: torch.profiler over iterations "
                        "--profile-step-start + 1 to --profile-step-end (nsys's capture range "
                        "is refused)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="each profiled rank's trace goes to <--tensorboard-dir>/../"
                        "torch_profile/rank-R.json.gz")
    g.add_argument("--profile-step-start", type=int, default=None,
                   help="with --profile (default 10)")
    g.add_argument("--profile-step-end", type=int, default=None,
                   help="with --profile (default 12)")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[],
                   help="global ranks to profile (default: every rank)")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="go on when the loss is not finite (default: stop with an error)")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="with --fp16: a static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="with --fp16: the dynamic scale's start (default 2^32)")
    g.add_argument("--min-loss-scale", type=float, default=None,
                   help="with --fp16: the dynamic scale's floor (default 1)")
    g.add_argument("--loss-scale-window", type=float, default=None,
                   help="with --fp16: steps without inf/nan before the scale grows (default "
                        "1000)")
    g.add_argument("--hysteresis", type=int, default=None,
                   help="with --fp16: inf/nan steps tolerated before the scale shrinks "
                        "(default 2)")

    g = p.add_argument_group("learning rate and optimizer")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="adam (sgd is refused: a recovery carries Adam's moments)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=get_args(LRDecayStyle), default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay span (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples (default: --train-samples)")
    g.add_argument("--lr-wsd-decay-style", choices=get_args(WSDDecayStyle), default=None,
                   help="with --lr-decay-style WSD: the annealing phase's shape (default "
                        "exponential)")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="with --lr-decay-style WSD: iterations of the annealing phase, the last "
                        "of the decay span")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="with --lr-decay-style WSD and --train-samples: its samples")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="with --weight-decay-incr-style linear|cosine: the first weight decay")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="with --weight-decay-incr-style linear|cosine: the last")
    g.add_argument("--weight-decay-incr-style", choices=get_args(WDIncrStyle),
                   default="constant",
                   help="how the weight decay goes from start to end over the training span "
                        "(constant: --weight-decay throughout)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true", dest="override_opt_param_scheduler",
                   help="a loaded checkpoint's LR and weight-decay schedule settings give way "
                        "to the flags")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-"
                   "scheduler", action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="a loaded checkpoint's schedule settings replace the flags' (default: "
                        "they must be equal)")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="the learning rate of the word embeddings and the output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="with --decoupled-lr: their minimum (default --min-lr)")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="refused: the optimizer keeps fp32 main gradients and moments")
    for flag in ("--main-grads-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        g.add_argument(flag, choices=("fp32", "bf16", "fp16", "fp8"), default="fp32",
                       help="only fp32")

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", choices=get_args(Backend), default=None,
                   help="default: nccl with CUDA, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long the job's start (its rendezvous, building the datasets) may "
                        "wait for the slowest rank")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="only 1: context parallelism is not supported")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="an interleaved pipeline: each rank holds model chunks of this many "
                        "layers (Megatron-LM's interleaved 1F1B; not with --chameleon yet)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="an interleaved pipeline of this many model chunks per rank")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over each stage's replicas (megatron-core's "
                        "DistributedOptimizer); not with --chameleon yet")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="with --use-distributed-optimizer: shard over this many parts of each "
                        "replica group, which all-reduce their shards")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each DDP bucket's gradients as soon as its backward is done")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: gather the stepped parameters "
                        "during the next forward")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split the sequence over the tensor-parallel ranks where the model is "
                        "not split (norms, dropout, the activations between stages); off at "
                        "--tensor-model-parallel-size 1, as in Megatron-LM")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (with --bf16; default fp32)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32: the default here; "
                        "--grad-reduce-in-bf16 overrides it, as in Megatron-LM")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (the stages between the first and "
                        "last split the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer of the first stage in the even split")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as a layer of the last stage")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="refused: --use-distributed-optimizer shards the optimizer state")
    g.add_argument("--use-nccl-ub", action="store_true",
                   help="refused: NCCL user-buffer registration is not supported")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per DDP gradient bucket (megatron-core's default: one "
                        "bucket, or 40M with --use-distributed-optimizer)")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="refused: gradients are summed over replicas, each loss already scaled "
                        "by the global batch")
    g.add_argument("--use-torch-fsdp2", action="store_true", help="refused")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="refused: transformer-engine's userbuffers (CUDA)")
    g.add_argument("--defer-embedding-wgrad-compute", action="store_true", help="refused")
    g.add_argument("--delay-wgrad-compute", action="store_true",
                   help="refused: the schedule splits backwards itself where it pays "
                        "(--chameleon's rerouted schedules)")

    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a dataset prefix, or weight prefix pairs to blend")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart after each end-of-document token")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="no attention across end-of-document tokens")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1,
                   help="threads megatron-core's dataset builder builds the datasets with")
    g.add_argument("--num-workers", type=int, default=2,
                   help="threads that read each micro-batch's samples")
    g.add_argument("--no-mmap-bin-files", action="store_true",
                   help="read the .bin files instead of mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true",
                   help="accepted: the causal mask is implied (a mask is built only for "
                        "--reset-attention-mask, which this flag excludes)")
    g.add_argument("--tiktoken-pattern", default=None, help="refused: no TikTokenizer here")
    g.add_argument("--dataloader-type", choices=get_args(DataloaderType), default="single",
                   help="single: the dataset's order once; cyclic: a new seeded shuffle of it "
                        "each pass")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist",
                   help="torch.distributed.checkpoint files with layout-independent keys (they "
                        "load under another parallel layout)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load the parameters only; the optimizer starts fresh")
    g.add_argument("--no-load-rng", action="store_true",
                   help="accepted: no RNG state is saved, every random draw is derived from "
                        "--seed and the iteration")
    g.add_argument("--finetune", action="store_true",
                   help="load the parameters only and start at iteration 0")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape from the --load checkpoint")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep only the latest checkpoint and those of iterations divisible by "
                        "this (a multiple of --save-interval)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="refused: every checkpoint is a persistent one")
    g.add_argument("--async-save", action="store_true",
                   help="refused: saves are synchronous (a recovery needs a complete one)")

    g = p.add_argument_group("logging and validation")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate the loaded model (--load) on the validation "
                        "split once and exit")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=None,
                   help="iterations between tensorboard writes (default 1)")
    g.add_argument("--tensorboard-queue-size", type=int, default=None,
                   help="events the tensorboard writer queues before it flushes (default 1000)")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="the training world's size (it changes as ranks are lost and rejoin)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="CUDA's allocator statistics (needs CUDA)")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0)
    g.add_argument("--timing-log-option", choices=get_args(TimingLogOption), default="minmax",
                   help="each timer's max over ranks, min and max, or every rank's")
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--log-throughput", action="store_true",
                   help="model TFLOP/s per GPU in each iteration line")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-params-norm", action="store_true",
                   help="the norm of the stepped parameters in each iteration line (an "
                        "all-reduce at the iteration's boundary)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="the gradient's zero entries (each parameter once) in each iteration "
                        "line")
    g.add_argument("--wandb-project", default=None,
                   help="refused: wandb is not installed; use --tensorboard-dir")
    g.add_argument("--wandb-exp-name", default=None, help="refused with --wandb-project")
    g.add_argument("--wandb-save-dir", default=None, help="refused with --wandb-project")

    g = p.add_argument_group("chameleon", "fault-tolerance and execution-plan options")
    g.add_argument("--chameleon", action="store_true",
                   help="turn on in-process recovery from lost ranks")
    g.add_argument("--chameleon-metrics-file", default=None,
                   help="JSON-lines events (iteration, failure, recovery)")
    g.add_argument("--chameleon-plan", default=None,
                   help="run this execution plan (JSON) instead of the homogeneous one")
    g.add_argument("--chameleon-placement", choices=get_args(Placement), default=None,
                   help="which rank takes which place under chameleon-launch: spread (each "
                        "stage's replicas on different nodes; default with --chameleon) or "
                        "megatron (Megatron's rank order)")
    g.add_argument("--chameleon-strategy",
                   choices=get_args(Strategy), default="auto",
                   help="recovery strategy (with --chameleon): auto (the candidate the "
                        "performance model, calibrated from this job's timers, predicts "
                        "cheapest over the horizon), reroute (ReCycle-style data rerouting; "
                        "restart where it cannot absorb a failure), takeover (Bamboo-style: a "
                        "neighbour stage of the failed pipeline takes over its layers, their state "
                        "fetched from a replica), reparallelize (Oobleck-style: pipelines of "
                        "different depths over every survivor, the batch split by their speed), "
                        "reroute+restart (reroute, then at the next "
                        "--save-interval checkpoint restart from it onto the re-planned layout), "
                        "restart (reload the latest "
                        "checkpoint of --save, else --load, onto a plan over the survivors; from "
                        "the initial weights when there is none) or substitute (spares, the "
                        "healthy ranks an earlier plan left out, take the lost places; restart "
                        "where too few wait). Under every forced strategy spares take the lost "
                        "places first where they can; auto weighs substitute with the others")
    g.add_argument("--chameleon-mtbf", type=float, default=None, metavar="HOURS",
                   help="mean time between failures, for the planner's horizon (default: the "
                        "failure rate observed in this job, else the iterations left)")
    g.add_argument("--chameleon-repair-minutes", type=float, default=None, metavar="MINUTES",
                   help="how long a lost GPU's slot takes to come back (a repair or a "
                        "replacement), for the planner's window: the next event is a failure "
                        "or a repair, whichever comes first (default: measured from this "
                        "job's rejoins; before the first, chameleon-launch's --restart-delay "
                        "where it restarts lost workers)")
    g.add_argument("--chameleon-profile", default=None, metavar="PATH",
                   help="performance-model profile (JSON, e.g. from tools/profile_model.py) to "
                        "plan with until this job's own timers have calibrated one")
    g.add_argument("--chameleon-emulate", default=None, metavar="PROFILE.json",
                   help="emulate a dedicated device of this performance-model profile per rank "
                        "(e.g. chameleon_ext.planning.perf_model.analytical_profile(shape, 'H200') saved "
                        "with Profile.save): each op still computes this job's model, then "
                        "sleeps until the profile's time for it (a layer of this job costs a "
                        "layer of the profile's shape) times --chameleon-emulate-dilation; "
                        "messages, gradient all-reduces, state transfers and checkpoints take "
                        "the profile's link and storage times. The planner plans with it")
    g.add_argument("--chameleon-emulate-storage", type=float, default=STORAGE_MIB_PER_S,
                   metavar="MIB_PER_S",
                   help="bandwidth of the storage an emulated rank saves its checkpoint part to "
                        "and loads it from, MiB/s (default %(default)g: a node's share of a "
                        "parallel file system; a compressed failure trace scales it with its "
                        "time)")
    g.add_argument("--chameleon-emulate-dilation", type=float, default=1.0, metavar="X",
                   help="how many times slower than the profile's device the emulated ranks "
                        "run: large enough that every op's real computation fits in its "
                        "emulated time while the other ranks share the cores (the run reports "
                        "its overruns, and is invalid above 1%%); start from (ranks / cores) x "
                        "the real op time / the profile's op time and raise it until the "
                        "overrun share is at most 1%%")
    g.add_argument("--chameleon-redundancy", choices=get_args(Redundancy), default="none",
                   help="eager: every stage's parameters and optimizer state are also held by an "
                        "adjacent stage (refreshed every iteration), so a takeover moves no state")
    g.add_argument("--chameleon-shard-redundancy", choices=get_args(ShardRedundancy),
                   default="none",
                   help="buddy: with --use-distributed-optimizer, each rank also keeps the shard "
                        "of the rank before it in its replica group, stepped in lockstep from the "
                        "gradient it sends before each step's commit, so that a lost rank's shard "
                        "survives with one instance")
    g.add_argument("--chameleon-inject", action="append", default=[], metavar="SPEC",
                   help="inject a failure, e.g. kill:rank=3,iter=5,phase=backward; several: "
                        "repeat the flag or separate specs with ';' (kinds kill, exit, hang, "
                        "slow; phases forward, backward, grad-reduce, optimizer, commit, "
                        "between-iterations, checkpoint, eval, shutdown, recovery, rebuild, "
                        "transfer)")
    default = Timeouts()
    g.add_argument("--chameleon-comm-timeout", type=float, default=default.comm_s,
                   metavar="SECONDS",
                   help="how long a training collective or point-to-point may wait before it is "
                        "taken as a failure (with --chameleon; default %(default)g); a false "
                        "alarm costs one re-run iteration. At most --chameleon-agree-timeout")
    g.add_argument("--chameleon-progress-timeout", type=float, default=None, metavar="SECONDS",
                   help="a rank whose progress (iteration, op) stalls this long while its peers "
                        "wait is reported hung and killed by its agent, even with a live "
                        "heartbeat (default: 10 x the median iteration time, at least the "
                        "launcher's --heartbeat-timeout). At least --heartbeat-timeout, below "
                        "--chameleon-agree-timeout")
    g.add_argument("--chameleon-save-timeout", type=float, default=default.save_s,
                   metavar="SECONDS",
                   help="how long a checkpoint save or load may wait for its slowest rank, and "
                        "go without progress, before a rank is taken as lost (default "
                        "%(default)g). At least --chameleon-comm-timeout")
    g.add_argument("--chameleon-agree-timeout", type=float, default=default.agree_s,
                   metavar="SECONDS",
                   help="how long each wait on the store of a recovery (the agreement on who "
                        "is alive, the leader's plan, the barrier before the new world) and a "
                        "step's commit vote may take (default %(default)g). Above "
                        "--heartbeat-timeout and --chameleon-progress-timeout")
    g.add_argument("--chameleon-rendezvous-timeout", type=float, default=default.rendezvous_s,
                   metavar="SECONDS",
                   help="how long a recovery's new world, and each of its process groups, may "
                        "take to connect its ranks; it gives up at once when one is reported "
                        "lost (default %(default)g)")
    g.add_argument("--chameleon-join-timeout", type=float, default=default.join_s,
                   metavar="SECONDS",
                   help="how long a restarted worker waits to be admitted into the running job "
                        "(default %(default)g)")
    g.add_argument("--chameleon-executor", choices=get_args(Executor), default="ir",
                   help="who runs each iteration: the schedule-IR executor, or megatron-core's own "
                        "pipeline schedule on the same model and data (homogeneous plans only; "
                        "for side-by-side checks)")
    return p


def parse_config(argv: list[str] | None = None, world_size: int | None = None) -> JobConfig:
    """The flags (sys.argv's by default) as the job's configuration; `world_size` defaults to
    the launcher's WORLD_SIZE. Raises ConfigError (an ArgumentError for a flag's problem)."""
    args = build_parser().parse_args(argv)
    validate(args, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    return job_config(args)


def job_config(args: argparse.Namespace) -> JobConfig:
    """The validated flags as a JobConfig: the one place a flag's name meets its field."""
    try:
        inject = tuple(parse_injects(args.chameleon_inject))
    except FaultSpecError as e:
        raise ArgumentError(f"--chameleon-inject: {e}") from None
    return JobConfig(
        model=ModelConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            position_embedding_type=args.position_embedding_type,
            normalization=args.normalization,
            tied_embeddings=not args.untie_embeddings_and_output_weights,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            init_method_std=args.init_method_std, transformer_impl=args.transformer_impl,
            bf16=args.bf16, fp16=args.fp16, swiglu=args.swiglu,
            cross_entropy_fusion=args.cross_entropy_fusion_impl
            if args.cross_entropy_loss_fusion else None,
            deterministic=args.deterministic_mode,
            squared_relu=args.squared_relu, quick_geglu=args.quick_geglu,
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            add_bias_linear=not args.disable_bias_linear, kv_channels=args.kv_channels,
            rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
            rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
            rotary_interpolation=args.rotary_seq_len_interpolation_factor,
            qk_layernorm=args.qk_layernorm, norm_epsilon=args.norm_epsilon,
            apply_layernorm_1p=args.apply_layernorm_1p,
            attention_backend=args.attention_backend,
            apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
            attention_softmax_in_fp32=args.attention_softmax_in_fp32,
            num_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_token_dispatcher=args.moe_token_dispatcher_type,
            moe_router_dtype=args.moe_router_dtype, moe_z_loss_coeff=args.moe_z_loss_coeff,
            moe_router_score_function=args.moe_router_score_function,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            recompute_granularity=args.recompute_granularity,
            recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers),
        parallel=ParallelConfig(
            world_size=args.world_size, tensor_parallel=args.tensor_model_parallel_size,
            sequence_parallel=args.sequence_parallel,
            pipeline_parallel=args.pipeline_model_parallel_size,
            data_parallel=args.data_parallel_size, backend=args.distributed_backend,
            distributed_timeout_s=60.0 * args.distributed_timeout_minutes,
            plan_file=args.chameleon_plan, placement=args.chameleon_placement,
            distributed_optimizer=args.use_distributed_optimizer,
            optimizer_instances=args.num_distributed_optimizer_instances,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers,
            ddp_bucket_size=args.ddp_bucket_size, virtual_stages=args.virtual_stages),
        training=TrainingConfig(
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            train_iters=args.train_iters, seed=args.seed, lr=args.lr, min_lr=args.min_lr,
            lr_decay_style=args.lr_decay_style, lr_warmup_iters=args.lr_warmup_iters,
            lr_warmup_fraction=args.lr_warmup_fraction,
            lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay,
            lr_wsd_decay_iters=args.lr_wsd_decay_iters,
            lr_wsd_decay_samples=args.lr_wsd_decay_samples,
            lr_wsd_decay_style=args.lr_wsd_decay_style,
            start_weight_decay=args.start_weight_decay, end_weight_decay=args.end_weight_decay,
            weight_decay_incr_style=args.weight_decay_incr_style,
            train_samples=args.train_samples,
            override_schedule=args.override_opt_param_scheduler,
            checkpoint_schedule=args.use_checkpoint_opt_param_scheduler,
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis,
            clip_grad=args.clip_grad, decoupled_lr=args.decoupled_lr,
            decoupled_min_lr=args.decoupled_min_lr,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
            ramp=args.ramp,
            lr_warmup_samples=args.lr_warmup_samples or None,
            lr_decay_samples=args.lr_decay_samples,
            exit_interval=args.exit_interval,
            exit_duration_s=(None if args.exit_duration_in_mins is None
                             else 60.0 * args.exit_duration_in_mins),
            exit_signal_handler=args.exit_signal_handler, manual_gc=args.manual_gc,
            manual_gc_interval=args.manual_gc_interval,
            empty_unused_memory_level=args.empty_unused_memory_level,
            grad_reduce_in_bf16=args.grad_reduce_in_bf16,
            check_for_nan=args.check_for_nan_in_loss_and_grad,
            per_token_loss=args.calculate_per_token_loss,
            check_replicas_interval=args.check_weight_hash_across_dp_replicas_interval,
            skip_train=args.skip_train),
        logging=LoggingConfig(
            log_interval=args.log_interval, timing_log_level=args.timing_log_level,
            tensorboard_dir=args.tensorboard_dir, progress_bar=not args.no_progress_bar,
            metrics_file=args.chameleon_metrics_file, log_throughput=args.log_throughput,
            log_timers_to_tensorboard=args.log_timers_to_tensorboard,
            log_num_zeros_in_grad=args.log_num_zeros_in_grad,
            log_params_norm=args.log_params_norm,
            timing_log_option=args.timing_log_option,
            tensorboard_log_interval=args.tensorboard_log_interval,
            tensorboard_queue_size=args.tensorboard_queue_size,
            log_loss_scale=args.log_loss_scale_to_tensorboard,
            log_validation_ppl=args.log_validation_ppl_to_tensorboard,
            log_world_size=args.log_world_size_to_tensorboard,
            log_memory=args.log_memory_to_tensorboard,
            profile=args.profile, profile_start=args.profile_step_start,
            profile_end=args.profile_step_end, profile_ranks=tuple(args.profile_ranks),
            profile_shapes=args.pytorch_profiler_collect_shapes,
            profile_stack=args.pytorch_profiler_collect_callstack),
        data=DataConfig(
            data_path=tuple(args.data_path or ()), split=args.split, mock_data=args.mock_data,
            cache_path=args.data_cache_path, tokenizer_type=args.tokenizer_type,
            vocab_file=args.vocab_file, merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
            eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask, num_workers=args.num_workers,
            mmap_bin_files=not args.no_mmap_bin_files,
            dataloader_type=args.dataloader_type,
            builder_threads=args.num_dataset_builder_threads),
        checkpoint=CheckpointConfig(save=args.save, load=args.load,
                                    save_interval=args.save_interval,
                                    load_optim=not (args.no_load_optim or args.finetune),
                                    finetune=args.finetune,
                                    retain_interval=args.save_retain_interval),
        elastic=ElasticConfig(
            enabled=args.chameleon, strategy=args.chameleon_strategy,
            redundancy=args.chameleon_redundancy, mtbf_hours=args.chameleon_mtbf,
            shard_redundancy=args.chameleon_shard_redundancy,
            repair_minutes=args.chameleon_repair_minutes,
            # chameleon-launch's --restart-delay, handed to its workers in the environment
            restart_delay_s=float(os.environ[RESTART_DELAY_ENV])
            if os.environ.get(RESTART_DELAY_ENV) else None,
            profile=args.chameleon_profile, emulate=args.chameleon_emulate,
            emulate_storage_mib_per_s=args.chameleon_emulate_storage,
            emulate_dilation=args.chameleon_emulate_dilation, inject=inject,
            executor=args.chameleon_executor,
            timeouts=Timeouts(
                # the launcher's --heartbeat-timeout, handed to its workers in the environment
                heartbeat_s=float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_TIMEOUT)),
                comm_s=args.chameleon_comm_timeout,
                progress_s=args.chameleon_progress_timeout,
                save_s=args.chameleon_save_timeout, agree_s=args.chameleon_agree_timeout,
                rendezvous_s=args.chameleon_rendezvous_timeout,
                join_s=args.chameleon_join_timeout)))


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived defaults and reject what cannot run, with a message naming the flag."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ArgumentError(msg)

    _refuse_unsupported(args)
    if args.use_checkpoint_args:
        _apply_checkpoint_args(args)
    _train_span(args)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "log_interval", "num_query_groups",
                 "rotary_base"):
        need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    args.world_size = world_size
    args.sequence_parallel = args.sequence_parallel and tp > 1
    need(not args.sequence_parallel or args.seq_length % tp == 0,
         f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
         f"--tensor-model-parallel-size {tp}")
    _virtual_stages(args)
    if args.chameleon_plan is None:
        need(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp}")
        _pipeline_split(args)
        args.data_parallel_size = world_size // (tp * pp)
    else:
        need(args.decoder_first_pipeline_num_layers is None
             and args.decoder_last_pipeline_num_layers is None
             and not args.account_for_embedding_in_pipeline_split
             and not args.account_for_loss_in_pipeline_split,
             "--decoder-first/last-pipeline-num-layers and --account-for-* go with the "
             "homogeneous plan: --chameleon-plan sets its own stages")
        need(Path(args.chameleon_plan).is_file(), f"--chameleon-plan {args.chameleon_plan}: no such file")
        args.data_parallel_size = None
        need(args.chameleon_executor == "ir",
             "--chameleon-executor megatron-core runs only the homogeneous plan, not --chameleon-plan")
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * (dp or 1)
    if dp is not None:
        need(args.global_batch_size % (args.micro_batch_size * dp) == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data parallel size {dp}")
        per_pipeline = args.global_batch_size // (args.micro_batch_size * dp)
        need(args.virtual_stages == 1 or per_pipeline % pp == 0,
             f"an interleaved pipeline of {pp} stages runs a multiple of {pp} micro-batches: "
             f"--global-batch-size {args.global_batch_size} gives each of the {dp} pipeline(s) "
             f"{per_pipeline}")
    args.ramp = None
    if args.rampup_batch_size is not None:
        args.ramp = BatchRamp(*args.rampup_batch_size, final=args.global_batch_size)
        problem = args.ramp.problem(args.micro_batch_size * dp)
        need(problem is None, problem or "")
        args.train_iters = len(args.ramp.first_samples(args.train_samples))
    if args.kv_channels is None:
        need(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
             f"{args.num_attention_heads} (or give --kv-channels)")
    else:
        need(args.kv_channels >= 1, "--kv-channels must be at least 1")
    need(args.num_attention_heads % tp == 0,
         f"--num-attention-heads {args.num_attention_heads} is not divisible by "
         f"--tensor-model-parallel-size {tp}")
    if args.group_query_attention:
        groups = args.num_query_groups
        need(args.num_attention_heads % groups == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--num-query-groups {groups}")
        need(groups % tp == 0, f"--num-query-groups {groups} is not divisible by "
                               f"--tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size is None:
        # Megatron-LM's SwiGLU default keeps the MLP's parameters near a 4h GELU MLP's
        args.ffn_hidden_size = (int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
        need(args.ffn_hidden_size >= 1, f"--swiglu's default --ffn-hidden-size is 0 at "
                                        f"--hidden-size {args.hidden_size}: give one")
    for flag, size in (("--ffn-hidden-size", args.ffn_hidden_size),
                       ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size),
                       ("--moe-shared-expert-intermediate-size",
                        args.moe_shared_expert_intermediate_size)):
        need(size is None or size >= 1, f"{flag} must be at least 1")
        need(size is None or size % tp == 0,
             f"{flag} {size} is not divisible by --tensor-model-parallel-size {tp}")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    activations = [f for f, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                   ("--quick-geglu", args.quick_geglu)) if on]
    need(len(activations) <= 1, f"{' and '.join(activations)} exclude each other")
    rope = args.position_embedding_type == "rope"
    # Megatron-LM: the flag is deprecated, and means nothing more than rope's own lack of one
    need(args.add_position_embedding or rope,
         "--no-position-embedding is deprecated (as in Megatron-LM): use "
         "--position-embedding-type rope")
    need(not args.use_rope_scaling or rope, "--use-rope-scaling needs --position-embedding-type rope")
    if args.rope_scaling_factor is None:
        args.rope_scaling_factor = 8.0           # Megatron-LM's default
    else:
        need(args.use_rope_scaling, "--rope-scaling-factor needs --use-rope-scaling")
        need(args.rope_scaling_factor > 0, "--rope-scaling-factor must be positive")
    need(args.rope_type is None or rope, "--rope-type needs --position-embedding-type rope")
    need(args.rotary_seq_len_interpolation_factor is None
         or (rope and args.rotary_seq_len_interpolation_factor >= 1),
         "--rotary-seq-len-interpolation-factor needs --position-embedding-type rope and a "
         "factor of at least 1")
    need(args.moe_z_loss_coeff is None or args.moe_z_loss_coeff >= 0,
         "--moe-z-loss-coeff must be non-negative")
    need(0.0 < args.rotary_percent <= 1.0, "--rotary-percent must be in (0, 1]")
    need(args.norm_epsilon > 0, "--norm-epsilon must be positive")
    if args.num_experts is not None:
        need(args.num_experts >= 1, "--num-experts must be at least 1")
        need(1 <= args.moe_router_topk <= args.num_experts,
             f"--moe-router-topk {args.moe_router_topk} must be in 1..--num-experts "
             f"{args.num_experts}")
        need(args.moe_aux_loss_coeff >= 0, "--moe-aux-loss-coeff must be non-negative")
        # megatron-core 0.16.1's SequentialMLP adds an expert's bias in place to a view that
        # autograd refuses to modify; MoE recipes (Mixtral, DeepSeek) have no biases anyway
        # megatron-core's token dispatcher gathers tokens over the TP group, which holds
        # each token once only with sequence parallelism (Megatron-LM asserts the same)
        need(tp == 1 or args.sequence_parallel,
             "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel")
        need(args.disable_bias_linear,
             "--num-experts needs --disable-bias-linear (megatron-core's experts fail with "
             "biases without the grouped GEMM)")
    else:
        for flag in ("--moe-shared-expert-intermediate-size", "--moe-router-num-groups",
                     "--moe-router-group-topk", "--moe-router-topk-scaling-factor",
                     "--moe-token-dispatcher-type", "--moe-router-dtype", "--moe-z-loss-coeff",
                     "--moe-router-score-function"):
            need(getattr(args, flag[2:].replace("-", "_")) is None, f"{flag} needs --num-experts")
    need(args.moe_router_group_topk is None or args.moe_router_num_groups is not None,
         "--moe-router-group-topk needs --moe-router-num-groups")
    args.moe_token_dispatcher_type = args.moe_token_dispatcher_type or "allgather"
    args.moe_router_score_function = args.moe_router_score_function or "softmax"
    if args.recompute_activations:
        need(args.recompute_granularity in (None, "selective"),
             "--recompute-activations is --recompute-granularity selective")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        need(args.recompute_method is not None,
             "--recompute-granularity full needs --recompute-method uniform|block")
        need(args.recompute_num_layers is not None and args.recompute_num_layers >= 1,
             "--recompute-granularity full needs --recompute-num-layers N >= 1")
    else:
        need(args.recompute_method is None and args.recompute_num_layers is None,
             "--recompute-method and --recompute-num-layers go with --recompute-granularity full")
    # The padded vocabulary does not grow with TP (training._pad_vocab), so its multiple must
    # split evenly over the tensor-parallel ranks.
    need(args.make_vocab_size_divisible_by >= 1 and args.make_vocab_size_divisible_by % tp == 0,
         f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} is not divisible "
         f"by --tensor-model-parallel-size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    need(args.seq_length <= args.max_position_embeddings,
         f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
         f"{args.max_position_embeddings}")
    need(0.0 <= args.hidden_dropout < 1.0 and 0.0 <= args.attention_dropout < 1.0,
         "dropout probabilities must be in [0, 1)")
    need(args.lr >= args.min_lr >= 0.0, "--lr must be >= --min-lr >= 0")
    if args.decoupled_lr is None:
        need(args.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr")
    else:
        floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        need(args.decoupled_lr >= floor >= 0.0,
             "--decoupled-lr must be >= --decoupled-min-lr (default --min-lr) >= 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        need(0.0 <= args.lr_warmup_fraction <= 1.0, "--lr-warmup-fraction must be in [0, 1]")
        need(args.lr_warmup_iters == 0 and args.lr_warmup_samples == 0,
             "--lr-warmup-fraction excludes --lr-warmup-iters and --lr-warmup-samples")
    # megatron-core's scheduler needs the warm-up to end before the decay does
    need(args.lr_warmup_iters < args.lr_decay_iters or args.lr_warmup_iters == 0,
         f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters "
         f"{args.lr_decay_iters}")
    if args.lr_decay_samples is not None:
        need(args.lr_warmup_samples < args.lr_decay_samples or args.lr_warmup_samples == 0,
             f"--lr-warmup-samples {args.lr_warmup_samples} must be below --lr-decay-samples "
             f"{args.lr_decay_samples}")
    _schedule(args)
    _tensorboard(args)
    for name in ("exit_interval", "exit_duration_in_mins"):
        value = getattr(args, name)
        need(value is None or value > 0, f"--{name.replace('_', '-')} must be positive")
    need(args.manual_gc_interval >= 0, "--manual-gc-interval must be non-negative")
    need(args.check_weight_hash_across_dp_replicas_interval is None
         or args.check_weight_hash_across_dp_replicas_interval >= 1,
         "--check-weight-hash-across-dp-replicas-interval must be at least 1")
    profiler_flags = {"--use-pytorch-profiler": args.use_pytorch_profiler,
                      "--profile-step-start": args.profile_step_start is not None,
                      "--profile-step-end": args.profile_step_end is not None,
                      "--profile-ranks": bool(args.profile_ranks),
                      "--pytorch-profiler-collect-shapes": args.pytorch_profiler_collect_shapes,
                      "--pytorch-profiler-collect-callstack":
                          args.pytorch_profiler_collect_callstack}
    for flag, given in profiler_flags.items():
        need(args.profile or not given, f"{flag} goes with --profile")
    if args.profile_step_start is None:
        args.profile_step_start = 10             # Megatron-LM's defaults
    if args.profile_step_end is None:
        args.profile_step_end = 12
    if args.profile:
        need(0 <= args.profile_step_start < args.profile_step_end,
             "--profile needs 0 <= --profile-step-start < --profile-step-end")
        need(args.tensorboard_dir is not None,
             "--use-pytorch-profiler needs --tensorboard-dir: the traces go beside it "
             "(<dir>/../torch_profile)")
    need(args.num_workers >= 0, "--num-workers must be non-negative")
    need(args.num_dataset_builder_threads >= 1, "--num-dataset-builder-threads must be at least 1")
    need(not (args.no_create_attention_mask_in_dataloader and args.reset_attention_mask),
         "--reset-attention-mask needs the loader's attention mask "
         "(--no-create-attention-mask-in-dataloader refuses it)")
    need(not args.grad_reduce_in_bf16 or args.bf16, "--grad-reduce-in-bf16 needs --bf16")
    instances = args.num_distributed_optimizer_instances
    need(instances >= 1, "--num-distributed-optimizer-instances must be at least 1")
    need(instances == 1 or args.use_distributed_optimizer,
         "--num-distributed-optimizer-instances needs --use-distributed-optimizer")
    need(dp is None or dp % instances == 0,
         f"--num-distributed-optimizer-instances {instances} does not divide the data parallel "
         f"size {dp}")
    need(not args.overlap_param_gather or args.use_distributed_optimizer,
         "--overlap-param-gather needs --use-distributed-optimizer")
    need(args.chameleon_shard_redundancy == "none" or
         (args.use_distributed_optimizer and args.chameleon),
         "--chameleon-shard-redundancy buddy needs --use-distributed-optimizer and --chameleon")

    need(args.tokenizer_type in TOKENIZER_TYPES,
         f"unknown --tokenizer-type {args.tokenizer_type!r}; choose one of "
         f"{', '.join(TOKENIZER_TYPES)}")
    if args.mock_data:
        need(not args.data_path, "--mock-data and --data-path exclude each other")
    else:
        need(bool(args.data_path), "no training data: give --data-path PREFIX or --mock-data")
        prefixes = args.data_path if len(args.data_path) == 1 else args.data_path[1::2]
        if len(args.data_path) > 1:
            need(len(args.data_path) % 2 == 0,
                 "--data-path with several datasets takes weight prefix pairs")
            for w in args.data_path[0::2]:
                try:
                    float(w)
                except ValueError:
                    raise ArgumentError(f"--data-path weight {w!r} is not a number") from None
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                need(Path(prefix + ext).is_file(),
                     f"--data-path {prefix}: {prefix + ext} does not exist")

    need(not (args.chameleon_redundancy == "eager" and args.chameleon_executor != "ir"),
         "--chameleon-redundancy eager needs --chameleon-executor ir")
    need(args.recompute_granularity is None or args.chameleon_executor == "ir",
         "activation recompute needs --chameleon-executor ir: it reseeds dropout for the "
         "recomputed micro-batch")
    need(not (args.chameleon and args.chameleon_executor != "ir"),
         "--chameleon recovers only with --chameleon-executor ir")
    if args.chameleon_placement is None:
        args.chameleon_placement = "spread" if args.chameleon else "megatron"
    need(not (args.chameleon and args.fp16),
         "--chameleon does not take --fp16: its dynamic loss scaler is updated before the "
         "step's commit point, so a re-run step would update it twice (use --bf16)")
    need(args.chameleon_mtbf is None or args.chameleon_mtbf > 0,
         "--chameleon-mtbf must be positive (hours)")
    need(args.chameleon_repair_minutes is None or args.chameleon_repair_minutes > 0,
         "--chameleon-repair-minutes must be positive")
    if args.chameleon_profile is not None:
        need(Path(args.chameleon_profile).is_file(),
             f"--chameleon-profile {args.chameleon_profile}: no such file")

    need(args.chameleon_emulate_dilation > 0,
         f"--chameleon-emulate-dilation {args.chameleon_emulate_dilation:g} must be positive")
    need(args.chameleon_emulate_storage > 0,
         f"--chameleon-emulate-storage {args.chameleon_emulate_storage:g} must be positive")
    if args.chameleon_emulate is not None:
        need(args.chameleon_executor == "ir", "--chameleon-emulate needs --chameleon-executor ir")
        try:
            Profile.load(args.chameleon_emulate)
        except ProfileError as e:
            raise ArgumentError(f"--chameleon-emulate: {e}") from None

    if args.use_flash_attn:
        need(args.attention_backend in ("auto", "flash"),
             f"--use-flash-attn is --attention-backend flash, not {args.attention_backend}")
        args.attention_backend = "flash"
    cuda = _cuda_available()
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    need(args.distributed_backend == "gloo" or cuda, "--distributed-backend nccl needs CUDA")
    need(args.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")
    need(not (args.bf16 and args.fp16), "--bf16 and --fp16 exclude each other")
    need(cuda or not (args.bf16 or args.fp16),
         "--bf16/--fp16 need CUDA: megatron-core's mixed-precision optimizer is CUDA-only")
    te = cuda and importlib.util.find_spec("transformer_engine") is not None
    scaling = [f"--{name.replace('_', '-')}" for name in LOSS_SCALING
               if getattr(args, name) is not None]
    need(args.fp16 or not scaling, f"{', '.join(scaling)} go(es) with --fp16")
    need(all(getattr(args, name) is None or getattr(args, name) > 0 for name in LOSS_SCALING),
         "the loss-scaling settings must be positive")
    need(cuda or not args.log_memory_to_tensorboard,
         "--log-memory-to-tensorboard logs CUDA's allocator statistics: it needs CUDA")
    if args.cross_entropy_loss_fusion:
        args.cross_entropy_fusion_impl = args.cross_entropy_fusion_impl or "native"
        need(args.cross_entropy_fusion_impl == "native" or te,
             "--cross-entropy-fusion-impl te needs transformer-engine and CUDA")
    else:
        need(args.cross_entropy_fusion_impl is None,
             "--cross-entropy-fusion-impl goes with --cross-entropy-loss-fusion")
    need(args.ddp_bucket_size is None or args.ddp_bucket_size >= 1,
         "--ddp-bucket-size must be at least 1")
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te else "local"
    need(args.transformer_impl == "local" or te,
         "--transformer-impl transformer_engine needs transformer-engine and CUDA")
    need(args.attention_backend not in ("flash", "fused")
         or args.transformer_impl == "transformer_engine",
         f"--attention-backend {args.attention_backend} is a transformer-engine kernel: it needs "
         "--transformer-impl transformer_engine (and CUDA)")
    if args.save_interval is not None:
        need(args.save_interval >= 1, "--save-interval must be at least 1")
        need(args.save is not None, "--save-interval needs --save DIR")
    if args.save_retain_interval is not None:
        need(args.save_interval is not None and args.save_retain_interval >= 1
             and args.save_retain_interval % args.save_interval == 0,
             "--save-retain-interval must be a multiple of --save-interval")
    if args.eval_interval is not None:
        need(args.eval_interval >= 1 and args.eval_iters >= 1,
             "--eval-interval and --eval-iters must be at least 1")
    if args.skip_train:
        need(args.eval_iters >= 1, "--skip-train evaluates: --eval-iters must be at least 1")
        need(not args.chameleon, "--skip-train trains nothing: it takes no --chameleon")
    if args.load is not None:
        need(Path(args.load).is_dir() or not Path(args.load).exists(),
             f"--load {args.load} is not a directory")


# Megatron-LM flags this job cannot honour yet, each with the reason its line gives; checked
# before anything else so that no other complaint hides them.
_REFUSED: tuple[tuple[str, Callable[[argparse.Namespace], bool], str], ...] = (
    ("--rampup-batch-size", lambda a: a.rampup_batch_size is not None and a.chameleon,
     "not with --chameleon yet: a recovery's plan keeps one global batch"),
    ("--rampup-batch-size", lambda a: a.rampup_batch_size is not None and a.chameleon_plan,
     "not with --chameleon-plan: the ramp changes the homogeneous plan's micro-batches"),
    ("--context-parallel-size", lambda a: a.context_parallel_size != 1,
     "context parallelism is not supported (only 1)"),
    ("--expert-model-parallel-size", lambda a: a.expert_model_parallel_size != 1,
     "expert parallelism is not supported (only 1: experts are replicated like any layer)"),
    ("--num-layers-per-virtual-pipeline-stage",
     lambda a: a.num_layers_per_virtual_pipeline_stage is not None and a.chameleon,
     "not with --chameleon yet: a recovery plans stages, not a rank's model chunks"),
    ("--num-virtual-stages-per-pipeline-rank",
     lambda a: a.num_virtual_stages_per_pipeline_rank is not None and a.chameleon,
     "not with --chameleon yet: a recovery plans stages, not a rank's model chunks"),
    ("--bf16", lambda a: a.bf16 and a.use_distributed_optimizer and a.chameleon,
     "not with --use-distributed-optimizer and --chameleon yet: a recovery carries the "
     "optimizer's fp32 shards of fp32 parameters only, not the fp32 main copies of bf16 ones"),
    ("--use-distributed-optimizer",
     lambda a: a.use_distributed_optimizer and a.chameleon_redundancy == "eager",
     "not with --chameleon-redundancy eager yet: its shadow copies hold whole optimizer state"),
    ("--fp8-format", lambda a: a.fp8_format is not None,
     "fp8 needs transformer-engine on a Hopper GPU and is not supported yet"),
    ("--fp8-param-gather", lambda a: a.fp8_param_gather,
     "fp8 needs transformer-engine on a Hopper GPU and is not supported yet"),
    ("--checkpoint-activations", lambda a: a.checkpoint_activations,
     "no longer valid (as in Megatron-LM): use --recompute-activations, or "
     "--recompute-granularity and --recompute-method"),
    ("--multi-latent-attention", lambda a: a.multi_latent_attention,
     "multi-latent attention is not supported: the stage model and the performance model "
     "know standard and grouped-query attention, and megatron-core 0.16.1 builds it only on "
     "transformer-engine's attention (its local DotProductAttention takes no k_channels)"),
    ("--rope-type", lambda a: a.rope_type == "yarn",
     "yarn goes with multi-latent attention, which is not supported"),
    ("--window-size", lambda a: a.window_size is not None,
     "sliding-window attention is not supported: megatron-core's local attention has none"),
    ("--moe-layer-freq", lambda a: a.moe_layer_freq.strip() != "1",
     "only 1: every layer is an MoE layer (the performance model costs one kind of layer)"),
    ("--moe-token-dispatcher-type", lambda a: a.moe_token_dispatcher_type == "flex",
     "flex needs DeepEP (CUDA); use allgather or alltoall"),
    ("--moe-router-enable-expert-bias", lambda a: a.moe_router_enable_expert_bias,
     "the expert bias is updated from each step's token counts by megatron-core's "
     "finalize_model_grads, which this executor does not run (it reduces gradients itself)"),
    ("--moe-permute-fusion", lambda a: a.moe_permute_fusion,
     "the fused permutation is a CUDA kernel; tokens are permuted unfused"),
    ("--optimizer", lambda a: a.optimizer != "adam",
     "only adam: a recovery and a checkpoint carry Adam's moments"),
    ("--use-megatron-fsdp", lambda a: a.use_megatron_fsdp,
     "Megatron FSDP is not supported: --use-distributed-optimizer shards the optimizer state"),
    ("--use-nccl-ub", lambda a: a.use_nccl_ub,
     "NCCL user-buffer registration is not supported"),
    ("--moe-grouped-gemm", lambda a: a.moe_grouped_gemm,
     "grouped GEMM is a CUDA kernel; experts run as separate MLPs"),
    ("--non-persistent-save-interval", lambda a: a.non_persistent_save_interval is not None,
     "every checkpoint is written whole to --save (no local or in-memory ones)"),
    ("--async-save", lambda a: a.async_save,
     "saves are synchronous: a recovery or restart needs a complete checkpoint"),
    ("--log-straggler", lambda a: a.log_straggler,
     "the straggler detector needs CUDA's kernel timings; --chameleon's live calibration "
     "measures each rank's ops (a slowed rank gets less rerouted work)"),
    ("--log-energy", lambda a: a.log_energy, "needs NVML's GPU energy counters"),
    ("--record-memory-history", lambda a: a.record_memory_history,
     "CUDA's allocator history is not recorded"),
    ("--test-mode", lambda a: a.test_mode, "Megatron-LM's in-run tests are not here"),
    ("--full-validation", lambda a: a.full_validation,
     "each evaluation takes --eval-iters batches of the validation split"),
    ("--ckpt-assume-constant-structure", lambda a: a.ckpt_assume_constant_structure,
     "each save plans its files anew (a recovery may change the layout between saves)"),
    ("--use-legacy-models", lambda a: a.use_legacy_models,
     "the legacy models are gone: megatron-core's GPTModel only"),
    ("--rerun-mode", lambda a: a.rerun_mode not in (None, "disabled"),
     "only disabled: no iteration is re-run to validate its result"),
    ("--use-precision-aware-optimizer", lambda a: a.use_precision_aware_optimizer,
     "the optimizer keeps fp32 main gradients and moments (a recovery and a checkpoint carry "
     "them as they are)"),
    ("--main-grads-dtype", lambda a: a.main_grads_dtype != "fp32",
     "only fp32 (without --use-precision-aware-optimizer)"),
    ("--exp-avg-dtype", lambda a: a.exp_avg_dtype != "fp32",
     "only fp32 (without --use-precision-aware-optimizer)"),
    ("--exp-avg-sq-dtype", lambda a: a.exp_avg_sq_dtype != "fp32",
     "only fp32 (without --use-precision-aware-optimizer)"),
    ("--ddp-average-in-collective", lambda a: a.ddp_average_in_collective,
     "gradients are summed over the replicas, each micro-batch's loss already divided by "
     "the global batch, so that the update is the same under every plan"),
    ("--use-torch-fsdp2", lambda a: a.use_torch_fsdp2,
     "FSDP is not supported: --use-distributed-optimizer shards the optimizer state"),
    ("--tp-comm-overlap", lambda a: a.tp_comm_overlap,
     "transformer-engine's userbuffers overlap is not supported"),
    ("--defer-embedding-wgrad-compute", lambda a: a.defer_embedding_wgrad_compute,
     "needs --tp-comm-overlap and the gradient-accumulation fusion, neither supported"),
    ("--delay-wgrad-compute", lambda a: a.delay_wgrad_compute,
     "transformer-engine's delayed weight gradients are not supported; the executor "
     "splits backwards itself where a rerouted schedule gains from it"),
    ("--profile", lambda a: a.profile and not a.use_pytorch_profiler,
     "only with --use-pytorch-profiler: nsys's capture range (cudaProfilerStart) is not wired"),
    ("--tiktoken-pattern", lambda a: a.tiktoken_pattern is not None,
     "there is no TikTokenizer here"),
    ("--wandb-project", lambda a: any(v is not None for v in (
        a.wandb_project, a.wandb_exp_name, a.wandb_save_dir)),
     "wandb is not installed: the job logs to --tensorboard-dir"),
)


def _refuse_unsupported(args: argparse.Namespace) -> None:
    for flag, given, why in _REFUSED:
        if given(args):
            raise ArgumentError(f"{flag}: {why}")
    for flag, (_, why) in _FEATURE_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            raise ArgumentError(f"{flag}: {why}")


def _virtual_stages(args: argparse.Namespace) -> None:
    """Megatron-LM's interleaved pipeline: V model chunks per rank, from
    --num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage."""
    per_chunk, v = (args.num_layers_per_virtual_pipeline_stage,
                    args.num_virtual_stages_per_pipeline_rank)
    pp = args.pipeline_model_parallel_size
    args.virtual_stages = 1
    if per_chunk is None and v is None:
        return
    flag = ("--num-layers-per-virtual-pipeline-stage" if per_chunk is not None
            else "--num-virtual-stages-per-pipeline-rank")
    if per_chunk is not None and v is not None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage and "
                            "--num-virtual-stages-per-pipeline-rank exclude each other")
    if pp < 2:
        raise ArgumentError(f"{flag} needs --pipeline-model-parallel-size 2 or more")
    if per_chunk is not None:
        if per_chunk < 1 or args.num_layers % (pp * per_chunk):
            raise ArgumentError(f"{flag} {per_chunk}: --num-layers {args.num_layers} is not "
                                f"a multiple of {pp} stages x {per_chunk} layers")
        v = args.num_layers // (pp * per_chunk)
    elif v < 1 or args.num_layers % (pp * v):
        raise ArgumentError(f"{flag} {v}: --num-layers {args.num_layers} does not split into "
                            f"{pp} stages x {v} chunks")
    others = [f for f, on in (
        ("--chameleon-plan", args.chameleon_plan is not None),
        ("--chameleon-executor megatron-core", args.chameleon_executor != "ir"),
        ("--decoder-first/last-pipeline-num-layers",
         args.decoder_first_pipeline_num_layers is not None
         or args.decoder_last_pipeline_num_layers is not None),
        ("--account-for-embedding/loss-in-pipeline-split",
         args.account_for_embedding_in_pipeline_split
         or args.account_for_loss_in_pipeline_split),
        ("--rampup-batch-size", args.rampup_batch_size is not None)) if on]
    if others:
        raise ArgumentError(f"{flag} does not go with {', '.join(others)} yet")
    args.virtual_stages = v


# Megatron-LM flags of refused features: flag -> (whether it takes a value, why)
_MLA = "goes with multi-latent attention, which is not supported"
_FSDP = "goes with Megatron FSDP, which is not supported"
_FEATURE_FLAGS: dict[str, tuple[bool, str]] = {
    **{f: (True, _MLA) for f in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                                 "--qk-pos-emb-head-dim", "--v-head-dim",
                                 "--rotary-scaling-factor", "--mscale", "--mscale-all-dim")},
    **{f: (True, _FSDP) for f in ("--data-parallel-sharding-strategy",
                                  "--outer-dp-sharding-strategy",
                                  "--megatron-fsdp-main-params-dtype",
                                  "--megatron-fsdp-main-grads-dtype")},
    **{f: (False, _FSDP) for f in ("--fsdp-double-buffer", "--fsdp-manual-registration")},
    "--window-attn-skip-freq": (True, "goes with sliding-window attention, which is not "
                                      "supported"),
    "--per-split-data-args-path": (True, "give the data with --data-path and --split"),
    "--sft": (False, "supervised fine-tuning's chat data is not supported (--finetune loads "
                     "a checkpoint's parameters and goes on pretraining)"),
    "--enable-experimental": (False, "no experimental megatron-core feature is used here"),
}


def _pipeline_split(args: argparse.Namespace) -> None:
    """The homogeneous plan's stages: an even split, Megatron-LM's uneven first and last, or
    the even split with the embedding and the loss counted as layers (their stages then hold
    one transformer layer fewer), turned into first and last stage layers."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    pp = args.pipeline_model_parallel_size
    embedding, loss = (args.account_for_embedding_in_pipeline_split,
                       args.account_for_loss_in_pipeline_split)
    if embedding or loss:
        accounted = " and ".join(f for f, on in (
            ("--account-for-embedding-in-pipeline-split", embedding),
            ("--account-for-loss-in-pipeline-split", loss)) if on)
        if first is not None or last is not None:
            raise ArgumentError(f"{accounted} and --decoder-first/last-pipeline-num-layers "
                                "exclude each other")
        counted = args.num_layers + embedding + loss
        if pp < 2 or counted % pp or counted // pp < 2:
            raise ArgumentError(
                f"{accounted}: --num-layers {args.num_layers} plus the {embedding + loss} "
                f"counted as layers must split evenly over --pipeline-model-parallel-size {pp} "
                "(2 or more), at least 2 per stage: a stage here holds a transformer layer")
        per = counted // pp
        first = per - 1 if embedding else None
        last = per - 1 if loss else None
        args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = first, last
    try:
        stage_bounds(args.num_layers, pp, first, last)
    except PlanError as e:
        flags = ("--num-layers" if first is None and last is None else
                 "--decoder-first/last-pipeline-num-layers")
        raise ArgumentError(f"{flags}: {e}") from None


def _schedule(args: argparse.Namespace) -> None:
    """WSD's annealing phase in samples, the weight decay's start and end, and how a loaded
    checkpoint's schedule meets the flags', as Megatron-LM's scheduler takes them."""
    wsd = {"--lr-wsd-decay-iters": args.lr_wsd_decay_iters,
           "--lr-wsd-decay-samples": args.lr_wsd_decay_samples,
           "--lr-wsd-decay-style": args.lr_wsd_decay_style}
    if args.lr_decay_style != "WSD":
        given = [f for f, v in wsd.items() if v is not None]
        if given:
            raise ArgumentError(f"{', '.join(given)} go(es) with --lr-decay-style WSD")
    else:
        by_samples = args.train_samples is not None
        flag = "--lr-wsd-decay-samples" if by_samples else "--lr-wsd-decay-iters"
        other = "--lr-wsd-decay-iters" if by_samples else "--lr-wsd-decay-samples"
        if wsd[other] is not None:
            raise ArgumentError(f"{other} goes with "
                                f"{'--train-iters' if by_samples else '--train-samples'}; "
                                f"use {flag}")
        if wsd[flag] is None or wsd[flag] < 1:
            raise ArgumentError(f"--lr-decay-style WSD needs {flag} N >= 1 (its annealing "
                                "phase)")
        if wsd[flag] > (args.lr_decay_samples if by_samples else args.lr_decay_iters):
            raise ArgumentError(f"{flag}: the annealing phase is longer than the decay span")
    args.lr_wsd_decay_style = args.lr_wsd_decay_style or "exponential"
    start, end = args.start_weight_decay, args.end_weight_decay
    if args.weight_decay_incr_style == "constant":
        if start is not None or end is not None:
            raise ArgumentError("--start-weight-decay and --end-weight-decay go with "
                                "--weight-decay-incr-style linear|cosine (constant: "
                                "--weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif start is None or end is None or not 0.0 <= start <= end:
        raise ArgumentError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
                            "--start-weight-decay and --end-weight-decay, 0 <= start <= end")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and "
                            "--use-checkpoint-opt_param-scheduler exclude each other")


def _tensorboard(args: argparse.Namespace) -> None:
    """Flags that only change what goes to tensorboard need --tensorboard-dir."""
    given = [flag for flag, on in (
        ("--tensorboard-log-interval", args.tensorboard_log_interval is not None),
        ("--tensorboard-queue-size", args.tensorboard_queue_size is not None),
        ("--log-validation-ppl-to-tensorboard", args.log_validation_ppl_to_tensorboard),
        ("--log-world-size-to-tensorboard", args.log_world_size_to_tensorboard),
        ("--log-memory-to-tensorboard", args.log_memory_to_tensorboard)) if on]
    if given and args.tensorboard_dir is None:
        raise ArgumentError(f"{', '.join(given)} go(es) with --tensorboard-dir")
    for name, default in (("tensorboard_log_interval", 1), ("tensorboard_queue_size", 1000)):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be at least 1")
        setattr(args, name, default if value is None else value)


def _train_span(args: argparse.Namespace) -> None:
    """--train-iters or --train-samples (then the LR span in samples too), as Megatron-LM."""
    if args.train_samples is None:
        if args.train_iters is None:
            args.train_iters = 20
        if args.rampup_batch_size is not None:
            raise ArgumentError("--rampup-batch-size needs --train-samples (as in Megatron-LM: "
                                "no batch-size ramp-up for iteration-based training)")
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            raise ArgumentError("--lr-decay-samples and --lr-warmup-samples go with "
                                "--train-samples; with --train-iters use --lr-decay-iters and "
                                "--lr-warmup-iters")
        return
    if args.train_iters is not None:
        raise ArgumentError("--train-iters and --train-samples exclude each other")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        raise ArgumentError("--lr-decay-iters and --lr-warmup-iters go with --train-iters; with "
                            "--train-samples use --lr-decay-samples and --lr-warmup-samples")
    if args.train_samples < 1:
        raise ArgumentError("--train-samples must be at least 1")
    gbs = args.global_batch_size or args.micro_batch_size
    args.train_iters = -(-args.train_samples // gbs)     # the last batch completes the samples
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples


def _apply_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: the model's shape flags from the --load checkpoint's meta."""
    if args.load is None:
        raise ArgumentError("--use-checkpoint-args needs --load DIR")
    from megatron.training import checkpointing   # torch's import, only for this flag
    try:
        saved = checkpointing.model_args(args.load)
    except checkpointing.CheckpointError as e:
        raise ArgumentError(f"--use-checkpoint-args: {e}") from None
    if saved is None:
        raise ArgumentError(f"--use-checkpoint-args: no checkpoint under --load {args.load}")
    for name, value in saved.items():
        if name == "tied_embeddings":
            args.untie_embeddings_and_output_weights = not value
        elif name == "add_bias_linear":
            args.disable_bias_linear = not value
        elif name == "num_query_groups":
            args.group_query_attention = value is not None
            args.num_query_groups = value or 1
        else:
            setattr(args, name, value)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()

