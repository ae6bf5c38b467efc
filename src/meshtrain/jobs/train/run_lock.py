"""The output folder of a ``meshtrain train`` run: usable, and used by this run alone.

Two runs given the same ``--output-dir`` used to corrupt each other (one read the other's
``config.json``, both appended to ``metrics.jsonl``, one crashed at a save); and a folder
that could not be written was found only at the first checkpoint, after the steps before
it were lost. So before anything is tokenized or launched:

* :func:`check_output_dir` creates the folder, refuses a path that is a file or lies under
  one, and *writes* a probe file into it and into ``checkpoints/`` if that exists (a real
  write: ``os.access`` says yes to root on a read-only mount's bits, and to everyone on a
  full disk);
* :class:`RunLock` takes an exclusive ``flock`` on ``<output_dir>/.meshtrain-run.lock``
  for the whole run and writes the holder's PID, host and start time into it; a second run
  is refused with those. The kernel drops the lock when the holder dies, so a crashed run
  never leaves a stale lock (on NFS, ``flock`` works only where the server supports it).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

from meshtrain.errors import ConfigError

LOCK_NAME = ".meshtrain-run.lock"


def check_output_dir(path: str | os.PathLike, field: str = "train.output_dir") -> Path:
    """Create ``path`` if needed and prove it (and its ``checkpoints/``) can be written."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"{field}: {out} exists and is a file, not a folder; pick another --output-dir "
            "or move the file away"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except NotADirectoryError:
        raise ConfigError(
            f"{field}: cannot create {out}: a part of that path is a file, not a folder; "
            "pick another --output-dir"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{field}: cannot create {out} ({exc.strerror or exc}); pick a folder you can "
            "write, e.g. --output-dir ~/runs/a"
        ) from None
    _probe(out, field)
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir():
        _probe(checkpoints, f"{field} (its checkpoints/ folder)")
    return out


def _probe(folder: Path, field: str) -> None:
    probe = folder / f".meshtrain-write-probe-{os.getpid()}"
    try:
        with open(probe, "w") as f:
            f.write("ok")
        probe.unlink()
    except OSError as exc:
        why = "read-only file system" if exc.errno == errno.EROFS else exc.strerror or str(exc)
        raise ConfigError(
            f"{field}: cannot write into {folder} ({why}); checkpoints and logs would be "
            "lost at the first save. Fix its permissions or pick another --output-dir"
        ) from None


class RunLock:
    """An exclusive lock on an output folder, held from ``acquire`` to ``release``."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._file = None

    def acquire(self) -> RunLock:
        import fcntl

        f = open(self.path, "a+")  # noqa: SIM115 - held open for the whole run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                f.close()
                raise
            f.seek(0)
            holder = f.read().strip() or "an unknown process"
            f.close()
            raise ConfigError(
                f"train.output_dir: {self.path.parent} is in use by another meshtrain train "
                f"run ({holder}); two runs in one folder overwrite each other's config, "
                "logs and checkpoints. Wait for it to finish, stop it, or pick another "
                "--output-dir"
            ) from None
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
