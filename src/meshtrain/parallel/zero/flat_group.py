"""Flat, bucketed parameter and gradient storage shared by data parallelism and ZeRO 1-3.

One ``FlatGroup`` holds trainable parameters of one optimizer param group. In reverse
registration order (roughly the order backward produces their gradients) they are packed
into buckets of at most ``bucket_numel`` elements (a parameter is never split; one larger
than the cap gets a bucket of its own; ``keys`` force a new bucket where the key changes,
which is how ZeRO-3 aligns buckets with gather units). Each bucket is zero-padded to a
multiple of the partition count ``P`` (``P = 1`` for plain data parallelism, ``P = dp``
for ZeRO), so rank ``r`` owns chunk ``r`` of every bucket::

    bucket b:  [ chunk 0 | chunk 1 | ... | chunk P-1 ]      chunk = numel_b / P

What a rank keeps, per ``FlatGroup`` of ``n`` padded elements of ``s`` bytes:

=====================  ====================================  ==========================
storage                full (``shard_*=False``)              sharded (``shard_*=True``)
=====================  ====================================  ==========================
parameters             ``param_flat``: n (params are views)  ``param_shard``: n / P; a
                                                             bucket is gathered into a
                                                             temporary buffer for use
gradients              ``grad_flat``: n (``.grad`` views;    ``grad_shard``: n / P; each
                       None between windows, see             bucket's ``.grad`` tensors
                       ``grad_reducer``)                     live only until reduced
fp32 master            n / P, or 0 when the model is fp32 on the master device (the
                       masters then *are* this rank's parameter chunks)
=====================  ====================================  ==========================

The optimizer never sees the model's parameters: it steps ``master_params``, fp32 leaves
that cut each bucket's master chunk into *slices* of at most ``slice_numel`` elements
(default ``2**18``, 1 MiB in fp32), and ``copy_master_to_params`` writes them back.

Why slices, when one leaf per bucket would do: an element-wise optimizer allocates
temporaries the size of the tensor it steps (torch's AdamW: ``sqrt(v)`` and its quotient,
two of them at once on CPU). With one leaf per bucket that is up to two bucket-sized
buffers on every step (2 x 14 MiB for the 3.7M-parameter benchmark model in one bucket);
with slices it is two slices, whatever the bucket size. Buckets stay large (few
collectives), the optimizer's working set stays small. Element-wise optimizers (Adam,
AdamW, SGD, Adagrad) give bit-identical results for any slicing; the slices share the
chunk's storage, so nothing is copied. Checkpoints see whole chunks
(``optimizer_state`` / ``set_optimizer_state`` join and cut the slices' states).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshtrain.parallel.zero.master_layout import (
    LAYOUTS,
    cut_state,
    join_state,
    master_leaves,
    master_spans,
)
from meshtrain.parallel.zero.packing import pack_buckets, pack_whole, padding_spans
from meshtrain.parallel.zero.partition import (
    full_numel,
    full_shape,
    full_value,
    is_partitioned,
    release,
)

SLICE_NUMEL = 1 << 18  # elements per optimizer leaf (module docstring: why slices)


@dataclass(eq=False)
class Bucket:
    """A contiguous run of whole parameters inside a FlatGroup, padded to P chunks."""

    index: int
    start: int  # offset in the group's flat (unsharded) index space
    numel: int  # padded size, divisible by the partition count
    chunk: int  # numel // partitions: what one rank owns
    shard_start: int  # offset of this bucket's chunk inside a rank's shard
    key: object = None  # the packing key (ZeRO-3: the unit)
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each param's offset in the flat space

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.narrow(0, self.start, self.numel)

    def owned(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat.narrow(0, self.start + rank * self.chunk, self.chunk)

    def in_shard(self, shard: torch.Tensor) -> torch.Tensor:
        return shard.narrow(0, self.shard_start, self.chunk)


class FlatGroup:
    """One param group's flat buffers, buckets and master chunks (see module docstring)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        partitions: int,
        rank: int,
        bucket_numel: int,
        shard_grads: bool = False,
        shard_params: bool = False,
        master_device: torch.device | None = None,
        separate_master: bool = False,
        param_device: torch.device | None = None,
        keys: list | None = None,
        slice_numel: int = SLICE_NUMEL,
        layout: str = "flat",
    ) -> None:
        if not params:
            raise ValueError("a FlatGroup needs at least one trainable parameter")
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
        self.partitions, self.rank = partitions, rank
        self.layout = layout
        self.align = LAYOUTS[layout]
        self.slice_numel = max(1, slice_numel)
        self.shard_grads, self.shard_params = shard_grads, shard_params
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        self.itemsize = first.element_size()  # bytes per element of params and grads
        for p in params:
            if p.dtype != self.dtype or p.device != self.device:
                raise ValueError(
                    f"parameters of one group must share dtype and device; found "
                    f"{p.dtype}/{p.device} beside {self.dtype}/{self.device}"
                )
        self.params = list(reversed(params))  # backward order
        rev_keys = list(reversed(keys)) if keys is not None else None
        numels = [full_numel(p) for p in self.params]  # true sizes, even if partitioned
        if layout == "whole":
            packed = pack_whole(numels, bucket_numel, partitions, rev_keys)
        else:  # contiguous: each parameter right after the previous, on the align grid
            packed = []
            for start, numel, members in pack_buckets(
                numels, bucket_numel, partitions, rev_keys, self.align
            ):
                sizes = [-(-numels[i] // self.align) * self.align for i in members]
                offsets = [start + sum(sizes[:k]) for k in range(len(members))]
                packed.append((start, numel, members, offsets))
        self.numel = sum(n for _, n, _, _ in packed)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        shard_start = 0
        for b_index, (start, numel, members, offsets) in enumerate(packed):
            key = rev_keys[members[0]] if rev_keys is not None else None
            bucket = Bucket(b_index, start, numel, numel // partitions, shard_start, key)
            shard_start += bucket.chunk
            for i, offset in zip(members, offsets, strict=True):
                p = self.params[i]
                bucket.params.append(p)
                bucket.offsets.append(offset)
                self.bucket_of[p] = bucket
            self.buckets.append(bucket)
        self.shapes = {p: full_shape(p) for p in self.params}
        self.params_offloaded = param_device is not None  # ZeRO-3 offload_param
        self._init_params(param_device or self.device)
        self._init_grads()
        self._init_masters(master_device or self.device, separate_master)

    # construction ------------------------------------------------------------------------
    def _init_params(self, param_device: torch.device) -> None:
        if not self.shard_params:
            self.param_flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self.param_shard = None
            with torch.no_grad():
                for b in self.buckets:
                    for p, view in self.views(b, self.param_flat):
                        view.copy_(self._value(p))
                        p.data = view
            return
        self.param_flat = None
        self.param_shard = torch.zeros(
            self.numel // self.partitions, dtype=self.dtype, device=param_device
        )
        with torch.no_grad():
            for b in self.buckets:
                # each parameter's owned part straight into the shard (padding stays zero):
                # no bucket-sized temporary, which was the largest transient of a load
                lo = b.start + self.rank * b.chunk
                mine = b.in_shard(self.param_shard)
                for p, off in zip(b.params, b.offsets, strict=True):
                    value = self._value(p)  # every parameter: zero.Init's gather is collective
                    s, e = max(off, lo), min(off + value.numel(), lo + b.chunk)
                    if s < e:
                        mine[s - lo : e - lo].copy_(value.reshape(-1)[s - off : e - off])
                for p in b.params:
                    p.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def _value(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s whole value. One partitioned at construction (``meshtrain.zero.Init``)
        is all-gathered here, one parameter at a time, and its construction shard dropped."""
        if not is_partitioned(p):
            return p.data
        full = full_value(p, self.device)
        release(p)
        return full

    def _init_grads(self) -> None:
        """Allocated, not written (no resident pages until the first backward: a loaded
        model holds only its parameters). Each element is written before it is read: by
        a window's first reduction (sharded), by the first landing or land_missing_grads
        (full; ``.grad`` starts None, as after ``zero_grads``); padding is zeroed here; a
        step before any backward zeroes all (``ZeroStage.before_step``)."""
        if self.shard_grads:
            self.grad_flat = None
            self.grad_shard = torch.empty(
                self.numel // self.partitions, dtype=self.dtype, device=self.device
            )
            self.grad_chunks = [b.in_shard(self.grad_shard) for b in self.buckets]
            self.grad_views = {}
            return
        self.grad_flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.grad_shard = None
        for b in self.buckets:  # the padding: never a parameter's, reduced as zeros
            sizes = [self.shapes[p].numel() for p in b.params]
            for lo, hi in padding_spans(b.start, b.numel, b.offsets, sizes):
                self.grad_flat[lo:hi].zero_()
        self.grad_chunks = [
            b.view(self.grad_flat) if self.partitions == 1 else b.owned(self.grad_flat, self.rank)
            for b in self.buckets
        ]
        self.grad_views = {p: v for b in self.buckets for p, v in self.views(b, self.grad_flat)}
        for p in self.grad_views:
            p.grad = None

    def zero_grad_storage(self) -> None:
        """Write zeros over all gradient storage (a step that no backward preceded)."""
        for t in (self.grad_flat, self.grad_shard):
            if t is not None:
                t.zero_()

    def _init_masters(self, master_device: torch.device, separate: bool) -> None:
        owned = [self.owned_params(b) for b in self.buckets]
        self.master_device = master_device
        self.master_aliases_params = (
            not separate
            and self.dtype == torch.float32
            and all(o.device == master_device for o in owned)
        )
        if self.master_aliases_params:
            self.master_shard = None
            self.master_chunks = owned
        else:
            pin = separate and master_device.type == "cpu" and torch.cuda.is_available()
            self.master_shard = torch.empty(
                self.numel // self.partitions,
                dtype=torch.float32,
                device=master_device,
                pin_memory=pin,
            )
            self.master_chunks = [b.in_shard(self.master_shard) for b in self.buckets]
            for chunk, src in zip(self.master_chunks, owned, strict=True):
                chunk.copy_(src)
        # the optimizer steps these: leaves sharing the storage above, at most slice_numel
        # elements each, so its temporaries stay small (module docstring)
        self.slice_spans = [master_spans(self, b) for b in self.buckets]
        self.master_slices = [
            master_leaves(c, spans)
            for c, spans in zip(self.master_chunks, self.slice_spans, strict=True)
        ]
        self.master_params = [m for slices in self.master_slices for m in slices]

    # views -------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """True when each rank owns one chunk of every bucket (ZeRO stages 1-3)."""
        return self.partitions > 1

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """Bucket-local ``[lo, hi)`` of the elements whose master this rank holds."""
        lo = self.rank * bucket.chunk if self.sharded else 0
        return lo, lo + bucket.chunk

    def views(self, bucket: Bucket, flat: torch.Tensor, base: int = 0):
        """``(param, view)`` of each parameter of ``bucket`` inside ``flat`` (whose element
        0 is flat-space offset ``base``)."""
        # shapes are remembered: a ZeRO-3 parameter is an empty placeholder between uses
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            shape = self.shapes[p]
            yield p, flat.narrow(0, off - base, shape.numel()).view(shape)

    def owned_params(self, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk of ``bucket``'s parameter values (model dtype)."""
        if self.shard_params:
            return bucket.in_shard(self.param_shard)
        return bucket.owned(self.param_flat, self.rank)

    def land_grad(self, param: torch.Tensor) -> None:
        """Full gradients: put ``param``'s fresh ``.grad`` into its view of ``grad_flat``
        and point ``.grad`` at the view (a no-op when it is the view already, and for
        sharded gradients). Called by the reducer's hook right after autograd stored it."""
        view = self.grad_views.get(param)
        grad = param.grad
        if view is not None and grad is not None and grad is not view:
            view.copy_(grad)
            param.grad = view

    def land_missing_grads(self) -> None:
        """Before the window's reduction: every parameter whose gradient did not land
        through the hook (no gradient in this window: zero; one written without autograd's
        hooks, e.g. the pipeline's split backward: copied) now has it in ``grad_flat``."""
        for p, view in self.grad_views.items():
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            p.grad = view

    def take_bucket_grads(
        self, bucket: Bucket, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sharded gradients: pack the bucket's fresh ``.grad`` tensors (zero for a
        parameter that got none) into one padded buffer of ``dtype`` and drop them.

        ``out`` (``bucket.numel`` elements, any contents) is filled and returned instead of
        a new buffer: every element is written, so a reused, uninitialised one is fine."""
        if out is None:
            out = torch.empty(bucket.numel, dtype=dtype or self.dtype, device=self.device)
        if self.layout != "flat":  # gaps between aligned/whole parameters reduce as zeros
            out.zero_()
        for p, view in self.views(bucket, out, base=bucket.start):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
            else:
                view.zero_()
        if self.layout == "flat":
            used = sum(self.shapes[p].numel() for p in bucket.params)  # packed from offset 0
            out.narrow(0, used, bucket.numel - used).zero_()  # padding to a multiple of P
        return out

    # the optimizer step --------------------------------------------------------------------
    def load_master_grads(self, factor: float) -> None:
        """Give each master chunk its fp32 gradient, multiplied by ``factor``
        (1 / (loss scale x dp size) x clip coefficient)."""
        pending = None  # the accelerator whose copies to the host are in flight
        for slices, spans, g in zip(
            self.master_slices, self.slice_spans, self.grad_chunks, strict=True
        ):
            if g.device != self.master_device and g.device.type == "cuda":
                # offload: cast and scale on the GPU, copy asynchronously into pinned
                # memory, wait once below. Scaling the host copy right after a non_blocking
                # copy read it in flight (H200: losses off a plain loop's by up to 1%); a
                # blocking copy into pageable memory was 4.9x slower (docs/performance.md)
                pending = g.device
                g = g.float() * factor if factor != 1.0 else g.float()
                g = g.to(device=self.master_device, non_blocking=True)
            else:
                if g.dtype != torch.float32 or g.device != self.master_device:
                    g = g.to(device=self.master_device, dtype=torch.float32)
                if factor != 1.0:
                    g.mul_(factor)
            for master, (lo, n, *_) in zip(slices, spans, strict=True):
                master.grad = g.narrow(0, lo, n).view(master.shape)
        if pending is not None:
            torch.cuda.current_stream(pending).synchronize()

    def optimizer_state(self, bucket: Bucket, state: dict) -> dict:
        """The optimizer state of ``bucket``'s master chunk (``master_layout.join_state``)."""
        return join_state(self, bucket, state)

    def set_optimizer_state(self, bucket: Bucket, state: dict, values: dict) -> None:
        """Inverse of ``optimizer_state`` (``master_layout.cut_state``)."""
        cut_state(self, bucket, state, values)

    def release_master_grads(self) -> None:
        for master in self.master_params:
            master.grad = None

    def copy_master_to_params(self) -> None:
        """Write updated master chunks into this rank's parameter chunks."""
        if self.master_aliases_params:
            return
        for b, master in zip(self.buckets, self.master_chunks, strict=True):
            self.owned_params(b).copy_(master, non_blocking=True)

    def zero_grads(self) -> None:
        """Clear full gradients for the next window: ``.grad = None`` (no pass over
        ``grad_flat``); each gradient's first landing in the window overwrites its view
        (``land_grad``), the ones that never land are zeroed (``land_missing_grads``).
        Sharded gradients need nothing: the first reduction of a window overwrites."""
        for p in self.grad_views:
            p.grad = None

    # accounting ----------------------------------------------------------------------------
    @property
    def trainable_numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes.values())

    def state_bytes(self) -> dict[str, int]:
        """Bytes this group keeps for parameters, gradients and fp32 masters on this rank
        (ZeRO-3 units gathered right now are the gatherer's, not counted here)."""
        size = self.itemsize
        store = self.param_flat if self.param_flat is not None else self.param_shard
        params = store.numel() * size
        grad = self.grad_flat if self.grad_flat is not None else self.grad_shard
        master = 0 if self.master_shard is None else self.master_shard.numel() * 4
        return {"params": params, "grads": grad.numel() * size, "master": master}
