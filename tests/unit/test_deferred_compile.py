"""megatron-core imported without TorchDynamo (megatron.training.deferred_compile): a worker's
imports leave it out, and what torch.compile decorated in the block still compiles at its first
call, with its options."""

import subprocess
import sys

import torch

from megatron.training.deferred_compile import deferred_compile
from tests.launch import REPO


def test_a_workers_imports_leave_dynamo_out():
    probe = ("import sys, pretrain_gpt, megatron.elastic.runtime; "
             "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', "
             "'torch._inductor'))))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=120)   # one import of torch and megatron-core
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_a_deferred_kernel_compiles_at_its_first_call_with_its_options():
    original = torch.compile
    with deferred_compile():
        assert torch.compile is not original

        @torch.compile(backend="eager")
        def add_one(x):
            return x + 1

        scale = torch.compile(lambda x: 2 * x, backend="eager")
    assert torch.compile is original
    x = torch.arange(3.0)
    assert torch.equal(add_one(x), x + 1) and torch.equal(scale(x), 2 * x)
    assert add_one.__name__ == "add_one"
