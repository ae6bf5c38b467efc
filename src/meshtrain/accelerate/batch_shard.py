"""accelerate's dealing of a prepared loader's batches, as a resumable sampler.

accelerate 1.15 (``data_loader.BatchSamplerShard``, ``split_batches=False``,
``even_batches=True``) deals *whole batches*: the loader's batch sampler cuts the epoch's
order ``P`` into batches of ``B`` and process ``r`` of ``R`` takes batches ``r, r + R,
r + 2R, ...``. A global step therefore holds ``R B`` consecutive positions of ``P``, rank
0's batch first. So that every process runs the same number of full batches, the stream
is padded at its end with its own beginning (``P[0], P[1], ...``, cycled when the dataset
is smaller than one global batch) up to a multiple of ``R B``; with ``drop_last`` the
last incomplete global step is left out instead.

In slots: the pass deals ``M`` positions; slot ``j`` is ``P[j]`` for ``j < M`` and the
padding ``P[(j - M) mod M]`` after; local row ``l`` of rank ``r`` is slot
``((l // B) R + r) B + l mod B``; each rank holds ``ceil(M / (R B)) B`` rows
(``floor`` with ``drop_last``). Gathering one batch from every rank gives the slots of
that global step in order, so ``gather_for_metrics`` keeps the first ``M - k R B`` rows
of global step ``k`` (``rows_kept``), accelerate's ``remainder``.

``split_batches=True``: the loader's ``batch_size`` is the global batch and each process
takes its ``B / R`` consecutive rows of every batch, which is the rule above with
``B / R`` rows per rank (accelerate requires ``R | B``; so does meshtrain).

The order ``P``: ``0..N-1`` for an unshuffled loader. Shuffled, accelerate gives the
loader's ``RandomSampler`` a ``torch.Generator`` seeded at ``prepare`` with a seed drawn
from the global torch RNG, and keeps it the same on every process (rank 0's); epoch
``e``'s order is the ``(e + 1)``-th pass of that ``RandomSampler`` (each pass draws
``torch.randperm(N)`` and one empty one from the generator). The sampler reproduces it
from the seed (``_permutation``), so a resumed run continues the same order. In one
process accelerate leaves the ``RandomSampler`` alone, which draws a fresh seed from the
global RNG at the start of every pass; so does this sampler (``draw_each_pass``). An
explicit ``Accelerator(seed=...)`` (meshtrain's) fixes the generator's seed instead.

Position and resharding are the base sampler's (``meshtrain.data.sampler``): all ranks
consume the same number of whole batches, so what is consumed is always a prefix of
``P`` (``C0 + k R B`` after ``k`` batches), and a resumed pass re-deals the rest.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import RandomSampler

from meshtrain.data.sampler import DistributedSampler


class BatchShardSampler(DistributedSampler):
    """Indices of this rank's whole batches, accelerate's order (module docstring)."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        draw_each_pass: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.batch_size = int(batch_size)
        self.draw_each_pass = bool(draw_each_pass and shuffle)

    def _permutation(self) -> np.ndarray:
        n = self.num_samples_total
        key = (self.seed, self.epoch, self.shuffle, n)
        if self._perm_key != key:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed)
                passes = 1 if self.draw_each_pass else self.epoch + 1
                for _ in range(passes):  # torch's own sampler: the generator's exact draws
                    perm = list(RandomSampler(range(n), generator=g))
                self._perm = np.asarray(perm, dtype=np.int64)
            else:
                self._perm = np.arange(n, dtype=np.int64)
            self._perm_key = key
        assert self._perm is not None
        return self._perm

    def _count(self, start: int) -> int:
        remaining = max(0, self.num_samples_total - start)
        step = self.batch_size * self.num_replicas
        steps = remaining // step if self.drop_last else math.ceil(remaining / step)
        return steps * self.batch_size

    def indices(self, start: int | None = None) -> np.ndarray:
        start = self._next_start if start is None else start
        n = self.num_samples_total
        total = self._count(start) * self.num_replicas
        stream = self._permutation()[start:n] if start < n else np.zeros(0, np.int64)
        if total == 0:
            return np.zeros(0, np.int64)
        if total > len(stream):  # the stream's own beginning, cycled
            stream = np.concatenate([stream, stream[np.arange(total - len(stream)) % len(stream)]])
        order = stream[:total].reshape(-1, self.num_replicas, self.batch_size)
        return order[:, self.rank, :].reshape(-1)

    def __iter__(self):
        if self.draw_each_pass and self._next_start == 0:
            # torch's RandomSampler without a generator: a fresh seed from the global RNG
            # when the pass starts (a resumed pass keeps the seed it was saved with)
            self.seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return super().__iter__()


def rows_kept(local_start: int, rows: int, replicas: int, remaining: int, batch_size: int) -> int:
    """How many leading rows of a gathered global batch are real (not padding): the batch
    that held this rank's local rows ``[local_start, local_start + rows)`` of a pass
    dealing ``remaining`` positions covers slots ``k R B .. k R B + R rows`` in order."""
    first = (local_start // batch_size) * replicas * batch_size
    return max(0, min(replicas * rows, remaining - first))


def draw_seed() -> int:
    """accelerate's seed for a shuffled loader's generator: drawn from the global torch RNG
    at ``prepare``, rank 0's kept everywhere (accelerate synchronises the generator from
    the main process; over the whole world, so tensor/pipeline ranks agree too)."""
    seed = torch.tensor([int(torch.empty((), dtype=torch.int64).random_().item())])
    dist = torch.distributed
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


__all__ = ["BatchShardSampler", "draw_seed", "rows_kept"]
