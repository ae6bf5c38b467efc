"""What the checkpoint reader checks before it trusts bytes, and what it tells the user.

* ``read_manifest``: ``manifest.json`` is checked against its own checksum (sealed by the
  writer) before it is parsed, and parsed with duplicate keys refused, so a damaged byte
  anywhere in it -- a digit of a size, a letter of a tensor name, an RNG state -- is named
  as damage to that file instead of surfacing as a wrong number later.
* rank files are checked as they are read (``rank_file``): the header when the file is
  opened, each tensor against its record as it is read, or the whole-file sha256 of
  manifests written before the records existed.

Every message ends with what to do: load the previous complete tag (named), or set
``MESHTRAIN_VERIFY=0`` (``verify=False``) to open it anyway and inspect it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtrain.checkpoint import storage
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
    sealed = checksums.unseal(raw, str(mpath), CheckpointError, fix) if verify else None
    text = decode(raw, str(mpath), CheckpointError, what="checkpoint manifest", empty_fix=fix)
    data = parse_json(
        text,
        str(mpath),
        CheckpointError,
        fix=f"it cannot be read as JSON, so the checkpoint is damaged: {fix}",
    )
    if not isinstance(data, dict):
        raise CheckpointError(f"{mpath}: not a manifest (a JSON object); {fix}")
    version = data.get("format_version")
    if sealed is False and isinstance(version, int) and version >= 2:
        raise CheckpointError(
            f"{mpath}: format_version {version} manifests end with their own checksum "
            f'("_checksum"), and this one has none: it was edited or damaged; {fix}'
        )
    return data


__all__ = ["VERIFY_ENV", "fix_for", "read_manifest", "verify_default"]
