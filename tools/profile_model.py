"""Write a Chameleon performance-model profile (chameleon_ext.planning.perf_model.Profile, JSON) for a GPT
configuration, for planning at sizes the training machine cannot run.

    python tools/profile_model.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --micro-batch-size 1 --output h200.json            # measured here
    python tools/profile_model.py --mode analytical --device-name H200 --bf16 \\
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \\
        --micro-batch-size 1 --output h200-analytical.json                  # FLOPs / peak
    chameleon-plan --profile h200.json --world-size 32 --pipeline-parallel 4 ...

The model flags are pretrain_gpt.py's: besides the sizes, Llama-style shapes (--swiglu,
--group-query-attention --num-query-groups, --disable-bias-linear, --kv-channels,
--position-embedding-type rope, --normalization RMSNorm, --untie-embeddings-and-output-weights,
--qk-layernorm), mixture of experts (--num-experts, --moe-router-topk, --moe-ffn-hidden-size;
expert parallel 1) and activation recompute (--recompute-granularity: full recomputes each layer
on its own, as --recompute-method uniform --recompute-num-layers 1; selective the attention
core). Both modes describe the model by them (the profile's ModelShape).

    python tools/profile_model.py --mode analytical --device-name H100 --bf16 --num-layers 32 \\
        --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 \\
        --vocab-size 128256 --ffn-hidden-size 14336 --swiglu --group-query-attention \\
        --num-query-groups 8 --disable-bias-linear --position-embedding-type rope \\
        --normalization RMSNorm --untie-embeddings-and-output-weights --output llama3-8b.json

--mode measure (the default) times, on the local device (CUDA if available, else the CPU with
torch's thread count as set by OMP_NUM_THREADS), a megatron-core GPTModel (local layer spec,
dropout 0.1, built from the model flags as pretrain_gpt.py builds it) with only
--layers-to-time layers and the real hidden size, so a huge --num-layers costs nothing. Each part
is run 2 times to warm up, then --iters times; the profile keeps the medians (ms per micro-batch):

- one transformer layer (the mean over the timed layers): forward; the backward split as the
  executor splits it (megatron.elastic.wgrad): the input-gradient half (autograd with the linear
  layers' weight gradients deferred; a recomputed forward included) and the weight-gradient half
  (the deferred matmuls); the fused backward is timed too and reported in the notes;
- the embedding (word, and learned positions) forward and backward;
- the head: final norm, the output layer (its own weights or the tied word embedding) and the
  cross-entropy loss, forward and its whole backward;
- the optimizer: torch.optim.Adam steps on one flat fp32 parameter, per million parameters.

Links cannot be measured in one process: when the device name names an entry of
perf_model.DEVICES (H200, H100, A100; "NVIDIA H200" counts) its analytical link costs are used,
else a loopback estimate: a copy on the local device of a tensor of at least the message size
(alpha: a copy of one element). That is a lower bound on any real link and the profile's notes say
so; a live calibration (megatron.elastic.calibration) or --device-name gives better ones.
The profile's source is "offline".

--mode analytical writes perf_model.analytical_profile(shape, --device-name): FLOPs over peak,
bytes over link bandwidth, source "analytical".

Bad input prints one line on stderr (``profile_model.py: error: ...``) and exits 2: among it
combinations megatron-core cannot build or train (heads not divisible by query groups, a top-k
outside the experts, and in measure mode experts with biases, whose in-place bias add fails
autograd at tensor parallel 1). The output is written atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

try:
    from chameleon_ext.planning.perf_model import DEVICES, MIB, NORMALIZATIONS, ModelShape, \
        Profile, ProfileError, analytical_profile
except ImportError:          # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from chameleon_ext.planning.perf_model import DEVICES, MIB, NORMALIZATIONS, ModelShape, \
        Profile, ProfileError, analytical_profile

PROG = "profile_model.py"
WARMUP = 2
SEED = 1234
DROPOUT = 0.1                # pretrain_gpt.py's --hidden-dropout / --attention-dropout defaults
INIT_STD = 0.02
LINK_PROBE_MIN_BYTES = 4 * MIB
OPT_MIN_PARAMS = 2 ** 20
OPT_MAX_PARAMS = {"cpu": 2 ** 24, "cuda": 2 ** 26}
POSITION_EMBEDDINGS = ("learned_absolute", "rope")     # pretrain_gpt.py's choices


class InputError(Exception):
    """Bad input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):       # one line, no usage block
        raise InputError(message)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description="Write a Chameleon performance-model profile (JSON) "
                "for a GPT configuration: measured on this device, or analytical.",
                epilog="See the module docstring (tools/profile_model.py) for what is timed.")
    m = p.add_argument_group("model (Megatron's flag names)")
    m.add_argument("--num-layers", type=int, required=True)
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--seq-length", type=int, required=True)
    m.add_argument("--micro-batch-size", type=int, required=True)
    m.add_argument("--vocab-size", type=int, default=50304,
                   help="the padded vocabulary GPTModel gets (default 50304: GPT-2's, padded)")
    m.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4 x hidden; with --swiglu 2/3 of that, rounded down to a "
                        "multiple of 64 (Megatron-LM's)")
    m.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations (2-byte messages)")
    m.add_argument("--swiglu", action="store_true", help="a gated MLP with SiLU")
    m.add_argument("--squared-relu", action="store_true", help="relu(x)^2 instead of GELU")
    m.add_argument("--quick-geglu", action="store_true", help="a gated MLP with quick GELU")
    m.add_argument("--group-query-attention", action="store_true")
    m.add_argument("--num-query-groups", type=int, default=1,
                   help="key/value heads with --group-query-attention (default 1)")
    m.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers")
    m.add_argument("--kv-channels", type=int, default=None,
                   help="projection size per head (default hidden / heads)")
    m.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS,
                   default="learned_absolute")
    m.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--qk-layernorm", action="store_true",
                   help="normalise queries and keys per head")
    m.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (default: a dense MLP)")
    m.add_argument("--moe-router-topk", type=int, default=2)
    m.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert's MLP size (every token passes it)")
    m.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's hidden size (default --ffn-hidden-size)")
    m.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: every layer recomputed on its own in the backward (Megatron's "
                        "--recompute-method uniform --recompute-num-layers 1); selective: the "
                        "attention core")
    p.add_argument("--mode", choices=("measure", "analytical"), default="measure")
    p.add_argument("--device-name",
                   help=f"analytical: one of {', '.join(DEVICES)}; measure: the label recorded "
                        "(default 'cpu' or the CUDA device's name); naming one of those takes its "
                        "link costs")
    p.add_argument("--layers-to-time", type=int, default=2,
                   help="layers in the timed model (default 2); the profile is per layer")
    p.add_argument("--iters", type=int, default=5,
                   help=f"timed repetitions of each part, after {WARMUP} warm-up ones (default 5)")
    p.add_argument("--cores", type=float, default=None,
                   help="cores per host recorded in the profile (default: os.cpu_count() on "
                        "CPU, 0 on GPU and in analytical mode)")
    p.add_argument("--ranks-per-host", type=int, default=0,
                   help="ranks per host recorded in the profile (default 0: all on one host)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory per rank (default: the GPU's total memory, 0 = unlimited on CPU, "
                        "the device's in analytical mode)")
    p.add_argument("--output", required=True, help="the profile JSON to write")
    args = p.parse_args(argv)
    _check(args)
    return args


