"""A rank's memory as measured: its persistent training state, and the activations autograd keeps.

Activations are the tensors autograd saves for the backward of each micro-batch
(torch.autograd.graph.saved_tensors_hooks around its forward), counted once per storage and
without the parameters, by part of the stage: the embedding (everything before the first
transformer layer), the transformer layers, and the head (final norm, output layer, loss). They
are held from the micro-batch's forward until its backward is done (for a split backward: its
weight-gradient part, which still needs the layers' inputs), the same span the simulator counts.
Only the first MEASURED_ITERATIONS iterations of a runtime are measured.
On a GPU this is what torch.cuda.max_memory_allocated would add up to less the transient
buffers of one op; on a CPU there is no allocator to ask.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

PARTS = ("embedding", "layers", "head")
# Iterations measured under each runtime: every iteration runs the same op list, so its
# activations and their peak are those of the first; the hooks stay off the rest.
MEASURED_ITERATIONS = 3


class MemoryMeter:
    def __init__(self, module: torch.nn.Module, first: bool, last: bool) -> None:
        self.first, self.last = first, last
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.saved = dict.fromkeys(PARTS, 0)   # bytes, summed over the micro-batches measured
        self.forwards = 0
        self.layers = len(module.decoder.layers)
        self._alive: dict[int, int] = {}
        self.peak_bytes = 0                    # the most activation bytes held at once
        self._part = PARTS[0]
        self._first: int | None = None
        layers = module.decoder.layers
        self._hooks = [layer.register_forward_pre_hook(lambda *_: self._enter("layers"))
                       for layer in layers]
        if len(layers):
            self._hooks.append(layers[-1].register_forward_hook(lambda *_: self._enter("head")))

    def _enter(self, part: str) -> None:
        self._part = part

    def measuring(self, iteration: int) -> bool:
        """Whether the forwards of `iteration` (0-based) are measured."""
        if self._first is None:
            self._first = iteration
        if iteration < self._first + MEASURED_ITERATIONS:
            return True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return False

    @contextmanager
    def forward(self, microbatch: int):
        seen: set[int] = set()
        held = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal held
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._params and ptr not in seen:
                seen.add(ptr)
                held += storage.nbytes()
                self.saved[self._part] += storage.nbytes()
            # Detached: the tensor itself would tie a saved output to its own grad_fn, a cycle
            # that keeps the graph (and the process groups its nodes hold) alive until a
            # garbage collection, which may come after those groups' world is gone.
            return t.detach()

        self._part = PARTS[0]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._alive[microbatch] = held
        self.forwards += 1
        self.peak_bytes = max(self.peak_bytes, sum(self._alive.values()))

    def backward_done(self, microbatch: int) -> None:
        self._alive.pop(microbatch, None)

    def reset(self) -> None:
        """An interrupted iteration's activations are gone."""
        self._alive.clear()

    def per_microbatch(self) -> dict[str, float]:
        """Mean bytes a micro-batch's forward keeps, per part (per layer for the layers)."""
        n = max(self.forwards, 1)
        return {"embedding": self.saved["embedding"] / n,
                "layers": self.saved["layers"] / n / max(self.layers, 1),
                "head": self.saved["head"] / n}


def optimizer_bytes(optimizers) -> int:
    """The torch optimizers' state (Adam's moments): with the distributed optimizer, only this
    rank's shards."""
    return sum(v.numel() * v.element_size() for opt in optimizers for s in opt.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


def state_bytes(module: torch.nn.Module, optimizers) -> int:
    """Parameters, their gradient buffers (megatron-core DDP's main_grad) and optimizer state."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    grads = sum(getattr(p, "main_grad", None).numel() * p.main_grad.element_size()
                for p in module.parameters() if getattr(p, "main_grad", None) is not None)
    return params + grads + optimizer_bytes(optimizers)
