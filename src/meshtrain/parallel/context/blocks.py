"""Attention of one query block over one key/value block, with its log-sum-exp, and the
online-softmax merge of such blocks (the math of ring attention, no communication).

Shapes (grouped-query attention kept grouped, never expanded): queries
``q [B, Hkv, g, Tq, hd]`` (``g = Hq / Hkv`` query heads per key/value head, query head
``h`` uses key/value head ``h // g`` as ``F.scaled_dot_product_attention(enable_gqa=True)``
does), keys and values ``k, v [B, Hkv, S, hd]``, masks ``[B, Tq, S]`` (True: may attend)
or None. Everything is computed in fp32.

For one block, with scores ``s = q k^T * scale`` (masked entries ``-inf``)::

    lse = log sum_j exp(s_j)          o = sum_j exp(s_j - lse) v_j        (o normalised)

Two partial results over disjoint key sets merge exactly (Milakov & Gimelshein 2018;
the flash-attention recurrence)::

    lse' = log(exp(lse_1) + exp(lse_2))
    o'   = o_1 exp(lse_1 - lse') + o_2 exp(lse_2 - lse')

A row whose every key in the block is masked has ``lse = -inf`` and ``o = 0``: its
weight ``exp(-inf - lse') = 0`` in the merge, as long as ``lse'`` is finite, which holds
once the block holding the row's own token (always visible to itself) has been merged.

Backward of a block, given the final ``lse`` and ``delta = rowsum(dO * O)`` of the whole
attention (so no block result needs to be kept)::

    p = exp(s - lse)    dV = p^T dO    dp = dO V^T    ds = p (dp - delta)
    dQ = ds K scale     dK = ds^T Q scale      (summed over the g query heads of a group)

Memory: the scores of a block are computed for a piece of its query rows at a time, so
that at most ``SCORE_ELEMENTS`` fp32 values (``B x Hq x rows x S``) exist at once (a few
such buffers in the backward): a long block never materialises its whole ``Tq x S``
matrix. ``mask_of(lo, hi)`` gives the ``[B, hi - lo, S]`` mask of query rows ``[lo, hi)``
(or None), built per piece for the same reason.
"""

from __future__ import annotations

import torch

SCORE_ELEMENTS = 1 << 25  # fp32 scores alive at once per block piece (128 MiB)


def _pieces(q: torch.Tensor, keys: int):
    """``(lo, hi)`` query-row ranges whose scores fit ``SCORE_ELEMENTS``."""
    b, hkv, g, t, _ = q.shape
    n = max(1, SCORE_ELEMENTS // max(1, b * hkv * g * keys))
    return [(lo, min(t, lo + n)) for lo in range(0, t, n)]


def scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """``[B, Hkv, g, Tq, S]`` scaled scores, ``-inf`` where ``mask`` is False."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


def block_forward(q, k, v, mask_of, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, Hkv, g, Tq, hd], lse [B, Hkv, g, Tq])`` of ``q`` over one key block."""
    outs, lses = [], []
    for lo, hi in _pieces(q, k.shape[2]):
        s = scores(q[..., lo:hi, :], k, mask_of(lo, hi), scale)
        lse = torch.logsumexp(s, dim=-1)
        safe = lse.masked_fill(torch.isinf(lse), 0.0)  # fully masked rows: p = 0, o = 0
        p = torch.exp(s - safe.unsqueeze(-1))
        outs.append(torch.matmul(p, v.unsqueeze(2)))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_b: torch.Tensor):
    """Merge a block's ``(o, lse_b)`` into the running ``(out, lse)`` in place (``o`` is
    overwritten when it has ``out``'s dtype)."""
    new = torch.logaddexp(lse, lse_b)
    weight = torch.exp(lse_b - new).unsqueeze(-1)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    # o is the caller's to spend: scaled in place when that keeps fp32 (no temporary)
    out.add_(o.mul_(weight) if o.dtype == out.dtype else o * weight)
    lse.copy_(new)


def block_backward(q, k, v, mask_of, scale: float, dout, lse, delta):
    """``(dq, dk, dv)`` of one block (module docstring); ``lse`` is the final one."""
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi in _pieces(q, k.shape[2]):
        qp, dop = q[..., lo:hi, :], dout[..., lo:hi, :]
        p = torch.exp(scores(qp, k, mask_of(lo, hi), scale) - lse[..., lo:hi].unsqueeze(-1))
        dv += torch.matmul(p.transpose(-1, -2), dop).sum(2)
        dp = torch.matmul(dop, v.unsqueeze(2).transpose(-1, -2))
        ds = p * (dp - delta[..., lo:hi].unsqueeze(-1))
        dqs.append(torch.matmul(ds, k.unsqueeze(2)) * scale)
        dk += torch.matmul(ds.transpose(-1, -2), qp).sum(2) * scale
    return torch.cat(dqs, dim=-2), dk, dv


__all__ = ["SCORE_ELEMENTS", "block_backward", "block_forward", "merge_into", "scores"]
