"""Ring attention: causal attention over the whole sequence when each of the ``C`` ranks
of a cp group holds only its chunks (``layout.py``), by passing key/value blocks around
the ring and merging the partial results with the online softmax (``blocks.py``).

Sharding: every rank holds ``q [B, Hq, L/C, hd]``, ``k, v [B, Hkv, L/C, hd]`` and the
attention output of its own tokens; no rank ever holds the queries or the output of
another's.

The ring, forward. At step ``s = 0 .. C-1`` rank ``i`` holds the key/value block of rank
``j = (i - s) mod C`` (its chunks ``j`` and ``2C-1-j``). While it computes with that block it
already sends it to rank ``i+1`` and receives the next from rank ``i-1`` (asynchronous
``isend``/``irecv`` through ``meshtrain.distributed.comm``: the transfer overlaps the
block's compute). With the load-balanced layout the causal structure of each step is
known from ``j`` alone (``c = L / 2C``; rank ``i``'s queries are chunks ``i`` and ``2C-1-i``):

=========  ==========================================  ===================================
step       keys seen                                   work (query x key tokens)
=========  ==========================================  ===================================
s = 0      its own block, causal within it             ``2c x 2c``, lower triangle
j < i      all queries see chunk ``j`` (first half),   ``2c x c``
           none of chunk ``2C-1-j``
j > i      only chunk ``2C-1-i`` (second half of the   ``c x 2c``
           queries) sees both key chunks
=========  ==========================================  ===================================

so every step after the first costs every rank the same half block: the load is
balanced. With ``document_ids`` (packed rows) each block's ids travel with its keys and a
query also needs the key's document to be its own.

Backward (a custom ``autograd.Function``, flash-attention style: no block's scores are
kept). Each rank keeps the ``C`` key/value blocks it saw; with ``delta = rowsum(dO * O)``
and the final log-sum-exp it recomputes each block's probabilities and produces that
block's ``dK, dV`` contribution. The gradient of the block received at step ``s+1`` goes
back to the rank it came from (rank ``i-1``), which adds it to the gradient of the block
it held at step ``s``: walking ``s`` from ``C-1`` down to 0, each rank sends the
accumulated gradient of step ``s+1`` while it computes step ``s``, and after ``C-1``
transfers every rank holds the full ``dK, dV`` of its own block.

Bytes per rank per attention layer (recorded under ``send``/``recv`` on the ``cp`` group):

* forward: ``(C-1) x (|k| + |v|)`` sent and the same received, in the dtype of k and v,
  plus ``(C-1) x |document_ids|`` (int64, ``B x L/C x 8``) with packed rows;
* backward: ``(C-1) x (|k| + |v|)`` of gradients sent and received, always in fp32 (the
  gradient of a block is a sum over ranks; fp32 keeps that sum exact to fp32).

Memory per rank per layer: the ``C`` key/value blocks of the whole sequence
(``2 x B x Hkv x L x hd`` elements, ``Hkv/Hq`` of the whole sequence's queries under GQA) are
kept for the backward instead of being passed around a second time, plus a piece of one
block's fp32 scores (``blocks.SCORE_ELEMENTS`` values at most) while it is computed.
"""

from __future__ import annotations

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.parallel.context.blocks import block_backward, block_forward, merge_into


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    document_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's ``q`` over the whole sequence's keys (module doc).

    ``q [B, Hq, L/C, hd]``, ``k, v [B, Hkv, L/C, hd]`` and ``document_ids [B, L/C]``
    (global ids) in the cp layout; returns ``[B, Hq, L/C, hd]`` in that layout.
    """
    b, hq, t, hd = q.shape
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"ring attention: {hq} query heads, {k.shape[1]} key/value heads")
    if t % 2:
        raise ValueError(f"ring attention: local length {t} is not even (two chunks per rank)")
    if scale is None:
        scale = hd**-0.5
    return _RingAttention.apply(q, k, v, document_ids, group, float(scale))


def _region(step: int, rank: int, size: int, c: int):
    """(query rows, key columns, causal) of ring step ``step`` on ``rank`` (module table)."""
    j = (rank - step) % size
    if step == 0:
        return slice(None), slice(None), True
    if j < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _mask_of(docs_q, docs_k, rows: slice, keys: slice, causal: bool, t: int, device):
    """``mask_of(lo, hi)``: the ``[B, hi - lo, S]`` mask of the region's query rows
    ``[lo, hi)`` (same document, and causal on step 0), or None when nothing is masked."""
    r0 = rows.start or 0
    dk = None if docs_k is None else docs_k[:, keys]

    def mask_of(lo: int, hi: int):
        mask = None
        if docs_q is not None:
            mask = docs_q[:, r0 + lo : r0 + hi, None] == dk[:, None, :]
        if causal:
            q_pos = torch.arange(lo, hi, device=device)[:, None]
            tri = (q_pos >= torch.arange(t, device=device)[None])[None]
            mask = tri if mask is None else mask & tri
        return mask

    return mask_of


def _post_shift(tensors: list[torch.Tensor], group: Group, forward: bool):
    """Send ``tensors`` one step along the ring (to rank+1 when ``forward``, else to
    rank-1) and receive the neighbour's on the other side; returns (works, buffers)."""
    n = group.size
    dst, src = (group.rank + 1) % n, (group.rank - 1) % n
    if not forward:
        dst, src = src, dst
    bufs = [torch.empty_like(t) for t in tensors]
    works = comm.batch_p2p(group, sends=[(t, dst) for t in tensors], recvs=[(b, src) for b in bufs])
    return works, bufs


