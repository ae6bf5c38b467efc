"""One rank file of a checkpoint, read key by key with one pass over its bytes.

A safetensors file is ``8-byte length | JSON header | tensor bytes back to back``. On
opening, the header is read once (and checked against the manifest's record when
verifying); its offsets are validated against the file size, so every later read is a
plain ``readinto`` at a known position.

**Whole keys, one pass.** ``read_key`` reads a key's bytes with ``readinto`` straight
into the storage of the tensor it returns, in ``BLOCK`` pieces; when verifying, each
block is hashed right after it lands, while it is still in the CPU cache, and the
digest is compared with the record before the tensor is handed out. So verification
adds the hash's arithmetic over bytes already in cache, never a second read: the reader
before this one hashed each file in a pass of its own and then let safetensors read it
again through a memory map (2.5x a load from the page cache, where a load is a memory
copy). Hashing on a second thread while the next block is read was measured and is not
done: slower than inline on this project's machine even with a core free
(docs/checkpoints.md). A key split over two threads, each reading and hashing its half
while it is in its own core's cache, measured 1.11-1.18x against 1.30-1.32x inline, but
only with the second core idle, and it needs a digest per part (records now carry part
digests for large keys, but whole-key reads do not use threads: not built;
``benchmarks/bench_warm_load.py``, docs/checkpoints.md). The tensor is the
caller's: nothing else refers to its storage.

**Parts of keys.** A key read only in part (one rank's range of a flat ZeRO buffer) is
sliced from safetensors' memory map, so a narrow read touches only its bytes. When the
record has a digest per 4 MiB part of the key (``tensor_files.PART_BYTES``), only the
parts the range lies in are checked (``verify_elements``), hashed in place through that
same map. Otherwise, while it is not yet verified, the whole key is first hashed *in
place*, in the page cache (``verify_key``): through a read-only map of the file, ``checksums.WINDOW`` at a time,
each window's pages dropped from this process's map once hashed (they stay in the page
cache), so checking even a huge key adds no copy and no resident memory. The slices
handed out afterwards are views of those same page-cache pages, so what the caller copies
is what was hashed (unless another writer rewrites the file in between, or the kernel
evicts a page and reads it again from the disk in that interval). Reading the key into
memory first, as this reader did before, cost a copy and a page fault per 4 KiB of fresh
memory (2.3 us each on this project's VM): a restart (``engine.load_checkpoint``) took
1.96x its unverified time (docs/checkpoints.md, ``bench_integrity.py --resume-rounds``).
``verify_all`` runs the same hash over every key, slicing nothing.

Manifests written before per-tensor records carry a whole-file sha256; such a file is
hashed whole when it is opened, as before.

Byte order: safetensors stores little-endian; the tensors are viewed in the host's order,
as safetensors itself does on the little-endian machines torch supports.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint import tensor_files
from meshtrain.dtypes import SAFETENSORS_CODES
from meshtrain.errors import CheckpointError
from meshtrain.files import checksums

# 256 KiB: a block and its hash stay in a core's L2 (1 MiB here); measured with
# benchmarks/bench_integrity.py against 64 KiB (more syscalls) and 1-4 MiB (the block is
# evicted before it is hashed)
BLOCK = 1 << 18
_TORCH = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}


class RankFile:
    """The header, key table and verification state of one rank file (module docstring).

    ``record``: the manifest's checksum record (``{"header", "tensors", ...}``), or None.
    ``sha256``: the whole-file digest of an older manifest, or None. ``verify``: check
    against whichever is present. ``fix``: what a message tells the user to do."""

    def __init__(
        self,
        path: Path,
        rank: int,
        *,
        record: dict[str, Any] | None,
        sha256: str | None,
        verify: bool,
        fix: str,
    ) -> None:
        self.path, self.rank, self.verify, self.fix = path, rank, verify, fix
        self.where = f"checkpoint file {path} (rank {rank})"
        self.record = record if verify else None
        self.verified: set[str] = set()
        self._f: Any = None
        self._mmap: Any = None
        f = self._file()
        size = os.fstat(f.fileno()).st_size
        err_fix = f"(rank {rank}) {fix}"
        head = tensor_files.header_bytes(f, str(path), CheckpointError, err_fix)
        if self.record is not None and checksums.digest(head) != self.record["header"]:
            raise CheckpointError(
                f"{path}: the safetensors header (bytes 0..{len(head)}, which say where each "
                f"tensor lies) is corrupted: its {checksums.ALGO} checksum differs from the "
                f"one recorded at save; {err_fix}"
            )
        self.keys = tensor_files.layout(head, size, str(path), CheckpointError, err_fix)
        for key, (code, _shape, _b, _e) in self.keys.items():
            if code not in _TORCH:
                raise CheckpointError(
                    f"{self.where}: tensor {key!r} has dtype {code!r}, which meshtrain does not "
                    f"write; {err_fix}"
                )
        if self.record is not None and set(self.record["tensors"]) != set(self.keys):
            raise CheckpointError(f"{path}: holds other tensors than were written; {err_fix}")
        self._parts = self._part_record(err_fix)
        self._parts_ok: dict[str, set[int]] = {}
        if verify and self.record is None and sha256 is not None:
            self._check_sha256(sha256)

    # ---- files -----------------------------------------------------------------------
    def _file(self) -> Any:
        if self._f is None:
            try:
                self._f = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
            except FileNotFoundError:
                raise CheckpointError(f"{self.where} is missing; {self.fix}") from None
        return self._f

    def mapped(self) -> Any:
        """safetensors' memory-mapped handle (for narrow slices)."""
        if self._mmap is None:
            from safetensors import safe_open

            try:
                self._mmap = safe_open(str(self.path), framework="pt")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(
                    f"{self.where} is not a readable safetensors file ({exc}); {self.fix}"
                ) from None
        return self._mmap

    def close(self) -> None:
        """Close the file and unmap it; what was verified stays verified."""
        if self._f is not None:
            self._f.close()
            self._f = None
        self._mmap = None

    # ---- keys ------------------------------------------------------------------------
    def shape(self, key: str) -> list[int]:
        return self.keys[key][1]

    def nbytes(self, key: str) -> int:
        _code, _shape, begin, end = self.keys[key]
        return end - begin

    def read_key(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (its stored shape and dtype) in a new storage, read in
        one pass and, unless already verified, hashed as it lands and checked."""
        code, shape, begin, end = self.keys[key]
        out = torch.empty(end - begin, dtype=torch.uint8)
        digest = self._pass(key, begin, end, memoryview(out.numpy()), self._needs(key))
        self._check(key, digest, begin, end)
        return out.view(_TORCH[code]).reshape(shape)

    def _part_record(self, err_fix: str) -> tuple[int, dict[str, list[str]]] | None:
        """``(part bytes, {key: part digests})`` from the record, checked against the keys'
        sizes; None when the record has none (written before parts, or no key is large)."""
        rec = None if self.record is None else self.record.get("parts")
        if rec is None:
            return None
        size, table = rec.get("bytes") if isinstance(rec, dict) else None, None
        if isinstance(size, int) and size > 0 and isinstance(rec.get("tensors"), dict):
            table = rec["tensors"]
            for key, digests in table.items():
                n = -(-self.nbytes(key) // size) if key in self.keys else -1
                if not isinstance(digests, list) or len(digests) != n:
                    table = None
                    break
        if table is None:
            raise CheckpointError(
                f"{self.path}: the manifest's per-part checksums of this file are malformed "
                f"(each key's list must have one digest per {size!r} bytes); {err_fix}"
            )
        return size, table

    def verify_elements(self, key: str, lo: int, hi: int) -> None:
        """Check what elements ``[lo, hi)`` of 1-D key ``key`` lie in: the parts covering
        them, when the record has parts for it, else the whole key. A part is hashed in
        place through safetensors' map of the file, the map the caller's slice is a view
        of, so a narrow read of a large key hashes about what it reads. (Hashing just
        before the caller's copy was meant to let the copy read the bytes from cache; the
        restart measured the same with or without parts: docs/checkpoints.md.)"""
        if not self._needs(key):
            return
        if self._parts is None or key not in self._parts[1]:
            self.verify_key(key)
            return
        size, digests = self._parts[0], self._parts[1][key]
        code, _shape, begin, end = self.keys[key]
        item = _TORCH[code].itemsize
        ok = self._parts_ok.setdefault(key, set())
        data: Any = None
        for i in range(lo * item // size, -(-hi * item // size)):
            if i in ok:
                continue
            if data is None:  # the key's bytes in safetensors' map: the slices' own pages
                if self._file_size() < end:  # checked at opening; a shorter map would fault
                    self._truncated(key, self._file_size())
                data = self.mapped().get_slice(key)[:].view(torch.uint8).numpy()
            a, b = i * size, min(end - begin, (i + 1) * size)
            if checksums.digest(data[a:b]) != digests[i]:
                a, b = begin + a, begin + b
                raise CheckpointError(
                    f"{self.path}: tensor {key!r} (part {i}, bytes {a}..{b} of the file) is "
                    f"corrupted: its {checksums.ALGO} checksum differs from the one recorded "
                    f"at save; (rank {self.rank}) {self.fix}"
                )
            ok.add(i)
        if len(ok) == len(digests):
            self.verified.add(key)

    def verify_key(self, key: str) -> None:
        """Hash ``key``'s bytes in place (``checksums.digest_in_place``: through a read-only
        map of the file, in windows whose pages leave this process's map once hashed) and
        check them; the slices that follow come from safetensors' map of the same pages."""
        if not self._needs(key):
            return
        _code, _shape, begin, end = self.keys[key]
        if self._file_size() < end:  # checked at opening; a shorter map would fault
            self._truncated(key, self._file_size())
        self._check(key, checksums.digest_in_place(self._file(), begin, end), begin, end)

    def _file_size(self) -> int:
        return os.fstat(self._file().fileno()).st_size

    def _needs(self, key: str) -> bool:
        """Whether ``key`` is still to be checked."""
        return self.record is not None and key not in self.verified

    def _pass(self, key: str, begin: int, end: int, dst: memoryview, verify: bool) -> str | None:
        """Read bytes ``[begin, end)`` block by block into ``dst``; with ``verify``, return
        their digest, else None. Each block is hashed right after it lands, while it is in
        the CPU cache."""
        h = checksums.hasher() if verify else None
        f = self._file()
        f.seek(begin)
        pos, n = 0, end - begin
        while pos < n:
            view = dst[pos : pos + min(BLOCK, n - pos)]
            got = f.readinto(view)
            if not got:
                self._truncated(key, begin + pos)
            if h is not None:
                h.update(view[:got])
            pos += got
        return h.hexdigest() if h is not None else None

    def _truncated(self, key: str, at: int) -> None:
        raise CheckpointError(
            f"{self.where}: the file ends inside tensor {key!r} (byte {at}); it was "
            f"truncated after it was opened; {self.fix}"
        )

    def _check(self, key: str, digest: str | None, begin: int, end: int) -> None:
        if digest is None:
            return
        if digest != self.record["tensors"][key]:
            raise CheckpointError(
                f"{self.path}: tensor {key!r} (bytes {begin}..{end} of the file) is corrupted: "
                f"its {checksums.ALGO} checksum differs from the one recorded at save; "
                f"(rank {self.rank}) {self.fix}"
            )
        self.verified.add(key)

    def _check_sha256(self, want: str) -> None:
        h = hashlib.sha256()  # manifests written before per-tensor records
        f = self._file()
        f.seek(0)
        while chunk := f.read(checksums.CHUNK):
            h.update(chunk)
        if h.hexdigest() != want:
            raise CheckpointError(
                f"{self.where} is corrupted: its sha256 differs from the manifest's "
                f"{want[:16]}...; {self.fix}"
            )
