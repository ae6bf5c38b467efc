"""The hashing thread (files/hash_thread.py): the digest of a stream hashed on a worker
equals the digest of its bytes hashed in one call, whatever the chunking; the worker ends
by itself when idle but never inside a stream; errors come back to the caller."""

from __future__ import annotations

import os
import threading
import time

import pytest

from meshtrain.files import checksums, hash_thread
from meshtrain.files.hash_thread import HashThread, cut


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "meshtrain-hash"]


def test_digests_equal_one_call_for_any_chunking():
    data = memoryview(os.urandom(300_001))
    ht = HashThread()
    try:
        for size in (1, 7, 4096, 65_537, 300_001):
            ht.begin()
            for i in range(0, len(data), size):
                ht.feed(data[i : i + size])
            assert ht.hexdigest() == checksums.digest(data)
        ht.begin()  # an empty stream
        assert ht.hexdigest() == checksums.digest(b"")
    finally:
        ht.close()
    assert not _workers()


def test_cut_hands_over_every_byte_and_waits_for_one_block_at_the_end(monkeypatch):
    monkeypatch.setattr(hash_thread, "CHUNK", 1000)
    n, block, pos, last, chunks = 10_000, 64, 0, 0, []
    while pos < n:
        pos = min(n, pos + block)
        if cut(pos, last, n, block):
            chunks.append((last, pos))
            last = pos
    assert chunks[0] == (0, 1024) and chunks[-1][1] == n  # CHUNK, rounded up to blocks
    assert all(a == b for (_, a), (b, _) in zip(chunks, chunks[1:], strict=False))
    assert chunks[-1][1] - chunks[-1][0] <= block  # the tail: one block, not a chunk


def test_idle_worker_ends_and_restarts_but_never_inside_a_stream(monkeypatch):
    monkeypatch.setattr(hash_thread, "IDLE_S", 0.05)
    ht = HashThread()
    ht.begin()
    ht.feed(b"abc")
    time.sleep(0.3)  # a slow read between two chunks: the stream must survive it
    assert len(_workers()) == 1
    ht.feed(b"def")
    assert ht.hexdigest() == checksums.digest(b"abcdef")
    deadline = time.monotonic() + 10
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _workers()  # idle: gone by itself, without close()
    ht.begin()
    ht.feed(b"x")
    assert ht.hexdigest() == checksums.digest(b"x")  # and back on the next use
    ht.close()
    assert not _workers()


def test_an_error_in_the_worker_reaches_the_caller_and_the_next_stream_is_clean():
    ht = HashThread()
    try:
        ht.begin()
        ht.feed("not bytes")  # xxhash refuses str
        ht.feed(b"more")
        with pytest.raises(TypeError):
            ht.hexdigest()
        ht.begin()
        ht.feed(b"ok")
        assert ht.hexdigest() == checksums.digest(b"ok")
    finally:
        ht.close()


def test_streams_are_declined_for_a_while_after_the_thread_was_slower_than_inline(monkeypatch):
    monkeypatch.setattr(hash_thread, "core_free", lambda: True)
    monkeypatch.setattr(hash_thread, "INLINE_BYTES_PER_S", 1e30)  # any wait is too long
    ht = HashThread()
    try:
        assert ht.take()
        ht.begin()
        ht.feed(b"abc")
        assert ht.hexdigest() == checksums.digest(b"abc")
        assert [ht.take() for _ in range(hash_thread.BACKOFF + 1)] == [
            False
        ] * hash_thread.BACKOFF + [True]
        assert (ht.streams, ht.declined) == (1, 8)
        monkeypatch.setattr(hash_thread, "INLINE_BYTES_PER_S", 0)  # the thread keeps up
        ht.begin()
        ht.feed(b"abc")
        ht.hexdigest()
        assert ht.take()
    finally:
        ht.close()


def test_streams_are_declined_while_no_core_is_free(monkeypatch):
    free = [False]
    monkeypatch.setattr(hash_thread, "core_free", lambda: free[0])
    monkeypatch.setattr(hash_thread, "LOOK_S", 0.0)
    ht = HashThread()
    assert [ht.take(), ht.take()] == [False, False] and ht.declined == 2
    free[0] = True
    assert ht.take()


def test_core_free_reads_the_run_queue(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    f = tmp_path / "loadavg"
    f.write_text("0.50 1.20 1.80 1/150 4242\n")  # only the caller runs: a core is free
    assert hash_thread.core_free(f) is True
    f.write_text("9.10 9.00 6.00 2/150 4242\n")  # both cores busy
    assert hash_thread.core_free(f) is False
    f.write_text("garbage\n")
    assert hash_thread.core_free(f) is True  # unknown: the back-off decides
    assert hash_thread.core_free(tmp_path / "missing") is True
