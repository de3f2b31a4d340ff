"""What chameleon-launch's fork server imports once before it forks this stack's workers
(``--preload``, its default): the libraries every worker of pretrain_gpt.py imports, in the
context pretrain_gpt.py imports them (the known warnings silenced, megatron-core without
TorchDynamo's compile at import), and those its first iteration imports (the optimizer's step
imports TorchDynamo; the datasets numpy's random). Importing this touches no device, no process
group and no environment variable a worker is given."""

import importlib

from megatron.training.deferred_compile import deferred_compile
from megatron.training.known_warnings import silence_known_warnings

MODULES = ("megatron.core.datasets.gpt_dataset", "megatron.core.models.gpt.gpt_layer_specs",
           "megatron.core.optimizer", "megatron.training.training", "numpy.random",
           "torch._dynamo")

silence_known_warnings()
with deferred_compile():
    for name in MODULES:
        importlib.import_module(name)