def _check(args: argparse.Namespace) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "vocab_size", "layers_to_time", "iters"):
        value = getattr(args, name)
        if value <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("ffn_hidden_size", "kv_channels", "num_experts", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise InputError(f"--hidden-size {args.hidden_size} is not divisible by "
                         f"--num-attention-heads {args.num_attention_heads} (or give "
                         "--kv-channels)")
    if args.group_query_attention and (args.num_query_groups <= 0 or
                                       args.num_attention_heads % args.num_query_groups):
        raise InputError(f"--num-attention-heads {args.num_attention_heads} is not divisible "
                         f"by --num-query-groups {args.num_query_groups}")
    activations = [f for f, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                   ("--quick-geglu", args.quick_geglu)) if on]
    if len(activations) > 1:
        raise InputError(f"{' and '.join(activations)} exclude each other")
    if ffn_hidden_size(args) < 1:
        raise InputError(f"--swiglu's default --ffn-hidden-size is 0 at --hidden-size "
                         f"{args.hidden_size}: give one")
    if args.num_experts is None:
        if args.moe_ffn_hidden_size is not None:
            raise InputError("--moe-ffn-hidden-size needs --num-experts")
    elif not 1 <= args.moe_router_topk <= args.num_experts:
        raise InputError(f"--moe-router-topk {args.moe_router_topk} must be in 1..--num-experts "
                         f"{args.num_experts}")
    elif args.mode == "measure" and not args.disable_bias_linear:
        raise InputError("--num-experts needs --disable-bias-linear to be measured: "
                         "megatron-core's experts add their biases in place, which autograd "
                         "refuses at tensor parallel 1")
    for name in ("cores", "ranks_per_host", "device_memory_gib"):
        value = getattr(args, name)
        if value is not None and (value < 0 or not math.isfinite(value)):
            raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.mode == "analytical":
        if args.device_name is None:
            raise InputError(f"--mode analytical needs --device-name (one of "
                             f"{', '.join(DEVICES)})")
        if args.device_name not in DEVICES:
            raise InputError(f"unknown device {args.device_name!r} (known: {', '.join(DEVICES)})")
    elif args.device_name is not None and not args.device_name.strip():
        raise InputError("--device-name is empty")
    out = Path(args.output)
    if out.is_dir():
        raise InputError(f"--output {args.output} is a directory")
    parent = out.parent
    if not parent.is_dir():
        raise InputError(f"cannot write --output {args.output}: no directory {parent}")
    # Probe now, before minutes of timing, where Profile.save will write (PATH.tmp, renamed).
    tmp = out.with_suffix(out.suffix + ".tmp")
    existed = tmp.exists()
    try:
        with open(tmp, "a"):
            pass
        if not existed:
            tmp.unlink()
    except OSError as e:
        raise InputError(f"cannot write --output {args.output}: {e.strerror or e}") from None
    if out.exists() and not os.access(out, os.W_OK):
        raise InputError(f"cannot write --output {args.output}: permission denied")


