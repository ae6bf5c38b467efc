"""One writing path: check an output folder or file before any work starts.

A run that trains for hours and then fails at its first save with a ``PermissionError``
traceback from deep inside a writer has lost those hours. ``check_writable`` runs the same
checks up front and raises the caller's error with one line naming the path and the fix:

* a parent that is missing is fine when it can be created (writers ``mkdir -p``); the
  check then names the first *existing* ancestor that refuses it;
* a path that exists as the wrong kind (a file where a folder goes, or the reverse);
* a folder that cannot be written: checked by creating and removing a probe file, the only
  test that is true for root, ACLs, read-only mounts and network filesystems alike;
* free space below what the caller says it needs (``need_bytes``, default 1 MiB).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from meshtrain.errors import MeshtrainError

MIN_FREE = 1 << 20


def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def check_writable(
    path: str | os.PathLike,
    error: type[MeshtrainError],
    *,
    what: str = "output folder",
    is_dir: bool = True,
    need_bytes: int | None = None,
    flag: str | None = None,
) -> Path:
    """Raise ``error`` unless ``path`` (a folder, or a file with ``is_dir=False``) can be
    created or written now, with ``need_bytes`` (default 1 MiB) free beside it."""
    path = Path(path)
    name = f"{flag} {path}" if flag else str(path)
    fix_other = f"pass another {what}" + (f" with {flag}" if flag else "")
    if path.exists():
        if is_dir and not path.is_dir():
            raise error(f"{what} {name} is a file, not a folder; remove it or {fix_other}")
        if not is_dir and path.is_dir():
            raise error(f"{what} {name} is a folder, not a file; {fix_other}")
    folder = path if is_dir else path.parent
    anchor = _existing_ancestor(folder)
    if not anchor.is_dir():
        raise error(
            f"{what} {name}: {anchor} is a file, so the folder {folder} cannot be created; "
            f"{fix_other}"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=anchor, prefix=".meshtrain-probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        missing = "" if anchor == folder else f" (to create {folder} inside it)"
        raise error(
            f"{what} {name}: cannot write in {anchor}{missing}: {reason}; make it writable "
            f"(chmod u+w {anchor}) or {fix_other}"
        ) from None
    if not is_dir and path.exists() and not os.access(path, os.W_OK) and os.geteuid() != 0:
        raise error(
            f"{what} {name} exists and is read-only; make it writable (chmod u+w) or {fix_other}"
        )
    need = MIN_FREE if need_bytes is None else max(int(need_bytes), 1)
    free = shutil.disk_usage(anchor).free
    if free < need:
        raise error(
            f"{what} {name}: only {_human(free)} free on the disk holding {anchor}, "
            f"{_human(need)} needed; free space there or {fix_other}"
        )
    return path
