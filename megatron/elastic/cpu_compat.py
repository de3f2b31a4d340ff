"""The one place that knows megatron-core 0.16.1 hard-codes CUDA; active only without CUDA.

Each patch is module-local: the module's own name ``torch`` is rebound to a proxy that forwards
everything to torch except that tensor factories given a CUDA device build on the CPU, and
``torch.cuda`` answers like a CPU device (current_device, synchronize, RNG state). Nothing in
torch itself or in any other module changes. The patches (tests/unit/test_cpu_compat.py checks
that megatron-core still contains each hard-coded site, so a patch that is no longer needed shows):

=============================================  ===================================================
module (megatron.core.)                         hard-coded CUDA
=============================================  ===================================================
pipeline_parallel.schedules                     ``torch.zeros([], ..., device="cuda")`` x3
                                                (no-pipelining, interleaved, 1F1B token counts)
pipeline_parallel.p2p_communication             receive buffers on ``torch.cuda.current_device()``,
                                                ``torch.cuda.synchronize()`` after batched p2p
distributed.param_and_grad_buffer               DDP grad buffers on ``torch.cuda.current_device()``
timers                                          ``torch.cuda.synchronize()``, the current device
optimizer.optimizer                             ``torch.tensor([1.0], device='cuda')``, found_inf
optimizer.clip_grads                            norm buffers on cuda; and
                                                ``clip_grad_by_total_norm_fp32`` asserts
                                                ``torch.cuda.FloatTensor``: replaced in
                                                optimizer.optimizer by a CPU version
utils                                           ``local_multi_tensor_l2_norm`` returns a cuda tensor
transformer.utils                               ``get_default_causal_mask`` builds on "cuda" (used
                                                when no attention mask is passed, as here)
models.common.embeddings.rotary_pos_embedding   RoPE moves its frequencies to
                                                ``torch.cuda.current_device()`` (--position-
                                                embedding-type rope)
transformer.moe.router                          the router's weight moved to
                                                ``torch.cuda.current_device()`` (--num-experts)
transformer.moe.moe_utils                       the aux-loss tracker's ``torch.zeros(...,
                                                device="cuda")``
tensor_parallel.mappings                        sequence parallelism's gathers and reduce-scatters
                                                build on ``torch.cuda.current_device()``
tensor_parallel.layers                          and so does a linear layer's backward gather of
                                                its input under sequence parallelism
tensor_parallel.random                          the RNG tracker keeps CUDA generator states; here
                                                the "cuda" generator is the CPU default generator,
                                                and its fork() warning about the CPU state changing
                                                (always true when both are the CPU) is filtered
distributed.distributed_data_parallel           ``torch.cuda.Stream`` for the inter-instance
                                                all-reduce (--num-distributed-optimizer-instances);
                                                streams, ``torch.cuda.stream`` and ``wait_stream``
                                                are no-ops here (a CPU process runs its ops in order)
transformer.moe.token_dispatcher                the all-to-all dispatcher (--moe-token-dispatcher-
                                                type alltoall) copies its token counts to the host
                                                on a ``torch.cuda.Stream`` and waits on its event:
                                                a no-op stream here, whose event is already done
optimizer.distrib_optimizer                     accepts only parameters whose ``type()`` is
                                                ``torch.cuda.FloatTensor`` (or Half/BFloat16):
                                                while it builds its shards, each CPU parameter
                                                answers ``type()`` with its CUDA name (not a
                                                module patch: its ``torch`` stays torch)
=============================================  ===================================================

``LanguageModule.setup_embeddings_and_output_layer`` also calls ``.cuda()`` when a model is built
with pipeline_model_parallel_size > 1 and tied embeddings; our stage models are built with a
per-stage config of pipeline size 1 (megatron.elastic.stage_model), so that path never runs.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types

import torch

PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.timers",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.transformer.moe.token_dispatcher",
)

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor")
_applied = False


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _on_cpu(fn):
    def factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    factory.__name__ = fn.__name__
    return factory


class _NoStream:
    """A CUDA stream on the CPU: a process's ops already run in the order it issues them."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> "_NoStream":
        return self    # an event whose work is done: the ops before it already ran

    def synchronize(self) -> None:
        pass


_NO_STREAM = _NoStream()


class _CpuCuda(types.SimpleNamespace):
    """What megatron-core asks of ``torch.cuda``, answered for the CPU."""

    def __init__(self) -> None:
        super().__init__(
            current_device=lambda: "cpu",
            Stream=lambda *a, **k: _NO_STREAM,
            stream=lambda s: contextlib.nullcontext(),
            default_stream=lambda *a, **k: _NO_STREAM,
            current_stream=lambda *a, **k: _NO_STREAM,
            synchronize=lambda *a, **k: None,
            is_available=lambda: False,
            empty_cache=lambda: None,
            get_rng_state=lambda *a, **k: torch.get_rng_state(),
            set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
            manual_seed=lambda seed: torch.manual_seed(seed),
        )

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by one patched megatron-core module."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's clipping without its CUDA type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _cuda_typed(build: classmethod) -> classmethod:
    """``DistributedOptimizer._build_model_and_main_param_groups`` sorting CPU parameters as it
    sorts CUDA ones: during the call each parameter's ``type()`` answers with the CUDA name
    (an instance attribute over the method, removed afterwards; the tensors are untouched)."""
    original = build.__func__

    def wrapped(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        params = [p for group in opt_group_ranges for p in group["params"]
                  if p.device.type == "cpu" and "type" not in vars(p)]
        for p in params:
            p.type = lambda *a, _name=p.type().replace("torch.", "torch.cuda.", 1), **k: _name
        try:
            return original(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        finally:
            for p in params:
                del p.type
    wrapped.__wrapped__ = original  # megatron-core's own (tests call it)
    return classmethod(wrapped)


class _DropCpuRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def needed() -> bool:
    return not torch.cuda.is_available()


def _name_missing_te_gemm() -> None:
    """megatron-core's MoE router tests ``te_general_gemm is not None`` but defines the name only
    when transformer-engine imports: without it, an MoE forward raises NameError, CUDA or not."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    """Install the patches once per process; only the missing-name fix where CUDA is available."""
    global _applied
    if _applied:
        return
    _name_missing_te_gemm()
    if not needed():
        _applied = True
        return
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = proxy
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    distrib.DistributedOptimizer._build_model_and_main_param_groups = _cuda_typed(
        vars(distrib.DistributedOptimizer)["_build_model_and_main_param_groups"])
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _get_rng_state
    random._set_cuda_rng_state = _set_rng_state
    logging.getLogger(random.__name__).addFilter(_DropCpuRngWarning())
    _applied = True
