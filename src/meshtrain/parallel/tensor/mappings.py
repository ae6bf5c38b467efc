"""Tensor-parallel mappings: autograd functions that communicate over an explicit group.

Megatron-LM's ``tensor_parallel.mappings`` (Shoeybi et al., 2019; Korthikanti et al.,
2022) written on ``meshtrain.distributed.comm`` so every byte is counted in the group's
``CommStats``. Each function takes the tensor-parallel ``Group`` (``topology.tp_group``)
as an argument; nothing is global. ``T`` = group size; ``b`` = bytes of the full
activation ``x`` (``[batch, seq, hidden]`` x element size).

Each mapping is the adjoint of its backward, so a region entered with one and left with
its partner is exact:

==============================  ===========================  ===========================  ==========
mapping                         forward                      backward                     recorded
==============================  ===========================  ===========================  ==========
copy_to_region                  identity                     all-reduce (sum)             bwd 2b
reduce_from_region              all-reduce (sum)             identity                     fwd 2b
scatter_to_region (hidden)      keep this rank's 1/T chunk   all-gather                   bwd b
gather_from_region (hidden)     all-gather                   keep this rank's chunk       fwd b
gather_from_sequence            all-gather along sequence    reduce-scatter along seq.    b, b
reduce_scatter_to_sequence      reduce-scatter along seq.    all-gather along sequence    b, b
==============================  ===========================  ===========================  ==========

(The recorded column uses ``comm``'s convention: an all-reduce of ``b`` bytes records
``2b``, an all-gather / reduce-scatter the bytes of the full tensor ``b``.) With sequence
parallelism an all-reduce becomes a reduce-scatter plus an all-gather: the same volume,
but norms, dropout and residuals between two tensor-parallel regions then run on ``1/T``
of the tokens.

Collectives on a group of size 1 are skipped by ``comm``, so ``T = 1`` is the
single-process computation with no special case.
"""

from __future__ import annotations

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.errors import TopologyError

# --------------------------------------------------------------------------- helpers


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, group)
    return x


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous 1/T chunk of ``x`` along ``dim`` (a copy)."""
    size = x.shape[dim]
    if size % group.size:
        raise TopologyError(
            f"dimension {dim} of size {size} does not divide over the tensor-parallel group "
            f"of {group.size}; with sequence parallelism the sequence length must be a "
            f"multiple of tensor_parallel_size"
        )
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order."""
    if group.size == 1:
        return x
    x = x.contiguous()
    # flat buffers: gloo wants the output as the inputs concatenated along dim 0
    out = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.view(-1), group)
    return torch.cat(out.view(group.size, *x.shape).unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        _split(x, group, dim)  # raises the explanatory error
    chunks = torch.stack(x.chunk(group.size, dim=dim), 0).contiguous()
    out = torch.empty(chunks[0].numel(), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, chunks.view(-1), group)
    return out.view(chunks.shape[1:])


# --------------------------------------------------------------------------- functions


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        # The consumers are tensor-parallel layers: each rank's gradient is a partial sum.
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's 1/T chunk along ``dim`` (hidden by default); all-gather backward."""
    return _ScatterToRegion.apply(x, group, dim)


def gather_from_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """All-gather the chunks along ``dim`` (hidden by default); split backward."""
    return _GatherFromRegion.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism, entering a region: all-gather forward, reduce-scatter backward."""
    return _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism, leaving a region: reduce-scatter forward, all-gather backward."""
    return _ReduceScatterToSequence.apply(x, group, dim)


def reduce_gradient_hook(group: Group):
    """A tensor hook that sums a replicated parameter's gradient over ``group``.

    Sequence parallelism runs norms (and row-parallel biases) on a sequence shard, so each
    rank's gradient of those replicated weights covers only its tokens; the sum over the
    tensor-parallel group is the full gradient (Megatron#1446 shows the divergence when
    it is missing). Registered with ``param.register_hook`` it runs before the gradient is
    accumulated, so data-parallel reducers and ZeRO see the full gradient. Recorded: one
    all-reduce of the parameter's gradient per backward.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, group)

    return hook


__all__ = [
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence",
    "reduce_from_region",
    "reduce_gradient_hook",
    "reduce_scatter_to_sequence",
    "scatter_to_region",
]
