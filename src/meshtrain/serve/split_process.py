"""HTTP in a process of its own: ``meshtrain serve`` forks its front end for chat.

Why. In one process the asyncio event loop (uvicorn, FastAPI, pydantic, JSON) and the
decoding thread share one GIL, so at 16 concurrent chat requests the HTTP work of every
arriving and leaving request (about 0.5 ms of CPU each) falls inside the decoding steps
of everybody else, and the two run on one core at a time. Split, each has its own
interpreter and its own core.

Layout. The process that loaded the model keeps it, and runs the chat worker there (the
continuous batcher, or ``model.generate`` one request at a time: the same objects as
in one process). Just before uvicorn starts it forks; the child runs uvicorn and the
FastAPI app and hands every chat request to the parent over a pipe
(:class:`RemoteWorker`, in the app's ``lifespan``). The continuous batcher's own
thread reads that pipe between decoding steps (its ``inbox``, ``model_side.serve_model``):
a second reader thread would wake for every message and then wait for the GIL the
decoding thread holds. With ``model.generate`` one at a time, which has no steps to
read between, the parent's main thread reads it and feeds the worker's queue. The model side never
runs in the child, because a forked child can neither use CUDA set up by its parent
nor, with GNU OpenMP, run a multi-threaded op once its parent has (it hangs): the
child runs no torch op at all, only tokenization and HTTP.

Messages (pickled over ``multiprocessing`` connections, one pipe each way):

* HTTP -> model: ``("submit", id, input_ids, kwargs, stream, stop)``, ``("cancel", id)``
  (a 504 or a client that went away), ``("stop",)``;
* model -> HTTP: ``(events, stats)``: ``events`` are ``(id, "piece", text)``,
  ``(id, "done", answer)`` and ``(id, "error", exception)``, ``stats`` the worker's
  counters (requests received, waiting, running, answered, tokens, the batch size of
  each step since the last message: the metrics). The batcher sends at most one
  message per decoding step (that step's answers and streamed pieces, when it has
  any), plus one per request received.

The HTTP process runs ``SCHED_BATCH`` (:func:`_no_wakeup_preemption`: the message of a
step must not put the decoding thread off its core).

The bounded queue stays on the HTTP side: a request is refused (503 with Retry-After)
when ``max_queue`` requests are waiting, counting those still in the pipe, as in one
process. If the model process goes away, every request in flight gets 500 and so does
every later chat request; if the HTTP process goes away, the model process ends.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from meshtrain.errors import ServeError
from meshtrain.forking import fork
from meshtrain.serve.batching import QueueFull
from meshtrain.serve.generation import STOP, GenerationJob
from meshtrain.serve.model_side import serve_model


class RemoteWorker:
    """The HTTP side's chat worker: same interface as the local ones (``submit``,
    ``waiting``, ``running``, ``done``, ``tokens``, ``close``); the work runs in the
    model process (module docstring). Made on the event loop (the app's ``lifespan``),
    which then reads the model's messages itself (``add_reader``: no thread)."""

    def __init__(self, send: Any, recv: Any, *, max_queue: int, on_step: Callable) -> None:
        self._out, self._in = send, recv
        self.max_queue = max_queue
        self.on_step = on_step
        self.done = self.tokens = 0
        self._sent = self._received = self._model_waiting = self._model_running = 0
        self._jobs: dict[int, GenerationJob] = {}
        self._ids = itertools.count()
        self._lost: str | None = None
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._in.fileno(), self._readable)

    @property
    def waiting(self) -> int:  # in the pipe, plus queued in the model process
        return self._sent - self._received + self._model_waiting

    @property
    def running(self) -> int:
        # the counters travel with answers, so the last message may predate the worker's
        # own bookkeeping (generate's worker counts a job as running until after its
        # answer is sent): no more run than are unanswered
        return min(self._model_running, len(self._jobs))

    def submit(
        self,
        input_ids: list[int],
        kwargs: dict[str, Any],
        *,
        stream: bool = False,
        stop: tuple[str, ...] = (),
    ) -> GenerationJob:
        """Send a job to the model process; QueueFull when ``max_queue`` are waiting."""
        if self._lost is not None:
            raise ServeError(self._lost)
        if self.waiting >= self.max_queue:
            raise QueueFull(f"{self.max_queue} generation requests are already waiting")
        jid = next(self._ids)
        loop = asyncio.get_running_loop()
        job = GenerationJob(
            list(input_ids),
            kwargs,
            loop,
            loop.create_future(),
            asyncio.Queue() if stream else None,
            tuple(stop),
            cancelled=_Cancel(lambda: self._send(("cancel", jid))),
        )
        self._jobs[jid] = job
        self._send(("submit", jid, job.input_ids, kwargs, stream, job.stop))
        self._sent += 1
        return job

    def close(self) -> None:
        self._send(("stop",))
        self._gone("the server is shutting down", asyncio.CancelledError())

    def _send(self, msg: tuple) -> None:
        if self._lost is None:
            try:
                self._out.send(msg)
            except OSError:
                self._gone("the model process is gone")

    def _readable(self) -> None:
        try:
            while self._in.poll():
                events, stats = self._in.recv()
                self._take(events, stats)
        except (EOFError, OSError):
            self._gone("the model process is gone")

    def _take(self, events: list, stats: dict) -> None:
        self._received, self._model_waiting = stats["received"], stats["waiting"]
        self._model_running, self.done, self.tokens = (
            stats["running"],
            stats["done"],
            stats["tokens"],
        )
        for n in stats["steps"]:
            self.on_step(n)
        for jid, kind, value in events:
            job = self._jobs.get(jid)
            if job is None:
                continue
            if kind == "piece":
                job.stream.put_nowait(value)
                continue
            del self._jobs[jid]
            if not job.future.done():
                if kind == "done":
                    job.future.set_result(value)
                else:
                    job.future.set_exception(value)
            if job.stream is not None:
                job.stream.put_nowait(STOP)

    def _gone(self, why: str, error: BaseException | None = None) -> None:
        """No model process any more: fail every job in flight, refuse later ones."""
        if self._lost is None:
            self._lost = why
            self._loop.remove_reader(self._in.fileno())
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            if not job.future.done():
                job.future.set_exception(error or ServeError(why))
            if job.stream is not None:
                job.stream.put_nowait(STOP)


