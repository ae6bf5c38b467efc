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
core's cache, so the hash takes more CPU than inline, plus a wake-up per chunk. It pays
on wall time only when a second core is free. With one core (``usable()``) callers hash
inline; and when the cores are busy with other work, the thread waits for a CPU and the
reader waits for it: measured on this project's shared 2-core machine at load average
12.5-13, a warm load took 1.5-2.0x its unverified time that way against 1.1-1.2x
inline (benchmarks/bench_integrity.py). So ``take()``
declines a stream (the caller hashes it inline) when, at its last look at the run queue
(``core_free``, at most ``LOOK_S`` old), every core had a runnable task; and it watches
what the reader waited for at the end of each stream it took: when that was longer than
hashing the whole stream inline would have taken (``INLINE_BYTES_PER_S``), the next
``BACKOFF`` streams are declined, and then the thread is tried again.

The thread is started on first use and ends by itself after ``IDLE_S`` seconds without
work (or at ``close()``), so an object that is dropped without being closed leaves no
thread behind; a forked child starts its own.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from meshtrain.files import checksums

CHUNK = 4 << 20  # a wake-up per 4 MiB: ~0.1% of the copy it overlaps
IDLE_S = 2.0
# xxh3-64 over blocks in the cache (the inline alternative): 50-90 GB/s measured here
INLINE_BYTES_PER_S = 50e9
BACKOFF = 8  # streams declined after one where the thread was slower than inline
LOOK_S = 0.05  # how long one look at the run queue (/proc/loadavg) is trusted


def usable() -> bool:
    """Whether this process may run on more than one core (else hashing inline is faster)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except AttributeError:  # not Linux
        return (os.cpu_count() or 1) > 1


def core_free(loadavg: str | os.PathLike = "/proc/loadavg") -> bool:
    """Whether a core is idle now: fewer tasks runnable on the machine than cores this
    process may use. Linux's instantaneous count (``/proc/loadavg``'s 4th field, this
    thread included); True where it cannot be read (then ``take``'s back-off decides)."""
    try:
        with open(loadavg, "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
        return running < len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError, AttributeError):
        return True


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
        self._fed = 0  # bytes of the current stream
        self._backoff = 0  # streams still to decline
        self._look = (0.0, True)  # (when, core_free()) of the last look at the run queue
        self.streams = 0  # streams hashed here
        self.declined = 0  # streams declined by take()

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
    def take(self) -> bool:
        """Whether to hash the next stream here; False (the caller hashes inline) when no
        core was free at the last look (at most ``LOOK_S`` old) or during a back-off
        (module docstring)."""
        if self._backoff:
            self._backoff -= 1
            self.declined += 1
            return False
        now = time.monotonic()
        if now - self._look[0] > LOOK_S:
            self._look = (now, core_free())
        if not self._look[1]:
            self.declined += 1
            return False
        return True

    def begin(self) -> None:
        self._fed = 0
        self.streams += 1
        self._put(("begin", None))

    def feed(self, view: Any) -> None:
        self._fed += getattr(view, "nbytes", 0)
        self._put(("data", view))

    def hexdigest(self) -> str:
        self._put(("end", None))
        t0 = time.perf_counter()
        out = self._done.get()
        if (time.perf_counter() - t0) * INLINE_BYTES_PER_S > self._fed:
            self._backoff = BACKOFF  # inline would have been done sooner: no core is free
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
