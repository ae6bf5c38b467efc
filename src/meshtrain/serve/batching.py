"""Dynamic batching: concurrent requests' items share one forward pass.

Each request puts its items (texts) in a bounded ``asyncio.Queue`` and awaits one
future per item. One collector task takes the first waiting item, then keeps taking
until ``max_batch_size`` items or ``max_wait_ms`` since that first item, and runs the
batch on a single worker thread (``run_in_executor``), so the event loop never runs the
model. While a batch runs, new items queue up, so under load batches fill without any
waiting; alone, a request pays at most ``max_wait_ms``. ``max_batch_size=1`` turns
batching off (every item runs alone), which is the benchmark's baseline.

A full queue raises :class:`QueueFull` at once (the app answers 503 with
``Retry-After``) instead of letting latency grow without bound. An item whose request
timed out or disconnected (its future cancelled) is skipped before it costs compute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class QueueFull(Exception):
    """The server holds as much work as it is allowed to; the client should retry later."""


class DynamicBatcher:
    """Batches items from concurrent callers of :meth:`submit` into calls of ``run``.

    ``run(items) -> results`` (same length, same order) is called on one worker thread.
    """

    def __init__(
        self,
        run: Callable[[list[Any]], list[Any]],
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_queue: int = 1024,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.run = run
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self.batches = 0  # counters for GET / and the benchmark
        self.items = 0
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue(maxsize=self.max_queue)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-batch")
        self._task = asyncio.create_task(self._collect())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @property
    def waiting(self) -> int:
        """Items queued and not yet in a batch."""
        return 0 if self._queue is None else self._queue.qsize()

    async def submit(self, items: Sequence[Any]) -> list[Any]:
        """Results for ``items`` (in order); raises QueueFull when there is no room."""
        assert self._queue is not None, "DynamicBatcher.start() was not awaited"
        if self._queue.qsize() + len(items) > self.max_queue:
            raise QueueFull(f"{self._queue.qsize()} items are waiting (limit {self.max_queue})")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        for item, fut in zip(items, futures, strict=True):
            self._queue.put_nowait((item, fut))
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for fut in futures:  # a timed-out request: its queued items are skipped
                fut.cancel()

    async def _collect(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except asyncio.TimeoutError:
                    break
            batch = [(item, fut) for item, fut in batch if not fut.done()]
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(
                    self._executor, self.run, [item for item, _ in batch]
                )
            except Exception as exc:  # noqa: BLE001 - the model failed: every caller of this batch learns why
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            self.items += len(batch)
            if self.on_batch is not None:
                self.on_batch(len(batch))
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
