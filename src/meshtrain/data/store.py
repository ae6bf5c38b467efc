"""Read a token store: every rank shares one copy of the data in the page cache.

The store's files are plain arrays (see :mod:`meshtrain.data.layout`), so they can be
memory-mapped, and :attr:`TokenStore.tokens` / :attr:`TokenStore.offsets` are read-only
``mmap`` views for whole-array work. Reading *rows* — what a Dataset does for every batch —
uses ``os.pread`` of exactly the bytes of that row instead: N ranks on a machine still
share the kernel's single cached copy of the file, but no process maps it.

Why not mmap for rows: on Linux 6.x the page cache holds large folios (up to 2 MB) and a
fault maps the whole folio plus fault-around, ``MADV_RANDOM`` or not. Measured here: 2,000
random 100-byte reads through a map of a 150 MB file put all 150 MB in the process's RSS;
the same reads with ``pread`` added nothing (4.6 us per read). Those pages are clean and
shared, but RSS is what the OOM killer and memory monitors see, once per rank. With
``pread`` a process's memory is its batch plus two file descriptors, whatever the dataset
size. :class:`TokenDataset` is the map-style torch dataset over it: documents
(optionally truncated), or fixed-length rows of a packed store. Pickling it (DataLoader
workers, spawn) sends only the path.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from meshtrain.data.integrity import verify_store
from meshtrain.data.layout import LABELS, OFFSETS, TOKENS, read_meta
from meshtrain.files.checksums import verify_default

_INT64 = np.dtype("<i8")


def _map(path: str, dtype: np.dtype) -> np.ndarray:
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=dtype)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mm, dtype=dtype)


class TokenStore:
    """Read-only access to a store written by :func:`meshtrain.data.prepare`.

    ``doc(i)``, ``read(start, stop)`` and ``label(i)`` read only the bytes asked for;
    ``tokens``, ``offsets`` and ``labels`` are memory-mapped arrays created on first use.
    ``verify``: check every file against the checksums in ``meta.json`` on opening (one
    read of the store); ``None``: on unless ``MESHTRAIN_VERIFY=0``.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool | None = None) -> None:
        self.path = os.fspath(path)
        self.meta = read_meta(self.path)
        if verify_default(verify):  # every data file against meta.json's checksums
            verify_store(self.path, self.meta)
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self.has_labels = bool(self.meta.get("has_labels"))
        self._fds: dict[str, int] = {}
        self._maps: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}  # descriptors and maps are per process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], verify=False)  # type: ignore[misc] - checked by the sender

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _pread(self, name: str, nbytes: int, offset: int) -> bytes:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(os.path.join(self.path, name), os.O_RDONLY)
        if not hasattr(os, "pread"):  # pragma: no cover - Windows
            os.lseek(fd, offset, os.SEEK_SET)
            return os.read(fd, nbytes)
        return os.pread(fd, nbytes, offset)

    @property
    def num_docs(self) -> int:
        return int(self.meta["num_docs"])

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    def __len__(self) -> int:
        return self.num_docs

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` of the flat token stream."""
        n = max(0, stop - start)
        raw = self._pread(TOKENS, n * self.dtype.itemsize, start * self.dtype.itemsize)
        return np.frombuffer(raw, dtype=self.dtype)

    def bounds(self, i: int) -> tuple[int, int]:
        """``(start, stop)`` of document ``i`` in the token stream."""
        lo, hi = np.frombuffer(self._pread(OFFSETS, 16, i * 8), dtype=_INT64)
        return int(lo), int(hi)

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document ``i``."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range for a store of {self.num_docs}")
        return self.read(*self.bounds(i))

    def label(self, i: int) -> int:
        return int(np.frombuffer(self._pread(LABELS, 8, i * 8), dtype=_INT64)[0])

    def _mapped(self, name: str, dtype: np.dtype) -> np.ndarray:
        if name not in self._maps:
            self._maps[name] = _map(os.path.join(self.path, name), dtype)
        return self._maps[name]

    @property
    def tokens(self) -> np.ndarray:
        """All token ids, memory-mapped (pages are loaded as they are touched)."""
        return self._mapped(TOKENS, self.dtype)

    @property
    def offsets(self) -> np.ndarray:
        return self._mapped(OFFSETS, _INT64)

    @property
    def labels(self) -> np.ndarray | None:
        return self._mapped(LABELS, _INT64) if self.has_labels else None


class TokenDataset(Dataset):
    """Map-style dataset over a token store.

    Args:
        path: the store folder (``--out`` of ``prepare``) or an open :class:`TokenStore`.
        max_length: truncate documents to this many tokens (ignored for packed stores).
        packed: read fixed rows of ``seq_len`` tokens; default: as the store was prepared.
        seq_len: row length for ``packed``; default: the store's ``seq_len``.

    Items are ``{"input_ids": LongTensor}`` plus ``"labels": int`` when the store has labels.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | TokenStore,
        *,
        max_length: int | None = None,
        packed: bool | None = None,
        seq_len: int | None = None,
    ) -> None:
        self._store: TokenStore | None = path if isinstance(path, TokenStore) else None
        self._verify_on_open = True
        self.path = path.path if isinstance(path, TokenStore) else os.fspath(path)
        meta = self.store.meta
        self.packed = bool(meta.get("pack")) if packed is None else bool(packed)
        self.seq_len = int(seq_len or meta.get("seq_len") or 0)
        if self.packed and self.seq_len <= 0:
            raise ValueError(f"{self.path}: packed reading needs seq_len (the store has none)")
        self.max_length = max_length
        self._len = self.store.num_tokens // self.seq_len if self.packed else self.store.num_docs

    @property
    def store(self) -> TokenStore:
        if self._store is None:  # first use in this process (after unpickling)
            # verified where the dataset was built; an unpickled copy (a worker) skips it
            self._store = TokenStore(self.path, verify=None if self._verify_on_open else False)
            self._verify_on_open = False
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None
        return state

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = int(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {index} out of range for a dataset of {self._len}")
        store = self.store
        if self.packed:
            ids = store.read(i * self.seq_len, (i + 1) * self.seq_len)
        else:
            lo, hi = store.bounds(i)
            if self.max_length is not None:
                hi = min(hi, lo + self.max_length)
            ids = store.read(lo, hi)
        item: dict[str, Any] = {"input_ids": torch.from_numpy(ids.astype(np.int64))}
        if store.has_labels and not self.packed:
            item["labels"] = store.label(i)
        return item

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self[i] for i in indices]
