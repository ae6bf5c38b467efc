"""Gradient reduction over the data-parallel group, overlapped with backward.

Algorithm. Each ``FlatGroup`` bucket counts its parameters' gradients as autograd
finishes accumulating them (``register_post_accumulate_grad_hook``). When a bucket's last
gradient lands on a *synchronising* backward (the gradient-accumulation boundary, outside
``no_sync``), its collective starts asynchronously while backward carries on with
earlier layers; ``finish()`` (called by the engine's step) launches buckets that never
filled (parameters unused in this forward), waits for all of them and averages.

* ``P = 1`` (ZeRO stage 0, plain data parallelism): ``all_reduce`` of the bucket, in place.
* ``P = dp`` (ZeRO stages 1 and 2): ``reduce_scatter`` of the bucket into this rank's
  chunk of ``grad_shard``.

Averaging: the sum is divided by the data-parallel size ``N`` after the reduction. With
the engine's backward scaling each micro-batch loss by ``1 / gradient_accumulation_steps``,
``N`` ranks x micro-batch ``m`` x ``k`` accumulation steps produce exactly the gradient of
one process on batch ``N m k`` (up to summation order).

Bytes per optimizer step, in ``meshtrain.distributed.comm``'s convention, for a group of
padded size ``Psi_pad`` elements of ``s`` bytes: stage 0 records ``2 s Psi_pad``
(all-reduce), stages 1-2 record ``s Psi_pad`` (reduce-scatter). Non-boundary micro-steps
record nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.parallel.flat import Bucket, FlatGroup


class GradReducer:
    """Launches each bucket's reduction as soon as its gradients are complete."""

    def __init__(self, groups: list[FlatGroup], dp_group: Group) -> None:
        self.groups = groups
        self.dp_group = dp_group
        self.sync = True  # reduce on this backward?
        self._pending: list[tuple[FlatGroup, Bucket, object]] = []
        self._launched: set[tuple[int, int]] = set()
        self._handles = []
        for gi, group in enumerate(groups):
            for p in group.params:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(self._make_hook(gi, group))
                )

    def _make_hook(self, gi: int, group: FlatGroup):
        def hook(param: torch.Tensor) -> None:
            if not self.sync:
                return
            bucket = group.bucket_of[param]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(gi, group, bucket)

        return hook

    def _launch(self, gi: int, group: FlatGroup, bucket: Bucket) -> None:
        if (gi, bucket.index) in self._launched:
            return
        self._launched.add((gi, bucket.index))
        grads = bucket.view(group.grad_flat)
        if group.partitions == 1:
            work = comm.all_reduce(grads, self.dp_group, async_op=True)
        else:
            work = comm.reduce_scatter(
                group.shard_chunk(bucket), grads, self.dp_group, async_op=True
            )
        self._pending.append((group, bucket, work))

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally and communicate nothing."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def finish(self) -> None:
        """Launch unfilled buckets in a fixed order, wait for all, average by dp size."""
        for gi, group in enumerate(self.groups):
            for bucket in group.buckets:
                self._launch(gi, group, bucket)
        n = self.dp_group.size
        for group, bucket, work in self._pending:
            work.wait()
            if n > 1:
                group.shard_chunk(bucket).div_(n)
        self._pending.clear()
        self._launched.clear()
        for group in self.groups:
            for bucket in group.buckets:
                bucket.ready = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
