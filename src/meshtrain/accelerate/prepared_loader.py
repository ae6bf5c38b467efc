"""``PreparedDataLoader``: the loader ``Accelerator.prepare`` hands back, a
:class:`~meshtrain.data.loader.ResumableDataLoader` dealing the dataset's batches over
the data-parallel ranks in accelerate's order (``batch_shard``); batches land on the
device; its position is saved by ``save_state`` and resumed exactly.
``prepared_loader`` rebuilds the user's ``DataLoader`` as one."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtrain.accelerate.collectives import broadcast_in_place
from meshtrain.data.loader import ResumableDataLoader
from meshtrain.errors import ConfigError


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, Mapping):  # dicts and transformers' BatchEncoding
        return type(x)({k: _to_device(v, device) for k, v in x.items()})
    if isinstance(x, list | tuple) and not hasattr(x, "_fields"):
        return type(x)(_to_device(v, device) for v in x)
    return x


class PreparedDataLoader(ResumableDataLoader):
    """A resumable, data-parallel loader built from the user's ``DataLoader``.

    Each rank gets ``batch_size`` samples per batch (the global batch is ``batch_size x
    num_processes``, as in accelerate). A pass that runs to its end moves to the next
    epoch (a new shuffle), so ``for epoch in ...: for batch in loader`` reshuffles as
    accelerate's loaders do. ``rows_kept()`` says how much of the last global batch is
    real, which is what lets ``gather_for_metrics`` drop the padding exactly.
    """

    def __init__(self, dataset, batch_size: int, *, device: torch.device, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size, **kwargs)
        self.device = device
        self._pass_remaining = 0  # M: samples left in the dataset when this pass began
        self._local_start = 0  # this rank's position in the pass before the last batch
        self._last_rows = 0  # rows in the last batch
        self.end_of_dataloader = False
        self.batches_left = 0  # batches of this pass not yet consumed, the last one included
        self.on_batch = None  # the Accelerator's: which loader gather_for_metrics follows
        self.on_end = None  # and when a pass is over (no loader is being iterated)
        self._abandoned = False  # the last pass was left by ``break`` before its end

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        self._leave_abandoned_pass()
        self._sync_generator()
        # the pass deals the positions C0..N-1 (C0: where it starts, after a resume)
        self._pass_remaining = max(0, len(sampler.dataset) - sampler.next_start)
        self._local_start = self._last_rows = 0
        self.end_of_dataloader = False
        n_batches = len(self)
        started = finished = False
        try:
            for i, batch in enumerate(super().__iter__()):
                started = True
                self._local_start += self._last_rows
                self._last_rows = _rows(batch)
                self.end_of_dataloader = i + 1 == n_batches
                self.batches_left = n_batches - i
                if self.on_batch is not None:
                    self.on_batch(self)
                yield _to_device(batch, self.device)
            finished = True
        finally:
            # a pass that ran to its end, or one left by ``break`` (early stopping): the
            # next ``for`` is the next epoch with a new order, as with torch's and
            # accelerate's loaders (a pass never started leaves the position alone). A
            # pass left part-way keeps its position until then, so a save_state right
            # after the break resumes where it stopped
            if finished or started:
                self.batches_left = 0
                if self.on_end is not None:
                    self.on_end(self)
            if finished:
                sampler.set_epoch(sampler.epoch + 1)
            elif started:
                self._abandoned = True

    def _leave_abandoned_pass(self) -> None:
        if self._abandoned:
            self._abandoned = False
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def start_at(self, num_batches: int) -> None:
        """The next pass starts ``num_batches`` global batches into its epoch's order
        (``skip_first_batches``; a new epoch if the last pass was left by ``break``)."""
        self._leave_abandoned_pass()
        self.sampler.skip_to(num_batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._abandoned = False  # the loaded position is where the next pass starts
        super().load_state_dict(state)

    def _sync_generator(self) -> None:
        """accelerate's ``synchronize_rng_states(["generator"])``: every pass starts from
        rank 0's state of the shuffling generator (over the whole world, as accelerate)."""
        g = getattr(self.sampler, "generator", None)
        dist = torch.distributed
        if g is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        state = g.get_state()
        broadcast_in_place(state, src=0)
        g.set_state(state)

    def rows_kept(self) -> int:
        """How many leading rows of the last global batch gathered in rank order are real
        (the rest repeat the pass's first rows to even out the ranks; ``batch_shard``)."""
        from meshtrain.accelerate.batch_shard import rows_kept

        s = self.sampler
        return rows_kept(
            self._local_start, self._last_rows, s.num_replicas, self._pass_remaining, s.batch_size
        )


def prepared_loader(loader, topology, device, seed: int | None, split_batches: bool):
    """``Accelerator.prepare_data_loader``: the user's ``DataLoader`` rebuilt over a
    ``batch_shard.BatchShardSampler`` (accelerate's dealing and shuffle) as a
    ``PreparedDataLoader``."""
    from torch.utils.data import RandomSampler

    from meshtrain.accelerate.batch_shard import BatchShardSampler, draw_seed

    if loader.batch_size is None:
        raise ConfigError(
            "prepare: a DataLoader with a batch_sampler cannot be resharded; build it "
            "with batch_size= (and shuffle=) instead"
        )
    batch_size = int(loader.batch_size)
    if split_batches:
        if batch_size % topology.dp_size:
            raise ConfigError(
                f"prepare: split_batches=True needs the DataLoader's batch_size "
                f"({batch_size}) to be a multiple of the {topology.dp_size} data-parallel "
                "processes (accelerate's rule); change batch_size"
            )
        batch_size //= topology.dp_size
    shuffle = isinstance(loader.sampler, RandomSampler)
    # the generator that orders the batches, used live (``batch_shard``): the user's own,
    # else accelerate's, seeded now from the global RNG on several processes (rank 0's),
    # else meshtrain's Accelerator(seed=); one process without either draws per pass
    generator = loader.sampler.generator if shuffle else None
    fixed = seed is not None
    if shuffle and generator is None and (fixed or topology.world_size > 1):
        generator = torch.Generator()
        generator.manual_seed(seed if fixed else draw_seed())
    sampler = BatchShardSampler(
        loader.dataset,
        batch_size,
        num_replicas=topology.dp_size,
        rank=topology.dp_rank,
        shuffle=shuffle,
        seed=0 if seed is None else seed,
        drop_last=loader.drop_last,
        draw_each_pass=generator is None,
        generator=generator,
        even_batches=topology.dp_size > 1,
    )
    prepared = PreparedDataLoader(
        loader.dataset,
        batch_size,
        device=device,
        sampler=sampler,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        # torch draws each pass's base seed from it (the global RNG without one), as the
        # loader accelerate rebuilds with the user's kwargs does
        generator=loader.generator,
    )
    prepared.shuffle = shuffle
    return prepared


def _rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return _rows(next(iter(batch.values())))
    if isinstance(batch, list | tuple):
        # a tuple of columns (tensors, dicts, lists), or one column of plain rows
        # (default_collate of strings gives the list of them)
        first = batch[0] if batch else None
        return (
            _rows(first) if isinstance(first, torch.Tensor | Mapping | list | tuple) else len(batch)
        )
    return 1


__all__ = ["PreparedDataLoader", "prepared_loader"]
