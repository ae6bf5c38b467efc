"""This rank's random stream for tensor-parallel regions (Megatron's RNG tracker, small).

Dropout inside a tensor-parallel region acts on this rank's own heads or channels, so its
mask must differ across tp ranks (one shared stream would drop the same positions of
different heads: correlated noise). Dropout outside a region acts on activations every tp
rank holds in full, so its mask must be the same on every rank or the replicas diverge.
``RegionRNG`` keeps a second generator state seeded ``seed + 2718 + tp_rank`` (Megatron's
offset) and swaps it into the default generator while a region runs; outside regions the
default generator, seeded alike on every rank, advances identically everywhere.

Limitation: activation checkpointing replays the global generator state, not this one, so
a recomputed region with dropout would draw a new mask; use dropout 0 inside regions with
activation checkpointing.
"""

from __future__ import annotations

import torch


class RegionRNG:
    """Swap this rank's region generator state in (``enter``) and out (``exit``)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._state = torch.Generator().manual_seed(seed).get_state()
        self._cuda_state = (
            torch.Generator(device=self.device).manual_seed(seed).get_state() if self.cuda else None
        )
        self._saved: tuple | None = None

    @property
    def inside(self) -> bool:
        return self._saved is not None

    def enter(self) -> None:
        if self._saved is not None:  # nested region: already on the region stream
            return
        self._saved = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(self.device) if self.cuda else None,
        )
        torch.set_rng_state(self._state)
        if self.cuda:
            torch.cuda.set_rng_state(self._cuda_state, self.device)

    def exit(self) -> None:
        if self._saved is None:
            return
        self._state = torch.get_rng_state()
        torch.set_rng_state(self._saved[0])
        if self.cuda:
            self._cuda_state = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self._saved[1], self.device)
        self._saved = None


__all__ = ["RegionRNG"]
