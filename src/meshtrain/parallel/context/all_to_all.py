"""All-to-all context parallelism (DeepSpeed Ulysses; Jacobs et al., 2023): attention over
the whole sequence with each rank holding ``1/C`` of it, by re-sharding from sequence to
heads around the attention and back.

**What is sharded.** Outside attention every cp rank holds ``L/C`` tokens of each sequence
in the load-balanced layout shared with ring attention: the sequence is cut into ``2C``
equal chunks and cp rank ``i`` holds chunks ``i`` and ``2C-1-i``, concatenated (so under a
causal mask every rank does the same work in the layers that stay sequence-sharded, and
switching ``context_parallel.method`` changes nothing outside attention). Inside attention
rank ``j`` holds the *whole* sequence, in natural order, for ``1/C`` of the heads:

    q [B, Hq, L/C, hd] --all-to-all--> [B, Hq/C, L, hd] --reorder--> natural order
    causal_attention(q, k, v, document_ids)   (the one seam, models/attention.py)
    out [B, Hq/C, L, hd] --reorder back--> --all-to-all--> [B, Hq, L/C, hd]

**The four all-to-alls** (``comm.all_to_all``, so the ledger and ``CommStats`` see them):
forward ``q``, ``k``, ``v`` sequence -> heads and the output heads -> sequence; backward,
their adjoints in the other order: the output's gradient sequence -> heads, then the
gradients of ``q``, ``k``, ``v`` heads -> sequence (an even all-to-all is its own inverse,
so each backward is the same collective on the gradient). ``document_ids`` (packing) are
all-gathered once in the forward (integers, no gradient) and put in natural order.

**Heads that do not split over C.** Each rank needs the key/value heads of its own query
heads. With ``Hq % C == 0`` and grouped-query attention (``Hkv`` heads, ``g = Hq/Hkv``):
``Hkv % C == 0`` needs nothing; otherwise each key/value head is repeated ``r`` times to
``Hkv' = lcm(Hkv, C)`` heads (``r = Hkv'/Hkv``; ``Hkv'`` divides ``Hq`` because ``Hkv`` and
``C`` both do), so rank ``j``'s query heads ``[j Hq/C, (j+1) Hq/C)`` meet exactly their
key/value heads ``[j Hkv'/C, (j+1) Hkv'/C)``; the repeat's backward sums the copies'
gradients. With ``Hq % C != 0`` the key/value heads are repeated to ``Hq`` (plain
multi-head) and ``q``, ``k``, ``v`` padded with zero heads to ``Hq' = C ceil(Hq/C)``; the
padded heads' outputs are dropped (their gradients are zero). Both cost bytes and compute,
given below; nothing is refused for its head count.

**Bytes per rank per attention call** (``comm``'s convention: an all-to-all records the
bytes of its input; ``w`` = element size, ``S = L/C`` local tokens)::

    forward   all_to_all  B S hd w (2 Hq' + 2 Hkv')          (q, output; k, v)
              all_gather  8 B L                               (only with document_ids)
    backward  all_to_all  B S hd w (2 Hq' + 2 Hkv')           (d output; dq, dk, dv)

with ``Hq' = Hq`` and ``Hkv' = Hkv`` (or ``lcm(Hkv, C)``) when ``C`` divides ``Hq``, and
``Hq' = Hkv' = C ceil(Hq/C)`` otherwise. Each rank keeps ``1/C`` of what it sends, so the
bytes on its wire are ``(C-1)/C`` of that; for multi-head attention the forward puts
``4 (C-1)/C B (L/C) H hd w`` on each rank's wire (DeepSpeed-Ulysses' ``4Nh/P`` per link),
the backward the same again. Nothing is recorded on a cp group of size 1.

**Memory.** Inside attention a rank holds ``q``, ``k``, ``v`` and the output for the whole
sequence but ``1/C`` of the heads: the same bytes as its ``L/C`` tokens for every head.
So activation memory per rank falls as ``1/C`` (``meshtrain.estimate.activations``), as
long as the attention kernel itself is memory-efficient (an ``[L, L]`` score matrix per
head, as the math kernel or a ``document_ids`` mask keeps, falls as ``1/C`` too: ``Hq/C``
heads of ``L x L``).

**Against ring attention.** Ulysses moves ``(C-1)/C`` of ``2 (Hq + Hkv)`` head-slices of
its ``L/C`` tokens per layer forward; ring moves ``C-1`` key/value blocks, ``2 Hkv`` heads
of ``L/C`` tokens each. Per rank, Ulysses' volume falls as ``1/C`` for a fixed ``L`` while
ring's stays near ``2 B L Hkv hd w``: Ulysses moves fewer bytes once ``C > (Hq + Hkv) /
Hkv`` (``C > 2`` for multi-head, ``C > g + 1`` under grouped-query attention, where ring's
small key/value blocks win). Ulysses runs one ordinary attention call (any kernel, packed
``document_ids`` masks included, no online-softmax merge), but its all-to-alls block the
compute (ring overlaps each transfer with a block's attention), each is an all-to-all over
the whole cp group (ring only talks to its neighbours, so it scales across nodes), and its
degree is bounded by the heads: beyond ``C = Hq`` every extra rank only computes padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.errors import TopologyError
from meshtrain.models.attention import causal_attention

__all__ = ["head_layout", "ulysses_attention", "ulysses_bytes"]


def head_layout(hq: int, hkv: int, cp: int) -> tuple[int, int]:
    """``(Hq', Hkv')``: query and key/value heads after repeating/padding for ``cp`` ranks
    (module docstring, "Heads that do not split over C")."""
    if hq % cp:
        padded = cp * math.ceil(hq / cp)
        return padded, padded
    if hkv % cp == 0:
        return hq, hkv
    return hq, math.lcm(hkv, cp)


def ulysses_bytes(
    b: int, seq_len: int, hq: int, hkv: int, head_dim: int, itemsize: int, cp: int,
    *, documents: bool = False,
) -> dict[str, int]:  # fmt: skip
    """Recorded bytes per rank of one ``ulysses_attention`` call at global length
    ``seq_len``: ``{"forward_all_to_all", "backward_all_to_all", "forward_all_gather"}``
    (module docstring; all zero at ``cp == 1``)."""
    if cp == 1:
        return {"forward_all_to_all": 0, "backward_all_to_all": 0, "forward_all_gather": 0}
    hq2, hkv2 = head_layout(hq, hkv, cp)
    a2a = b * (seq_len // cp) * head_dim * itemsize * (2 * hq2 + 2 * hkv2)
    gather = 8 * b * seq_len if documents else 0
    return {"forward_all_to_all": a2a, "backward_all_to_all": a2a, "forward_all_gather": gather}


# Each re-sharding is one autograd function whose backward is the other direction: one
# copy into a contiguous send buffer, the all-to-all, one copy out, both ways. (Composing
# it from slices, flips and cats let autograd zero-fill and add whole-size buffers in the
# backward: one benchmark run measured 0.81x DeepSpeed's speed, 1.24x its peak RSS.) The
# whole-sequence tensors are laid out [B, L, h, hd] (seen as [B, h, L, hd]): SDPA's CPU
# flash kernel copies any other layout first (measured: 4 MiB more peak and 15-20% slower
# forward+backward at h=4, L=4096, hd=64).


def _pack_heads(x: torch.Tensor, cp: int) -> torch.Tensor:
    """``[B, H, S, ...]`` -> send buffer ``[C, B, H/C, S, ...]``: head slice j for rank j."""
    return x.unflatten(1, (cp, -1)).movedim(1, 0).contiguous()


def _unpack_natural(recv: torch.Tensor, seq_major: bool = True) -> torch.Tensor:
    """``[C, B, h, S, ...]`` (slot r: rank r's chunks r, 2C-1-r) -> ``[B, h, L, ...]`` in
    natural order; with ``seq_major`` (``recv`` 5-D) a transposed view of ``[B, L, h, hd]``
    memory, the layout the CPU flash kernel reads without a copy (and the one of its output),
    else contiguous."""
    cp, b, h, s = recv.shape[:4]
    c, rest = s // 2, recv.shape[4:]
    halves = recv.unflatten(3, (2, c))  # [C, B, h, 2, c, ...]
    if seq_major:
        out = recv.new_empty(b, 2 * cp, c, h, *rest)
        out[:, :cp].copy_(halves[:, :, :, 0].permute(1, 0, 3, 2, 4))  # chunks 0..C-1
        for r in range(cp):  # chunk 2C-1-r came second from rank r
            out[:, 2 * cp - 1 - r].copy_(halves[r, :, :, 1].transpose(1, 2))
        return out.flatten(1, 2).transpose(1, 2)
    out = recv.new_empty(b, h, 2 * cp, c, *rest)
    out[:, :, :cp].copy_(halves[:, :, :, 0].movedim(0, 2))
    for r in range(cp):
        out[:, :, 2 * cp - 1 - r].copy_(halves[r, :, :, 1])
    return out.flatten(2, 3)


def _pack_natural(y: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of ``_unpack_natural``: ``[B, h, L, ...]`` (any strides) -> send buffer
    ``[C, B, h, S, ...]`` with slot r holding chunks r and 2C-1-r."""
    b, h = y.shape[:2]
    chunks = y.unflatten(2, (2 * cp, -1))  # [B, h, 2C, c, ...]
    send = y.new_empty(cp, b, h, 2, *chunks.shape[3:])
    send[:, :, :, 0].copy_(chunks[:, :, :cp].movedim(2, 0))
    for r in range(cp):
        send[r, :, :, 1].copy_(chunks[:, :, 2 * cp - 1 - r])
    return send.flatten(3, 4)


def _unpack_heads(recv: torch.Tensor, seq_major: bool) -> torch.Tensor:
    """``[C, B, h, S, hd]`` (slot r: head slice r) -> ``[B, H, S, hd]``: with
    ``seq_major`` a transposed view of ``[B, S, H, hd]`` memory (what ``o_proj`` reads
    after ``transpose(1, 2)`` without a copy), else contiguous."""
    cp, b, h, s, hd = recv.shape
    if not seq_major:
        out = recv.new_empty(b, cp, h, s, hd)
        out.copy_(recv.movedim(0, 1))
        return out.view(b, cp * h, s, hd)
    out = recv.new_empty(b, s, cp, h, hd)
    out.copy_(recv.permute(1, 3, 0, 2, 4))
    return out.view(b, s, cp * h, hd).transpose(1, 2)


def _is_seq_major(x: torch.Tensor) -> bool:
    """``[B, H, S, hd]`` laid out as ``[B, S, H, hd]`` (a projection's output, viewed)."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


def _exchange(send: torch.Tensor, group: Group) -> torch.Tensor:
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group)
    return recv


class _SeqToHeads(torch.autograd.Function):
    """``[B, H, S, hd]`` this rank's tokens, every head -> ``[B, H/C, L, hd]`` every token
    in natural order, this rank's heads; backward: ``_HeadsToSeq``'s forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        # the gradient comes back in x's own layout (a leaf's .grad then needs no copy)
        ctx.group, ctx.seq_major = group, _is_seq_major(x)
        return _unpack_natural(_exchange(_pack_heads(x, group.size), group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = ctx.group
        return _unpack_heads(_exchange(_pack_natural(grad, g.size), g), ctx.seq_major), None


class _HeadsToSeq(torch.autograd.Function):
    """The inverse of ``_SeqToHeads``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _unpack_heads(_exchange(_pack_natural(y, group.size), group), seq_major=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = ctx.group
        return _unpack_natural(_exchange(_pack_heads(grad, g.size), g)), None


def _gather_documents(ids: torch.Tensor, group: Group) -> torch.Tensor:
    """``[B, S]`` this rank's document ids -> ``[B, L]`` the whole row's, natural order."""
    full = torch.empty(group.size * ids.numel(), dtype=ids.dtype, device=ids.device)
    comm.all_gather(full, ids.contiguous().view(-1), group)
    # [C, B, S] -> [C, B, 1, S] (a head axis of 1 for _unpack_natural) -> [B, L]
    ids = full.view(group.size, *ids.shape).unsqueeze(2)
    return _unpack_natural(ids, seq_major=False)[:, 0]


def _check(q, k, v, document_ids, cp: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise TopologyError(
            f"ulysses_attention: q, k, v must be [B, H, L/C, hd]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, hq, s, hd = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (s, hd):
        raise TopologyError(
            f"ulysses_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
            f"[B={b}, Hkv, L/C={s}, hd={hd}] like q {tuple(q.shape)}"
        )
    if hq % k.shape[1]:
        raise TopologyError(
            f"ulysses_attention: {hq} query heads are not a multiple of {k.shape[1]} "
            "key/value heads; grouped-query attention needs Hkv to divide Hq"
        )
    if cp > 1 and s % 2:
        raise TopologyError(
            f"ulysses_attention: this rank holds {s} tokens, an odd number; context "
            f"parallelism over {cp} ranks cuts a sequence into 2 x {cp} = {2 * cp} equal "
            f"chunks (two per rank), so pad the sequence length to a multiple of {2 * cp}"
        )
    if document_ids is not None and tuple(document_ids.shape) != (b, s):
        raise TopologyError(
            f"ulysses_attention: document_ids {tuple(document_ids.shape)} must be "
            f"[B={b}, L/C={s}], this rank's tokens in the same layout as q"
        )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    document_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention over the whole sequence of which this rank holds chunks ``i`` and
    ``2C-1-i`` (``C = group.size``, ``i = group.rank``): ``q`` ``[B, Hq, L/C, hd]``, ``k``
    and ``v`` ``[B, Hkv, L/C, hd]``, ``document_ids`` ``[B, L/C]`` global document ids in
    the same layout; returns ``[B, Hq, L/C, hd]`` in that layout. Equal to this rank's
    rows of ``causal_attention`` over the whole sequence (module docstring for the
    communication and its bytes). Raises ``TopologyError`` for shapes that cannot work."""
    cp = group.size
    _check(q, k, v, document_ids, cp)
    if cp == 1:
        return causal_attention(q, k, v, document_ids=document_ids, scale=scale)
    hq, hkv = q.shape[1], k.shape[1]
    hq2, hkv2 = head_layout(hq, hkv, cp)
    if hkv2 != hkv:  # repeat each key/value head so every rank holds its queries' heads
        k = k.repeat_interleave(hkv2 // hkv if hq2 == hq else hq // hkv, dim=1)
        v = v.repeat_interleave(hkv2 // hkv if hq2 == hq else hq // hkv, dim=1)
    if hq2 != hq:  # zero heads up to a multiple of C; their outputs are dropped below
        pad = (0, 0, 0, 0, 0, hq2 - hq)
        q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
    docs = None if document_ids is None else _gather_documents(document_ids, group)
    qh, kh, vh = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    out = causal_attention(qh, kh, vh, document_ids=docs, scale=scale)
    out = _HeadsToSeq.apply(out, group)
    return out[:, :hq] if hq2 != hq else out