def ffn_hidden_size(args: argparse.Namespace) -> int:
    """--ffn-hidden-size, or Megatron-LM's default: with --swiglu the gated MLP's three
    matrices keep about the parameters of a 4 x hidden MLP's two."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    return int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size


def model_shape(args: argparse.Namespace) -> ModelShape:
    return ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads,
                      args.seq_length, args.micro_batch_size, args.vocab_size,
                      ffn_hidden_size=ffn_hidden_size(args),
                      bytes_per_element=2 if args.bf16 else 4,
                      num_query_groups=args.num_query_groups if args.group_query_attention else 0,
                      kv_channels=args.kv_channels or 0,
                      gated_linear_unit=args.swiglu or args.quick_geglu,
                      add_bias_linear=not args.disable_bias_linear,
                      tied_embeddings=not args.untie_embeddings_and_output_weights,
                      learned_positions=args.position_embedding_type == "learned_absolute",
                      normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                      num_experts=args.num_experts or 0,
                      moe_ffn_hidden_size=args.moe_ffn_hidden_size or 0,
                      moe_router_topk=args.moe_router_topk,
                      moe_shared_ffn=args.moe_shared_expert_intermediate_size or 0,
                      recompute=args.recompute_granularity or "")


def link_device(name: str) -> str | None:
    """The DEVICES entry a device name names: exactly, or as a word of it ("NVIDIA H200")."""
    if name in DEVICES:
        return name
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    for key in DEVICES:
        if key.lower() in words:
            return key
    return None


# ---- analytical ------------------------------------------------------------------------------
def analytical(args: argparse.Namespace) -> Profile:
    prof = analytical_profile(model_shape(args), args.device_name)
    changes = {"cores": args.cores or 0.0, "ranks_per_host": args.ranks_per_host}
    if args.device_memory_gib is not None:
        changes["device_memory_bytes"] = int(args.device_memory_gib * 2 ** 30)
    return dataclasses.replace(prof, **changes, notes=[
        *prof.notes, f"analytical profile written by tools/profile_model.py for "
                     f"{args.device_name}: nothing measured"])


# ---- measurement -----------------------------------------------------------------------------
class _Clock:
    """Milliseconds of fn(): CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda

    def __call__(self, fn: Callable):
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end)
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3


