"""A DataLoader whose saved position is what the training loop actually consumed.

``torch.utils.data.DataLoader`` pulls indices from its sampler ahead of time
(``prefetch_factor * num_workers`` batches with worker processes), so a sampler that
counted the indices it handed out would save a position that runs ahead of training and
skip those batches on resume. :class:`ResumableDataLoader` turns the sampler's own
counting off and records ``len(batch)`` samples in the sampler each time a batch is
*yielded to the training loop*. The sampler's state is then exact, whatever
``num_workers`` is, and can be loaded under another number of replicas (see
:mod:`meshtrain.data.sampler` for the math).

A batch counts as consumed when the loop receives it, so a checkpoint taken after the
optimizer step of that batch resumes with the next one.

``lookahead=True`` collates the next batch before handing out the current one, as
accelerate's ``DataLoaderShard`` (the transformers Trainer's and ``prepare``'s loader)
does. It matters only for a collator that draws random numbers from the global torch
RNG (masked LM's masking) in a model with dropout: the draws then interleave with the
forward's as in the peer (collate 0, collate 1, forward 0, collate 2, forward 1, ...).
The position still counts a batch when the loop receives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from meshtrain.data.sampler import DistributedSampler


class ResumableDataLoader(DataLoader):
    """``DataLoader`` over a :class:`DistributedSampler` with an exact, resumable position.

    Args:
        dataset: a map-style dataset (a torch ``Dataset``, a ``datasets.Dataset``, a
            :class:`~meshtrain.data.store.TokenDataset`, ...).
        batch_size: micro-batch size per rank (``train_micro_batch_size_per_gpu``).
        sampler: a :class:`DistributedSampler`; built from ``num_replicas``, ``rank``,
            ``shuffle`` and ``seed`` when omitted. Another sampler works but is not tracked.
        collate_fn: e.g. one of :mod:`meshtrain.data.collators`.
        drop_last: drop the last incomplete micro-batch of each rank.
        lookahead: collate one batch ahead of the loop (module docstring).
        **kwargs: passed to ``torch.utils.data.DataLoader`` (``num_workers``,
            ``pin_memory``, ``prefetch_factor``, ...; ``in_order`` must stay ``True``).

    ``state_dict()`` / ``load_state_dict()`` / ``set_epoch()`` go to the sampler; the
    state is a small dict of ints, identical on every rank.
    """

    def __init__(
        self,
        dataset: Dataset | Any,
        batch_size: int = 1,
        *,
        sampler: Any = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        lookahead: bool = False,
        **kwargs: Any,
    ) -> None:
        self.lookahead = bool(lookahead)
        if kwargs.get("in_order", True) is False:
            raise ValueError("ResumableDataLoader needs in_order=True to count batches exactly")
        if "batch_sampler" in kwargs:
            raise ValueError("ResumableDataLoader builds its own batches; pass batch_size instead")
        if sampler is None:
            sampler = DistributedSampler(
                dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
            )
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            **kwargs,
        )

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if not isinstance(sampler, DistributedSampler):
            yield from super().__iter__()
            return
        sampler.track_iteration = False
        remaining = len(sampler)  # this rank's samples in the pass about to start
        batch_size = int(self.batch_size or 1)
        batches = super().__iter__()
        if self.lookahead:
            batches = _one_ahead(batches)
        for batch in batches:
            n = min(batch_size, remaining)
            remaining -= n
            sampler.advance(n)
            yield batch

    # -- position (delegated to the sampler) ---------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The sampler's position: small, JSON-serialisable, the same on every rank."""
        return self._tracked_sampler().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the last consumed sample, possibly under another replica count."""
        self._tracked_sampler().load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the sampler's ``set_epoch`` (keeps a loaded position for the same epoch)."""
        self._tracked_sampler().set_epoch(epoch)

    def _tracked_sampler(self) -> DistributedSampler:
        if not isinstance(self.sampler, DistributedSampler):
            raise TypeError(
                "this loader's sampler is not a meshtrain DistributedSampler, so it has no "
                "position to save; build the loader without sampler= or with one"
            )
        return self.sampler


def _one_ahead(batches: Iterator[Any]) -> Iterator[Any]:
    """Each batch once the next one is collated (accelerate's ``DataLoaderShard``)."""
    pending, started = None, False
    for batch in batches:
        if started:
            yield pending
        pending, started = batch, True
    if started:
        yield pending
