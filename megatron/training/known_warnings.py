"""The library warnings this stack expects, silenced in one place, each by its category, its
message and the package that raises it: a new or different warning still shows.

Call ``silence_known_warnings()`` before megatron-core is imported (most of these are raised by
its imports), in every process that imports it: pretrain_gpt.py, pretrain(), and the tools."""

from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    category: type[Warning]
    message: str                 # a regular expression matched at the start of the message
    why: str                     # why it is harmless here


KNOWN = (
    KnownWarning(UserWarning, r"Transformer Engine and Apex are not installed\. Falling back to ",
                 "megatron-core's imports without CUDA extensions: it uses torch's kernels "
                 "(pretrain() states the fallback in its startup line)"),
    KnownWarning(UserWarning, r"Apex is not installed\. Falling back to Torch Norm",
                 "the same for the layer norm"),
    KnownWarning(UserWarning, r"full scope is deprecated\. Use empty cuda_graph_scope",
                 "TransformerConfig's own default cuda_graph_scope in megatron-core 0.16.1; "
                 "no CUDA graph is captured"),
)

# megatron-core raises them (megatron.core.*); the same words from another package still show.
SOURCE = r"megatron\.core\."


def silence_known_warnings() -> None:
    """Ignore exactly the KNOWN warnings from megatron-core (idempotent)."""
    for known in KNOWN:
        warnings.filterwarnings("ignore", message=known.message, category=known.category,
                                module=SOURCE)
