"""Each CPU patch is still needed: megatron-core still hard-codes CUDA where the patch says."""

import importlib
import inspect

import pytest
import torch

from megatron.elastic import cpu_compat

# module -> a source fragment that only runs on CUDA
HARD_CODED = {
    "megatron.core.pipeline_parallel.schedules": 'torch.zeros([], dtype=torch.int, device="cuda")',
    "megatron.core.pipeline_parallel.p2p_communication": "device=torch.cuda.current_device()",
    "megatron.core.distributed.param_and_grad_buffer": "device=torch.cuda.current_device()",
    "megatron.core.timers": "torch.cuda.synchronize()",
    "megatron.core.optimizer.optimizer": "device='cuda'",
    "megatron.core.optimizer.clip_grads": "assert param.grad.type() == 'torch.cuda.FloatTensor'",
    "megatron.core.utils": 'l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda")',
    "megatron.core.tensor_parallel.random": "torch.cuda.manual_seed(seed)",
    "megatron.core.transformer.utils": 'torch.ones(sq, sq, device="cuda")',
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "self.inv_freq.to(device=torch.cuda.current_device())",
    "megatron.core.transformer.moe.router":
        "self.weight.data.to(device=torch.cuda.current_device())",
    "megatron.core.transformer.moe.moe_utils": 'torch.zeros(num_layers, device="cuda")',
    "megatron.core.distributed.distributed_data_parallel":
        "torch.cuda.Stream(device=torch.cuda.current_device())",
    "megatron.core.transformer.moe.token_dispatcher":
        "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()",
    "megatron.core.tensor_parallel.mappings":
        "torch.empty(dim_size, dtype=input_.dtype, device=torch.cuda.current_device())",
    "megatron.core.tensor_parallel.layers":
        "dim_size, dtype=input.dtype, device=torch.cuda.current_device(), requires_grad=False",
}


def test_every_patched_module_is_listed_and_still_hard_codes_cuda():
    assert set(HARD_CODED) == set(cpu_compat.PATCHED_MODULES)
    for name, fragment in HARD_CODED.items():
        src = inspect.getsource(importlib.import_module(name))
        assert fragment in src, f"{name} no longer contains {fragment!r}: drop its patch"


def test_language_module_cuda_call_is_avoided_not_patched():
    from megatron.core.models.common.language_module.language_module import LanguageModule
    src = inspect.getsource(LanguageModule.setup_embeddings_and_output_layer)
    assert "weight.data.cuda()" in src
    assert "if self.config.pipeline_model_parallel_size == 1:" in src


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches are CPU-only")
def test_patched_modules_build_on_cpu_and_torch_itself_is_untouched():
    cpu_compat.apply()
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.cuda.current_device() == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    from megatron.core.utils import local_multi_tensor_l2_norm
    norm, _ = local_multi_tensor_l2_norm(0, None, [[torch.ones(4)]], False)
    assert norm.device.type == "cpu" and float(norm) == pytest.approx(2.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patches are CPU-only")
def test_distributed_optimizer_shards_cpu_parameters_only_with_the_patch():
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range
    p = torch.nn.Parameter(torch.arange(6.0).view(2, 3))

    def arguments():
        ranges = [{torch.float32: [{"param_map": {p: {"param": Range(2, 5)}}}]}]
        groups = [{"params": [p], "orig_group": {"params": []}}]
        config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
        return ranges, {p: (0, torch.float32, 0)}, groups, config

    cpu_compat.apply()
    original = vars(DistributedOptimizer)["_build_model_and_main_param_groups"].__func__.__wrapped__
    with pytest.raises(TypeError, match="torch.cuda.FloatTensor"):
        original(DistributedOptimizer, *arguments())
    _, models, _, shards, _ = DistributedOptimizer._build_model_and_main_param_groups(
        *arguments())
    assert models == [[p]] and shards[0][0].tolist() == [2.0, 3.0, 4.0]
    assert p.type() == "torch.FloatTensor"  # the parameter answers as before
