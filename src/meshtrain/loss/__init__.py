"""Losses computed without materialising what the plain path would (chunked cross-entropy)."""

from meshtrain.loss.chunked_cross_entropy import chunked_cross_entropy

__all__ = ["chunked_cross_entropy"]
