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
from typing import get_args

from chameleon_ext.control.keys import DEFAULT_HEARTBEAT_TIMEOUT, HEARTBEAT_ENV
from chameleon_ext.control.faults import FaultSpecError, parse_injects
from chameleon_ext.planning.perf_model import Profile, ProfileError
from megatron.elastic.config import (ConfigError, ElasticConfig, Executor, Redundancy, Strategy,
                                     Timeouts)
from megatron.elastic.emulation import STORAGE_MIB_PER_S
from megatron.training.config import (Backend, CheckpointConfig, DataConfig, JobConfig,
                                      LoggingConfig, LRDecayStyle, ModelConfig, Normalization,
                                      ParallelConfig, Placement, PositionEmbedding,
                                      TrainingConfig, TransformerImpl)
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

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data parallel size")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")

    g = p.add_argument_group("learning rate and optimizer")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=get_args(LRDecayStyle), default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", choices=get_args(Backend), default=None,
                   help="default: nccl with CUDA, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long the job's start (its rendezvous, building the datasets) may "
                        "wait for the slowest rank")

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

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)

    g = p.add_argument_group("logging and validation")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0)
    g.add_argument("--no-progress-bar", action="store_true")

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
                        "--save-interval checkpoint restart from it onto the re-planned layout) "
                        "or restart (reload the latest "
                        "checkpoint of --save, else --load, onto a plan over the survivors; from "
                        "the initial weights when there is none)")
    g.add_argument("--chameleon-mtbf", type=float, default=None, metavar="HOURS",
                   help="mean time between failures, for the planner's horizon (default: the "
                        "failure rate observed in this job, else the iterations left)")
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
            bf16=args.bf16, fp16=args.fp16),
        parallel=ParallelConfig(
            world_size=args.world_size, tensor_parallel=args.tensor_model_parallel_size,
            pipeline_parallel=args.pipeline_model_parallel_size,
            data_parallel=args.data_parallel_size, backend=args.distributed_backend,
            distributed_timeout_s=60.0 * args.distributed_timeout_minutes,
            plan_file=args.chameleon_plan, placement=args.chameleon_placement),
        training=TrainingConfig(
            micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            train_iters=args.train_iters, seed=args.seed, lr=args.lr, min_lr=args.min_lr,
            lr_decay_style=args.lr_decay_style, lr_warmup_iters=args.lr_warmup_iters,
            lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay,
            clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps, eval_interval=args.eval_interval, eval_iters=args.eval_iters),
        logging=LoggingConfig(
            log_interval=args.log_interval, timing_log_level=args.timing_log_level,
            tensorboard_dir=args.tensorboard_dir, progress_bar=not args.no_progress_bar,
            metrics_file=args.chameleon_metrics_file),
        data=DataConfig(
            data_path=tuple(args.data_path or ()), split=args.split, mock_data=args.mock_data,
            cache_path=args.data_cache_path, tokenizer_type=args.tokenizer_type,
            vocab_file=args.vocab_file, merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size),
        checkpoint=CheckpointConfig(save=args.save, load=args.load,
                                    save_interval=args.save_interval),
        elastic=ElasticConfig(
            enabled=args.chameleon, strategy=args.chameleon_strategy,
            redundancy=args.chameleon_redundancy, mtbf_hours=args.chameleon_mtbf,
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

    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "log_interval"):
        need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    args.world_size = world_size
    if args.chameleon_plan is None:
        need(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp}")
        need(args.num_layers % pp == 0,
             f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
        args.data_parallel_size = world_size // (tp * pp)
    else:
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
    need(args.hidden_size % args.num_attention_heads == 0,
         f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
         f"{args.num_attention_heads}")
    need(args.num_attention_heads % tp == 0,
         f"--num-attention-heads {args.num_attention_heads} is not divisible by "
         f"--tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    need(args.ffn_hidden_size % tp == 0,
         f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
         f"--tensor-model-parallel-size {tp}")
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
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    need(args.lr_warmup_iters <= args.lr_decay_iters,
         f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --lr-decay-iters {args.lr_decay_iters}")

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
    need(not (args.chameleon and args.chameleon_executor != "ir"),
         "--chameleon recovers only with --chameleon-executor ir")
    if args.chameleon_placement is None:
        args.chameleon_placement = "spread" if args.chameleon else "megatron"
    need(not (args.chameleon and args.fp16),
         "--chameleon does not take --fp16: its dynamic loss scaler is updated before the "
         "step's commit point, so a re-run step would update it twice (use --bf16)")
    need(args.chameleon_mtbf is None or args.chameleon_mtbf > 0,
         "--chameleon-mtbf must be positive (hours)")
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

    cuda = _cuda_available()
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    need(args.distributed_backend == "gloo" or cuda, "--distributed-backend nccl needs CUDA")
    need(args.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")
    need(not (args.bf16 and args.fp16), "--bf16 and --fp16 exclude each other")
    need(cuda or not (args.bf16 or args.fp16),
         "--bf16/--fp16 need CUDA: megatron-core's mixed-precision optimizer is CUDA-only")
    te = cuda and importlib.util.find_spec("transformer_engine") is not None
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te else "local"
    need(args.transformer_impl == "local" or te,
         "--transformer-impl transformer_engine needs transformer-engine and CUDA")
    if args.save_interval is not None:
        need(args.save_interval >= 1, "--save-interval must be at least 1")
        need(args.save is not None, "--save-interval needs --save DIR")
    if args.eval_interval is not None:
        need(args.eval_interval >= 1 and args.eval_iters >= 1,
             "--eval-interval and --eval-iters must be at least 1")
    if args.load is not None:
        need(Path(args.load).is_dir() or not Path(args.load).exists(),
             f"--load {args.load} is not a directory")


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()

