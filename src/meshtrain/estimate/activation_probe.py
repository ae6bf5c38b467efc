"""Measure activation memory: the bytes of what autograd keeps for the backward.

``SavedBytes`` is a ``saved_tensors_hooks`` context: every tensor an operation saves for
its backward passes through ``pack``, and the distinct storages among them (a view saved by
two operations counts once) that are not the model's parameters or buffers are summed.
At the end of the forward that sum is the activation memory the backward will read, the
quantity ``meshtrain.estimate.activations`` estimates.

Why this measure and not the process's resident memory or the allocator's peak: it is
deterministic (the same bytes on every run and under load, on a machine shared by other
processes), it needs no CUDA allocator statistics (CPU tests), and it leaves out what is
not activation memory (temporaries freed inside an operation, allocator caching, the
Python heap). The transient peak of the backward (a gradient buffer beside the saved
tensors) is a separate, smaller term not counted here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """``with SavedBytes(model.parameters()) as probe: loss = model(...)``; then
    ``probe.bytes`` (distinct saved storages, parameters and ``exclude`` left out)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude and ptr not in self._seen:
            self._seen[ptr] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
