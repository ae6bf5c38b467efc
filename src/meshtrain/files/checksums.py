"""The checksum every meshtrain artifact carries, and JSON files that carry their own.

Hash: **xxh3-64** from the ``xxhash`` package. It guards against damage (a flipped bit
on disk or in a copy, a truncated transfer), not against an adversary, so a fast
non-cryptographic hash is the right tool. Measured on this project's 2-core machine
(``benchmarks/bench_hashes.py``, one core, GB/s over a block in the cache / from memory):
xxh3-64 87 / 27, xxh3-128 88 / 26, crc32c (``crc32c``, ``google-crc32c``) 18-23 / 7-8,
blake3 (one thread) 7.2 / 3.8, sha256 (``hashlib``) 1.5 / 1.5. A load from the page cache
is a memory copy of 10-17 GB/s, so only xxh3 keeps the hash a small fraction of it (a
fifth, inline; docs/checkpoints.md). 64 bits make the
chance that a damaged file still matches about 2^-64 (5e-20) per check; what matters for
damage is that every byte feeds the hash, and it does.

Streaming: writers feed the hash the bytes they write (``Hasher.update`` or
``HashingWriter``), so no second pass over a written file is needed; readers verify in one
pass, hashing the page cache in place (``digest_in_place``, ``digest_file``).

Sealed JSON: a manifest or metadata file carries its own checksum as its *last* member,
``"_checksum": "xxh3_64:<hex>"``, over the exact bytes before it. ``seal`` writes it,
``unseal`` checks it before the JSON is parsed. A file without the member (written by an
older meshtrain) is accepted as it is; one where the member is damaged is not, because a
single damaged byte cannot remove both the key and the ``xxh3_64:`` label it looks for.
"""

from __future__ import annotations

import mmap
import os
import re
from typing import Any, BinaryIO

import xxhash

from meshtrain.errors import MeshtrainError

ALGO = "xxh3_64"
VERIFY_ENV = "MESHTRAIN_VERIFY"  # =0: open damaged artifacts anyway, to inspect them
CHUNK = 1 << 22  # 4 MiB reads: large enough to run at memory speed, small in RSS
WINDOW = 64 << 20  # bytes hashed in place before their pages leave the map (RSS)
SEAL_KEY = "_checksum"
_SEAL = re.compile(rb',\n[ \t]*"_checksum": "xxh3_64:([0-9a-f]{16})"\n\}\n\Z')


def verify_default(verify: bool | None) -> bool:
    """``verify`` if given, else True unless the environment sets ``MESHTRAIN_VERIFY=0``."""
    if verify is not None:
        return bool(verify)
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def hasher() -> Any:
    """A fresh streaming hasher (``update(bytes-like)``, ``hexdigest()``)."""
    return xxhash.xxh3_64()


def digest(data: Any) -> str:
    """Hex digest of a bytes-like object (bytes, memoryview, a numpy array's buffer)."""
    return xxhash.xxh3_64_hexdigest(data)


def digest_in_place(f: BinaryIO, start: int, end: int) -> str:
    """Hex digest of bytes ``[start, end)`` of an open file, hashed where they lie in the
    page cache: through a read-only memory map, ``WINDOW`` bytes at a time, each window's
    pages dropped from this process's map once hashed (``MADV_DONTNEED``; they stay in
    the page cache). So a check adds no copy into memory of this process and no resident
    memory, however large the file: reading into a buffer first cost a copy and, for new
    memory, a page fault per 4 KiB (``benchmarks/bench_integrity.py --resume-rounds``).
    Bytes past the end of the file are not there to hash (the digest then differs), and
    the caller checks the size first: a file that shrinks while mapped faults (SIGBUS)."""
    h = hasher()
    end = min(end, os.fstat(f.fileno()).st_size)
    if end > start:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError:  # a file system that cannot map files: read it through a buffer
            return _digest_read(f, start, end)
        try:
            for lo in range(start, end, WINDOW):
                hi = min(end, lo + WINDOW)
                with memoryview(mm)[lo:hi] as window:
                    h.update(window)
                page = lo - lo % mmap.PAGESIZE
                mm.madvise(mmap.MADV_DONTNEED, page, hi - page)
        finally:
            mm.close()
    return h.hexdigest()


def _digest_read(f: BinaryIO, start: int, end: int) -> str:
    h, buf = hasher(), bytearray(CHUNK)
    view = memoryview(buf)
    f.seek(start)
    while start < end and (n := f.readinto(view[: min(CHUNK, end - start)])):
        h.update(view[:n])
        start += n
    return h.hexdigest()


def digest_file(path: str | os.PathLike) -> str:
    """Hex digest of a whole file, hashed in place (``digest_in_place``)."""
    with open(path, "rb") as f:
        return digest_in_place(f, 0, os.fstat(f.fileno()).st_size)


class HashingWriter:
    """Wrap a binary file: every ``write`` also feeds the hash and counts the bytes."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.h, self.size = f, hasher(), 0

    def write(self, data: Any) -> int:
        self.h.update(data)
        n = self.f.write(data)
        self.size += len(memoryview(data).cast("B"))
        return n

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def seal(text: str) -> str:
    """``text`` (a JSON object) with ``"_checksum"`` appended as its last member."""
    body = text.rstrip()
    if not body.endswith("}"):
        raise ValueError("seal needs a JSON object")
    body = body[:-1].rstrip()
    if body.endswith("{"):
        raise ValueError("seal needs a non-empty JSON object")
    return f'{body},\n "{SEAL_KEY}": "{ALGO}:{digest(body.encode("utf-8"))}"\n}}\n'


def unseal(raw: bytes, where: str, error: type[MeshtrainError], fix: str) -> bool:
    """Check a sealed file's bytes; True if sealed and intact, False if never sealed.

    Raises ``error`` naming ``where`` when the seal is present but does not match (or is
    itself damaged)."""
    m = _SEAL.search(raw)
    if m is None:
        tail = raw[-96:]
        if b'"_checksum"' in tail or f"{ALGO}:".encode() in tail:
            raise error(
                f"{where}: the file is damaged: its own checksum line at the end is malformed "
                f"or the file is truncated; {fix}"
            )
        return False
    body = raw[: m.start()]
    if digest(body) != m.group(1).decode():
        from meshtrain.files.text import line_col

        raise error(
            f"{where}: the file is corrupted: its bytes 0..{len(body)} (lines 1.."
            f"{line_col(body, len(body))[0]}) do not match its own {ALGO} checksum; {fix}"
        )
    return True
