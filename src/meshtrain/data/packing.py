"""Padding-free packing: several documents in one row, each attending only to itself.

Two shapes of the same contract (the one transformers' ``DataCollatorWithFlattening`` and
TRL's ``padding_free`` / ``packing`` use, so a model that honours it cannot tell them
apart):

* ``position_ids`` restart at 0 (``position_ids_start``) at the first token of every
  document; that restart is how the model finds the documents (``document_ids`` in
  ``meshtrain.models.attention``, ``find_packed_sequence_indices`` in transformers'
  ``masking_utils``) and masks attention block-diagonally.
* ``labels`` are ``-100`` at the first token of every document: a causal LM predicts
  token ``t + 1`` from ``t``, so the label at a document's first token would be predicted
  from the previous document's last token. With it ignored no token is trained across a
  boundary, and the label items of a row are ``sum(len(doc) - 1)``, exactly the items of
  the same documents one per row.

The two shapes:

* :class:`FlatteningCollator` flattens a micro-batch of variable-length features into one
  ``[1, total]`` row: the output of ``transformers.DataCollatorWithFlattening`` (same keys,
  values, dtypes and options), without importing transformers.
* :class:`PackedDataset` fills rows of a fixed length greedily (``plan_rows``) and pads
  only each row's tail; the tail is its own pseudo-document (positions 0.., labels
  -100, ``pad_token_id``), so it attends only to itself and never adds a label item. Fixed
  rows suit ``meshtrain train``, long-context rows and batches of equal shape across
  data-parallel ranks.

Plans are pure arithmetic over the document lengths (no tokens read), deterministic, so
every rank builds the same rows and a resumable sampler deals them like any dataset.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshtrain.errors import DataError

IGNORE_INDEX = -100
STRATEGIES = ("greedy", "bfd")
OVERFLOWS = ("split", "truncate")

Segment = tuple[int, int, int]
"""``(document, start, stop)``: tokens ``start:stop`` of one document, placed in a row."""


def _ids(x: Any) -> list[int]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


class FlatteningCollator:
    """transformers' ``DataCollatorWithFlattening``, feature for feature.

    ``features``: mappings with ``input_ids`` (and optionally ``labels``). Returns
    ``input_ids`` / ``labels`` / ``position_ids`` ``[1, total]`` int64, with ``labels`` =
    each feature's labels (its ``input_ids`` when it has none) whose first entry is
    ``separator_id``; ``seq_idx`` ``[1, total]`` int32 (``return_seq_idx``);
    ``cu_seq_lens_q/k`` int32 and ``max_length_q/k`` ints (``return_flash_attn_kwargs``).
    Empty features are dropped; a batch of only empty features is a :class:`DataError`.
    """

    def __init__(
        self,
        return_position_ids: bool = True,
        separator_id: int = IGNORE_INDEX,
        return_flash_attn_kwargs: bool = False,
        return_seq_idx: bool = False,
        position_ids_start: int = 0,
        return_tensors: str = "pt",
    ) -> None:
        if return_tensors not in ("pt", "np"):
            raise DataError(
                f"FlatteningCollator.return_tensors: {return_tensors!r} is not supported; "
                'use "pt" or "np"'
            )
        self.return_position_ids = return_position_ids
        self.separator_id = separator_id
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.return_seq_idx = return_seq_idx
        self.position_ids_start = position_ids_start
        self.return_tensors = return_tensors

    def __call__(
        self,
        features: Sequence[Mapping[str, Any]],
        return_tensors: str | None = None,
        separator_id: int | None = None,
    ) -> dict[str, Any]:
        kind = return_tensors or self.return_tensors
        sep = self.separator_id if separator_id is None else separator_id
        features = [f for f in features if len(f["input_ids"]) > 0]
        if not features:
            raise DataError(
                "FlatteningCollator: every example of the batch is empty (no input_ids); "
                "drop empty examples from the dataset"
            )
        has_labels = "labels" in features[0]
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        seq_idx: list[int] = []
        cu = [0]
        for i, f in enumerate(features):
            x = _ids(f["input_ids"])
            ids += x
            labels.append(sep)
            labels += (_ids(f["labels"]) if has_labels else x)[1:]
            if self.return_position_ids:
                positions += range(self.position_ids_start, self.position_ids_start + len(x))
            if self.return_seq_idx:
                seq_idx += [i] * len(x)
            cu.append(cu[-1] + len(x))
        out: dict[str, Any] = {"input_ids": [ids], "labels": [labels]}
        if self.return_position_ids:
            out["position_ids"] = [positions]
        if self.return_seq_idx:
            out["seq_idx"] = [seq_idx]
        if self.return_flash_attn_kwargs:
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
            longest = max(b - a for a, b in zip(cu, cu[1:], strict=False))
            out["max_length_q"] = out["max_length_k"] = longest
        make = torch.tensor if kind == "pt" else np.array
        wide = torch.int64 if kind == "pt" else np.int64
        narrow = torch.int32 if kind == "pt" else np.int32
        for key, value in out.items():
            if key.startswith("max_length"):
                continue  # python ints, as transformers returns them
            wide_key = key in ("input_ids", "labels", "position_ids")
            out[key] = make(value, dtype=wide if wide_key else narrow)
        return out


# -- greedy row filling ---------------------------------------------------------------------
def _pieces(lengths: Sequence[int], seq_len: int, overflow: str) -> list[Segment]:
    """Every document as segments of at most ``seq_len`` tokens (longer ones split or
    truncated), in document order; empty documents are dropped."""
    out: list[Segment] = []
    for doc, n in enumerate(lengths):
        n = int(n)
        if n <= 0:
            continue
        if n <= seq_len or overflow == "truncate":
            out.append((doc, 0, min(n, seq_len)))
        else:
            out += [(doc, s, min(s + seq_len, n)) for s in range(0, n, seq_len)]
    return out


def plan_rows(
    lengths: Sequence[int],
    seq_len: int,
    *,
    strategy: str = "greedy",
    overflow: str = "split",
) -> list[list[Segment]]:
    """Documents of ``lengths`` tokens into rows of at most ``seq_len`` tokens.

    ``strategy``: ``"greedy"`` (next fit) keeps the documents' order and opens a new row
    when the next piece does not fit the current one; ``"bfd"`` (best-fit decreasing, TRL's
    default) places pieces longest first into the fullest row that still has room, which
    leaves less padding but reorders documents. ``overflow``: a document longer than
    ``seq_len`` is ``"split"`` into ``seq_len`` pieces (each its own document: positions
    restart, its first label is ignored) or ``"truncate"``-d to its first ``seq_len``.
    Cost: greedy O(n); bfd O(n log n) comparisons plus list inserts.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"packing seq_len: {seq_len!r} must be a positive integer")
    if strategy not in STRATEGIES:
        raise DataError(f"packing strategy: {strategy!r} is not one of {list(STRATEGIES)}")
    if overflow not in OVERFLOWS:
        raise DataError(f"packing overflow: {overflow!r} is not one of {list(OVERFLOWS)}")
    pieces = _pieces(lengths, seq_len, overflow)
    rows: list[list[Segment]] = []
    if strategy == "greedy":
        room = 0
        for seg in pieces:
            n = seg[2] - seg[1]
            if not rows or n > room:
                rows.append([])
                room = seq_len
            rows[-1].append(seg)
            room -= n
        return rows
    # best fit: ``free`` holds (room left, row) sorted; the first entry with room >= n is
    # the fullest row that fits (ties: the earliest row, so the plan is deterministic)
    free: list[tuple[int, int]] = []
    for seg in sorted(pieces, key=lambda s: (-(s[2] - s[1]), s[0], s[1])):
        n = seg[2] - seg[1]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([seg])
            row, left = len(rows) - 1, seq_len - n
        else:
            left, row = free.pop(at)
            rows[row].append(seg)
            left -= n
        if left > 0:
            bisect.insort(free, (left, row))
    return rows


