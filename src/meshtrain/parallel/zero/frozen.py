"""ZeRO stage 3: frozen parameters sharded like trainable ones, without gradient state.

A frozen parameter (``requires_grad=False``: a LoRA base weight, a frozen embedding) that
belongs to a stage-3 gather unit and has at least ``stage3_param_persistence_threshold``
elements is packed into a ``FrozenGroup``: one bucket per unit (per dtype), padded to a
multiple of the data-parallel size ``N``, of which each rank keeps one chunk. For ``Phi``
frozen elements of ``s`` bytes a rank holds::

    parameters   s Phi / N   (the shard; the whole base model only as units are used)
    gradients    0           (autograd computes none)
    optimizer    0           (the optimizer never sees them)

Communication per micro-step, all of it parameter all-gathers (nothing is reduced):
``s Phi_u`` when unit ``u`` runs forward, and ``s Phi_u`` again before its backward when
its outputs need a gradient (a frozen embedding feeding nothing trainable is not
gathered for backward). Gradient traffic stays the adapter's alone.

Freeing in backward: a trainable bucket is freed once its gradients are reduced
(``GradReducer``); a frozen bucket has no gradient, so it is freed when the gradient of
every input of its unit that requires one has been computed (tensor hooks on the
inputs, ``ParamGatherer``): every autograd node that reads the frozen weight then has
run. A unit whose inputs need no gradient (the first one) keeps its frozen bucket until
the end of backward (``ZeroStage.after_backward``).

Checkpoints read the frozen values through :func:`whole_state_items`, which gathers one
unit bucket at a time, so a save never holds the whole frozen model on a rank.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from meshtrain.parallel.zero.flat_group import FlatGroup
from meshtrain.parallel.zero.partition import full_numel


class FrozenGroup(FlatGroup):
    """A ``FlatGroup`` of frozen parameters: sharded values only (module docstring)."""

    def _init_grads(self) -> None:
        self.grad_flat = self.grad_shard = None
        self.grad_chunks = []

    def _init_masters(self, master_device: torch.device, separate: bool) -> None:
        self.master_device = master_device
        self.master_aliases_params = True  # nothing to write back: never stepped
        self.master_shard = None
        self.master_chunks = []
        self.master_params = []

    @property
    def trainable_numel(self) -> int:
        return 0

    @property
    def frozen_numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes.values())

    def state_bytes(self) -> dict[str, int]:
        return {"params": self.param_shard.numel() * self.itemsize, "grads": 0, "master": 0}

    def load_full(self, p: nn.Parameter, full: torch.Tensor) -> None:
        """Write ``p``'s whole value ``full`` into this rank's chunk of its bucket."""
        b = self.bucket_of[p]
        off = next(o for q, o in zip(b.params, b.offsets, strict=True) if q is p)
        flat = full.reshape(-1).to(self.dtype)
        lo = b.start + self.rank * b.chunk  # this rank's chunk in the flat index space
        a, z = max(lo, off), min(lo + b.chunk, off + flat.numel())
        if z > a:
            with torch.no_grad():
                b.in_shard(self.param_shard)[a - lo : z - lo].copy_(flat[a - off : z - off])


def frozen_groups(
    units: list[nn.Module],
    threshold: int,
    *,
    partitions: int,
    rank: int,
    param_device: torch.device | None,
    select=None,
) -> list[FrozenGroup]:
    """Shard the frozen parameters of ``units`` (the first unit holding one owns it):
    one ``FrozenGroup`` per (dtype, device), one bucket per unit. ``select(p)``: which
    frozen parameters this plan shards (expert ones go to the edp plan; default all)."""
    owner: dict[nn.Parameter, int] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            if not p.requires_grad and full_numel(p) >= threshold and p not in owner:
                if select is None or select(p):
                    owner[p] = i
    by_kind: dict[tuple, list[nn.Parameter]] = {}
    for p in owner:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    return [
        FrozenGroup(
            params,
            partitions=partitions,
            rank=rank,
            bucket_numel=1 << 62,  # one bucket per unit: one all-gather per use
            shard_params=True,
            param_device=param_device,
            keys=[owner[p] for p in params],
        )
        for params in by_kind.values()
    ]


class _Params:
    """What ``ZeroStage.gathered`` reads of a module: ``parameters()``."""

    def __init__(self, params) -> None:
        self._params = list(params)

    def parameters(self):
        return iter(self._params)


def whole_state_items(module: nn.Module, zero):
    """``(key, tensor)`` of ``module.state_dict(keep_vars=True)``, with ``zero``'s sharded
    frozen parameters gathered one unit bucket at a time: such a tensor is whole only
    until the next item (copy it); every rank must iterate to the end."""
    sharded = {id(p): b for g in zero.frozen_groups for p, b in g.bucket_of.items()}
    current, stack = None, ExitStack()
    with stack:
        for key, t in module.state_dict(keep_vars=True).items():
            b = sharded.get(id(t))
            if b is not None and b is not current:
                stack.close()
                stack.enter_context(zero.gathered(_Params(b.params)))
                current = b
            yield key, t


__all__ = ["FrozenGroup", "frozen_groups", "whole_state_items"]