class _Cancel(threading.Event):
    """``job.cancelled`` on the HTTP side: setting it also tells the model process."""

    def __init__(self, notify: Callable[[], None]) -> None:
        super().__init__()
        self._notify = notify

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self._notify()


def serve_split(app: Any, run_http: Callable[[], None]) -> int:
    """Fork: the child runs ``run_http()`` (uvicorn serving ``app``), this process runs
    the model side until the child ends; returns the child's exit status (or ends by
    the signal that ended the child, as uvicorn re-raises the signal it stopped on).

    SIGTERM here is passed on to the child (uvicorn's graceful shutdown); SIGINT reaches
    both from the terminal, and this process then waits for the child to finish."""
    to_model_recv, to_model_send = multiprocessing.Pipe(duplex=False)
    to_http_recv, to_http_send = multiprocessing.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = fork()  # the child never collects what it inherits (meshtrain.forking)
    if pid == 0:  # the HTTP process
        code = 1
        try:
            to_model_recv.close()
            to_http_send.close()
            _end_with_parent()
            _no_wakeup_preemption()
            app.state.model_process = (to_model_send, to_http_recv)
            run_http()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 -- reported, then the child ends
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    to_model_send.close()
    to_http_recv.close()
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child got it too and shuts down
    serve_model(app.state.chat_worker, to_model_recv, to_http_send)
    to_http_send.close()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):  # uvicorn re-raises the signal that stopped it: so do we
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two take no handler
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


def _no_wakeup_preemption() -> None:
    """Linux: make this (the HTTP) process ``SCHED_BATCH``. Each decoding step's message
    wakes it, and the kernel tends to wake a process on the waker's core and let it
    preempt the waker: the decoding thread then waited for the HTTP work (a 10 us pipe
    write took 270 us at the median, 420 us on average, when the other core was busy).
    A ``SCHED_BATCH`` process does not preempt on wake-up: it runs on an idle core, or
    when the decoding thread's time slice ends. Unprivileged; other systems: no-op."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _end_with_parent() -> None:
    """Linux: SIGTERM this process when its parent (the model process) dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's EOF still ends requests
        pass
