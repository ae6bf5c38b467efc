"""A read-only window ``[offset, offset + length)`` of an open file, as a seekable file.

A DCP ``.distcp`` file is many ``torch.save`` archives end to end, one per chunk; torch's
zip reader needs a seekable file that starts at the archive. The window gives it one
without reading the chunk into a bytes object first (which would hold the chunk twice:
the bytes and the tensor built from them). Reads use ``os.pread`` on the shared
descriptor, so windows of one file do not disturb each other.
"""

from __future__ import annotations

import io
import os


class FileWindow(io.RawIOBase):
    """``length`` bytes of the file open as ``fd`` from ``offset``, seekable from 0."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:n]], self.offset + self.pos + done)
            if got <= 0:
                break  # the file ends early: the caller's parser names the damage
            done += got
        self.pos += done
        return done


__all__ = ["FileWindow"]
