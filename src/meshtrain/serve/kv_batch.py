"""The key/value cache of the sequences that decode together: padded, one row per sequence.

Layout: **left padding** (not a paged layout). Every layer holds keys and values of shape
``[B, kv_heads, T, head_dim]``, one row per running sequence; a sequence with ``n < T``
cached tokens keeps them in the last ``n`` columns and its first ``T - n`` columns are
padding, masked out by ``mask`` (``[B, T]``, 1 = real token). A row's own tokens are
therefore stored exactly as they would be alone, and RoPE positions are passed per row
(``positions``), so padding changes no position.

* Sequences **join** with the cache of their prefill (``b`` rows of ``L`` columns, left
  padded the same way, with their mask): the narrower of the batch and the newcomers is
  left-padded to the wider, and the newcomers are concatenated as new rows. Cost: one
  copy of the batch's cache when the newcomers are wider than ``T``, else one copy of
  theirs.
* Sequences **leave** by keeping the other rows (``index_select`` on the batch dimension);
  columns that became padding in every row are then cut from the left, so ``T`` stays the
  longest running sequence, not the longest ever seen.
* A decoding step appends one column to every row (the model's own ``DynamicCache.update``).

Memory: ``2 * layers * B * T * kv_heads * head_dim`` elements, where ``T`` is the longest
running sequence; padding wastes ``sum(T - n_b)`` columns, the price of plain batched
tensors (a paged layout would not waste them, but needs an attention kernel that reads
pages, which ``transformers`` models do not take).

Only caches made of full-attention ``DynamicLayer`` s can be padded like this; a sliding
window or recurrent layer cannot (``supports`` says so, and the server then decodes one
sequence at a time).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def cache_kwarg(model: Any) -> str:
    """The name under which ``model.forward`` takes the cache (``cache`` in newer
    ``transformers``, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    """The cache a forward returned, whatever the ``transformers`` version calls it."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def supports(cache: Any) -> bool:
    """True when every layer of ``cache`` is a plain full-attention ``DynamicLayer``."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class PaddedKV:
    """The running sequences' cache (module docstring): ``cache``, ``mask``, ``lengths``."""

    def __init__(self) -> None:
        self.cache: Any = None  # a transformers DynamicCache with B rows, or None when empty
        self.mask: torch.Tensor | None = None  # [B, T] long, 1 = real token
        self.lengths: list[int] = []  # real tokens cached per row

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def join(self, cache: Any, mask: torch.Tensor) -> None:
        """Add the sequences whose prefill left ``cache`` (``b`` rows, left-padded as
        ``mask``, ``[b, L]``, says)."""
        lengths = mask.sum(dim=1).tolist()
        if self.cache is None:
            self.cache, self.mask, self.lengths = cache, mask, lengths
            return
        width, n = self.width, mask.shape[1]
        grow, pad_new = max(n - width, 0), max(width - n, 0)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, grow), _pad_left(theirs.keys, pad_new)])
            mine.values = torch.cat(
                [_pad_left(mine.values, grow), _pad_left(theirs.values, pad_new)]
            )
        pad = torch.nn.functional.pad
        self.mask = torch.cat([pad(self.mask, (grow, 0)), pad(mask.to(self.mask), (pad_new, 0))])
        self.lengths += lengths

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order); trim columns that are padding everywhere."""
        if not rows:
            self.cache, self.mask, self.lengths = None, None, []
            return
        if rows == list(range(self.rows)):
            return
        index = torch.tensor(rows, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.lengths = [self.lengths[r] for r in rows]
        cut = self.width - max(self.lengths)
        if cut > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, cut:]
                layer.values = layer.values[:, :, cut:]
            self.mask = self.mask[:, cut:]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention mask ``[B, T + 1]``, position ids ``[B, 1]``) for one decoding step."""
        ones = torch.ones(self.rows, 1, dtype=self.mask.dtype, device=self.mask.device)
        positions = torch.tensor(self.lengths, device=self.mask.device).unsqueeze(1)
        return torch.cat([self.mask, ones], dim=1), positions

    def stepped(self, mask: torch.Tensor) -> None:
        """Record that the step run with ``mask`` appended one token to every row."""
        self.mask = mask
        self.lengths = [n + 1 for n in self.lengths]


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` (``[B, heads, T, dim]``) with ``n`` zero columns before its first token."""
    return x if n == 0 else torch.nn.functional.pad(x, (0, 0, n, 0))
