"""``Accelerator.skip_first_batches(loader, n)``: the loader of one pass that starts at
its ``n``-th batch, as accelerate's examples use it to resume mid-epoch::

    accelerator.load_state(folder)
    for epoch in range(starting_epoch, epochs):
        if epoch == starting_epoch and resume_step:
            active = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active = train_dataloader
        for batch in active: ...

accelerate returns a new loader whose batch sampler drops the first ``n`` batches of a
new pass of the loader's sampler. For a prepared loader meshtrain positions the prepared
loader itself: its next pass starts ``n`` global batches into an order drawn as
accelerate's is (the shuffling generator's next pass: ``batch_shard.BatchShardSampler
.skip_to``), whatever position ``load_state`` restored, so the batches are the peer's. In
epoch 0 that is the uninterrupted run's order; resumed in a later epoch it is the
generator's first pass again, as under accelerate (which does not save the generator);
a script that iterates the loader after ``load_state`` without skipping gets meshtrain's
exact resume instead. The object returned iterates that one pass; iterating it again
(accelerate's loader skips again every time) starts a pass again at batch ``n``.

A loader that was not prepared is skipped as accelerate skips it: the same batches from
its own batch sampler, the first ``n`` dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from meshtrain.errors import ConfigError


class SkippedLoader:
    """One pass of ``loader`` from its ``num_batches``-th batch (module docstring)."""

    def __init__(self, loader: Any, num_batches: int) -> None:
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ConfigError(
                f"skip_first_batches(num_batches={num_batches!r}): expected an integer >= 0"
            )
        if not isinstance(loader, DataLoader):
            raise ConfigError(
                f"skip_first_batches: {type(loader).__name__} is not a DataLoader; pass the "
                "prepared DataLoader (or a torch DataLoader)"
            )
        self.loader = loader
        self.num_batches = num_batches

    def _prepared(self) -> bool:
        from meshtrain.accelerate.prepared_loader import PreparedDataLoader

        return isinstance(self.loader, PreparedDataLoader)

    def __iter__(self) -> Iterator[Any]:
        if self._prepared():
            self.loader.start_at(self.num_batches)
            yield from self.loader
        else:
            yield from itertools.islice(self.loader, self.num_batches, None)

    def __len__(self) -> int:
        if self._prepared():
            return self.loader.sampler.pass_batches(self.num_batches)
        return max(0, len(self.loader) - self.num_batches)

    def __getattr__(self, name: str) -> Any:  # batch_size, dataset, end_of_dataloader, ...
        return getattr(self.loader, name)


__all__ = ["SkippedLoader"]
