"""The attention seam's old address: it lives in ``meshtrain.components.attention`` (below
``parallel/``, which context parallelism imports it from); imports of this path keep
working."""

from meshtrain.components.attention import causal_attention, document_mask

__all__ = ["causal_attention", "document_mask"]
