"""Gradient reduction over the data-parallel group, overlapped with backward.

Algorithm. Each ``FlatGroup`` bucket counts its parameters' gradients as autograd
finishes accumulating them (``register_post_accumulate_grad_hook``). When a bucket's last
gradient lands on a *synchronising* backward, its collective starts asynchronously while
backward carries on with earlier layers; ``finish()`` launches buckets that never filled
(parameters unused in this forward) in a fixed order, waits for all of them and lands
the results.

* ``P = 1`` (ZeRO stage 0, plain data parallelism): ``all_reduce`` of the bucket of
  ``grad_flat``, in place. Synchronises only on the accumulation boundary.
* ``P = dp``, full gradients (stage 1): ``reduce_scatter`` of the bucket of ``grad_flat``
  in place into this rank's chunk of it. Synchronises only on the boundary.
* ``P = dp``, sharded gradients (stages 2 and 3): the bucket's fresh ``.grad`` tensors are
  packed into one buffer and dropped, and the buffer is reduce-scattered into this
  rank's chunk of ``grad_shard`` (added to it after the first micro-step of an
  accumulation window). This happens on *every* backward, so no rank ever holds more
  than the buckets in flight; ``finish()`` then runs at the end of every backward.

The result is the *sum* over ranks; the engine folds the ``1 / dp`` of averaging into
the one scaling pass it makes anyway (``FlatGroup.load_master_grads``). With backward
scaling each micro-batch loss by ``1 / gradient_accumulation_steps``, ``N`` ranks x
micro-batch ``m`` x ``k`` accumulation steps then give exactly the gradient of one
process on batch ``N m k`` (up to summation order).

Bytes per optimizer step, in ``meshtrain.distributed.comm``'s convention, for a group of
padded size ``Psi_pad`` elements of ``s`` bytes: stage 0 records ``2 s Psi_pad``
(all-reduce), stages 1-3 record ``s Psi_pad`` of reduce-scatter per synchronising
backward (stages 2-3: per micro-step). Non-synchronising micro-steps record nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.parallel.flat_group import Bucket, FlatGroup


class GradReducer:
    """Launches each bucket's reduction as soon as its gradients are complete.

    ``on_reduced(group, bucket)`` is called once a bucket's gradients are handed to the
    collective (ZeRO-3 frees the gathered parameters there).
    """

    def __init__(
        self,
        groups: list[FlatGroup],
        dp_group: Group,
        on_reduced: Callable[[FlatGroup, Bucket], None] | None = None,
    ) -> None:
        self.groups = groups
        self.dp_group = dp_group
        self.on_reduced = on_reduced
        self.sync = True  # reduce on this backward?
        self._pending: list[tuple] = []
        self._launched: set[tuple[int, int]] = set()
        self._handles = []
        for gi, group in enumerate(groups):
            for p in group.params:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(self._make_hook(gi, group))
                )

    @property
    def every_backward(self) -> bool:
        """Sharded gradients must be reduced on every backward (no local accumulation)."""
        return any(g.shard_grads for g in self.groups)

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
        target = group.grad_chunks[bucket.index]
        landing = source = None
        if group.partitions == 1 and not group.shard_grads:
            work = comm.all_reduce(target, self.dp_group, async_op=True)
        elif not group.shard_grads:
            # stage 1: in place, the output is this rank's chunk of the input (gloo and
            # NCCL both allow it), so no temporary the size of the gradient shard
            source = bucket.view(group.grad_flat)
            work = comm.reduce_scatter(target, source, self.dp_group, async_op=True)
        else:
            source = group.take_bucket_grads(bucket)
            # the first micro-step of a window writes the shard; later ones reduce into
            # their own packed buffer's chunk and add it in finish()
            if not group.grads_fresh:
                landing = source.narrow(0, group.rank * bucket.chunk, bucket.chunk)
            out = target if landing is None else landing
            work = comm.reduce_scatter(out, source, self.dp_group, async_op=True)
        # ``source`` rides along so the packed buffer outlives the async collective
        self._pending.append((group, bucket, work, landing, source))
        if self.on_reduced is not None:
            self.on_reduced(group, bucket)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally and communicate nothing."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def finish(self) -> None:
        """Launch unfilled buckets in a fixed order, wait for all, land the results."""
        for gi, group in enumerate(self.groups):
            for bucket in group.buckets:
                self._launch(gi, group, bucket)
        for group, bucket, work, landing, _source in self._pending:
            work.wait()
            if landing is not None:
                group.grad_chunks[bucket.index].add_(landing)
        self._pending.clear()
        self._launched.clear()
        for group in self.groups:
            group.grads_fresh = False
            for bucket in group.buckets:
                bucket.ready = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
