"""The one way meshtrain replaces a file: write a temp name beside it, fsync, ``os.replace``,
fsync the folder.

A reader (a resumed run, the launcher reading a pre-emption note, a watchdog reading
heartbeats) sees the old file or the new one, never half of one, and after a crash or a
power cut the rename is durable: without the file's fsync the new name can point at
blocks that were never written, and without the folder's fsync the rename itself can be
lost. The temp name is hidden (``.name.tmp-PID`` keeping the suffix, so writers that
choose a format by extension, such as matplotlib, still do) and carries the process id,
so two processes replacing the same file never write the same temp file.

* :func:`write_atomic` -- text or bytes in hand.
* :func:`atomic_file` -- an open file to write into (``json.dump``, a streamed writer).
* :func:`atomic_path` -- a temp path for a writer that opens it itself (``fig.savefig``,
  ``ndarray.tofile``, ``save_pretrained`` into a folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def temp_name(path: str | os.PathLike) -> Path:
    """The hidden temp name beside ``path`` this process writes before the rename."""
    p = Path(path)
    return p.with_name(f".{p.stem}.tmp-{os.getpid()}{p.suffix}")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where folders cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file():
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(path)
    elif path.exists():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _discard(tmp: Path) -> None:
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; when the block ends normally, what was written
    there (a file, or a folder whose files are all fsync'd) replaces ``path``. A folder
    replaces a folder: the old one is removed first, so a crash in between leaves no
    ``path`` rather than a mixed one. On an error the temp is removed and ``path`` is
    untouched."""
    with _replacing(path, synced=False) as tmp:
        yield tmp


@contextlib.contextmanager
def _replacing(path: str | os.PathLike, synced: bool) -> Iterator[Path]:
    target = Path(path)
    tmp = temp_name(target)
    _discard(tmp)
    try:
        yield tmp
        if not synced:
            _fsync_tree(tmp)
        if tmp.is_dir() and target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8"
) -> Iterator[IO[Any]]:
    """Yield a file open for writing (``"w"`` text or ``"wb"`` bytes) on a temp name; when
    the block ends normally it is flushed, fsync'd and renamed over ``path``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file: mode {mode!r}; use 'w' or 'wb'")
    with _replacing(path, synced=True) as tmp:
        kwargs = {"encoding": encoding} if mode == "w" else {}
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_atomic(path: str | os.PathLike, data: str | bytes, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``data`` (text or bytes) atomically and durably."""
    if isinstance(data, bytes):
        with atomic_file(path, "wb") as f:
            f.write(data)
    else:
        with atomic_file(path, "w", encoding=encoding) as f:
            f.write(data)
