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

The order ``P``: ``0..N-1`` for an unshuffled loader. Shuffled, the order comes from a
``torch.Generator`` used *live*, exactly as accelerate uses it: the user's own
(``DataLoader(..., shuffle=True, generator=g)`` or ``RandomSampler(..., generator=g)``),
else on several processes one seeded at ``prepare`` with a seed drawn from the global
torch RNG (rank 0's, as accelerate synchronises it). Each pass that starts a new order
draws what torch's ``RandomSampler`` draws from that generator: ``torch.randperm(N)``
when its first batch is asked for, and the empty tail ``torch.randperm(N)[:0]`` when the
pass runs to its end (a pass left by ``break`` never draws the tail, as in torch). So the
generator's stream, and everything the script draws from it afterwards, is the peer's.
accelerate also broadcasts rank 0's generator state at the start of every pass; the
prepared loader does the same (``PreparedDataLoader``). In one process without a
generator accelerate leaves the ``RandomSampler`` alone, which draws a fresh seed from the
global RNG at the start of every pass; so does this sampler (``draw_each_pass``). An
explicit ``Accelerator(seed=...)`` (meshtrain's) seeds the generator with it instead.

Resume: the generator's state at the pass's ``randperm`` is part of ``state_dict``
(``generator_state``), so a pass resumed from a checkpoint re-draws the same order from
it and leaves the generator where the uninterrupted run left it. A state saved before
this field existed replays the seed's passes instead (exact when every earlier pass ran
to its end).

Position and resharding are the base sampler's (``meshtrain.data.sampler``): all ranks
consume the same number of whole batches, so what is consumed is always a prefix of
``P`` (``C0 + k R B`` after ``k`` batches), and a resumed pass re-deals the rest.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import RandomSampler

from meshtrain.accelerate.collectives import broadcast_in_place
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
        generator: torch.Generator | None = None,
        even_batches: bool = True,
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
        # accelerate pads the last global batch only when it shards (several processes);
        # in one process its loader is the user's, whose last batch is short
        self.even_batches = bool(even_batches)
        self.generator = generator if shuffle else None
        self.draw_each_pass = bool(draw_each_pass and shuffle and generator is None)
        self._pass_state: torch.Tensor | None = None  # the generator at this pass's randperm
        self._fresh = True  # whether the next pass draws a new order

    def _permutation(self) -> np.ndarray:
        if self.generator is not None:
            if self._perm is None:  # a state saved without generator_state: replay
                self._perm = self._replay()
            return self._perm
        n = self.num_samples_total
        key = (self.seed, self.epoch, self.shuffle, n)
        if self._perm_key != key:
            self._perm = self._replay() if self.shuffle else np.arange(n, dtype=np.int64)
            self._perm_key = key
        assert self._perm is not None
        return self._perm

    def _replay(self) -> np.ndarray:
        """Epoch ``epoch``'s order from ``seed``: the ``(epoch + 1)``-th pass of torch's
        sampler over a generator seeded with it (one pass when a seed is drawn per pass)."""
        n = self.num_samples_total
        g = torch.Generator()
        g.manual_seed(self.seed)
        passes = 1 if self.draw_each_pass else self.epoch + 1
        for _ in range(passes):  # torch's own sampler: the generator's exact draws
            perm = list(RandomSampler(range(n), generator=g))
        return np.asarray(perm, dtype=np.int64)

    def _count(self, start: int) -> int:
        remaining = max(0, self.num_samples_total - start)
        if not self.even_batches and not self.drop_last:
            return math.ceil(remaining / self.num_replicas)  # one process: the short tail
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
        if total % (self.num_replicas * self.batch_size):  # uneven: one process only
            return stream[:total]
        order = stream[:total].reshape(-1, self.num_replicas, self.batch_size)
        return order[:, self.rank, :].reshape(-1)

    def __iter__(self):
        # runs when the loader asks for its first batch: after torch's DataLoader drew its
        # base seed (from the loader's generator), as RandomSampler's draws come after it
        g, n = self.generator, self.num_samples_total
        if g is not None:
            if self._fresh:
                self._pass_state = g.get_state()
                self._perm = torch.randperm(n, generator=g).numpy()
            elif self._pass_state is not None:  # a resumed pass: its own order again
                g.set_state(self._pass_state)
                self._perm = torch.randperm(n, generator=g).numpy()
        elif self.draw_each_pass and self._fresh:
            # torch's RandomSampler without a generator: a fresh seed from the global RNG
            # when the pass starts (a resumed pass keeps the seed it was saved with)
            self.seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self._fresh = False
        return super().__iter__()

    def _generate(self, mine: np.ndarray):
        yield from super()._generate(mine)
        # the pass ran to its end: torch's sampler draws its empty tail; a new order next
        if self.generator is not None:
            torch.randperm(self.num_samples_total, generator=self.generator)
        self._fresh = True

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self._fresh = True
        super().set_epoch(epoch)

    def skip_to(self, num_batches: int) -> None:
        """The next pass starts ``num_batches`` whole global batches into an order drawn
        as accelerate's ``skip_first_batches`` loader draws it: the shuffling generator's
        next pass from its state now (or a new seed from the global RNG), never a pass
        order restored by ``load_state_dict``. accelerate does not save the generator, so
        a script resumed in epoch ``e > 0`` skips into its generator's first pass; so does
        this one (without ``skip_first_batches`` meshtrain resumes the saved order)."""
        start = min(self.num_samples_total, num_batches * self.batch_size * self.num_replicas)
        self._next_start = self._pass_start = self._consumed = start
        self._local = 0
        self._fresh, self._pass_state = True, None

    def pass_batches(self, skipped: int) -> int:
        """This rank's batches in a pass that starts ``skipped`` global batches in."""
        start = min(self.num_samples_total, skipped * self.batch_size * self.num_replicas)
        return math.ceil(self._count(start) / self.batch_size)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.generator is not None and self._pass_state is not None:
            state["generator_state"] = self._pass_state.tolist()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        saved = state.get("generator_state")
        self._pass_state = None if saved is None else torch.tensor(saved, dtype=torch.uint8)
        self._perm = None
        self._perm_key = None
        # a pass saved part-way continues its order; one saved at its start draws anew
        self._fresh = int(state["consumed"]) == 0 and saved is None


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
        broadcast_in_place(seed, src=0)
    return int(seed.item())


__all__ = ["BatchShardSampler", "draw_seed", "rows_kept"]
