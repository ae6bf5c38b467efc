"""Checksums of a token store: recorded while ``prepare`` writes it, verified on load.

``meta.json`` carries ``"checksums": {"algo": "xxh3_64", "tokens.bin": hex, ...}`` for
each data file, and is sealed with its own checksum (``files.checksums.seal``). The token
file is hashed chunk by chunk as ``StoreWriter.append`` writes it; offsets and labels are
hashed from the arrays about to be written. Nothing is read back.

``verify_store`` hashes each data file once, in place in the page cache; a mismatch
names the file and the first damaged 4 MiB block with the documents it holds, so a user
knows whether a few rows or the index is hit. ``TokenStore`` verifies when it opens a store
(once per process that opens it; unpickled copies in DataLoader workers skip it), and
``prepare`` verifies a store before reusing it and rebuilds a damaged one.

Stores written before checksums existed have none and load as before.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from meshtrain.errors import DataError
from meshtrain.files import checksums

FIX = (
    "run `meshtrain data prepare` again with --force to rebuild the store, or set "
    "MESHTRAIN_VERIFY=0 to open it anyway and inspect it"
)


def array_digest(a: np.ndarray) -> str:
    return checksums.digest(np.ascontiguousarray(a).view(np.uint8))


def verify_store(path: str, meta: dict[str, Any]) -> None:
    """Raise DataError naming the damaged file unless every data file matches ``meta``."""
    record = meta.get("checksums")
    if record is None:
        return  # written before checksums existed
    if not isinstance(record, dict) or record.get("algo") != checksums.ALGO:
        raise DataError(f"{os.path.join(path, 'meta.json')}: malformed 'checksums'; {FIX}")
    blocks = record.get("blocks", {})
    for name, want in record.items():
        if name in ("algo", "blocks", "block_bytes"):
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise DataError(f"{file}: the file is missing from the token store; {FIX}")
        if checksums.digest_file(file) == want:
            continue
        where = _locate(file, blocks.get(name), int(record.get("block_bytes", 0)))
        raise DataError(
            f"{file}: the token store file is corrupted{where}: its {checksums.ALGO} checksum "
            f"differs from the one recorded when it was written; {FIX}"
        )


def _locate(file: str, block_digests: list[str] | None, block: int) -> str:
    if not block_digests or block <= 0:
        return ""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for i, want in enumerate(block_digests):
            lo, hi = i * block, min(size, (i + 1) * block)
            if checksums.digest_in_place(f, lo, hi) != want:
                return f" in bytes {lo}..{hi}"
    return ""


def intact(out: str, meta: dict[str, Any], log: Any) -> bool:
    """``verify_store`` as a yes/no for ``prepare``'s reuse: a damaged store is rebuilt."""
    try:
        verify_store(out, meta)
    except DataError as exc:
        log.warning("not reusing the token store: %s; rebuilding it", exc)
        return False
    return True


class BlockHasher:
    """Whole-file and per-block digests of a stream written in pieces of any size."""

    def __init__(self, block: int = checksums.CHUNK * 16) -> None:
        self.block = block
        self.whole = checksums.hasher()
        self.cur = checksums.hasher()
        self.fill = 0
        self.blocks: list[str] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.whole.update(view)
        while len(view):
            take = min(len(view), self.block - self.fill)
            self.cur.update(view[:take])
            self.fill += take
            view = view[take:]
            if self.fill == self.block:
                self.blocks.append(self.cur.hexdigest())
                self.cur, self.fill = checksums.hasher(), 0

    def finish(self) -> tuple[str, list[str]]:
        if self.fill:
            self.blocks.append(self.cur.hexdigest())
        return self.whole.hexdigest(), self.blocks
