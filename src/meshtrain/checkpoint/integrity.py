"""What the checkpoint reader checks before it trusts bytes, and what it tells the user.

* ``read_manifest``: ``manifest.json`` is checked against its own checksum (sealed by the
  writer) before it is parsed, and parsed with duplicate keys refused, so a damaged byte
  anywhere in it -- a digit of a size, a letter of a tensor name, an RNG state -- is named
  as damage to that file instead of surfacing as a wrong number later.
* ``verify_rank_file``: a rank file against its per-tensor record (``tensor_files``), or
  the whole-file sha256 of manifests written before the record existed.

Every message ends with what to do: load the previous complete tag (named), or set
``MESHTRAIN_VERIFY=0`` (``verify=False``) to open it anyway and inspect it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import storage, tensor_files
from meshtrain.errors import CheckpointError
from meshtrain.files import checksums
from meshtrain.files.checksums import VERIFY_ENV, verify_default
from meshtrain.files.structured import parse_json
from meshtrain.files.text import decode, read_bytes


def fix_for(tag_dir: Path) -> str:
    """What to do about a damaged checkpoint: the previous complete tag, or inspect anyway."""
    try:
        others = [t for t in storage.list_tags(tag_dir.parent) if t != tag_dir.name]
    except (OSError, CheckpointError):
        others = []
    prev = (
        f"load the previous checkpoint (tag={others[-1]!r}) or restore the file from a copy"
        if others
        else "restore the file from a copy (no other complete checkpoint is in this folder)"
    )
    return f"{prev}; to open it anyway and inspect it, set {VERIFY_ENV}=0 (verify=False)"


def read_manifest(mpath: Path, verify: bool) -> dict[str, Any]:
    """Bytes of ``manifest.json`` checked against its seal, then parsed (no duplicates)."""
    fix = fix_for(mpath.parent)
    raw = read_bytes(mpath, CheckpointError, "checkpoint manifest")
    if verify:
        checksums.unseal(raw, str(mpath), CheckpointError, fix)
    text = decode(raw, str(mpath), CheckpointError, what="checkpoint manifest", empty_fix=fix)
    data = parse_json(
        text,
        str(mpath),
        CheckpointError,
        fix=f"it cannot be read as JSON, so the checkpoint is damaged: {fix}",
    )
    if not isinstance(data, dict):
        raise CheckpointError(f"{mpath}: not a manifest (a JSON object); {fix}")
    return data


def verify_rank_file(path: Path, entry: dict[str, Any]) -> None:
    """Check one rank file against its manifest entry; CheckpointError names file and part."""
    fix = fix_for(path.parent)
    record = entry.get("checksum")
    if isinstance(record, dict):
        tensor_files.verify(path, record, CheckpointError, f"(rank {entry['rank']}) {fix}")
        return
    h = hashlib.sha256()  # manifests written before per-tensor records
    with open(path, "rb") as f:
        while chunk := f.read(checksums.CHUNK):
            h.update(chunk)
    if h.hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint file {path} (rank {entry['rank']}) is corrupted: its sha256 differs "
            f"from the manifest's {entry['sha256'][:16]}...; {fix}"
        )


__all__ = ["VERIFY_ENV", "fix_for", "read_manifest", "verify_default", "verify_rank_file"]


WHOLE_MAX = 256 << 20  # keys up to this size are verified from the copy the read makes


class RankFileCheck:
    """Verification of one rank file, a tensor at a time, as the reader touches it.

    Opening checks the size and the header's checksum (a few KB). Each tensor is verified
    the first time it is read: a key of at most ``WHOLE_MAX`` bytes is read whole once
    (``get_tensor``), hashed in memory and handed to the reader, which serves this and
    later slices of it from that copy -- so the bytes are read once for the load and the
    hash is the only extra cost; a larger key is hashed from the file in 4 MiB chunks
    (memory stays bounded). A key never read is never hashed, and never used.
    """

    def __init__(self, path: Path, entry: dict[str, Any]) -> None:
        self.path, self.record = path, entry["checksum"]
        self.fix = f"(rank {entry['rank']}) {fix_for(path.parent)}"
        with open(path, "rb") as f:
            head = tensor_files.header_bytes(f, str(path), CheckpointError, self.fix)
        if checksums.digest(head) != self.record["header"]:
            raise CheckpointError(
                f"{path}: the safetensors header (bytes 0..{len(head)}, which say where each "
                f"tensor lies) is corrupted: its {checksums.ALGO} checksum differs from the "
                f"one recorded at save; {self.fix}"
            )
        header = tensor_files.parse_header(head, str(path), CheckpointError, self.fix)
        if set(header) != set(self.record["tensors"]):
            raise CheckpointError(f"{path}: holds other tensors than were written; {self.fix}")
        self.base = len(head)
        self.spans = {k: tuple(v["data_offsets"]) for k, v in header.items()}
        self.pending = set(header)

    def _bad(self, key: str) -> CheckpointError:
        lo, hi = (self.base + x for x in self.spans[key])
        return CheckpointError(
            f"{self.path}: tensor {key!r} (bytes {lo}..{hi} of the file) is corrupted: its "
            f"{checksums.ALGO} checksum differs from the one recorded at save; {self.fix}"
        )

    def tensor(self, handle: Any, key: str) -> Any:
        """Verify ``key`` (once); return its whole tensor when it was read for that."""
        if key not in self.pending:
            return None
        begin, end = self.spans[key]
        whole = None
        if end - begin <= WHOLE_MAX:
            whole = handle.get_tensor(key)
            ok = tensor_files.tensor_digest(whole) == self.record["tensors"][key]
        else:
            with open(self.path, "rb") as f:
                got = checksums.digest_range(f, self.base + begin, self.base + end)
            ok = got == self.record["tensors"][key]
        if not ok:
            raise self._bad(key)
        self.pending.discard(key)
        return whole
