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
  tensor-parallel size either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import layers
from megatron.core.transformer import TransformerConfig

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

    def hook(self, global_layer: int) -> Callable:
        def pre_hook(module, args):
            key = self.key(global_layer)
            torch.manual_seed(stable_seed("default", *key))
            tracker = tensor_parallel.get_cuda_rng_tracker()
            tracker.reset()
            tracker.add(tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                        stable_seed("tp", *key))
        return pre_hook

    def attach(self, model: torch.nn.Module, layer_offset: int, pre_process: bool,
               tp_rank: int) -> None:
        if pre_process:
            model.embedding.register_forward_pre_hook(self.hook(-1))
        for i, layer in enumerate(model.decoder.layers):
            layer.register_forward_pre_hook(self.hook(layer_offset + i))
            core = layer.self_attention.core_attention
            # The local spec's DotProductAttention; transformer-engine's attention draws its
            # masks inside its kernel, per rank (TP-dependent, like Megatron-LM's).
            if isinstance(getattr(core, "attention_dropout", None), torch.nn.Dropout):
                heads = core.num_attention_heads_per_partition
                core.attention_dropout = HeadDropout(
                    core.attention_dropout.p, tp_rank * heads,
                    lambda g=layer_offset + i: self.key(g))


def mark_tied_output(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The last stage's copy of the tied embeddings: excluded from the grad norm (shared) and
    summed with the first stage's gradient over the embedding group."""
    if model.pre_process or not model.post_process or not model.share_embeddings_and_output_weights:
        return None
    w = model.output_layer.weight
    w.shared = True
    w.shared_embedding = True
    return w
