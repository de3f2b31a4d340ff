"""megatron-core's import without TorchDynamo and Inductor.

megatron-core decorates its fusion kernels with ``torch.compile`` (``megatron.core.jit.jit_fuser``)
as its modules are imported, and ``torch.compile`` imports TorchDynamo and Inductor at once: about
half of a worker's start-up (measured: the imports of pretrain_gpt.py and the runtime took 12-16 s
with them and 3-6 s without, on this 2-core host under load). This stack never calls those
kernels (every fusion is off: `megatron.training.training.transformer_config`), and every worker
of every launch, restart and test pays the import. Inside `deferred_compile()`, ``torch.compile``
decorates lazily: a kernel is compiled at its first call, which is when ``torch.compile`` itself
compiles, so nothing changes but the import."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch


@contextmanager
def deferred_compile() -> Iterator[None]:
    """``torch.compile`` deferred to the first call of what it decorates, while the block runs
    (megatron-core's imports); the decorators it returned stay deferred."""
    original = torch.compile

    def defer(model: Callable | None = None, **options) -> Callable:
        if model is None:                        # @torch.compile(mode=...) form
            return lambda fn: defer(fn, **options)
        compiled: Callable | None = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = original(model, **options)
            return compiled(*args, **kwargs)
        return call

    torch.compile = defer
    try:
        yield
    finally:
        torch.compile = original