class _Progress:
    """A tqdm bar over all timed repetitions (on a terminal) and one line per measured part."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="run", leave=False, disable=None,  # None: a tty only
                        file=sys.stderr)

    def part(self, name: str) -> None:
        self.bar.set_description(name)

    def step(self) -> None:
        self.bar.update(1)

    def line(self, text: str) -> None:
        self.bar.write(text, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()


def _repeat(progress: _Progress, iters: int, run: Callable[[], dict]) -> dict:
    """Medians of the named times run() returns, over `iters` runs after WARMUP ones."""
    samples: dict[str, list[float]] = {}
    for i in range(WARMUP + iters):
        times = run()
        progress.step()
        if i >= WARMUP:
            for k, v in times.items():
                samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


def _setup_megatron(torch, cuda: bool) -> bool:
    """One-process world (gloo on an in-process store: no port; nothing collective runs at
    TP = PP = 1) and megatron-core's parallel state; the CPU patches where there is no CUDA.
    Returns whether the world was created here (and so is to be destroyed here)."""
    import logging

    import torch.distributed as dist
    from megatron.training.known_warnings import silence_known_warnings
    silence_known_warnings()
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    from megatron.elastic import cpu_compat
    if cuda:
        torch.cuda.set_device(0)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cpu_compat.apply()
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel
    mps.initialize_model_parallel(1, 1)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)
    return owned


def _teardown_megatron(owned: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    mps.destroy_model_parallel()
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def _build_model(torch, args, layers: int, cuda: bool, dtype):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron.training.training import activation_func
    shape = model_shape(args)
    full = args.recompute_granularity == "full"
    config = TransformerConfig(
        num_layers=layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=shape.ffn,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, gated_linear_unit=shape.gated_linear_unit,
        activation_func=activation_func(args.swiglu, args.squared_relu, args.quick_geglu),
        add_bias_linear=not args.disable_bias_linear, qk_layernorm=args.qk_layernorm,
        normalization=args.normalization, num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=shape.moe_ffn if args.num_experts else None,
        moe_router_topk=args.moe_router_topk,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        recompute_granularity=args.recompute_granularity,
        recompute_method="uniform" if full else None, recompute_num_layers=1 if full else None,
        hidden_dropout=DROPOUT, attention_dropout=DROPOUT, init_method_std=INIT_STD,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        use_cpu_initialization=not cuda, calculate_per_token_loss=True,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
                     pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=shape.tied_embeddings,
                     position_embedding_type=args.position_embedding_type)
    if cuda:
        model = model.cuda()
    model.train()
    return model


def _time_model(torch, args, k: int, dev, dtype, clock: _Clock, progress: _Progress) -> dict:
    """Layer, embedding and head times of a k-layer GPTModel; its parameter count."""
    from megatron.core import tensor_parallel
    from megatron.elastic import wgrad

    s, b, h, v = args.seq_length, args.micro_batch_size, args.hidden_size, args.vocab_size
    model = _build_model(torch, args, k, dev.type == "cuda", dtype)
    store = wgrad.install(model)
    for p in model.parameters():        # where megatron-core's DDP would keep the gradients
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
    layers = list(model.decoder.layers)

    # -- transformer layers: forward, input half, weight half, fused backward
    progress.part("layer")
    x = torch.randn(s, b, h, device=dev, dtype=dtype, requires_grad=True)
    gy = torch.randn(s, b, h, device=dev, dtype=dtype)
    # the decoder gets RoPE's frequencies from the model, and checkpoints its layers under full
    # recompute (uniform, one layer each): the layers alone do neither
    rope = model.rotary_pos_emb(s) if args.position_embedding_type == "rope" else None
    full = args.recompute_granularity == "full"

    def fwd():
        y = x
        for layer in layers:
            def run(t, layer=layer):
                return layer(t, attention_mask=None, rotary_pos_emb=rope)[0]
            y = tensor_parallel.checkpoint(run, False, y) if full else run(y)
        return y

    def bwd_input(y):
        store.deferring = 0
        try:
            torch.autograd.backward(y, gy)
        finally:
            store.deferring = None

    def run_layers() -> dict:
        model.zero_grad(set_to_none=True)
        x.grad = None
        y, t_f = clock(fwd)
        _, t_i = clock(lambda: bwd_input(y))
        _, t_w = clock(lambda: store.compute(0))
        y = fwd()
        _, t_b = clock(lambda: torch.autograd.backward(y, gy))
        return {"fwd": t_f / k, "bwd_input": t_i / k, "bwd_weight": t_w / k, "bwd": t_b / k}

    lay = _repeat(progress, args.iters, run_layers)
    progress.line(f"  layer (mean of {k}): fwd {lay['fwd']:.3f} ms, bwd-input "
                  f"{lay['bwd_input']:.3f} ms, bwd-weight {lay['bwd_weight']:.3f} ms "
                  f"(fused bwd {lay['bwd']:.3f} ms)")

    # -- embedding (word + position)
    progress.part("embedding")
    gen = torch.Generator(device=dev).manual_seed(SEED)
    tokens = torch.randint(0, v, (b, s), device=dev, generator=gen)
    positions = torch.arange(s, device=dev).unsqueeze(0).expand(b, -1)
    ge = torch.randn(s, b, h, device=dev, dtype=dtype)

    def run_embedding() -> dict:
        model.zero_grad(set_to_none=True)
        e, t_f = clock(lambda: model.embedding(input_ids=tokens, position_ids=positions))
        _, t_b = clock(lambda: torch.autograd.backward(e, ge))
        return {"fwd": t_f, "bwd": t_b}

    emb = _repeat(progress, args.iters, run_embedding)
    progress.line(f"  embedding: fwd {emb['fwd']:.3f} ms, bwd {emb['bwd']:.3f} ms")

    # -- head: final layer norm, output layer (tied weights), cross-entropy
    progress.part("head")
    xh = torch.randn(s, b, h, device=dev, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (b, s), device=dev, generator=gen)

    def head_fwd():
        y = model.decoder.final_layernorm(xh)
        tied = model.share_embeddings_and_output_weights
        logits, _ = model.output_layer(
            y, weight=model.shared_embedding_or_output_weight() if tied else None)
        loss = model.compute_language_model_loss(labels, logits)
        return loss.float().sum() / loss.numel()

    def run_head() -> dict:
        model.zero_grad(set_to_none=True)
        xh.grad = None
        loss, t_f = clock(head_fwd)
        _, t_b = clock(loss.backward)
        return {"fwd": t_f, "bwd": t_b}

    head = _repeat(progress, args.iters, run_head)
    progress.line(f"  head (final norm, output layer, loss): fwd {head['fwd']:.3f} ms, "
                  f"bwd {head['bwd']:.3f} ms")
    return {"layer": lay, "embedding": emb, "head": head,
            "params": sum(p.numel() for p in model.parameters())}


def _time_optimizer(torch, n: int, dev, clock: _Clock, progress: _Progress, iters: int) -> float:
    """ms of one torch.optim.Adam step on one flat fp32 parameter of n elements."""
    progress.part("optimizer")
    flat = torch.nn.Parameter(torch.zeros(n, device=dev))
    flat.grad = torch.randn(n, device=dev) * 1e-3
    adam = torch.optim.Adam([flat], lr=1e-4)
    return _repeat(progress, iters, lambda: {"step": clock(adam.step)[1]})["step"]


def _time_copies(torch, nbytes: int, dev, clock: _Clock, progress: _Progress,
                 iters: int) -> dict:
    """ms of a device copy of nbytes ("big") and of one element ("one")."""
    progress.part("links")
    src = torch.empty(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    one_src, one_dst = torch.empty(1, device=dev), torch.empty(1, device=dev)
    return _repeat(progress, iters, lambda: {"big": clock(lambda: dst.copy_(src))[1],
                                             "one": clock(lambda: one_dst.copy_(one_src))[1]})


def measure(args: argparse.Namespace) -> Profile:
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = args.device_name or (torch.cuda.get_device_name(0) if cuda else "cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    shape = model_shape(args)
    k = min(args.layers_to_time, args.num_layers)
    clock = _Clock(torch, cuda)
    progress = _Progress(5 * (WARMUP + args.iters))  # layers, embedding, head, optimizer, links
    threads = torch.get_num_threads()
    where = dev.type if name == dev.type else f"{dev.type} ({name})"
    progress.line(f"[{PROG}] timing on {where}"
                  f"{'' if cuda else f' with {threads} torch thread(s)'}: megatron-core GPTModel "
                  f"with {k} layer(s) of hidden {args.hidden_size}, seq {args.seq_length}, "
                  f"micro-batch {args.micro_batch_size}, vocab {args.vocab_size}"
                  f"{', bf16' if args.bf16 else ''}; {WARMUP} warm-up + {args.iters} timed runs "
                  "per part")

    owned = _setup_megatron(torch, cuda)
    try:
        t = _time_model(torch, args, k, dev, dtype, clock, progress)
    finally:
        _teardown_megatron(owned)
    lay, emb, head = t["layer"], t["embedding"], t["head"]
    if cuda:
        torch.cuda.empty_cache()

    n_opt = max(OPT_MIN_PARAMS, min(t["params"], OPT_MAX_PARAMS[dev.type]))
    opt_ms = _time_optimizer(torch, n_opt, dev, clock, progress, args.iters)
    opt_ms_per_mparam = opt_ms / (n_opt / 1e6)
    progress.line(f"  optimizer (torch.optim.Adam, {n_opt:,} fp32 params): {opt_ms:.3f} ms per "
                  f"step, {opt_ms_per_mparam:.3f} ms per Mparam")

    # links: the named device's analytical ones, else a loopback copy (a lower bound)
    msg = shape.message_bytes()
    nbytes = max(msg, LINK_PROBE_MIN_BYTES)
    copy = _time_copies(torch, nbytes, dev, clock, progress, args.iters)
    copy_ms_per_mib = copy["big"] / (nbytes / MIB)
    copy_gbps = nbytes / (copy["big"] / 1e3) / 1e9 if copy["big"] > 0 else math.inf
    notes = [f"offline: measured by tools/profile_model.py on {dev.type} ({name}) with "
             f"megatron-core GPTModel (local layer spec, dropout {DROPOUT}), "
             f"{k} timed layer(s) of the real hidden size, medians of {args.iters} runs after "
             f"{WARMUP} warm-up" + ("" if cuda else f", {threads} torch thread(s)"),
             f"layer backward split as megatron.elastic.wgrad does (weight matmuls of the "
             f"linear layers deferred): input {lay['bwd_input']:.4g} + weight "
             f"{lay['bwd_weight']:.4g} ms; the fused backward took {lay['bwd']:.4g} ms",
             f"head = final layer norm + output layer + cross-entropy; head_bwd is its whole "
             f"backward; optimizer: torch.optim.Adam on {n_opt:,} fp32 parameters"]
    linked = link_device(name)
    if linked:
        ref = analytical_profile(shape, linked)
        links = dict(p2p_alpha_ms=ref.p2p_alpha_ms, p2p_ms_per_mib=ref.p2p_ms_per_mib,
                     allreduce_alpha_ms=ref.allreduce_alpha_ms,
                     allreduce_ms_per_mib=ref.allreduce_ms_per_mib)
        d = DEVICES[linked]
        notes.append(f"links: analytical, from perf_model.DEVICES[{linked!r}] "
                     f"({d.p2p_gbps:g} GB/s, {d.link_latency_us:g} us): not measured")
        link_line = f"analytical ({linked}), not measured"
    else:
        links = dict(p2p_alpha_ms=copy["one"], p2p_ms_per_mib=copy_ms_per_mib,
                     allreduce_alpha_ms=copy["one"], allreduce_ms_per_mib=copy_ms_per_mib)
        notes.append(f"links: LOOPBACK ESTIMATE, a lower bound, not a network measurement: a "
                     f"{dev.type} memcpy of {nbytes / MIB:g} MiB ({copy_gbps:.3g} GB/s; the "
                     f"message is {msg / MIB:.3g} MiB) and of one element as alpha; give "
                     f"--device-name {'/'.join(DEVICES)} for analytical links or calibrate a "
                     "live run")
        link_line = f"loopback memcpy estimate ({copy_gbps:.3g} GB/s, a lower bound)"
    progress.line(f"  links: {link_line}")
    progress.close()

    if args.device_memory_gib is not None:
        memory = int(args.device_memory_gib * 2 ** 30)
    elif cuda:
        memory = int(torch.cuda.get_device_properties(0).total_memory)
    else:
        memory = 0
    cores = args.cores if args.cores is not None else (0.0 if cuda else float(os.cpu_count() or 1))
    if not cuda and threads > 1 and cores > 0:
        notes.append(f"timed with {threads} torch threads, but the profile shares a host's "
                     f"{cores:g} cores among its ranks as if each used one")
    return Profile(
        source="offline", device=name, shape=shape,
        layer_fwd_ms=lay["fwd"], layer_bwd_input_ms=lay["bwd_input"],
        layer_bwd_weight_ms=lay["bwd_weight"],
        embedding_fwd_ms=emb["fwd"], embedding_bwd_ms=emb["bwd"],
        head_fwd_ms=head["fwd"], head_bwd_ms=head["bwd"],
        optimizer_ms_per_mparam=opt_ms_per_mparam, **links,
        bytes_per_param=18 if args.bf16 else 16, device_memory_bytes=memory,
        cores=cores, ranks_per_host=args.ranks_per_host, notes=notes)


# ---- main ------------------------------------------------------------------------------------
def _variants(sh: ModelShape) -> str:
    """What sets the model apart from GPT-2's shapes, as ", a, b" ("" for none)."""
    parts = [
        ("SwiGLU", sh.gated_linear_unit),
        (f"{sh.num_query_groups} query groups", sh.num_query_groups),
        ("no biases", not sh.add_bias_linear),
        ("RoPE", not sh.learned_positions),
        (sh.normalization, sh.normalization != "LayerNorm"),
        ("untied output layer", not sh.tied_embeddings),
        ("qk-layernorm", sh.qk_layernorm),
        (f"{sh.num_experts} experts, top {sh.moe_router_topk}", sh.num_experts),
        (f"{sh.recompute} recompute", sh.recompute),
    ]
    return "".join(f", {name}" for name, on in parts if on)


