"""Token dispatch and combine over the ep group: all-to-all with variable split sizes.

Layout: ``E`` experts, an ep group of ``P`` ranks, ``L = E / P`` local experts per rank;
expert ``e`` lives on ep rank ``e // L`` as its local expert ``e % L``.

One layer's forward on a rank with ``N`` tokens routed to ``k`` experts each (hidden ``H``,
element size ``b``)::

    sort      the N k (token, slot) pairs by expert (stable): rows for rank 0's experts
              first, each rank's block ordered by its local expert
    counts    all-to-all of the E per-expert counts (int64): each rank learns how many rows
              every peer sends to each of its local experts           8 E bytes ("control")
    dispatch  all-to-all of the rows, split by destination rank       N k H b bytes sent
    regroup   received rows from (source, expert) to (expert, source) order (a permutation)
    compute   the local experts on their rows (``gemm``: grouped GEMM or a loop)
    combine   the inverse permutation, then the reverse all-to-all    R H b bytes sent
              (R = rows received = tokens this rank's experts computed)
    weight    rows x their routing weight, summed back into their token (index_add, in
              expert order as transformers does)

The counts' all-to-all is started asynchronously and the sort runs while it is in flight.
The permutations (``regroup``/``ungroup``, and the routing weights into sorted order) are
:class:`Permute` nodes: their backward is the gather by the inverse permutation, not the
``index_put`` with accumulation that autograd runs for ``x[index]`` (the same numbers: each
gradient row lands in exactly one place).

Backward is the same two all-to-alls with the splits swapped (:class:`AllToAll`): the
gradient of the combine's output travels ``N k H b`` bytes to the experts, the gradient of
the dispatched rows ``R H b`` back. So per layer and step, each rank records exactly
``2 (N k + R) H b`` bytes under ``all_to_all`` on the ``ep`` group (``comm``'s convention:
the bytes a rank sends, its own chunk included), plus the counts' ``8 E`` under ``control``.

The routing weights never travel: rows are weighted on the token's own rank, so the
router's gradient is computed where the router lives. Every rank enters every all-to-all
of every layer whatever its routing: a rank that sends or receives no rows passes zero
split sizes, never skips the call, so no routing can hang the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group


class AllToAll(torch.autograd.Function):
    """Rows ``x`` sent ``send[j]`` to ep rank ``j``, ``recv[j]`` received from rank ``j``;
    the backward sends the gradient back along the same splits, reversed."""

    @staticmethod
    def forward(ctx, x, group: Group, recv: list[int], send: list[int]):
        ctx.group, ctx.recv, ctx.send = group, recv, send
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), group, recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        comm.all_to_all(out, grad.contiguous(), ctx.group, ctx.send, ctx.recv)
        return out, None, None, None


class Permute(torch.autograd.Function):
    """``x[index]`` along dim 0 for a permutation ``index`` with its ``inverse``: the
    backward is ``grad[inverse]``, a gather."""

    @staticmethod
    def forward(ctx, x, index: torch.Tensor, inverse: torch.Tensor):
        ctx.inverse = inverse  # an integer index, never differentiated
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.inverse), None, None


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(perm.numel(), device=perm.device)
    return torch.empty_like(perm).index_copy_(0, perm, positions)


@dataclass
class DispatchPlan:
    """Where each of this rank's ``N k`` routed rows goes and what comes back."""

    order: torch.Tensor  # [N k] (token, slot) indices sorted by expert
    unorder: torch.Tensor  # its inverse
    tokens: torch.Tensor  # [N k] token index of each sorted row (order // k)
    counts: torch.Tensor  # [E] rows this rank routes to each expert
    send: list[int]  # rows to each ep rank
    recv: list[int]  # rows from each ep rank
    local_counts: list[int]  # rows for each local expert, summed over sources
    regroup: torch.Tensor | None  # received (source, expert) order -> (expert, source)
    ungroup: torch.Tensor | None  # its inverse


def plan_dispatch(experts: torch.Tensor, num_experts: int, group: Group | None) -> DispatchPlan:
    """Sort this rank's routed rows and exchange the per-expert counts (one small
    all-to-all over ``group``; none when the group has one rank)."""
    top_k = experts.shape[-1]
    flat = experts.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    p = 1 if group is None else group.size
    n_local = num_experts // p
    work = None
    if p > 1:  # in flight while this rank sorts its rows
        received = torch.empty_like(counts)
        work = comm.all_to_all(received, counts, group, async_op=True, label="control")
    order = torch.argsort(flat, stable=True)
    unorder = _inverse(order)
    if work is None:
        received = counts.view(1, n_local)
    else:
        work.wait()
        received = received.view(p, n_local)  # [source, local expert]
    send = counts.view(p, n_local).sum(1).tolist()
    recv = received.sum(1).tolist()
    regroup = ungroup = None
    if p > 1 and n_local > 1:
        expert_of_row = torch.arange(n_local, device=flat.device).repeat(p)
        expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        ungroup = _inverse(regroup)
    return DispatchPlan(
        order=order,
        unorder=unorder,
        tokens=order // top_k,
        counts=counts,
        send=send,
        recv=recv,
        local_counts=received.sum(0).tolist(),
        regroup=regroup,
        ungroup=ungroup,
    )


def dispatch(x: torch.Tensor, plan: DispatchPlan, group: Group | None) -> torch.Tensor:
    """``x`` ``[N, H]`` -> the rows this rank's experts compute, grouped by local expert."""
    rows = x.index_select(0, plan.tokens)
    if group is not None and group.size > 1:
        rows = AllToAll.apply(rows, group, plan.recv, plan.send)
    return rows if plan.regroup is None else Permute.apply(rows, plan.regroup, plan.ungroup)


def combine(
    y: torch.Tensor,
    weights: torch.Tensor,
    plan: DispatchPlan,
    group: Group | None,
    n_tokens: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The experts' rows ``y`` back to their tokens: ``out[t] = sum_j w[t, j] y[t, j]``."""
    if plan.ungroup is not None:
        y = Permute.apply(y, plan.ungroup, plan.regroup)
    if group is not None and group.size > 1:
        y = AllToAll.apply(y, group, plan.send, plan.recv)
    # weight in the routing weights' dtype (fp32), then back, as transformers does
    w = Permute.apply(weights.reshape(-1), plan.order, plan.unorder)
    y = (y * w[:, None]).to(dtype)
    return y.new_zeros(n_tokens, y.shape[-1]).index_add(0, plan.tokens, y)


__all__ = ["AllToAll", "DispatchPlan", "Permute", "combine", "dispatch", "plan_dispatch"]
