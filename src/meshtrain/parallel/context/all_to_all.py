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
    causal_attention(q, k, v, document_ids)   (the one seam, components/attention.py)
    out [B, Hq/C, L, hd] --reorder back--> --all-to-all--> [B, Hq, L/C, hd]

**Two all-to-alls each way** (``comm.all_to_all``, so the ledger and ``CommStats`` see
them): forward ``q``, ``k`` and ``v`` together sequence -> heads (one send buffer holding,
for each destination rank, its heads of all three), then the output heads -> sequence;
backward, their adjoints in the other order: the output's gradient sequence -> heads, then
the gradients of ``q``, ``k``, ``v`` together heads -> sequence (an even all-to-all is its
own inverse, so each backward is the same collective on the gradient). Fusing q, k and v
moves exactly the bytes of three separate all-to-alls in one collective (on gloo each
call is a synchronisation of the whole group). ``document_ids`` (packing) are
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
given below; nothing is refused for its head count. The repeat and the padding are done by
the copy into the send buffer (no repeated or padded tensor is built), and undone (repeated
heads' gradients summed, padded heads' dropped) by the copy out of it.

**Bytes per rank per attention call** (``comm``'s convention: an all-to-all records the
bytes of its input; ``w`` = element size, ``S = L/C`` local tokens)::

    forward   all_to_all  B S hd w (Hq' + 2 Hkv') + B S hd w Hq'   (q, k, v; output)
              all_gather  8 B L                               (only with document_ids)
    backward  all_to_all  B S hd w Hq' + B S hd w (Hq' + 2 Hkv')   (d output; dq, dk, dv)

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

from meshtrain.components.attention import causal_attention
from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.errors import TopologyError
from meshtrain.parallel.context.ulysses_buffers import (
    head_map,
    is_seq_major,
    pack_heads,
    pack_natural,
    send_buffer,
    unpack_heads,
    unpack_natural,
)

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


def _exchange(send: torch.Tensor, group: Group) -> torch.Tensor:
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group)
    return recv


def _scatter_qkv(q, k, v, group: Group, maps: tuple, counts: tuple):
    """q, k, v sequence -> heads in one all-to-all: ``(buf, whole)``, ``whole [B, n_q + 2
    n_kv, L, hd]`` every token in natural order (seq-major), held in ``buf``'s memory."""
    cp, s = group.size, q.shape[2]
    nq, nkv = counts[0] // cp, counts[1] // cp
    send, parts = send_buffer(q, cp, [nq, nkv, nkv], s)
    for t, part, m in zip((q, k, v), parts, (maps[0], maps[1], maps[1]), strict=True):
        pack_heads(t, part, m)
    # the send buffer is spent once the all-to-all returns: the unpack writes into it
    # (each fresh buffer costs page faults: fewer of them is most of the speed here)
    return send, unpack_natural(_exchange(send, group), send).transpose(1, 2)


def _gather_grads(grads: list, group: Group, maps: tuple, layouts: list, send=None) -> list:
    """The adjoint of ``_scatter_qkv``: ``grads = [dq, dk, dv]`` (``[B, n, L, hd]``) -> the
    gradients of q, k, v in their own shapes and layouts (``layouts``: ``(heads,
    seq_major)`` each), in one all-to-all; ``send``: a spent buffer of the right size to
    pack into, else new. ``grads`` is emptied once packed, so that (when the caller holds
    no other reference) they are freed before the all-to-all's receive buffer exists."""
    dq, dk, dv = grads
    grads.clear()
    cp, s = group.size, dq.shape[2] // group.size
    heads = [t.shape[1] for t in (dq, dk, dv)]
    if send is None:
        send, parts = send_buffer(dq, cp, heads, s)
    else:
        offsets = (0, heads[0], heads[0] + heads[1], sum(heads))
        parts = [send[:, :, :, offsets[i] : offsets[i + 1]] for i in range(3)]
    for t, part in zip((dq, dk, dv), parts, strict=True):
        pack_natural(t.transpose(1, 2), part)
    del dq, dk, dv, parts, t, part  # (the loop's names too: t would keep dv alive)
    recv = _exchange(send, group)
    offsets = (0, heads[0], heads[0] + heads[1], recv.shape[3])
    flat, at, grads = send.view(-1), 0, []  # the spent send buffer holds the gradients
    for i, (h_out, seq_major) in enumerate(layouts):
        part = recv[:, :, :, offsets[i] : offsets[i + 1]]
        size = part.shape[1] * part.shape[2] * h_out * part.shape[4]
        grads.append(unpack_heads(part, maps[min(i, 1)], h_out, seq_major, flat[at : at + size]))
        at += size  # Hq + 2 Hkv <= Hq' + 2 Hkv': the three fit
    return grads


def _layouts(q, k, v) -> list:
    return [(t.shape[1], is_seq_major(t)) for t in (q, k, v)]


