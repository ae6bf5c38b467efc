"""``ContextParallel``: the object a model's attention hands its chunks to.

``meshtrain.components.attention.causal_attention(q, k, v, context=ctx)`` calls
``ctx.attend(q, k, v, document_ids=, scale=)``; this class dispatches to the configured
algorithm over the cp group: ``ring`` (``ring.py``) or ``all_to_all``
(``all_to_all.py``, DeepSpeed Ulysses). Both take and return tensors in the layout of
``layout.py``, so switching the method changes nothing outside attention.
"""

from __future__ import annotations

import torch

from meshtrain.distributed.comm import Group
from meshtrain.errors import ConfigError

METHODS = ("ring", "all_to_all")


class ContextParallel:
    """Attention over the whole sequence from this rank's chunks, on ``group`` (cp)."""

    def __init__(self, group: Group, method: str = "ring") -> None:
        if method not in METHODS:
            raise ConfigError(
                f"context_parallel.method: {method!r} is not a method; use one of {METHODS}"
            )
        self.group, self.method = group, method

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``q [B, Hq, L/C, hd]``, ``k, v [B, Hkv, L/C, hd]``, ``document_ids [B, L/C]``
        (global ids) in the cp layout -> ``[B, Hq, L/C, hd]`` in the cp layout."""
        if self.method == "ring":
            from meshtrain.parallel.context.ring import ring_attention

            return ring_attention(q, k, v, self.group, document_ids=document_ids, scale=scale)
        from meshtrain.parallel.context.all_to_all import ulysses_attention

        return ulysses_attention(q, k, v, self.group, document_ids=document_ids, scale=scale)

    def __repr__(self) -> str:
        return f"ContextParallel({self.method}, cp={self.group.size}, rank {self.group.rank})"


__all__ = ["METHODS", "ContextParallel"]
