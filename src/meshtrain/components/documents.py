"""The document index of packed rows: which document each token of a padding-free row
belongs to, read from where its positions restart.

Packed rows (``meshtrain.data.packing``) number every document's positions from 0, so a
new document starts wherever the position is 0. The Decoder derives its attention mask
from this (``components.attention.document_mask``), and context parallelism derives the
ids from the *whole* rows before it cuts them into chunks, so the ids stay global.
"""

from __future__ import annotations

import torch


def documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[B, T]`` document index of each token of packed rows: a new document starts
    wherever the position restarts at 0. None when every row is one document (plain
    causal attention, no mask to build)."""
    starts = position_ids == 0
    if int(starts[:, 1:].sum()) == 0:
        return None
    return starts.cumsum(-1)


__all__ = ["documents_from_positions"]
