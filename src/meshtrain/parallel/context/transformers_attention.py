"""transformers' attention registry entry that routes a model's attention through
meshtrain's one seam (``meshtrain.components.attention.causal_attention``) with the context.

``register()`` adds :func:`cp_attention` to ``transformers.AttentionInterface`` under
``ATTN_NAME``; a model whose ``config._attn_implementation`` is that name calls it from
each attention layer as ``fn(module, query, key, value, attention_mask, dropout=,
scaling=, **kwargs)`` with ``query [B, Hq, T, hd]`` and ``key``/``value [B, Hkv, T, hd]``
(grouped, not repeated), and expects ``([B, T, Hq, hd], weights)`` back. A name outside
transformers' mask registry makes the model build no mask at all: causality (and the
documents of packed rows, ``meshtrain_document_ids`` passed down the model's kwargs by
``inputs.py``) is applied inside the seam, over the whole sequence.
"""

from __future__ import annotations

from meshtrain.components.attention import causal_attention
from meshtrain.errors import ConfigError

ATTN_NAME = "meshtrain_context_parallel"
CONTEXT_ATTR = "meshtrain_context"  # set on each attention layer by apply.py


def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One attention layer of a transformers model, over the cp group (module doc)."""
    context = getattr(module, CONTEXT_ATTR, None)
    if context is None:
        raise ConfigError(
            f"{type(module).__name__}: config._attn_implementation is {ATTN_NAME!r} but "
            "the layer has no context; let meshtrain.initialize apply context parallelism"
        )
    if dropout:
        raise ConfigError(
            f"{type(module).__name__}: attention dropout {dropout} under context "
            "parallelism is not built (the probabilities are never materialised whole); set "
            "the model's attention dropout (attention_dropout / attn_pdrop) to 0"
        )
    window = kwargs.get("sliding_window")
    length = query.shape[2] * context.group.size
    if window is not None and window < length:
        raise ConfigError(
            f"{type(module).__name__}: sliding_window {window} < sequence length {length}: "
            "sliding-window attention under context parallelism is not built; use rows of "
            "at most sliding_window tokens or a model without a window"
        )
    out = causal_attention(
        query, key, value,
        document_ids=kwargs.get("meshtrain_document_ids"), scale=scaling, context=context,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Add :func:`cp_attention` to transformers' registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, cp_attention)


__all__ = ["ATTN_NAME", "CONTEXT_ATTR", "cp_attention", "register"]
