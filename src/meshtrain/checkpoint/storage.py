"""Files and directories of a save_dir: fsync, checksums, ``latest``, tags, retention.

A save_dir holds complete checkpoints ``<tag>/`` (a directory with ``manifest.json``), the
``latest`` file naming the newest complete tag, and transient ``.tmp-<tag>/`` (a save in
progress or a crashed one), ``.old-<tag>/`` (a tag being overwritten) and ``.del-<tag>/``
(a tag being deleted by retention) directories.

Durability: a rename is only as durable as its directory entry, so after every rename
the parent directory is fsynced too (``files.atomic``, which also writes ``latest``).
Ordering is what makes a crash harmless: ``latest`` is replaced only after the tag's
directory is complete and durable, and ``os.replace`` swaps it atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.manifest import LATEST, MANIFEST, OLD_PREFIX, check_tag
from meshtrain.errors import CheckpointError
from meshtrain.files.atomic import fsync_dir

log = logging.getLogger(__name__)

DEL_PREFIX = ".del-"  # a tag being deleted by retention
_CHUNK = 1 << 22  # 4 MiB reads for hashing: large enough to be fast, small in memory


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (memory stays at one chunk)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / MANIFEST).is_file()


def latest_tag(save_dir: str | os.PathLike) -> str | None:
    """The tag ``save_dir/latest`` names, or None when there is no ``latest`` file."""
    path = Path(save_dir) / LATEST
    try:
        tag = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not tag:
        raise CheckpointError(f"{path} is empty; delete it or write a tag name into it")
    return check_tag(tag)


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _created(tag_dir: Path) -> float:
    """When the tag was saved, from its manifest (file times change when a directory is
    copied); the manifest's mtime if it cannot be parsed."""
    path = tag_dir / MANIFEST
    try:
        return float(json.loads(path.read_text())["created_unix"])
    except (OSError, ValueError, KeyError, TypeError):
        return path.stat().st_mtime


def list_tags(save_dir: str | os.PathLike) -> list[str]:
    """Complete tags in ``save_dir``, oldest first: by the save time in their manifest,
    then by name with numbers compared as numbers (``global_step9`` < ``global_step10``)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [
        (_created(d), _natural(d.name), d.name)
        for d in root.iterdir()
        if not d.name.startswith(".") and d.is_dir() and is_complete(d)
    ]
    return [name for *_, name in sorted(found)]


def tag_dir(save_dir: Path, tag: str) -> Path:
    """Directory of a complete ``tag``: ``<tag>/``, or ``.old-<tag>/`` if a crash hit the
    moment between moving an overwritten tag aside and renaming its replacement in."""
    check_tag(tag)
    primary = save_dir / tag
    if is_complete(primary):
        return primary
    old = save_dir / f"{OLD_PREFIX}{tag}"
    if not primary.exists() and is_complete(old):
        return old
    if primary.is_dir():
        raise CheckpointError(
            f"{primary} has no {MANIFEST}: the checkpoint is incomplete or was not written "
            f"by meshtrain; load another tag (complete ones: {list_tags(save_dir)})"
        )
    raise CheckpointError(
        f"checkpoint tag {tag!r} not found in {save_dir}; complete tags there: "
        f"{list_tags(save_dir)}"
    )


def restore_old(save_dir: Path) -> None:
    """Settle overwrites a crash interrupted: ``.old-<tag>`` goes back to ``<tag>`` when
    the replacement never arrived, and is deleted when it did."""
    for old in save_dir.glob(f"{OLD_PREFIX}*"):
        tag = save_dir / old.name[len(OLD_PREFIX) :]
        if tag.exists():
            shutil.rmtree(old, ignore_errors=True)
        elif is_complete(old):
            os.rename(old, tag)
            fsync_dir(save_dir)


def apply_retention(save_dir: Path, keep_last: int) -> list[str]:
    """Delete the oldest complete tags beyond ``keep_last``, never the one ``latest`` names.

    Only directories with a meshtrain manifest are considered, so other files a user keeps
    in save_dir are never touched. Returns the deleted tags.
    """
    tags = list_tags(save_dir)
    keep = set(tags[-keep_last:]) if keep_last > 0 else set()
    latest = latest_tag(save_dir)
    if latest is not None:
        keep.add(latest)
    deleted = []
    for tag in tags:
        if tag in keep:
            continue
        doomed = save_dir / f"{DEL_PREFIX}{tag}"
        try:
            # rename first so a crash mid-delete never leaves a half-deleted "complete" tag
            os.rename(save_dir / tag, doomed)
            shutil.rmtree(doomed)
            deleted.append(tag)
        except OSError as exc:
            log.warning("checkpoint retention: could not delete %s: %s", save_dir / tag, exc)
    for d in save_dir.glob(f"{DEL_PREFIX}*"):  # leftovers of a crash mid-delete
        shutil.rmtree(d, ignore_errors=True)
    if deleted:
        fsync_dir(save_dir)
    return deleted