class _SeqToHeads(torch.autograd.Function):
    """``q [B, Hq, S, hd]``, ``k, v [B, Hkv, S, hd]`` this rank's tokens, every head ->
    ``[B, n, L, hd]`` each: every token in natural order, this rank's ``n = H'/C`` of the
    sent heads (``maps``: ``head_map`` of q and of k, v), in one all-to-all; backward:
    the gradients back the same way in one all-to-all, in q's, k's, v's own layouts."""

    @staticmethod
    def forward(ctx, group: Group, maps: tuple, counts: tuple, q, k, v):
        ctx.group, ctx.maps, ctx.layouts = group, maps, _layouts(q, k, v)
        nq, nkv = counts[0] // group.size, counts[1] // group.size
        _, whole = _scatter_qkv(q, k, v, group, maps, counts)
        return whole[:, :nq], whole[:, nq : nq + nkv], whole[:, nq + nkv :]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        grads = _gather_grads([dq, dk, dv], ctx.group, ctx.maps, ctx.layouts)
        return None, None, None, *grads


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _flash_fits(q: torch.Tensor) -> bool:
    """Whether ``_SeqToHeadsAttention`` runs for ``q``: the CPU flash kernel's dtypes."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


class _SeqToHeadsAttention(torch.autograd.Function):
    """``_SeqToHeads`` then causal attention, one function (CPU, no document mask): the
    attention is the CPU flash kernel that ``F.scaled_dot_product_attention`` runs, called
    directly, so the backward decides what is alive: once the kernel's backward has run,
    the whole-sequence q, k, v it saved (in the forward's spent send buffer) are dead, and
    that buffer is where dq, dk, dv are packed for the all-to-all (no new send buffer, and
    the kernel's gradients freed before the receive buffer exists). Writing into a saved
    tensor bumps its version, so a second backward through this graph (``retain_graph``)
    raises torch's in-place error instead of reading it. Returns ``[B, n_q, L, hd]``."""

    @staticmethod
    def forward(ctx, group: Group, maps: tuple, counts: tuple, scale, q, k, v):
        ctx.group, ctx.maps, ctx.layouts, ctx.scale = group, maps, _layouts(q, k, v), scale
        nq, nkv = counts[0] // group.size, counts[1] // group.size
        buf, whole = _scatter_qkv(q, k, v, group, maps, counts)
        qh, kh, vh = whole[:, :nq], whole[:, nq : nq + nkv], whole[:, nq + nkv :]
        out, lse = _FLASH(qh, kh, vh, 0.0, True, scale=scale)
        ctx.save_for_backward(buf, out, lse)
        ctx.split = (nq, nkv)
        return out

    @staticmethod
    def backward(ctx, dout):
        buf, out, lse = ctx.saved_tensors
        nq, nkv = ctx.split
        b, hd = buf.shape[1], buf.shape[4]  # buf [C, B, S, n_q + 2 n_kv, hd]
        whole = buf.view(b, -1, nq + 2 * nkv, hd).transpose(1, 2)
        qh, kh, vh = whole[:, :nq], whole[:, nq : nq + nkv], whole[:, nq + nkv :]
        grads = list(_FLASH_BACKWARD(dout, qh, kh, vh, out, lse, 0.0, True, scale=ctx.scale))
        del whole, qh, kh, vh, out, lse, dout
        grads = _gather_grads(grads, ctx.group, ctx.maps, ctx.layouts, send=buf)
        return None, None, None, None, *grads


class _HeadsToSeq(torch.autograd.Function):
    """``[B, h, L, hd]`` this rank's heads, every token in natural order -> ``[B, C h, S,
    hd]`` this rank's tokens, every head (seq-major memory, what ``o_proj`` reads); the
    inverse of ``_SeqToHeads`` for one tensor."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, cp = group, group.size
        b, h, length, hd = y.shape
        send = y.new_empty(cp, b, length // cp, h, hd)
        pack_natural(y.transpose(1, 2), send)
        recv = _exchange(send, group)
        return unpack_heads(recv, None, cp * h, seq_major=True, memory=send.view(-1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = ctx.group
        b, hh, s, hd = grad.shape
        send = grad.new_empty(g.size, b, s, hh // g.size, hd)
        pack_heads(grad, send, None)
        return unpack_natural(_exchange(send, g), send).transpose(1, 2), None


def _gather_documents(ids: torch.Tensor, group: Group) -> torch.Tensor:
    """``[B, S]`` this rank's document ids -> ``[B, L]`` the whole row's, natural order."""
    full = torch.empty(group.size * ids.numel(), dtype=ids.dtype, device=ids.device)
    comm.all_gather(full, ids.contiguous().view(-1), group)
    return unpack_natural(full.view(group.size, *ids.shape))  # [C, B, S] -> [B, L]


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
    # the key/value heads each rank needs, repeated (and q, k, v zero-padded) by the copy
    # into the send buffer: k, v repeated r times to Hkv' = lcm(Hkv, C), or to Hq when C
    # does not divide Hq (module docstring, "Heads that do not split over C")
    repeat = hkv2 // hkv if hq2 == hq else hq // hkv
    maps = (head_map(hq, hq2, 1), head_map(hkv, hkv2, repeat))
    if document_ids is None and _flash_fits(q):
        out = _SeqToHeadsAttention.apply(group, maps, (hq2, hkv2), scale, q, k, v)
    else:  # a document mask (or another device): the seam's SDPA call with its mask
        docs = None if document_ids is None else _gather_documents(document_ids, group)
        qh, kh, vh = _SeqToHeads.apply(group, maps, (hq2, hkv2), q, k, v)
        out = causal_attention(qh, kh, vh, document_ids=docs, scale=scale)
    out = _HeadsToSeq.apply(out, group)
    return out[:, :hq] if hq2 != hq else out
