"""One rank's model chunk for its stage of a plan, independent of the parallel layout.

A stage holding layers [a, b) is a megatron-core model built from a per-stage config with
num_layers = b - a and pipeline size 1, so megatron-core needs no knowledge of uneven or
heterogeneous splits. Two things make every layout compute the same function:

- initialisation: each parameter is drawn from a generator seeded by (seed, its global name),
  with Megatron's init (normal(0, std) and the scaled std for output projections), so layer i has
  the same weights whichever rank holds it; the tied output weight of a last stage gets exactly
  the first stage's word embeddings;
- dropout: before the embedding and each layer, the RNG (default and megatron-core's
  model-parallel tracker) is reseeded from (seed, iteration, micro-batch, global layer), so a
  micro-batch gets the same masks wherever and in whatever order it runs.
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
from megatron.core.transformer import TransformerConfig

from chameleon_ext.plan import Stage

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
    """Re-draw every matrix parameter from (seed, global name); vectors keep megatron's init."""
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
            full_shape = list(p.shape)
            dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
            if dim >= 0:
                full_shape[dim] *= tp_size
            gen = torch.Generator().manual_seed(stable_seed(seed, gname))
            full = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            if dim >= 0:
                full = full.chunk(tp_size, dim=dim)[tp_rank]
            p.copy_(full.to(p.dtype))


@dataclass
class DropoutSeeder:
    """Reseeds the RNGs before each layer from (seed, iteration, micro-batch, global layer)."""

    seed: int
    tp_rank: int
    iteration: int = 0
    microbatch: int = 0

    def at(self, iteration: int, microbatch: int) -> None:
        self.iteration, self.microbatch = iteration, microbatch

    def hook(self, global_layer: int) -> Callable:
        def pre_hook(module, args):
            key = (self.seed, self.iteration, self.microbatch, global_layer)
            torch.manual_seed(stable_seed("default", *key))
            tracker = tensor_parallel.get_cuda_rng_tracker()
            tracker.reset()
            tracker.add(tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                        stable_seed("tp", self.tp_rank, *key))
        return pre_hook

    def attach(self, model: torch.nn.Module, layer_offset: int, pre_process: bool) -> None:
        if pre_process:
            model.embedding.register_forward_pre_hook(self.hook(-1))
        for i, layer in enumerate(model.decoder.layers):
            layer.register_forward_pre_hook(self.hook(layer_offset + i))


def mark_tied_output(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The last stage's copy of the tied embeddings: excluded from the grad norm (shared) and
    summed with the first stage's gradient over the embedding group."""
    if model.pre_process or not model.post_process or not model.share_embeddings_and_output_weights:
        return None
    w = model.output_layer.weight
    w.shared = True
    w.shared_embedding = True
    return w
