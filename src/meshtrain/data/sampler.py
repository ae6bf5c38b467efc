"""A deterministic, resumable and reshardable distributed sampler.

The math
--------
Let ``N = len(dataset)``, ``R`` the number of data-parallel replicas and ``r`` this rank.

* **Global order.** Epoch ``e`` visits the samples in the order ``P_e``: a permutation
  of ``0..N-1`` drawn by ``torch.randperm(N)`` from a generator seeded with ``seed + e``
  (``P_e = 0..N-1`` without shuffling). Every rank computes the same ``P_e``.
* **Consumed count.** ``C`` is the number of positions of ``P_e`` already trained on,
  counted *globally*: when every rank has consumed ``k`` samples, ``C = C0 + k*R`` where
  ``C0`` is where the current pass started. Consumption is always a prefix of ``P_e``.
* **Dealing.** A pass starting at ``C0`` deals the remaining positions ``C0..N-1``
  round-robin: rank ``r`` takes positions ``C0 + r, C0 + r + R, C0 + r + 2R, ...``.
  With ``M = N - C0`` remaining, each rank gets ``ceil(M / R)`` samples; the last
  ``ceil(M / R) * R - M`` slots (fewer than ``R``) are padding that repeats
  ``P_e[0], P_e[1], ...``. With ``drop_last`` each rank gets ``floor(M / R)`` and the
  ``M mod R`` tail is left out. From ``C0 = 0`` this is exactly the order of
  ``torch.utils.data.DistributedSampler``.
* **Dealing whole batches** (``deal_batch = B > 1``, the transformers Trainer's loader:
  accelerate's ``BatchSamplerShard`` over a ``BatchSampler`` of ``B``): the remaining
  positions are cut into batches of ``B`` and rank ``r`` takes batches ``r, r + R, ...``,
  so local row ``l`` of rank ``r`` is slot ``((l // B) R + r) B + l mod B``. On ``R > 1``
  ranks the pass is padded the same way up to a multiple of ``R B`` (each rank gets
  ``ceil(M / (R B)) B`` samples; ``floor`` with ``drop_last``), as accelerate's
  ``even_batches`` pads with the epoch's first rows; on one rank nothing is padded (the
  loader's last batch is short). ``B = 1`` is the round-robin rule above. One optimizer
  step of ``k`` batches per rank covers the same ``k R B`` consecutive positions under
  both rules; what differs is which rank holds which row (the rows a collator pads or
  masks together).
* **Undealing (exact rows).** Gathering what the ranks computed on a pass puts rank
  ``r``'s rows after those of ranks ``0..r-1``. Local row ``l`` of rank ``r`` is slot
  ``j = l R + r`` of the pass; slots ``j >= M`` are the padding. ``exact_rows_order``
  gives the indices into that rank-major concatenation that keep each slot ``< M`` once,
  in slot order (the dataset's order for an unshuffled pass). One rule for the
  Accelerator's ``gather_for_metrics`` (a batch at a time, padded pass) and the Trainer's
  evaluation (the whole pass at once, dealt without padding: ranks hold ``ceil((M -
  r) / R)`` rows).
* **Resume / reshard.** ``state_dict()`` stores ``(seed, epoch, C)``; loading it starts
  the next pass at ``C0 = C`` and re-deals the remaining positions over whatever ``R``
  the new run has. The ranks are therefore disjoint within a pass, and over a whole epoch
  with any sequence of replica counts (2 -> 3 -> 4 ...) every sample is consumed exactly
  once, apart from padding (fewer than ``R`` repeats, only at the end of the epoch).

Consumption is recorded in one of two ways. Iterating the sampler directly counts each
index it hands out. :class:`~meshtrain.data.loader.ResumableDataLoader` switches that off
and calls :meth:`DistributedSampler.advance` only when a batch reaches the training loop,
so DataLoader prefetching (``num_workers > 0``) never moves the saved position ahead of
what training used.

Iterating again without :meth:`set_epoch` repeats the epoch from the position the last
pass started at (like torch's sampler); a pass that ran to its end leaves the next one
starting at 0. ``set_epoch`` with the current epoch keeps a loaded position, so the usual
``load_state_dict(...)`` then ``set_epoch(epoch)`` resume order works.

Per-process memory is one int64 permutation (8 bytes per sample) and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from meshtrain.errors import DataError

STATE_VERSION = 1
_STATE_KEYS = ("version", "epoch", "seed", "consumed", "num_samples", "num_replicas", "shuffle")


def _default_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class DistributedSampler(Sampler[int]):
    """Give each data-parallel rank a disjoint, equal share of a deterministic shuffle,
    and resume it exactly — also under a different number of replicas.

    Args:
        dataset: anything with ``len()``.
        num_replicas: data-parallel size (default: the torch.distributed world size, or 1).
        rank: this rank's data-parallel index (default: the torch.distributed rank, or 0).
        shuffle: shuffle with ``torch.randperm`` seeded by ``seed + epoch``.
        seed: shuffle seed; identical on every rank.
        drop_last: drop the tail that does not divide evenly instead of padding it.
        deal_batch: rows dealt to a rank at a time: 1 deals rows round-robin (torch's
            sampler), ``B`` deals whole batches of ``B`` (the transformers Trainer's
            loader under accelerate); see the module docstring.

    See the module docstring for the dealing and resharding math.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        deal_batch: int = 1,
    ) -> None:
        if num_replicas is None or rank is None:
            world, world_rank = _default_world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = world_rank if rank is None else rank
        if int(num_replicas) < 1:
            raise DataError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= int(rank) < int(num_replicas):
            raise DataError(f"rank must be in [0, {num_replicas}), got {rank}")
        if int(deal_batch) < 1:
            raise DataError(
                f"DistributedSampler deal_batch must be >= 1 (rows dealt to a rank at a "
                f"time), got {deal_batch}; pass the per-rank batch size, or 1"
            )
        self.deal_batch = int(deal_batch)
        self.dataset = dataset
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.track_iteration = True  # the loader turns this off and calls advance()
        self._next_start = 0  # where the next pass starts (global position)
        self._pass_start = 0  # where the current (or last) pass started
        self._local = 0  # samples this rank consumed in the current pass
        self._consumed = 0  # global consumed count of this epoch
        self._perm_key: tuple[int, int, bool, int] | None = None
        self._perm: np.ndarray | None = None

    # -- order ------------------------------------------------------------------------
    @property
    def num_samples_total(self) -> int:
        return len(self.dataset)

    def _permutation(self) -> np.ndarray:
        n = self.num_samples_total
        key = (self.seed, self.epoch, self.shuffle, n)
        if self._perm_key != key:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(n, generator=g).numpy()
            else:
                self._perm = np.arange(n, dtype=np.int64)
            self._perm_key = key
        assert self._perm is not None
        return self._perm

    def _count(self, start: int) -> int:
        remaining = max(0, self.num_samples_total - start)
        if self.num_replicas == 1:  # one rank pads nothing; the loader drops a short batch
            return remaining
        step = self.num_replicas * self.deal_batch
        steps = remaining // step if self.drop_last else math.ceil(remaining / step)
        return steps * self.deal_batch

    def indices(self, start: int | None = None) -> np.ndarray:
        """This rank's indices for a pass starting at global position ``start``
        (default: where the next pass starts)."""
        start = self._next_start if start is None else start
        n = self.num_samples_total
        per_rank = self._count(start)
        total = per_rank * self.num_replicas
        perm = self._permutation()
        order = perm[start:n] if start < n else perm[:0]
        if total > len(order):  # pad with the fewest repeats, from the front of P_e
            pad = total - len(order)
            order = np.concatenate([order, perm[np.arange(pad) % n]])
        else:
            order = order[:total]
        if self.num_replicas == 1:
            return order
        # (steps, rank, row): rank r's rows are the r-th batch of every step
        return order.reshape(-1, self.num_replicas, self.deal_batch)[:, self.rank, :].reshape(-1)

    def __len__(self) -> int:
        return self._count(self._next_start)

    def __iter__(self) -> Iterator[int]:
        start = self._next_start
        self._pass_start = start
        self._local = 0
        self._consumed = min(start, self.num_samples_total)
        mine = self.indices(start)
        return self._generate(mine)

    def _generate(self, mine: np.ndarray) -> Iterator[int]:
        for lo in range(0, len(mine), 4096):
            for idx in mine[lo : lo + 4096].tolist():
                if self.track_iteration:
                    self.advance(1)
                yield idx
        self._next_start = 0  # a pass that ran to its end: the next one repeats from 0

    # -- position -----------------------------------------------------------------------
    def advance(self, n: int) -> None:
        """Record that this rank's training loop consumed ``n`` more samples (every rank
        consumes the same number per step, so the global count grows by ``n * R``)."""
        self._local += int(n)
        self._consumed = min(
            self.num_samples_total, self._pass_start + self._local * self.num_replicas
        )

    @property
    def next_start(self) -> int:
        """Global position where the next pass starts (after a resume, mid-epoch)."""
        return self._next_start

    @property
    def consumed(self) -> int:
        """Global number of positions of this epoch's order already consumed."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning; calling it with the current epoch keeps
        the position (so it is safe to call right after :meth:`load_state_dict`)."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._next_start = self._pass_start = self._local = self._consumed = 0

    def state_dict(self) -> dict[str, int]:
        """Small, JSON-serialisable position; identical on every rank."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": self._consumed,
            "num_samples": self.num_samples_total,
            "num_replicas": self.num_replicas,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (possibly saved under another ``num_replicas``): the next
        pass starts at the first unconsumed position of the same global order."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise DataError(
                f"sampler state is missing {missing} (got keys {sorted(state)}); pass the dict "
                "returned by DistributedSampler.state_dict() or ResumableDataLoader.state_dict()"
            )
        if int(state["version"]) > STATE_VERSION:
            raise DataError(
                f"sampler state version {state['version']} is newer than this meshtrain "
                f"understands ({STATE_VERSION}); upgrade meshtrain"
            )
        n = self.num_samples_total
        if int(state["num_samples"]) != n:
            raise DataError(
                f"sampler state was saved for a dataset of {state['num_samples']} samples but "
                f"this dataset has {n}; resume with the same data, or do not restore the data "
                "position (the epoch then restarts from its first sample)"
            )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= n:
            raise DataError(f"sampler state 'consumed'={consumed} is outside [0, {n}]")
        # The order is defined by (seed, epoch, shuffle): adopt them so nothing is skipped.
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self._next_start = self._pass_start = self._consumed = consumed
        self._local = 0


def exact_rows_order(counts: list[int], local_start: int, remaining: int) -> np.ndarray:
    """Indices into the rank-major concatenation of ``counts[r]`` rows from each rank
    ``r`` (its local rows ``local_start, local_start + 1, ...`` of a pass dealing
    ``remaining`` slots over ``len(counts)`` ranks) that keep every real slot once, in slot
    order: ``concatenated[order]`` drops the padding (module docstring, "Undealing")."""
    replicas = len(counts)
    rank = np.repeat(np.arange(replicas, dtype=np.int64), counts)
    local = np.concatenate(
        [np.arange(c, dtype=np.int64) for c in counts] or [np.zeros(0, np.int64)]
    )
    slot = (local + local_start) * replicas + rank
    keep = np.flatnonzero(slot < remaining)
    return keep[np.argsort(slot[keep], kind="stable")]
