"""``GET /metrics``: the server's health in Prometheus' text format (``prometheus-client``).

Each app has its own ``CollectorRegistry`` (no process-global state: tests run several
servers in one process). What it exports:

==============================================  =========  ======================================
``meshtrain_serve_requests_total``              counter    requests answered, by ``route`` and
                                                           ``status`` (the HTTP code)
``meshtrain_serve_request_duration_seconds``    histogram  request start to last byte sent, by
                                                           ``route`` (a stream counts until its end)
``meshtrain_serve_queue_depth``                 gauge      requests waiting: ``queue="chat"``
                                                           (generation) or ``"classify"`` (texts)
``meshtrain_serve_running_sequences``           gauge      chat sequences in the decoding batch now
``meshtrain_serve_batch_size``                  histogram  sequences per decoding step
                                                           (``kind="chat"``), texts per forward
                                                           (``kind="classify"``)
``meshtrain_serve_generated_tokens_total``      counter    chat tokens generated
``meshtrain_serve_tokens_per_second``           gauge      chat tokens generated per second over the
                                                           last ``window_s`` (10 s) seconds
==============================================  =========  ======================================

``route`` is the route's path (``/v1/chat/completions``), never the raw URL, so a client
probing random paths cannot grow the label set (they count as ``route="other"``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """The registry of one app and the hooks that feed it (module docstring).

    ``queue_depth()`` returns ``{"chat": n, "classify": n}``, ``running()`` the chat batch
    size now, ``tokens()`` the chat tokens generated so far; all are read at scrape time.
    """

    def __init__(
        self,
        *,
        queue_depth: Callable[[], dict[str, int]],
        running: Callable[[], int],
        tokens: Callable[[], int],
        window_s: float = 10.0,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "meshtrain_serve_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "meshtrain_serve_request_duration_seconds",
            "Seconds from a request's start to the last byte of its answer.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch = Histogram(
            "meshtrain_serve_batch_size",
            "Chat sequences per decoding step (kind=chat); texts per forward (kind=classify).",
            ["kind"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self._queue_depth, self._running, self._tokens = queue_depth, running, tokens
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()  # steps are recorded on the worker thread
        self.registry.register(_Live(self))

    def step(self, kind: str, size: int) -> None:
        """One decoding step of ``size`` sequences, or one classify forward of ``size`` texts."""
        self.batch.labels(kind).observe(size)
        if kind == "chat":
            self._sample()

    def _sample(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, self._tokens()))
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()

    def tokens_per_second(self) -> float:
        """Chat tokens per second over the last ``window_s`` seconds (0 when idle)."""
        self._sample()
        with self._lock:
            (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Live:
    """Values read when scraped (queue depth, batch now, tokens)."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.m = metrics

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        depth = GaugeMetricFamily(
            "meshtrain_serve_queue_depth", "Requests waiting to be served.", labels=["queue"]
        )
        for name, n in self.m._queue_depth().items():
            depth.add_metric([name], n)
        yield depth
        yield GaugeMetricFamily(
            "meshtrain_serve_running_sequences",
            "Chat sequences in the decoding batch now.",
            value=self.m._running(),
        )
        yield CounterMetricFamily(
            "meshtrain_serve_generated_tokens",
            "Chat tokens generated.",
            value=self.m._tokens(),
        )
        yield GaugeMetricFamily(
            "meshtrain_serve_tokens_per_second",
            f"Chat tokens generated per second over the last {self.m.window_s:g} s.",
            value=self.m.tokens_per_second(),
        )


class MetricsMiddleware:
    """ASGI middleware: counts every answer by route and status and times it to its last
    byte (so a server-sent-events stream is timed until it ends)."""

    def __init__(self, app: Any, metrics: ServeMetrics, routes: Callable[[], set[str]]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            path = scope.get("path", "")
            route = path if path in self.routes() else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