def row_arrays(
    segments: Sequence[Segment],
    tokens_of: Any,
    seq_len: int,
    *,
    pad_token_id: int = 0,
    labels_of: Any = None,
    position_ids_start: int = 0,
) -> dict[str, torch.Tensor]:
    """One packed row of ``seq_len`` tokens: ``input_ids``, ``position_ids``, ``labels``.

    ``tokens_of(doc, start, stop)`` returns a document's tokens; ``labels_of`` (same
    signature, optional) its labels (default: the tokens). Each segment's first label is
    -100; the tail after the last segment is padding: ``pad_token_id``, its own positions
    from ``position_ids_start`` and labels -100.
    """
    ids = np.full(seq_len, pad_token_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    pos = np.empty(seq_len, dtype=np.int64)
    at = 0
    for doc, start, stop in segments:
        n = stop - start
        ids[at : at + n] = tokens_of(doc, start, stop)
        if n > 1:
            lab = ids[at + 1 : at + n] if labels_of is None else labels_of(doc, start, stop)[1:]
            labels[at + 1 : at + n] = lab
        pos[at : at + n] = np.arange(position_ids_start, position_ids_start + n)
        at += n
    if at > seq_len:
        raise DataError(f"packed row holds {at} tokens, more than seq_len {seq_len}")
    pos[at:] = np.arange(position_ids_start, position_ids_start + seq_len - at)
    return {
        "input_ids": torch.from_numpy(ids),
        "position_ids": torch.from_numpy(pos),
        "labels": torch.from_numpy(labels),
    }


def _source_lengths(source: Any) -> np.ndarray:
    """Document lengths of ``source`` without reading its tokens where it can."""
    from meshtrain.data.store import TokenDataset, TokenStore

    if isinstance(source, TokenDataset):
        source = source.store
    if isinstance(source, TokenStore):
        return np.diff(np.asarray(source.offsets, dtype=np.int64))
    column = getattr(source, "column_names", None)
    if column is not None and "input_ids" in column:  # datasets.Dataset: one column read
        return np.fromiter(map(len, source["input_ids"]), dtype=np.int64, count=len(source))
    return np.fromiter((len(source[i]["input_ids"]) for i in range(len(source))), np.int64)


class PackedDataset(torch.utils.data.Dataset):
    """Rows of ``seq_len`` tokens filled with whole documents (``plan_rows``).

    ``source``: a :class:`~meshtrain.data.store.TokenStore` / ``TokenDataset`` (documents
    read from the store's offsets; a store prepared with ``pack=True`` keeps them), a
    ``datasets.Dataset`` or any sequence of mappings with ``input_ids`` (and optionally
    per-token ``labels``, e.g. -100 on a chat prompt). Items are ``input_ids``,
    ``position_ids``, ``labels`` of ``seq_len`` tokens (``row_arrays``); rows stack with
    the default collator. ``stats()`` gives the real and padded token counts.
    """

    def __init__(
        self,
        source: Any,
        seq_len: int,
        *,
        strategy: str = "greedy",
        overflow: str = "split",
        pad_token_id: int = 0,
        position_ids_start: int = 0,
    ) -> None:
        from meshtrain.data.store import TokenDataset, TokenStore

        self.store = source.store if isinstance(source, TokenDataset) else source
        self.is_store = isinstance(self.store, TokenStore)
        self.seq_len = seq_len
        self.pad_token_id = pad_token_id
        self.position_ids_start = position_ids_start
        self.lengths = _source_lengths(self.store)
        self.rows = plan_rows(self.lengths, seq_len, strategy=strategy, overflow=overflow)
        first = None if self.is_store or not len(self.store) else self.store[0]
        self.has_labels = isinstance(first, Mapping) and "labels" in first

    def __len__(self) -> int:
        return len(self.rows)

    def _tokens(self, doc: int, start: int, stop: int) -> np.ndarray:
        if self.is_store:
            lo = int(self.store.bounds(doc)[0])
            return self.store.read(lo + start, lo + stop).astype(np.int64)
        return np.asarray(_ids(self.store[doc]["input_ids"])[start:stop], dtype=np.int64)

    def _labels(self, doc: int, start: int, stop: int) -> np.ndarray:
        return np.asarray(_ids(self.store[doc]["labels"])[start:stop], dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return row_arrays(
            self.rows[index],
            self._tokens,
            self.seq_len,
            pad_token_id=self.pad_token_id,
            labels_of=self._labels if self.has_labels else None,
            position_ids_start=self.position_ids_start,
        )

    def stats(self) -> dict[str, int]:
        """``documents``, ``rows``, ``real_tokens`` (placed), ``slots`` (rows x seq_len)."""
        real = sum(stop - start for row in self.rows for _, start, stop in row)
        docs = int((self.lengths > 0).sum())
        return {
            "documents": docs,
            "rows": len(self.rows),
            "real_tokens": int(real),
            "slots": len(self.rows) * self.seq_len,
        }


def stack_rows(features: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collate packed rows of equal length (``PackedDataset`` items) into ``[B, seq_len]``."""
    return {k: torch.stack([torch.as_tensor(f[k]) for f in features]) for k in features[0]}


def is_packed(position_ids: torch.Tensor | None) -> bool:
    """Whether a row holds more than one document: somewhere its position does not go up
    by one (transformers' ``find_packed_sequence_indices`` rule)."""
    if position_ids is None or position_ids.dim() < 2 or position_ids.shape[-1] < 2:
        return False
    return bool((position_ids[..., 1:] - position_ids[..., :-1] != 1).any())


__all__ = [
    "IGNORE_INDEX",
    "FlatteningCollator",
    "PackedDataset",
    "is_packed",
    "plan_rows",
    "row_arrays",
    "stack_rows",
]
