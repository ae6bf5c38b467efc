"""Gradient reduction over the data-parallel group, overlapped with backward.

Algorithm. Each ``FlatGroup`` bucket counts its parameters' gradients as autograd
finishes accumulating them (``register_post_accumulate_grad_hook``). When a bucket's last
gradient lands on a *synchronising* backward, its collective starts asynchronously while
backward carries on with earlier layers (``overlap_comm``; without it every bucket is
launched in ``finish``); ``finish()`` launches buckets that never filled (parameters
unused in this forward) in a fixed order, waits for all of them and lands the results.

Full gradients (stages 0-1) live in ``grad_flat``; the same hook lands each one there
first (``FlatGroup.land_grad``), on every backward, synchronising or not. Between windows
``.grad`` is None (``zero_grads``), so autograd hands over the fresh gradient it computed
and the hook copies it into its view and points ``.grad`` at the view; a second backward
in the window then accumulates into the view in place. Per window that is one copy of
the gradients, where clearing ``grad_flat`` and accumulating into it costs a memset plus
an add (read two, write one): two passes over the gradients less. This is DDP's own
scheme (``zero_grad(set_to_none=True)``; its hook copies into the bucket). ``finish()``
lands what no hook did (zero for a parameter without a gradient, a copy for one written
without autograd's hooks) before it launches the remaining buckets.

* ``P = 1`` (ZeRO stage 0, plain data parallelism): ``all_reduce`` of the bucket of
  ``grad_flat``, in place.
* ``P = dp``, full gradients (stage 1): ``reduce_scatter`` of the bucket of ``grad_flat``
  in place into this rank's chunk of it.
* ``P = dp``, sharded gradients (stages 2 and 3): the bucket's fresh ``.grad`` tensors are
  packed into one buffer and dropped, and the buffer is reduce-scattered into this
  rank's chunk of ``grad_shard`` (the first reduction of an accumulation window writes
  the chunk, later ones add to it).

At most ``max_in_flight`` (default 2) reductions are outstanding: launching one more first
waits for the oldest and lands it. Unbounded, every bucket of a backward can be in flight
at its end (on 2 CPU cores gloo's thread falls behind compute), and each holds its
packed buffer (stages 2-3) and gloo's clone of the input (reduce-scatter), i.e. up to two
extra copies of all gradients. Two in flight keep one reduction running while the next
bucket fills, which is all the overlap a single communication thread can use.

The reduce-scatters go through ``comm.reduce_scatter_bucket``: on CPU (gloo) an
in-place all-reduce of the bucket is used instead (about half the time; the bytes are
still recorded as a reduce-scatter of the bucket). Stage 1's full-gradient buffer then
holds the summed gradient in every chunk, not only the owned one; nothing reads the others,
and the next window's landings overwrite them.

Stages 2-3 pack each bucket's gradients into a buffer taken from a small pool (at most
``max_in_flight + 1`` buffers of the largest bucket, filled without zeroing first): a
fresh buffer of 32 MiB or more is a fresh ``mmap`` in glibc and pays a page fault per 4 KiB
on first touch (about 17 ms for 38 MiB here) every time. The pool is dropped at the end of
``finish()``, so it adds nothing to the memory held during the optimizer step.

Which backward synchronises is the caller's decision (``begin_backward(sync)``): the ZeRO
stage plan makes it every backward for sharded gradients and the accumulation boundary
otherwise. ``communication_data_type`` reduces in another dtype (e.g. fp32 sums of bf16
gradients): the bucket is cast into a temporary of that dtype, reduced, and cast back.

The result is the *sum* over ranks; the engine folds the ``1 / dp`` of averaging into
the one scaling pass it makes anyway (``FlatGroup.load_master_grads``). With backward
scaling each micro-batch loss by ``1 / gradient_accumulation_steps``, ``N`` ranks x
micro-batch ``m`` x ``k`` accumulation steps then give exactly the gradient of one
process on batch ``N m k`` (up to summation order).

Bytes per synchronising backward, in ``meshtrain.distributed.comm``'s convention, for a
group of padded size ``Psi_pad`` elements of ``c`` bytes in the communication dtype:
``2 c Psi_pad`` for the all-reduce (stage 0), ``c Psi_pad`` for a reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.errors import TrainingError
from meshtrain.parallel.zero.flat_group import Bucket, FlatGroup


class GradReducer:
    """Launches each bucket's reduction as soon as its gradients are complete.

    ``on_reduced(group, bucket)`` is called once a bucket's gradients are handed to the
    collective (ZeRO-3 frees the gathered parameters there). ``names`` maps parameters
    to their names for the unused-parameter error (``ignore_unused=False``).
    """

    def __init__(
        self,
        groups: list[FlatGroup],
        dp_group: Group,
        *,
        overlap: bool = True,
        comm_dtype: torch.dtype | None = None,
        ignore_unused: bool = True,
        names: dict[torch.Tensor, str] | None = None,
        on_reduced: Callable[[FlatGroup, Bucket], None] | None = None,
        max_in_flight: int = 2,
    ) -> None:
        self.groups = groups
        self.dp_group = dp_group
        self.overlap = overlap
        self.comm_dtype = comm_dtype
        self.ignore_unused = ignore_unused
        self.names = names or {}
        self.on_reduced = on_reduced
        self.max_in_flight = max(1, max_in_flight)
        self._sync = True  # reduce on this backward?
        self._local = False  # inside no_sync()
        self._ready = {id(b): 0 for g in groups for b in g.buckets}
        self._fresh = {id(g): True for g in groups}  # sharded: nothing reduced this window
        self._seen: set[int] = set()  # params with a gradient (only when checking unused)
        self._pending: list[tuple] = []
        self._launched: set[int] = set()
        self._spare: list[torch.Tensor] = []  # pooled packing buffers (stages 2-3)
        self._handles = []
        for group in groups:
            for p in group.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(group)))

    def _hook(self, group: FlatGroup):
        def hook(param: torch.Tensor) -> None:
            group.land_grad(param)  # full gradients: into grad_flat, on every backward
            if not self._sync:
                return
            if not self.ignore_unused:
                self._seen.add(id(param))
            bucket = group.bucket_of[param]
            self._ready[id(bucket)] += 1
            if self.overlap and self._ready[id(bucket)] == len(bucket.params):
                self._launch(group, bucket)

        return hook

    # the window ------------------------------------------------------------------------------
    def begin_window(self) -> None:
        """A new accumulation window: the next reduction of sharded gradients overwrites."""
        for key in self._fresh:
            self._fresh[key] = True

    def begin_backward(self, sync: bool) -> None:
        """Whether the coming backward reduces (ignored inside ``no_sync``)."""
        self._sync = sync and not self._local

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally and communicate nothing."""
        previous, self._local = self._local, True
        try:
            yield
        finally:
            self._local = previous

    @property
    def synchronising(self) -> bool:
        return self._sync

    # launching -------------------------------------------------------------------------------
    def _launch(self, group: FlatGroup, bucket: Bucket) -> None:
        if id(bucket) in self._launched:
            return
        self._launched.add(id(bucket))
        target = group.grad_chunks[bucket.index]
        cast = self.comm_dtype is not None and self.comm_dtype != group.dtype
        landing = source = None
        if group.grad_flat is not None and not group.sharded:
            source = target.to(self.comm_dtype) if cast else target
            landing = source if cast else None
            work = comm.all_reduce(source, self.dp_group, async_op=True)
        elif group.grad_flat is not None:
            # stage 1: in place, the output is this rank's chunk of the input (gloo and
            # NCCL both allow it), so no temporary the size of the gradient shard
            source = bucket.view(group.grad_flat)
            if cast:
                source = source.to(self.comm_dtype)
                landing = source.narrow(0, group.rank * bucket.chunk, bucket.chunk)
            out = target if landing is None else landing
            work = comm.reduce_scatter_bucket(out, source, self.dp_group)
        else:
            source = group.take_bucket_grads(bucket, out=self._buffer(group, bucket))
            # the first reduction of a window writes the shard; later ones reduce into
            # their own packed buffer's chunk and add it in finish()
            if cast or not self._fresh[id(group)]:
                landing = source.narrow(0, group.rank * bucket.chunk, bucket.chunk)
            out = target if landing is None else landing
            work = comm.reduce_scatter_bucket(out, source, self.dp_group)
        # ``source`` rides along so the buffer outlives the async collective
        self._pending.append((group, bucket, work, landing, source))
        if self.on_reduced is not None:
            self.on_reduced(group, bucket)
        while len(self._pending) > self.max_in_flight:
            self._land(*self._pending.pop(0))

    def _buffer(self, group: FlatGroup, bucket: Bucket) -> torch.Tensor:
        """A packing buffer of ``bucket.numel`` elements in the communication dtype."""
        dtype = self.comm_dtype or group.dtype
        for i, buf in enumerate(self._spare):
            if buf.dtype == dtype and buf.device == group.device and buf.numel() >= bucket.numel:
                return self._spare.pop(i).narrow(0, 0, bucket.numel)
        largest = max(b.numel for g in self.groups if g.grad_flat is None for b in g.buckets)
        return torch.empty(largest, dtype=dtype, device=group.device).narrow(0, 0, bucket.numel)

    def _land(self, group: FlatGroup, bucket: Bucket, work, landing, source) -> None:
        """Wait for one reduction and put its result where it belongs."""
        work.wait()
        if landing is not None:
            target = group.grad_chunks[bucket.index]
            if group.grad_flat is None and not self._fresh[id(group)]:
                target.add_(landing)
            else:
                target.copy_(landing)
        if group.grad_flat is None and len(self._spare) <= self.max_in_flight:
            self._spare.append(source._base)  # the pooled buffer (source is a narrow of it)

    def finish(self) -> None:
        """Launch unfilled buckets in a fixed order, wait for all, land the results. After a
        backward that did not synchronise (``no_sync``), everything is reduced here."""
        if not self.ignore_unused and self._sync:
            self._check_unused()
        for group in self.groups:
            group.land_missing_grads()  # before the buckets still to launch read grad_flat
            for bucket in group.buckets:
                self._launch(group, bucket)
        for entry in self._pending:
            self._land(*entry)
        self._pending.clear()
        self._spare.clear()  # not held through the optimizer step (module docstring)
        self._launched.clear()
        for group in self.groups:
            self._fresh[id(group)] = False
            for bucket in group.buckets:
                self._ready[id(bucket)] = 0

    def note_written(self, params) -> None:
        """``params`` got their ``.grad`` written directly, not through autograd's
        accumulation (ZB-H1's weight-gradient step): count them for the unused-parameter
        check, which otherwise hears of a gradient only from the accumulation hooks."""
        if self._sync and not self.ignore_unused:
            self._seen.update(id(p) for p in params if p.grad is not None)

    def _check_unused(self) -> None:
        missing = [p for g in self.groups for p in g.params if id(p) not in self._seen]
        self._seen.clear()
        if missing:
            shown = [self.names.get(p, f"<parameter of shape {tuple(p.shape)}>") for p in missing]
            raise TrainingError(
                f"zero_optimization.ignore_unused_parameters is false and {len(missing)} "
                f"trainable parameter(s) got no gradient in this backward: {shown[:8]}"
                f"{' ...' if len(shown) > 8 else ''}; freeze them (requires_grad=False), use "
                "them in forward, or set ignore_unused_parameters to true (they then count "
                "as zero gradients)"
            )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
