"""The one attention seam: every causal self-attention meshtrain runs goes through
``causal_attention``.

Meshtrain's Decoder calls it directly; transformers' families reach it through their
attention-function registry. What varies is behind its arguments, never in the models:

* ``document_ids`` (padding-free packing): several documents share one row, and a token
  attends only to earlier tokens of its own document. Ids are per token, ``[B, T]``;
  ``None`` means the whole row is one document (plain causal attention).
* ``context`` (context parallelism): this rank holds only its chunks of each sequence
  and the attention over the whole sequence is computed with the other cp ranks (ring
  or all-to-all). ``None`` means the rank holds the whole sequence.

Shapes: ``q`` is ``[B, Hq, T, hd]``; ``k`` and ``v`` are ``[B, Hkv, T, hd]`` with ``Hkv``
dividing ``Hq`` (grouped-query attention); the result is ``[B, Hq, T, hd]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` boolean mask: query i sees key j when j <= i in the same document."""
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
    scale: float | None = None,
    context=None,
) -> torch.Tensor:
    """Causal softmax attention of ``q`` over ``k``/``v`` (module docstring for the
    arguments). ``context``: an object with ``attend(q, k, v, document_ids=, scale=)``
    that computes the same result with this rank's sequence chunks only."""
    if context is not None:
        return context.attend(q, k, v, document_ids=document_ids, scale=scale)
    gqa = k.shape[1] != q.shape[1]
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = document_mask(document_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


__all__ = ["causal_attention", "document_mask"]
