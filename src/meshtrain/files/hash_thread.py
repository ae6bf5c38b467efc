"""A hashing thread: the checksum of bytes being read, computed on the second core.

A load from the page cache is a memory copy (``readinto`` at about 10-17 GB/s here), and
xxh3-64 even over bytes still in the cache runs at 50-90 GB/s, so hashing inline adds
15-25% to it (docs/checkpoints.md). ``HashThread`` moves the hash off the reading thread:
the reader hands it each chunk of the destination as soon as ``readinto`` has filled it
and goes on reading; the thread hashes the chunks in order (``xxhash`` releases the GIL
for inputs over 64 KiB, so both run at once) and the reader waits only for the last one.
The chunks it hashes are the bytes the caller gets, not a second read of the file.

Chunks are ``CHUNK`` bytes, smaller towards the end of a stream (half of what is left, at
least one read block), so what the reader waits for at the end is the hash of one block,
not of a whole chunk.

It costs CPU rather than saving it: the hashing core reads the bytes out of the reading
core's cache, so the hash takes about twice the CPU it takes inline, plus a wake-up per
chunk. It pays on wall time when a second core is free; with one core (``usable()``),
callers hash inline.

The thread is started on first use and ends by itself after ``IDLE_S`` seconds without
work (or at ``close()``), so an object that is dropped without being closed leaves no
thread behind; a forked child starts its own.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

from meshtrain.files import checksums

CHUNK = 4 << 20  # a wake-up per 4 MiB: ~0.1% of the copy it overlaps
IDLE_S = 2.0


def usable() -> bool:
    """Whether this process may run on more than one core (else hashing inline is faster)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except AttributeError:  # not Linux
        return (os.cpu_count() or 1) > 1


def cut(pos: int, last: int, end: int, block: int) -> bool:
    """Whether the bytes ``[last, pos)`` read so far of a stream ending at ``end`` make a
    chunk to hand over: ``CHUNK`` bytes, or half of what is left and at least ``block``."""
    return pos == end or pos - last >= min(CHUNK, max(block, (end - pos) // 2))


class HashThread:
    """Digests of byte streams, one stream at a time, hashed on a worker thread in order.

    ``begin()`` starts a stream, ``feed(view)`` queues a chunk (the caller must not change
    its bytes until ``hexdigest()`` returns), ``hexdigest()`` waits for the stream's last
    chunk and returns its digest (or raises what the hash raised)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()  # start/stop of the worker
        self._h: Any = None

    # ---- the worker ---------------------------------------------------------------
    def _run(self, jobs: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
        h, error, streaming = None, None, False
        while True:
            try:
                item = jobs.get(timeout=IDLE_S)
            except queue.Empty:
                if streaming:  # a slow read between two chunks: the stream goes on
                    continue
                with self._lock:  # nothing queued can be lost: _put() takes the same lock
                    if jobs.empty():
                        self._thread = None
                        return
                continue
            if item is None:  # close()
                return
            kind, data = item
            if kind == "begin":
                h, error, streaming = checksums.hasher(), None, True
            elif kind == "data":
                if error is None:
                    try:
                        h.update(data)
                    except Exception as exc:  # handed to the reader at hexdigest()
                        error = exc
            else:  # "end"
                streaming = False
                done.put(error if error is not None else h.hexdigest())

    def _put(self, item: Any) -> None:
        with self._lock:
            if self._thread is None or self._pid != os.getpid():
                # first use, idle exit, or a forked child (the parent's thread is not here)
                self._jobs, self._done = queue.SimpleQueue(), queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._run,
                    args=(self._jobs, self._done),
                    name="meshtrain-hash",
                    daemon=True,
                )
                self._pid = os.getpid()
                self._thread.start()
            self._jobs.put(item)

    # ---- the stream ---------------------------------------------------------------
    def begin(self) -> None:
        self._put(("begin", None))

    def feed(self, view: Any) -> None:
        self._put(("data", view))

    def hexdigest(self) -> str:
        self._put(("end", None))
        out = self._done.get()
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        """Stop the worker (it would stop by itself after ``IDLE_S`` idle seconds)."""
        with self._lock:
            t, self._thread = self._thread, None
            if t is not None and self._pid == os.getpid():
                self._jobs.put(None)
            else:
                t = None
        if t is not None:
            t.join()
