"""The on-disk format of a token store, and its writer.

A store is a folder::

    tokens.bin    every document's token ids, back to back (uint16, or uint32 when the
                  vocabulary has more than 65,536 ids), little-endian, no header
    offsets.bin   int64[num_docs + 1]: document i is tokens[offsets[i]:offsets[i+1]]
    labels.bin    int64[num_docs], only when a label field was given
    meta.json     format, version, dtype, counts, tokenizer, content hash, statistics,
                  the xxh3-64 checksum of each file (``data.integrity``); sealed with
                  its own checksum

The binary files are plain arrays so any process can ``mmap`` them; ``meta.json`` is
written last (and removed before the new files replace the old ones), so a folder whose
``meta.json`` is present and whose file sizes match it is complete. With packing
(``pack=True``, ``seq_len=L``), row i is ``tokens[i*L:(i+1)*L]`` and the last
``num_tokens mod L`` tokens are not used.

This module does not import torch, so ``prepare``'s worker processes stay light.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from meshtrain.data.integrity import BlockHasher, array_digest
from meshtrain.errors import DataError
from meshtrain.files import checksums
from meshtrain.files.atomic import write_atomic
from meshtrain.files.structured import parse_json
from meshtrain.files.text import decode, read_bytes

FORMAT = "meshtrain-token-store"
VERSION = 1
META = "meta.json"
TOKENS = "tokens.bin"
OFFSETS = "offsets.bin"
LABELS = "labels.bin"


def read_meta(path: str) -> dict[str, Any]:
    """Load and check ``meta.json`` and the file sizes; raise :class:`DataError` if the
    folder is not a complete store."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise DataError(
            f"{path} is not a token store (no {META}); create it with "
            "`meshtrain data prepare INPUT --tokenizer NAME --out DIR`"
        )
    raw = read_bytes(meta_path, DataError, "token store metadata")
    fix = "run prepare again (--force) to rebuild the store"
    checksums.unseal(raw, meta_path, DataError, fix)  # meta.json carries its own checksum
    meta = parse_json(
        decode(raw, meta_path, DataError, what="token store metadata", empty_fix=fix),
        meta_path,
        DataError,
        fix=f"corrupt store metadata; {fix}",
    )
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path}: corrupt store metadata (not a JSON object); {fix}")
    if meta.get("format") != FORMAT or int(meta.get("version", 0)) > VERSION:
        raise DataError(
            f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')} is not a "
            f"{FORMAT} v{VERSION} store; run prepare again with this meshtrain"
        )
    expected = {
        TOKENS: int(meta["num_tokens"]) * np.dtype(meta["dtype"]).itemsize,
        OFFSETS: (int(meta["num_docs"]) + 1) * 8,
    }
    if meta.get("has_labels"):
        expected[LABELS] = int(meta["num_docs"]) * 8
    for name, size in expected.items():
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else -1
        if actual != size:
            raise DataError(
                f"{file}: expected {size} bytes from {META}, found "
                f"{'no file' if actual < 0 else actual}; the store is incomplete, run prepare again"
            )
    return meta


class StoreWriter:
    """Append documents to a new store in ``out``; ``close()`` publishes it atomically.

    Data goes to ``*.tmp`` files; a previous store in ``out`` stays valid until ``close()``
    removes its ``meta.json``, renames the new files into place and writes the new one.
    """

    def __init__(self, out: str, dtype: np.dtype, vocab_size: int, with_labels: bool) -> None:
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.dtype = np.dtype(dtype)
        self.vocab_size = int(vocab_size)
        self.limit = np.iinfo(self.dtype).max
        self._tokens = open(os.path.join(out, TOKENS + ".tmp"), "wb")  # noqa: SIM115 - open while the writer lives; closed by close() or abort()
        self._hash = BlockHasher()  # fed as the tokens are written: no second pass
        self._lengths: list[np.ndarray] = []
        self._labels: list[np.ndarray] | None = [] if with_labels else None
        self.num_tokens = 0
        self.num_docs = 0

    def append(self, tokens: np.ndarray, lengths: np.ndarray, labels: Any = None) -> None:
        if len(tokens) and int(tokens.max()) > self.limit:
            raise DataError(
                f"token id {int(tokens.max())} does not fit {self.dtype} (vocabulary size "
                f"{self.vocab_size} reported by the tokenizer); fix the tokenizer's vocab size"
            )
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._tokens.write(data)
        self._hash.update(data)
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        if self._labels is not None:
            self._labels.append(np.asarray(labels, dtype=np.int64))
        self.num_tokens += int(len(tokens))
        self.num_docs += int(len(lengths))

    def abort(self) -> None:
        self._tokens.close()
        for name in (TOKENS, OFFSETS, LABELS):
            tmp = os.path.join(self.out, name + ".tmp")
            if os.path.exists(tmp):
                os.remove(tmp)

    def close(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Write offsets/labels, rename everything into place, then write ``meta.json``."""
        self._tokens.flush()
        os.fsync(self._tokens.fileno())
        self._tokens.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        offsets.tofile(os.path.join(self.out, OFFSETS + ".tmp"))
        names = [TOKENS, OFFSETS]
        whole, blocks = self._hash.finish()
        sums: dict[str, Any] = {
            "algo": checksums.ALGO,
            TOKENS: whole,
            OFFSETS: array_digest(offsets),
        }
        sums["block_bytes"], sums["blocks"] = self._hash.block, {TOKENS: blocks}
        if self._labels is not None:
            labels = np.concatenate(self._labels) if self._labels else np.zeros(0, np.int64)
            labels.tofile(os.path.join(self.out, LABELS + ".tmp"))
            names.append(LABELS)
            sums[LABELS] = array_digest(labels)
        elif os.path.exists(os.path.join(self.out, LABELS)):
            os.remove(os.path.join(self.out, LABELS))
        meta_path = os.path.join(self.out, META)
        if os.path.exists(meta_path):  # the old store stops being valid before it changes
            os.remove(meta_path)
        for name in names:
            os.replace(os.path.join(self.out, name + ".tmp"), os.path.join(self.out, name))
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
            "has_labels": self._labels is not None,
            **meta,
            "checksums": sums,
        }
        write_atomic(
            os.path.join(self.out, META), checksums.seal(json.dumps(meta, indent=2, sort_keys=True))
        )
        return meta
