"""One rank's model chunk for its stage of a plan, independent of the parallel layout.

A stage holding layers [a, b) is a megatron-core model built from a per-stage config with
num_layers = b - a and pipeline size 1, so megatron-core needs no knowledge of uneven or
heterogeneous splits. Two things make every layout compute the same function:

- initialisation: each parameter is drawn whole from a generator seeded by (seed, its global
  name), with Megatron's init (normal(0, std) and the scaled std for output projections), and a
  tensor-parallel rank keeps its partition, split by megatron-core's own CPU initialisation
  (partition dim and stride: the fused QKV's query groups, a gated fc1's [gate, up] halves), so
  layer i has the same weights whichever rank holds it and at every tensor-parallel size; the
  tied output weight of a last stage gets exactly the first stage's word embeddings;
- dropout: before the embedding and each layer, the RNG (default and megatron-core's
  model-parallel tracker) is reseeded from (seed, iteration, micro-batch, global layer), the same
  on every tensor-parallel rank, so a micro-batch gets the same masks wherever and in whatever
  order it runs. Hidden and embedding dropout act on tensors that every tensor-parallel rank
  holds whole, so they need nothing more; attention dropout acts on this rank's heads only, and
  draws each head's mask from its own generator (HeadDropout), so the masks do not depend on the
  tensor-parallel size either. Under sequence parallelism hidden and embedding dropout act on this
  rank's rows of the sequence: each takes its rows of the whole sequence's mask
  (SequenceShardDropout).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import layers
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

from chameleon_ext.plan.execution_plan import Stage

_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")
_SCALED_INIT = (".linear_proj.weight", ".linear_fc2.weight")
TIED_NAME = "embedding.word_embeddings.weight"


def stable_seed(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def stage_config(config: TransformerConfig, stage: Stage) -> TransformerConfig:
    return dataclasses.replace(config, num_layers=stage.num_layers, pipeline_model_parallel_size=1)


def global_name(local_name: str, layer_offset: int, pre_process: bool) -> str:
    """The layout-independent name of a parameter of a stage starting at layer `layer_offset`."""
    if local_name == "output_layer.weight" and not pre_process:
        return TIED_NAME
    return _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name,
                         count=1)


def init_parameters(model: torch.nn.Module, *, seed: int, layer_offset: int, pre_process: bool,
                    total_layers: int, init_std: float, tp_rank: int, tp_size: int,
                    tied_output: bool) -> None:
    """Re-draw every matrix parameter from (seed, global name); vectors keep megatron's init
    (biases zero, norms one, whatever the tensor-parallel size)."""
    scaled_std = init_std / math.sqrt(2.0 * total_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "output_layer.weight" and not tied_output:
                gname = name
            else:
                gname = global_name(name, layer_offset, pre_process)
            if p.dim() < 2:
                continue
            std = scaled_std if gname.endswith(_SCALED_INIT) else init_std
            gen = torch.Generator().manual_seed(stable_seed(seed, gname))

            def draw(whole: torch.Tensor) -> None:
                whole.normal_(0.0, std, generator=gen)

            if not getattr(p, "tensor_model_parallel", False):
                whole = torch.empty(p.shape, dtype=torch.float32)
                draw(whole)
                p.copy_(whole.to(p.dtype))
                continue
            if p.dim() != 2:
                raise RuntimeError(f"tensor-parallel parameter {name} has {p.dim()} dimensions; "
                                   "its partition is known for matrices only")
            shape = list(p.shape)
            shape[p.partition_dim] *= tp_size
            # megatron-core's own split: stride pieces per rank, taken round-robin, so that the
            # whole matrix is the one a single rank would hold (TP 1).
            layers._initialize_affine_weight_cpu(
                p, shape[0], shape[1], p.shape[p.partition_dim], p.partition_dim, draw,
                stride=getattr(p, "partition_stride", 1), params_dtype=p.dtype, rank=tp_rank,
                world_size=tp_size, skip_set_tensor_parallel_attributes=True)


class HeadDropout(torch.nn.Module):
    """Attention dropout with one generator per attention head, seeded by (the layer's dropout
    key, the head's global index): head h gets the same mask whichever tensor-parallel rank holds
    it. megatron-core's torch.nn.Dropout draws one mask for this rank's [b, heads/tp, s, s]
    block, so the mask of a head depended on the tensor-parallel size."""

    def __init__(self, p: float, first_head: int, key: Callable[[], tuple]) -> None:
        super().__init__()
        self.p, self.first_head, self.key = p, first_head, key

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return probs
        b, heads, sq, sk = probs.shape
        key = self.key()
        keep = torch.empty((b, heads, sq, sk), dtype=probs.dtype, device=probs.device)
        for h in range(heads):
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(stable_seed("attention", *key, self.first_head + h))
            keep[:, h] = torch.rand((b, sq, sk), generator=gen, device=probs.device) >= self.p
        return probs * keep.div_(1.0 - self.p)


class SequenceShardDropout(torch.nn.Module):
    """Dropout of a tensor of which this rank holds rows [r * s, (r + 1) * s) of the sequence
    (sequence parallelism): the mask is drawn for the whole sequence, as one rank without
    sequence parallelism draws it (torch's dropout: a bernoulli over a tensor of the input's
    shape), and this rank keeps its rows. megatron-core draws a mask of the shard's shape, one
    pattern on every rank, so a token's mask depended on the tensor-parallel size."""

    def __init__(self, p: float, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.p, self.tp_rank, self.tp_size = p, tp_rank, tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x, self.p, self.training)

    def drop(self, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        s = x.shape[0]
        keep = torch.empty((s * self.tp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        keep = keep.bernoulli_(1.0 - p)[self.tp_rank * s:(self.tp_rank + 1) * s]
        return x * keep.div_(1.0 - p)

    def bias_dropout_add(self, training: bool, fused: bool) -> Callable:
        """A transformer layer's self_attn_bda / mlp_bda: megatron-core's bias-dropout-add of the
        tensor dropped with this mask (unfused: the mask is not a fused kernel's)."""
        add = get_bias_dropout_add(training, False)

        def apply(x_with_bias: tuple, residual: torch.Tensor, prob: float) -> torch.Tensor:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return add((self.drop(x, prob, training), None), residual, 0.0)
        return apply


class _ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose weight w is stored centred on zero and scales by 1 + w
    (--apply-layernorm-1p, transformer-engine's zero_centered_gamma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class _ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose weight w is stored centred on zero and scales by 1 + w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


_ZERO_CENTERED = {torch.nn.LayerNorm: _ZeroCenteredLayerNorm,
                  torch.nn.RMSNorm: _ZeroCenteredRMSNorm}


class TorchNorm:
    """megatron-core's torch LayerNorm / RMSNorm (WrappedTorchNorm) with the two things it
    refuses:

    - sequence parallelism, refused because nothing marks the norm's parameters there: each
      rank normalises its rows of the sequence, so their gradients are partial sums, which
      finalize_model_grads (and the executor) add over the TP group for parameters marked
      `sequence_parallel`, as TENorm marks its own. A q/k norm's gradient is partial over this
      rank's heads: summed the same;
    - a zero-centred weight (--apply-layernorm-1p): it starts at 0 and the norm scales by
      1 + weight, as transformer-engine's zero_centered_gamma does."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *,
                sequence_parallel: bool = False, zero_centered: bool = False,
                **kwargs) -> torch.nn.Module:
        unmarked = copy.copy(config)
        unmarked.sequence_parallel = False  # read by WrappedTorchNorm's check only
        norm = WrappedTorchNorm(unmarked, hidden_size, eps, **kwargs)
        if zero_centered:
            norm.__class__ = _ZERO_CENTERED[type(norm)]
            torch.nn.init.zeros_(norm.weight)
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm


def torch_norm_block(layer: ModuleSpec, num_layers: int, *, sequence_parallel: bool,
                     zero_centered: bool) -> TransformerBlockSubmodules:
    """A block of `num_layers` layers of spec `layer` whose torch norms (the layers', their q/k
    norms and the block's final one) are TorchNorm with these options."""
    norm = ModuleSpec(module=TorchNorm, params={"sequence_parallel": sequence_parallel,
                                                "zero_centered": zero_centered})
    return TransformerBlockSubmodules(layer_specs=[_torch_norms(layer, norm)] * num_layers,
                                      layer_norm=_torch_norms(LayerNormImpl, norm))


def _torch_norms(spec, norm: ModuleSpec):
    if spec is WrappedTorchNorm:
        return norm
    if isinstance(spec, ModuleSpec) and dataclasses.is_dataclass(spec.submodules):
        sub = spec.submodules
        return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **{
            f.name: _torch_norms(getattr(sub, f.name), norm)
            for f in dataclasses.fields(sub) if f.init}))
    return spec


@dataclass
class DropoutSeeder:
    """Reseeds the RNGs before each layer from (seed, iteration, micro-batch, global layer)."""

    seed: int
    iteration: int = 0
    microbatch: int = 0

    def at(self, iteration: int, microbatch: int) -> None:
        self.iteration, self.microbatch = iteration, microbatch

    def key(self, global_layer: int) -> tuple:
        return (self.seed, self.iteration, self.microbatch, global_layer)

    def hook(self, global_layer: int, reseed_tracker: bool = True) -> Callable:
        """`reseed_tracker`: megatron-core's model-parallel tracker too (not inside its fork)."""
        def pre_hook(module, args):
            key = self.key(global_layer)
            torch.manual_seed(stable_seed("default", *key))
            if not reseed_tracker:
                return
            tracker = tensor_parallel.get_cuda_rng_tracker()
            tracker.reset()
            # Under sequence parallelism megatron-core runs the embedding's dropout in the
            # tracker's fork: there the tracker draws what the default generator draws without.
            tracker.add(tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                        stable_seed("default" if global_layer < 0 else "tp", *key))
        return pre_hook

    def attach(self, model: torch.nn.Module, layer_offset: int, pre_process: bool,
               tp_rank: int, tp_size: int = 1, sequence_parallel: bool = False) -> None:
        shard = SequenceShardDropout(model.config.hidden_dropout, tp_rank, tp_size)
        if pre_process:
            model.embedding.register_forward_pre_hook(self.hook(-1))
            if sequence_parallel:
                model.embedding.embedding_dropout = shard
        for i, layer in enumerate(model.decoder.layers):
            # Under sequence parallelism megatron-core runs the whole decoder in the tracker's
            # fork: the generator seeded here is the tracker's, and a reset would break the fork.
            layer.register_forward_pre_hook(self.hook(layer_offset + i, not sequence_parallel))
            if sequence_parallel:
                layer.self_attn_bda = layer.mlp_bda = shard.bias_dropout_add
            core = layer.self_attention.core_attention
            # The local spec's DotProductAttention; transformer-engine's attention draws its
            # masks inside its kernel, per rank (TP-dependent, like Megatron-LM's).
            if isinstance(getattr(core, "attention_dropout", None), torch.nn.Dropout):
                heads = core.num_attention_heads_per_partition
                core.attention_dropout = HeadDropout(
                    core.attention_dropout.p, tp_rank * heads,
                    lambda g=layer_offset + i: self.key(g))


class ModelChunks(torch.nn.ModuleList):
    """An interleaved rank's stage models (one per stage it holds, in stage order) as one
    module for megatron-core's DDP and optimizer; the executor runs each chunk itself."""

    def __init__(self, parts: dict[int, torch.nn.Module]) -> None:
        super().__init__(parts[s] for s in sorted(parts))

    @property
    def config(self):
        return self[0].config

    @property
    def pg_collection(self):
        return self[0].pg_collection


def mark_tied_output(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The last stage's copy of the tied embeddings: excluded from the grad norm (shared) and
    summed with the first stage's gradient over the embedding group."""
    if model.pre_process or not model.post_process or not model.share_embeddings_and_output_weights:
        return None
    w = model.output_layer.weight
    w.shared = True
    w.shared_embedding = True
    return w