def _wait(works) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, docs, group: Group, scale: float):
        b, hq, t, hd = q.shape
        hkv, size, rank, c = k.shape[1], group.size, group.rank, t // 2
        qf = q.float().reshape(b, hkv, hq // hkv, t, hd)
        out = torch.empty_like(qf)
        lse = torch.empty(qf.shape[:-1], dtype=torch.float32, device=q.device)
        block = [k.contiguous(), v.contiguous()] + ([] if docs is None else [docs.contiguous()])
        held = []
        for step in range(size):
            pending = _post_shift(block, group, True) if step < size - 1 else None
            held.append(block)
            kb, vb = block[0].float(), block[1].float()
            docs_k = block[2] if docs is not None else None
            rows, keys, causal = _region(step, rank, size, c)
            mask_of = _mask_of(docs, docs_k, rows, keys, causal, t, q.device)
            o, lse_b = block_forward(
                qf[..., rows, :], kb[:, :, keys], vb[:, :, keys], mask_of, scale
            )
            if step == 0:
                out.copy_(o)
                lse.copy_(lse_b)
            else:
                merge_into(out[..., rows, :], lse[..., rows], o, lse_b)
            if pending is not None:
                _wait(pending[0])
                block = pending[1]
        flat = [x for blk in held for x in blk]
        ctx.save_for_backward(q, out, lse, *([] if docs is None else [docs]), *flat)
        ctx.group, ctx.scale, ctx.has_docs, ctx.per_block = (
            group,
            scale,
            docs is not None,
            len(held[0]),
        )
        return out.reshape(b, hq, t, hd).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, out, lse, *rest = ctx.saved_tensors
        docs = rest.pop(0) if ctx.has_docs else None
        n = ctx.per_block
        held = [rest[i : i + n] for i in range(0, len(rest), n)]
        group, scale = ctx.group, ctx.scale
        b, hq, t, hd = q.shape
        size, rank, c = group.size, group.rank, t // 2
        qf = q.float().reshape(out.shape)
        dout = grad.float().reshape(out.shape)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qf)
        carry: list[torch.Tensor] | None = None  # fp32 (dk, dv) of the block of step s+1
        for step in reversed(range(size)):
            pending = _post_shift(carry, group, False) if carry is not None else None
            block = held[step]
            kb, vb = block[0].float(), block[1].float()
            docs_k = block[2] if docs is not None else None
            rows, keys, causal = _region(step, rank, size, c)
            mask_of = _mask_of(docs, docs_k, rows, keys, causal, t, q.device)
            dq_b, dk_b, dv_b = block_backward(
                qf[..., rows, :], kb[:, :, keys], vb[:, :, keys], mask_of, scale,
                dout[..., rows, :], lse[..., rows], delta[..., rows],
            )  # fmt: skip
            dq[..., rows, :] += dq_b
            dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
            dk[:, :, keys] += dk_b
            dv[:, :, keys] += dv_b
            if pending is not None:
                _wait(pending[0])
                dk += pending[1][0]
                dv += pending[1][1]
            carry = [dk, dv]
        k, v = held[0][0], held[0][1]
        dq = dq.reshape(b, hq, t, hd).to(q.dtype)
        return dq, carry[0].to(k.dtype), carry[1].to(v.dtype), None, None, None


__all__ = ["ring_attention"]
