"""Flat, bucketed parameter and gradient storage shared by data parallelism and ZeRO.

One ``FlatGroup`` per optimizer param group. Its trainable parameters, in reverse
registration order (roughly the order backward produces their gradients), are packed
into buckets of at most ``bucket_numel`` elements (a parameter is never split; one larger
than the cap gets a bucket of its own). Each bucket is zero-padded to a multiple of the
number of partitions ``P`` (``P = 1`` for plain data parallelism, ``P = dp`` for ZeRO),
so rank ``r`` owns chunk ``r`` of every bucket::

    bucket b:  [ chunk 0 | chunk 1 | ... | chunk P-1 ]      chunk = numel_b / P

Parameters and their ``.grad`` are views into two flat buffers of the model dtype
(``param_flat``, ``grad_flat``). The optimizer does not see the model's parameters: it
steps *master chunks*, one fp32 tensor per bucket holding this rank's chunk. When the
model is fp32, on the master device, a master chunk *is* the view of ``param_flat`` (no
copy, no extra memory); with bf16/fp16 or CPU offload the master chunks are a separate
fp32 shard of ``numel / P`` elements.

Memory per rank for Psi trainable parameters (16-bit model, Adam: K = 12 bytes/param of
fp32 master + two moments), matching the ZeRO paper: parameters 2 Psi, gradients 2 Psi,
master + optimizer states 12 Psi / P. (Gradient sharding, ZeRO-2, and parameter
sharding, ZeRO-3, build on this layout in ``meshtrain.parallel.zero``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    """A contiguous run of whole parameters inside a FlatGroup, padded to P chunks."""

    index: int
    start: int  # offset in the group's flat buffers
    numel: int  # padded size, divisible by the partition count
    chunk: int  # numel // partitions: what one rank owns
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each param's offset in the flat buffer
    ready: int = 0  # params whose gradient has landed in the current backward

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.narrow(0, self.start, self.numel)

    def owned(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat.narrow(0, self.start + rank * self.chunk, self.chunk)


def pack_buckets(
    numels: list[int], bucket_numel: int, partitions: int
) -> list[tuple[int, int, list[int]]]:
    """Greedy packing: ``[(start, padded_numel, [param indices]), ...]`` in order."""
    out: list[tuple[int, int, list[int]]] = []
    start, cur, members = 0, 0, []
    for i, n in enumerate(numels):
        if members and cur + n > bucket_numel:
            padded = -(-cur // partitions) * partitions
            out.append((start, padded, members))
            start, cur, members = start + padded, 0, []
        members.append(i)
        cur += n
    if members:
        padded = -(-cur // partitions) * partitions
        out.append((start, padded, members))
    return out


class FlatGroup:
    """One param group's flat buffers, buckets and master chunks (see module docstring)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        partitions: int,
        rank: int,
        bucket_numel: int,
        master_device: torch.device | None = None,
    ) -> None:
        if not params:
            raise ValueError("a FlatGroup needs at least one trainable parameter")
        self.partitions, self.rank = partitions, rank
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        for p in params:
            if p.dtype != self.dtype or p.device != self.device:
                raise ValueError(
                    f"parameters of one group must share dtype and device; found "
                    f"{p.dtype}/{p.device} beside {self.dtype}/{self.device}"
                )
        self.params = list(reversed(params))  # backward order
        packed = pack_buckets([p.numel() for p in self.params], bucket_numel, partitions)
        self.numel = sum(n for _, n, _ in packed)
        self.param_flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.grad_flat = torch.zeros_like(self.param_flat)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        for b_index, (start, numel, members) in enumerate(packed):
            bucket = Bucket(b_index, start, numel, numel // partitions)
            offset = start
            for i in members:
                p = self.params[i]
                bucket.params.append(p)
                bucket.offsets.append(offset)
                self.bucket_of[p] = bucket
                offset += p.numel()
            self.buckets.append(bucket)
        with torch.no_grad():
            for p, view in self._param_views(self.param_flat):
                view.copy_(p.data)
                p.data = view
        self.attach_grads()

        self.master_device = master_device or self.device
        self.master_aliases_params = (
            self.dtype == torch.float32 and self.master_device == self.device
        )
        if self.master_aliases_params:
            self.master_shard = None
            self.master_chunks = [b.owned(self.param_flat, rank) for b in self.buckets]
        else:
            self.master_shard = torch.empty(
                self.numel // partitions, dtype=torch.float32, device=self.master_device
            )
            self.master_chunks = []
            offset = 0
            for b in self.buckets:
                chunk = self.master_shard.narrow(0, offset, b.chunk)
                chunk.copy_(b.owned(self.param_flat, rank))
                self.master_chunks.append(chunk)
                offset += b.chunk
        # the optimizer steps these; each is its own leaf tensor sharing the storage above
        self.master_params = [nn.Parameter(c, requires_grad=True) for c in self.master_chunks]
        # Reduced gradients this rank owns: with one partition the reduced bucket itself,
        # otherwise a separate shard the reduce-scatter writes into.
        self.grad_shard = (
            self.grad_flat
            if partitions == 1
            else torch.zeros(self.numel // partitions, dtype=self.dtype, device=self.device)
        )

    # views -------------------------------------------------------------------------------
    def _param_views(self, flat: torch.Tensor):
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets, strict=True):
                yield p, flat.narrow(0, off, p.numel()).view(p.shape)

    def attach_grads(self) -> None:
        """Point every ``param.grad`` at its slice of ``grad_flat`` (autograd then
        accumulates in place). Cheap; re-run when a user reset ``.grad`` to None."""
        for p, view in self._param_views(self.grad_flat):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def owned_grad_chunks(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunk of every bucket (valid after the reduction)."""
        if self.partitions == 1:
            return [b.view(self.grad_flat) for b in self.buckets]
        out, offset = [], 0
        for b in self.buckets:
            out.append(self.grad_shard.narrow(0, offset, b.chunk))
            offset += b.chunk
        return out

    def shard_chunk(self, bucket: Bucket) -> torch.Tensor:
        """Where this rank's reduced chunk of ``bucket`` goes (a view of ``grad_shard``)."""
        if self.partitions == 1:
            return bucket.view(self.grad_flat)
        offset = sum(b.chunk for b in self.buckets[: bucket.index])
        return self.grad_shard.narrow(0, offset, bucket.chunk)

    # the optimizer step --------------------------------------------------------------------
    def load_master_grads(self, factor: float) -> None:
        """Give each master chunk its fp32 gradient, multiplied by ``factor``
        (1 / loss scale x clip coefficient)."""
        for master, g in zip(self.master_params, self.owned_grad_chunks(), strict=True):
            if g.dtype == torch.float32 and g.device == master.device:
                if factor != 1.0:
                    g.mul_(factor)
                master.grad = g
            else:
                mg = g.to(device=master.device, dtype=torch.float32, non_blocking=True)
                master.grad = mg.mul_(factor) if factor != 1.0 else mg

    def release_master_grads(self) -> None:
        for master in self.master_params:
            master.grad = None

    def copy_master_to_params(self) -> None:
        """Write updated master chunks into this rank's chunks of ``param_flat``."""
        if self.master_aliases_params:
            return
        for b, master in zip(self.buckets, self.master_chunks, strict=True):
            b.owned(self.param_flat, self.rank).copy_(master, non_blocking=True)

    def zero_grads(self) -> None:
        self.grad_flat.zero_()
        if self.grad_shard is not self.grad_flat:
            self.grad_shard.zero_()

    # accounting ----------------------------------------------------------------------------
    @property
    def trainable_numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this group keeps for parameters, gradients and fp32 masters on this rank."""
        size = self.param_flat.element_size()
        grads = self.grad_flat.numel() * size
        if self.grad_shard is not self.grad_flat:
            grads += self.grad_shard.numel() * size
        master = 0 if self.master_shard is None else self.master_shard.numel() * 4
        return {"params": self.numel * size, "grads": grads, "master": master}