def summary(prof: Profile, path: str) -> str:
    sh = prof.shape
    mem = f"{prof.device_memory_bytes / 2 ** 30:.1f} GiB" if prof.device_memory_bytes else \
        "unlimited"
    return "\n".join([
        f"profile ({prof.source}, {prof.device}): GPT {sh.num_layers} layers, hidden "
        f"{sh.hidden_size}, {sh.num_attention_heads} heads, seq {sh.seq_length}, micro-batch "
        f"{sh.micro_batch_size}, vocab {sh.vocab_size}{_variants(sh)}",
        f"  per layer:  fwd {prof.layer_fwd_ms:.4g} ms, bwd-input {prof.layer_bwd_input_ms:.4g} "
        f"ms, bwd-weight {prof.layer_bwd_weight_ms:.4g} ms",
        f"  embedding:  fwd {prof.embedding_fwd_ms:.4g} ms, bwd {prof.embedding_bwd_ms:.4g} ms",
        f"  head+loss:  fwd {prof.head_fwd_ms:.4g} ms, bwd {prof.head_bwd_ms:.4g} ms",
        f"  optimizer:  {prof.optimizer_ms_per_mparam:.4g} ms per Mparam",
        f"  links:      p2p {prof.p2p_alpha_ms:.3g} ms + {prof.p2p_ms_per_mib:.3g} ms/MiB, "
        f"all-reduce {prof.allreduce_alpha_ms:.3g} ms + {prof.allreduce_ms_per_mib:.3g} ms/MiB "
        "per step",
        f"  memory {mem} per rank, cores {prof.cores:g}, source {prof.source}",
        f"wrote {path}"])


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        prof = analytical(args) if args.mode == "analytical" else measure(args)
        try:
            prof.save(args.output)
        except OSError as e:
            raise InputError(f"cannot write --output {args.output}: "
                             f"{e.strerror or e}") from None
    except (InputError, ProfileError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except MemoryError:
        print(f"{PROG}: error: out of memory timing this configuration: lower "
              "--layers-to-time or --micro-batch-size", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        if "out of memory" not in str(e).lower():
            raise
        print(f"{PROG}: error: out of memory timing this configuration: lower "
              "--layers-to-time or --micro-batch-size", file=sys.stderr, flush=True)
        return 1
    print(summary(prof, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
