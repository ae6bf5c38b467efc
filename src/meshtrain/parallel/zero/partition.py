"""Parameters partitioned one by one at construction (``meshtrain.zero.Init``).

A parameter of ``n`` elements partitioned over a group of ``P`` ranks is flattened,
zero-padded to ``P c`` elements with ``c = ceil(n / P)``, and rank ``r`` keeps
``[r c, (r + 1) c)``::

    param (shape S, n elements) -> flat [ shard 0 | shard 1 | ... | shard P-1 ]   c each

Each rank holds ``c`` elements instead of ``n`` (``P c - n < P`` of them padding), in the
attributes DeepSpeed uses, so code written for DeepSpeed's ZeRO-3 reads them unchanged:

==================  ==========================================================
``p.data``          an empty placeholder (0 elements) of the parameter's dtype
``p.ds_tensor``     this rank's shard, 1-D, ``c`` elements
``p.ds_shape``      the full shape ``S``; ``p.ds_numel`` is ``n``
``p.ds_id``         a number unique within one ``Init`` context
==================  ==========================================================

This layout is per parameter, because at construction nothing is known about the
engine's ZeRO-3 units and buckets. When the Engine lays the parameters out in its own
flat buckets (``FlatGroup``), it asks :func:`full_value` for one parameter at a time: one
all-gather of ``P c`` elements, used to fill that bucket and freed, so a rank still never
holds more than one gather unit whole (:func:`release` then drops the construction
shard). Parameters the engine does not shard (frozen ones below stage 3, for instance)
are made whole by :func:`materialize` after the layout is built.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group

_GROUP = "_meshtrain_partition_group"  # the comm Group the parameter was split over


class Ref:
    """A reference kept on a parameter that pickles as empty, so ``torch.save`` of a model
    does not try to pickle process groups or an engine along with its parameters."""

    __slots__ = ("target",)

    def __init__(self, target: object = None) -> None:
        self.target = target

    def __reduce__(self):
        return (Ref, ())


def _group_of(p: torch.Tensor) -> Group:
    return getattr(p, _GROUP).target


def is_partitioned(p: torch.Tensor) -> bool:
    """True for a parameter that holds only its construction-time shard."""
    ref = getattr(p, _GROUP, None)
    return ref is not None and ref.target is not None


def full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's real shape, partitioned or not."""
    return p.ds_shape if is_partitioned(p) else p.shape


def full_numel(p: torch.Tensor) -> int:
    """The parameter's real number of elements, partitioned or not."""
    return p.ds_numel if is_partitioned(p) else p.numel()


def shard_numel(numel: int, parts: int) -> int:
    """Elements each of ``parts`` ranks keeps of a parameter of ``numel`` elements."""
    return -(-numel // parts)


def _slice(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's shard of ``flat`` (a full parameter's elements), padded, as a copy."""
    c = shard_numel(flat.numel(), group.size)
    shard = torch.zeros(c, dtype=flat.dtype, device=flat.device)
    lo, hi = group.rank * c, min((group.rank + 1) * c, flat.numel())
    if hi > lo:
        shard[: hi - lo].copy_(flat[lo:hi])
    return shard


def partition(
    p: nn.Parameter,
    group: Group,
    ds_id: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    src: int | None = 0,
) -> None:
    """Keep only this rank's shard of ``p`` (see the module docstring).

    ``src`` (a group rank) first broadcasts its values so every rank slices the same full
    tensor, as the Engine's start-up broadcast from rank 0 would; None skips it.
    """
    with torch.no_grad():
        full = p.data
        if src is not None and group.size > 1:
            full = full.contiguous()
            comm.broadcast(full, src, group, label="zero.Init")
        dtype = dtype or full.dtype
        shard = _slice(full.reshape(-1), group).to(device=device or full.device, dtype=dtype)
        p.ds_shape, p.ds_numel, p.ds_id = full.shape, full.numel(), ds_id
        p.ds_tensor = shard
        setattr(p, _GROUP, Ref(group))
        p.data = torch.empty(0, dtype=dtype, device=full.device)


def full_value(p: nn.Parameter, device: torch.device | None = None) -> torch.Tensor:
    """All-gather a partitioned parameter's whole value (a new tensor of ``ds_shape``)."""
    group = _group_of(p)
    shard = p.ds_tensor
    if device is not None:
        shard = shard.to(device)
    out = torch.empty(shard.numel() * group.size, dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, shard, group, label="zero.Init")
    return out[: p.ds_numel].view(p.ds_shape)


def store(p: nn.Parameter, full: torch.Tensor, src: int | None) -> None:
    """Write a whole value back into ``p``'s shard; with ``src`` (a group rank) that
    rank's value is broadcast first, so its changes land in every rank's shard."""
    group = _group_of(p)
    with torch.no_grad():
        if src is not None and group.size > 1:
            full = full.contiguous()
            comm.broadcast(full, src, group, label="zero.Init")
        p.ds_tensor.copy_(_slice(full.reshape(-1), group))


def release(p: nn.Parameter) -> None:
    """Forget the construction-time partition (the Engine now owns the parameter)."""
    for name in ("ds_tensor", _GROUP):
        if hasattr(p, name):
            delattr(p, name)


def materialize(params) -> None:
    """Make every still-partitioned parameter of ``params`` whole again, in its current
    dtype and device (collective: every rank of the partition group calls it)."""
    with torch.no_grad():
        for p in params:
            if is_partitioned(p):
                full = full_value(p, p.device)
                p.data = full.to(dtype=p.dtype).clone()
                release(p)


OWNER = "_meshtrain_owner"  # the ZeroStage whose flat buffers hold the parameter


def owner(p: torch.Tensor):
    """The ``ZeroStage`` whose buffers hold ``p``'s values, or None."""
    ref = getattr(p, OWNER, None)
    return None if ref is None else ref.target


def adopt(module: nn.Module, zero) -> None:
    """After the Engine laid out ``module``: make leftover partitioned parameters (frozen
    below stage 3, or in no optimizer group) whole, and mark every parameter in a flat buffer with the
    ``ZeroStage`` that owns it, so ``GatheredParameters`` finds where its values live."""
    materialize(module.parameters())
    for g in [*zero.flat_groups, *zero.frozen_groups]:
        for p in g.params:
            setattr(p, OWNER, Ref(zero))


__all__ = [
    "OWNER",
    "Ref",
    "adopt",
    "full_numel",
    "full_shape",
    "full_value",
    "is_partitioned",
    "materialize",
    "owner",
    "partition",
    "release",
    "shard_numel",
    "store",
]
