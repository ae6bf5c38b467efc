"""The model process's side of ``split_process``: the chat worker fed from the pipe.

``serve_model`` runs the chat worker (the continuous batcher, or ``model.generate`` one at
a time) in the process that loaded the model, applies the HTTP side's messages
(``submit``, ``cancel``, ``stop``; ``split_process``'s docstring lists them) and sends the
worker's results back: the worker settles futures and streams pieces as it would on an
event loop, and :class:`_Sink` turns those calls into events, one message for what one
call produced (a whole decoding step's, for the batcher).
"""

from __future__ import annotations

import collections
import pickle
import threading
from collections.abc import Callable
from typing import Any

from meshtrain.serve.generation import STOP, GenerationJob


class _Sink:
    """Stands in for the event loop on the model side. The worker settles futures and
    streams pieces through ``loop.call_soon_threadsafe``; here those callbacks run at
    once, append events, and what one call produced (a whole step's, for the batcher)
    leaves in one message."""

    def __init__(self, conn: Any, stats: Callable[[], dict]) -> None:
        self.conn, self.stats = conn, stats
        self.events: list[tuple] = []
        self.lock = threading.Lock()  # the worker thread and the main thread both send

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        fn()
        self.send()

    def send(self) -> None:
        with self.lock:
            events, self.events = self.events, []
            try:
                self.conn.send((events, self.stats()))
            except OSError:  # the HTTP process is gone: serve_model ends at its EOF
                pass


class _Future:
    """``job.future`` on the model side: its result becomes an event."""

    def __init__(self, sink: _Sink, jid: int, jobs: dict) -> None:
        self.sink, self.jid, self.jobs = sink, jid, jobs
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._set("done", value)

    def set_exception(self, exc: BaseException) -> None:
        self._set("error", _portable(exc))

    def _set(self, kind: str, value: Any) -> None:
        self._done = True
        self.jobs.pop(self.jid, None)
        self.sink.events.append((self.jid, kind, value))


class _Pieces:
    """``job.stream`` on the model side: each streamed piece becomes an event."""

    def __init__(self, sink: _Sink, jid: int) -> None:
        self.sink, self.jid = sink, jid

    def put_nowait(self, piece: Any) -> None:
        if piece is not STOP:  # the end of a stream travels as the job's result
            self.sink.events.append((self.jid, "piece", piece))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError naming it (same text)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 -- any exception class that does not round-trip
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve_model(make_worker: Callable, recv: Any, send: Any) -> None:
    """The model side (module docstring): run the chat worker that
    ``make_worker(on_step, max_queue, inbox)`` returns and feed it the jobs read from
    ``recv`` until the HTTP side says stop or goes away.

    A worker that takes an ``inbox`` (the continuous batcher) reads the pipe on its own
    thread between decoding steps, and this thread only waits for it to end; otherwise
    (one request at a time with ``model.generate``) this thread reads the pipe."""
    steps: collections.deque[int] = collections.deque()  # appended by the worker thread
    received = 0
    jobs: dict[int, GenerationJob] = {}
    worker: Any = None

    def stats() -> dict:
        done = [steps.popleft() for _ in range(len(steps))]
        return {
            "received": received,
            "waiting": worker.waiting,
            "running": worker.running,
            "done": worker.done,
            "tokens": worker.tokens,
            "steps": done,
        }

    sink = _Sink(send, stats)

    def take(msg: tuple | None) -> bool:
        """Apply one message (None: the pipe ended); False once there is no more to read."""
        nonlocal received
        if msg is not None and msg[0] == "submit":
            _, jid, ids, kwargs, stream, stop = msg
            job = GenerationJob(
                ids,
                kwargs,
                sink,
                _Future(sink, jid, jobs),
                _Pieces(sink, jid) if stream else None,
                stop,
            )
            jobs[jid] = job
            worker.put(job)
            received += 1
            return True
        if msg is not None and msg[0] == "cancel":
            job = jobs.get(msg[1])
            if job is not None:
                job.cancelled.set()
            return True
        return False  # "stop", or the HTTP side is gone

    ended = False

    def inbox(block: bool) -> None:
        """Every message waiting (``block``: wait for the first), on the worker's thread;
        one acknowledgement for the submits among them."""
        nonlocal ended
        before, last = received, ended
        try:
            while not ended and (block or recv.poll()):
                block = False
                ended = not take(recv.recv())
        except (EOFError, OSError):
            ended = True
        if ended and not last:  # nobody will read answers any more: stop now
            for job in jobs.values():
                job.cancelled.set()
            worker.put(STOP)
        if received != before:
            sink.send()  # the HTTP side now counts them as queued here

    # the HTTP side bounds the queue; this one only must never block the pipe's reader
    worker = make_worker(steps.append, 1 << 16, inbox)
    if getattr(worker, "inbox", None) is inbox:
        worker.join()
        worker.close()
        return
    while True:
        try:
            msg = recv.recv()
        except (EOFError, OSError):
            break
        if not take(msg):
            break
        if msg[0] == "submit":
            sink.send()  # the HTTP side now counts it as queued here
    worker.close()
