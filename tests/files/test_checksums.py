"""``files.checksums.digest_in_place``: the digest of any byte range of a real file equals
xxh3-64 of those bytes, across window boundaries (windows of 3 pages and 7 bytes here),
for empty and past-the-end ranges, and through the buffered read a file system that
cannot map files gets."""

from __future__ import annotations

import mmap
import os
from unittest import mock

import pytest

from meshtrain.files import checksums


@pytest.mark.parametrize("window", [7, 3 * mmap.PAGESIZE, 64 << 20])
def test_in_place_digest_equals_the_bytes_digest(tmp_path, monkeypatch, window):
    monkeypatch.setattr(checksums, "WINDOW", window)
    data = os.urandom(5 * mmap.PAGESIZE + 123)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    ranges = [(0, len(data)), (1, 2), (4095, 4097), (100, 3 * mmap.PAGESIZE + 5), (7, 7)]
    with open(path, "rb") as f:
        for lo, hi in ranges:
            assert checksums.digest_in_place(f, lo, hi) == checksums.digest(data[lo:hi])
        # past the end: only the bytes that are there (the caller's size check names it)
        assert checksums.digest_in_place(f, 10, len(data) + 50) == checksums.digest(data[10:])
        with mock.patch.object(checksums.mmap, "mmap", side_effect=OSError("cannot map")):
            for lo, hi in ranges:
                assert checksums.digest_in_place(f, lo, hi) == checksums.digest(data[lo:hi])
    assert checksums.digest_file(path) == checksums.digest(data)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert checksums.digest_file(empty) == checksums.digest(b"")
