"""The serve command's Prometheus metrics (``GET /metrics``, the text exposition format), kept with
``prometheus_client`` in a registry of the server's own (`Metrics`), and the ASGI middleware that counts every
request (`MetricsMiddleware`).

Metric names (all ``detpipe_serve_*``):

* ``requests_total{route, status}``: requests answered, by route (``/predict``, ``/readyz``, ...; any other path
  is ``other``, so a scan of random paths cannot grow the label set) and HTTP status;
* ``request_duration_seconds{route}``: histogram of seconds from the request's headers to its last response byte;
* ``queue_depth``: requests admitted and not yet in a model batch (gauge, read at scrape time);
* ``batch_size``: histogram of images per model call;
* ``connections{state}``: connections served (``active``) and waiting for a slot (``waiting``), at scrape time;
* ``slow_clients_total{phase}``: connections closed for not sending their headers (``headers``) or body
  (``body``) in time;
* ``reloads_total{outcome}``: model reloads that swapped the model (``ok``) or left the old one serving
  (``failed``);
* ``model_info{version, model, runtime}``: 1 for the model being served (one sample; the version is the first 12
  hex digits of the model file's sha256).
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

ROUTES = ("/predict", "/healthz", "/readyz", "/metrics", "/admin/reload")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    """The server's metrics (see the module docstring) in their own `prometheus_client.CollectorRegistry` (not the
    process-wide default one: two servers in one process, as in tests, do not mix).

    Args:
        queue_depth: returns the requests admitted and not yet batched (called at each scrape).
        connections: returns ``(active, waiting)`` connection counts (called at each scrape).
    """

    def __init__(self, queue_depth: Callable[[], int] = lambda: 0,
                 connections: Callable[[], tuple[int, int]] = lambda: (0, 0)):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("detpipe_serve_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("detpipe_serve_request_duration_seconds",
                                 "Seconds from a request's headers to its last response byte", ["route"],
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        Gauge("detpipe_serve_queue_depth", "Requests admitted and not yet in a model batch",
              registry=r).set_function(queue_depth)
        self.batch_size = Histogram("detpipe_serve_batch_size", "Images per model call", buckets=BATCH_BUCKETS,
                                    registry=r)
        conns = Gauge("detpipe_serve_connections", "Connections served (active) and waiting for a slot",
                      ["state"], registry=r)
        conns.labels("active").set_function(lambda: connections()[0])
        conns.labels("waiting").set_function(lambda: connections()[1])
        self.slow_clients = Counter("detpipe_serve_slow_clients", "Connections closed for not sending their "
                                    "request headers or body in time", ["phase"], registry=r)
        self.reloads = Counter("detpipe_serve_reloads", "Model reloads, by outcome", ["outcome"], registry=r)
        self.model = Gauge("detpipe_serve_model_info", "The model being served (1)", ["version", "model", "runtime"],
                           registry=r)
        self._model_labels: tuple[str, str, str] | None = None

    def set_model(self, version: str, model: str, runtime: str) -> None:
        """Make ``model_info`` name this model only."""
        if self._model_labels is not None:
            self.model.remove(*self._model_labels)
        self._model_labels = (version, model, runtime)
        self.model.labels(*self._model_labels).set(1)

    def exposition(self) -> bytes:
        """The text exposition of every metric (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


CONTENT_TYPE = CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """ASGI middleware counting each HTTP request of ``app`` into ``metrics`` (route, status, seconds). A request
    whose response never started (the client went away) is counted with status ``0``."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        t0 = time.perf_counter()
        status = 0

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - t0)
