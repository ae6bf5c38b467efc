"""Generation off the event loop: one worker thread, a bounded queue, cancellable jobs.

``model.generate`` holds the GIL-free torch kernels for seconds; running it on the
event loop would stall every other request (``/health`` included). So a request
becomes a :class:`GenerationJob` put on a ``queue.Queue(maxsize=max_queue)`` that one
worker thread drains in order (one sequence at a time: a CPU or a single GPU gains
little from batching autoregressive decoding of a few requests, and each answer then
equals ``model.generate`` on that prompt alone). ``submit`` on a full queue raises
:class:`~meshtrain.serve.batching.QueueFull` at once: the app answers 503 with
``Retry-After``, never a hang.

A job's result reaches its request through ``loop.call_soon_threadsafe``; a streaming
job also pushes each piece of decoded text as it is produced. A request that times out
(504) or whose client goes away sets ``job.cancelled``: a job still queued is dropped,
and a running one stops at the next token (a ``StoppingCriteria``), so abandoned work
does not hold the worker.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshtrain.serve.batching import QueueFull

STOP = object()  # the worker's shutdown sentinel, and a stream's end marker


@dataclass
class GenerationJob:
    """One generation request. ``kwargs`` go to ``model.generate``."""

    input_ids: list[int]
    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    stream: asyncio.Queue | None = None  # text pieces, then STOP, when streaming
    stop: tuple[str, ...] = ()  # stop strings: the answer ends before the first (stops.py)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # how the worker hands a callback to the event loop (JobQueue._post); None: at once
    post: Callable[[Callable[[], None]], None] | None = None

    def push(self, text: str) -> None:
        """Called on the worker thread with each new piece of text (streaming only)."""
        if self.stream is not None and text:
            put = functools.partial(self.stream.put_nowait, text)
            if self.post is not None:
                self.post(put)
            else:
                self.loop.call_soon_threadsafe(put)

    async def pieces(self):
        """Async iterator over the streamed text pieces (ends when generation ends)."""
        assert self.stream is not None
        while True:
            piece = await self.stream.get()
            if piece is STOP:
                return
            yield piece


class JobQueue:
    """The event loop's side of a generation worker: a bounded queue of jobs (``_queue``,
    ``max_queue`` places) that its thread takes from. Shared by the one-at-a-time worker
    and the continuous batcher."""

    _queue: queue.Queue
    _thread: threading.Thread
    max_queue: int
    # callbacks for each event loop, sent by _flush in one call_soon_threadsafe; None
    # (the one-at-a-time worker): each callback is sent at once
    _outbox: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] | None = None

    def submit(
        self,
        input_ids: list[int],
        kwargs: dict[str, Any],
        *,
        stream: bool = False,
        stop: tuple[str, ...] = (),
    ) -> GenerationJob:
        """Queue a job (call on the event loop); raises QueueFull when the queue is full."""
        loop = asyncio.get_running_loop()
        job = GenerationJob(
            input_ids,
            kwargs,
            loop,
            loop.create_future(),
            asyncio.Queue() if stream else None,
            tuple(stop),
        )
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.max_queue} generation requests are already waiting") from None
        return job

    def put(self, job: Any) -> None:
        """Queue a job built elsewhere (the model process's pipe reader), or ``STOP``,
        waiting for a place: that side bounds nothing itself."""
        self._queue.put(job)

    def join(self) -> None:
        """Wait for the worker's thread to end (after a ``STOP``)."""
        self._thread.join()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the waiting jobs, stop the thread after its current work, join it."""
        for job in list(self._queue.queue):
            if isinstance(job, GenerationJob):
                job.cancelled.set()
        try:
            self._queue.put(STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
        """Run ``fn`` on ``loop``: at once, or at the next :meth:`_flush` when batched."""
        if self._outbox is None:
            _send(loop, [fn])
        else:
            self._outbox.setdefault(loop, []).append(fn)

    def _flush(self) -> None:
        """Send the callbacks gathered since the last flush: one wake-up per event loop.

        Each ``call_soon_threadsafe`` writes to the loop's wake-up socket, and the
        worker thread, which gives up the GIL for that write, may then wait for the
        event loop thread to give it back; one per step instead of one per answer and
        per streamed piece keeps the decoding thread off that hand-over."""
        if self._outbox:
            box, self._outbox = self._outbox, {}
            for loop, fns in box.items():
                _send(loop, fns)

    # called on the worker thread: settle a job's future (and end its stream) on its loop
    def _finish(self, job: GenerationJob, result: Any = None, error: BaseException | None = None):
        def settle() -> None:
            if not job.future.done():
                if error is not None:
                    job.future.set_exception(error)
                else:
                    job.future.set_result(result)
            if job.stream is not None:
                job.stream.put_nowait(STOP)

        self._post(job.loop, settle)


def _send(loop: asyncio.AbstractEventLoop, fns: list[Callable[[], None]]) -> None:
    def run_all() -> None:
        for fn in fns:
            fn()

    try:
        loop.call_soon_threadsafe(run_all)
    except RuntimeError:  # the loop is closed: nobody is waiting for these answers
        pass


class GenerationWorker(JobQueue):
    """Runs ``run(job) -> result`` for each submitted job on one thread, in order."""

    def __init__(
        self,
        run: Callable[[GenerationJob], Any],
        *,
        max_queue: int = 8,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.run = run
        self.max_queue = max_queue
        self.on_done = on_done  # called after each answer (metrics)
        self.done = 0
        self.tokens = 0  # generated so far (answers' completion_tokens)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshtrain-generate", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return 0 if self._idle.is_set() else 1

    def _loop(self) -> None:
        while True:
            self._idle.set()
            job = self._queue.get()
            self._idle.clear()
            if job is STOP:
                return
            if job.cancelled.is_set():
                self._finish(job, error=asyncio.CancelledError())
                continue
            try:
                result = self.run(job)
            except Exception as exc:  # noqa: BLE001 - reported to the request that asked; the worker lives on
                self._finish(job, error=exc)
                continue
            self.done += 1
            self.tokens += getattr(result, "completion_tokens", 0)
            if self.on_done is not None:
                self.on_done()
            self._finish(job, result)
