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

Per-block kernel (chosen once per call, ``_backend``): on CPU, torch's flash-attention
kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``), the
one ``F.scaled_dot_product_attention`` itself runs on CPU: it returns the block's output
and log-sum-exp, takes grouped-query heads as they are, the causal flag of step 0, and
an additive float mask for packed rows (built for a piece of query rows at a time,
``MASK_ELEMENTS``; a row whose keys are all masked comes back as ``o = 0, lse = 0`` and
its ``lse`` is set to ``-inf`` for the merge). Elsewhere (other devices) the fp32 block
math of ``blocks.py``. Both merge the blocks in fp32 (``blocks.merge_into``).

Backward (a custom ``autograd.Function``, flash-attention style: no block's scores are
kept, and no other rank's key/value block either). Each rank keeps its own ``q``, ``k``,
``v``, the output and the final log-sum-exp (and, with packed rows, the ``C`` blocks'
int64 document ids). The key/value blocks go around the ring a second time, in the
forward's order: at step ``s`` rank ``i`` holds rank ``j = (i - s) mod C``'s block again
(received while step ``s-1`` was computed) and computes that block's ``dQ`` and ``dK, dV``
contribution from ``dO``, the final output and log-sum-exp (the kernel's backward given the
*final* output and log-sum-exp is exactly the block's share). The fp32 ``(dK, dV)`` of a
block travels with it one step behind: rank ``j+1`` starts it at step 1, every rank adds
its share and sends it on to rank ``i+1`` while it computes the next step, and after step
``C-1`` rank ``j-1`` sends the sum to rank ``j``, which adds its own step-0 share. So the
backward sends ``C-1`` key/value blocks and ``C-1`` gradient blocks per rank, each overlapped
with a block's compute.

Bytes per rank per attention layer (recorded under ``send``/``recv`` on the ``cp`` group):

* forward: ``(C-1) x (|k| + |v|)`` sent and the same received, in the dtype of k and v,
  plus ``(C-1) x |document_ids|`` (int64, ``B x L/C x 8``) with packed rows;
* backward: ``(C-1) x (|k| + |v|)`` again (the blocks, in their dtype; the document ids
  are kept from the forward, not re-sent) plus ``(C-1) x (|dk| + |dv|)`` of gradients,
  always in fp32 (the gradient of a block is a sum over ranks; fp32 keeps that sum exact
  to fp32): for fp32 k and v, ``2 (C-1) (|k| + |v|)`` each way.

Memory per rank per layer: what the forward keeps is ``q``, ``k``, ``v`` of its own
``L/C`` tokens, the output and a fp32 log-sum-exp per query and head (the same terms as one
process at ``L/C`` tokens: falls as ``1/C``), plus with packed rows the ``C`` blocks' ids
(``8 B L`` bytes). While a block is computed: two key/value blocks (the current and the
next in flight) and, in the backward, two fp32 gradient blocks; with the fp32 fallback a
piece of one block's scores (``blocks.SCORE_ELEMENTS`` values at most).
"""

from __future__ import annotations

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.parallel.context import blocks

MASK_ELEMENTS = 1 << 22  # float mask values alive at once per block piece (packed rows)


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
    backend = _backend(q)
    return _RingAttention.apply(q, k, v, document_ids, group, float(scale), backend)


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


# --------------------------------------------------------------------- per-block kernels
class _FlashCPU:
    """torch's CPU flash-attention kernel per block (module docstring). Shapes: ``q [B, Hq,
    T, hd]``, ``k, v [B, Hkv, S, hd]`` (grouped, as they are); returns ``o`` in q's dtype
    and a fp32 ``lse [B, Hq, T]``."""

    fwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    bwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)

    @staticmethod
    def _pieces(q, keys: int):
        n = max(1, MASK_ELEMENTS // max(1, q.shape[0] * keys))
        return [(lo, min(q.shape[2], lo + n)) for lo in range(0, q.shape[2], n)]

    @staticmethod
    def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
        add = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return add.masked_fill_(~mask, float("-inf"))[:, None]

    def forward(self, q, k, v, mask_of, causal: bool, masked: bool, scale: float):
        if not masked:
            return self.fwd(q, k, v, 0.0, causal, scale=scale)
        outs, lses = [], []
        for lo, hi in self._pieces(q, k.shape[2]):
            mask = mask_of(lo, hi)
            o, lse = self.fwd(
                q[:, :, lo:hi], k, v, 0.0, False, attn_mask=self._additive(mask, q.dtype),
                scale=scale,
            )  # fmt: skip
            # a row with no visible key: the kernel gives o = 0, lse = 0; the merge needs -inf
            lses.append(lse.masked_fill(~mask.any(-1)[:, None], float("-inf")))
            outs.append(o)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def backward(self, q, k, v, mask_of, causal, masked, scale, dout, out, lse):
        """``(dq, dk, dv)`` of one block given the *final* ``out`` and ``lse``."""
        if not masked:
            return self.bwd(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
        for lo, hi in self._pieces(q, k.shape[2]):
            mask = self._additive(mask_of(lo, hi), q.dtype)
            dq_p, dk_p, dv_p = self.bwd(
                dout[:, :, lo:hi], q[:, :, lo:hi], k, v, out[:, :, lo:hi], lse[:, :, lo:hi],
                0.0, False, attn_mask=mask, scale=scale,
            )  # fmt: skip
            dqs.append(dq_p)
            dk += dk_p
            dv += dv_p
        return torch.cat(dqs, dim=2), dk, dv


class _Math:
    """The fp32 block math of ``blocks.py`` (any device), same interface as ``_FlashCPU``."""

    @staticmethod
    def _grouped(q, k):
        b, hq, t, hd = q.shape
        return q.float().reshape(b, k.shape[1], hq // k.shape[1], t, hd)

    def forward(self, q, k, v, mask_of, causal, masked, scale):
        o, lse = blocks.block_forward(self._grouped(q, k), k.float(), v.float(), mask_of, scale)
        return o.flatten(1, 2), lse.flatten(1, 2)

    def backward(self, q, k, v, mask_of, causal, masked, scale, dout, out, lse):
        qg, hkv = self._grouped(q, k), k.shape[1]
        dog = dout.float().reshape(qg.shape)
        delta = (dog * out.float().reshape(qg.shape)).sum(-1)
        dq, dk, dv = blocks.block_backward(
            qg, k.float(), v.float(), mask_of, scale, dog, lse.unflatten(1, (hkv, -1)), delta
        )
        return dq.flatten(1, 2), dk, dv


def _backend(q: torch.Tensor):
    """The per-block kernel for ``q``: the CPU flash kernel where it runs, else the math."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return _FlashCPU()
    return _Math()


# ------------------------------------------------------------------------------- the ring
def _post(group: Group, sends: list[torch.Tensor], recvs: list[torch.Tensor]):
    """Send ``sends`` to rank+1 and receive ``recvs`` from rank-1 (asynchronous)."""
    n = group.size
    dst, src = (group.rank + 1) % n, (group.rank - 1) % n
    return comm.batch_p2p(group, sends=[(t, dst) for t in sends], recvs=[(r, src) for r in recvs])


def _wait(works) -> None:
    for w in works:
        w.wait()


def _full(part: torch.Tensor, keys: slice, t: int, sent: bool) -> torch.Tensor:
    """A block's fp32 gradient over all its ``t`` keys from the one of ``keys``, contiguous
    when it will be ``sent`` (the kernel's own tensor when it already is that: no copy)."""
    if keys.start is None:
        return part.float().contiguous() if sent else part.float()
    full = part.new_zeros(*part.shape[:2], t, part.shape[3], dtype=torch.float32)
    full[:, :, keys] += part
    return full


class _RingAttention(torch.autograd.Function):
    # Names are dropped (del) as soon as a tensor is dead: a Python name that still binds
    # last step's block or gradient keeps a whole block alive through the next step.
    @staticmethod
    def forward(ctx, q, k, v, docs, group: Group, scale: float, backend):
        size, rank, t = group.size, group.rank, q.shape[2]
        c, masked = t // 2, docs is not None
        block = [k, v] + ([docs] if masked else [])
        sendable = [x.contiguous() for x in block] if size > 1 else []
        out = lse = None
        doc_blocks = []
        for step in range(size):
            nxt = [torch.empty_like(x) for x in sendable] if step < size - 1 else []
            works = _post(group, sendable, nxt) if nxt else []
            kb, vb = block[0], block[1]
            docs_k = block[2] if masked else None
            if masked:
                doc_blocks.append(docs_k)
            rows, keys, causal = _region(step, rank, size, c)
            mask_of = _mask_of(docs, docs_k, rows, keys, causal, t, q.device)
            o, lse_b = backend.forward(
                q[:, :, rows], kb[:, :, keys], vb[:, :, keys], mask_of, causal, masked, scale
            )
            del kb, vb, mask_of
            if step == 0:  # all rows, the causal diagonal block: the running result
                out, lse = o.float(), lse_b
            else:
                blocks.merge_into(out[:, :, rows], lse[:, :, rows], o, lse_b)
            del o, lse_b
            _wait(works)
            block = sendable = nxt
        del block, sendable
        result = out if q.dtype == torch.float32 else out.to(q.dtype)
        del out
        ctx.save_for_backward(q, k, v, result, lse, *doc_blocks)
        ctx.group, ctx.scale, ctx.backend = group, scale, backend
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, *doc_blocks = ctx.saved_tensors
        group, scale, backend = ctx.group, ctx.scale, ctx.backend
        size, rank, t = group.size, group.rank, q.shape[2]
        docs, c, masked = (doc_blocks[0] if doc_blocks else None), t // 2, bool(doc_blocks)
        dout = grad.to(q.dtype)
        dq = None
        block = [k, v]
        sendable = [x.contiguous() for x in block] if size > 1 else []
        own = acc = None  # fp32 [dk, dv]: of this rank's block / of the block of step - 1
        for step in range(size):
            nxt = [torch.empty_like(x) for x in sendable] if step < size - 1 else []
            sends, incoming = list(nxt and sendable), []
            if step >= 2:  # pass the previous block's gradient on; receive this block's
                sends += acc
                incoming = [torch.empty_like(x) for x in acc]
            works = _post(group, sends, nxt + incoming) if sends else []
            del sends
            acc = None
            kb, vb = block
            docs_k = doc_blocks[step] if masked else None
            rows, keys, causal = _region(step, rank, size, c)
            mask_of = _mask_of(docs, docs_k, rows, keys, causal, t, q.device)
            dq_b, dk_b, dv_b = backend.backward(
                q[:, :, rows], kb[:, :, keys], vb[:, :, keys], mask_of, causal, masked,
                scale, dout[:, :, rows], out[:, :, rows], lse[:, :, rows],
            )  # fmt: skip
            del kb, vb, mask_of
            if step == size - 1:
                block = sendable = None  # the last block: nothing to pass on
            if dq is None:  # step 0: all rows
                dq = dq_b.float()
            else:
                dq[:, :, rows] += dq_b
            del dq_b
            dk, dv = _full(dk_b, keys, t, step > 0), _full(dv_b, keys, t, step > 0)
            del dk_b, dv_b
            _wait(works)
            if incoming:
                dk += incoming[0]
                dv += incoming[1]
            del incoming
            if step == 0:
                own = [dk, dv]
            else:
                acc = [dk, dv]
            del dk, dv
            if nxt:
                block = sendable = nxt
        if size > 1:  # the last holder of each block sends its full gradient home
            home = [torch.empty_like(x) for x in acc]
            _wait(_post(group, acc, home))
            del acc
            own[0] += home[0]
            own[1] += home[1]
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


__all__ = ["MASK_ELEMENTS", "ring_attention"]
