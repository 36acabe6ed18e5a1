"""The serve command's HTTP application (Starlette, ASGI): the routes (`create_app`) and the state behind them
(`Service`: the model's loading, warm-up and reload without downtime, the micro-batching queue, the pools). A
request's intake (body, limits, decoding) is `detpipe.serve.intake`; the models, `detpipe.serve.served`."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import json
import logging
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from detpipe.core.errors import StageError
from detpipe.core.net import is_loopback
from detpipe.data.augmentation import target_size
from detpipe.predict import Predictor
from detpipe.serve.batcher import Batcher, QueueFull
from detpipe.serve.intake import Rejected, decode, error_response, form_image, one_line, query, read_body
from detpipe.serve.limits import Limits
from detpipe.serve.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from detpipe.serve.served import Served, fetch_experiment_model, model_version

log = logging.getLogger("detpipe.serve")

RETRY_AFTER_S = 1  # the Retry-After of a 503 (queue full, model not ready), in seconds
ROUTES_HELP = "POST /predict (an image), GET /healthz, GET /readyz, GET /metrics, POST /admin/reload"


class Service:
    """The state behind the routes: the model being served (loaded in the background, `start`; replaced by
    `reload`), the `Batcher`, the pools, the metrics.

    Args:
        load: loads a model file's `detpipe.predict.Predictor` (runs in a loading thread).
        limits: `Limits`.
        model_source: the ``--model`` path (or ``exp:<name>``) loaded first.
        on_fatal: called with the one-line reason when the first model cannot be loaded (the server then stops).
        metrics: where to count (default: a fresh `Metrics`).
        admin_remote: accept ``POST /admin/reload`` from any address (default: loopback only).
    """

    def __init__(self, load: Callable[[Path], Predictor], limits: Limits, model_source: str,
                 on_fatal: Callable[[str], None], metrics: Metrics | None = None, admin_remote: bool = False):
        self.load, self.limits, self.on_fatal = load, limits, on_fatal
        self.model_source, self.admin_remote = str(model_source), admin_remote
        self.metrics = metrics or Metrics()
        self.served: Served | None = None
        self.failed: str | None = None
        self.ready = False
        self.reloading = False
        self.model_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="serve-model")
        self.batcher = Batcher(self.model_pool, limits.max_batch, limits.max_wait_s, limits.queue_size,
                               on_batch=self.metrics.batch_size.observe)
        self.load_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="serve-load")
        self.decode_pool = cf.ThreadPoolExecutor(limits.workers, thread_name_prefix="serve-decode")
        self.fetched = Path(tempfile.mkdtemp(prefix="detpipe-serve-models-"))   # exp:<name> copies; removed at stop
        self._tasks: list[asyncio.Task] = []

    @property
    def model_name(self) -> str:
        return self.served.source if self.served else self.model_source

    def _load_warm(self, source: str) -> Served:
        """Load ``source`` (a model file, or ``exp:<name>``: `fetch_experiment_model`) and run it once on a blank
        image of the preprocessing's size (warm-up). Runs in the loading thread."""
        path = fetch_experiment_model(source[4:], self.fetched) if source.startswith("exp:") else Path(source)
        if not path.is_file():
            raise StageError(f"{path}: model not found")
        predictor = self.load(path)
        warm = torch.zeros(3, *target_size(480, 640, predictor.cfg))
        predictor.run([warm])
        return Served(predictor, source, str(path), model_version(path), time.time())

    async def start(self) -> None:
        """Load and warm up ``model_source`` (`_load_warm`), then start the batcher and be ready. A failure is
        logged as one line and handed to ``on_fatal``."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            served = await loop.run_in_executor(self.load_pool, self._load_warm, self.model_source)
        except StageError as e:
            self.failed = one_line(e, 2000)
        except Exception as e:  # noqa: BLE001 - reported as one line; the server stops
            log.exception("serve: loading the model failed")
            self.failed = one_line(f"{self.model_source}: cannot load the model ({type(e).__name__}: {e})", 2000)
        if self.failed:
            self.on_fatal(self.failed)
            return
        self._swap(served)
        self._tasks.append(asyncio.create_task(self.batcher.run_forever(), name="serve-batcher"))
        self.ready = True
        limits = self.limits
        log.info("serve: ready in %.1f s (model loaded and warmed up): %s, version %s; batches of up to %d, queue "
                 "of %d", time.perf_counter() - t0, served.predictor.runtime, served.version, limits.max_batch,
                 limits.queue_size)

    def _swap(self, served: Served) -> None:
        self.served = served
        self.metrics.set_model(served.version, served.source, served.predictor.runtime)

    async def reload(self, source: str | None = None) -> dict:
        """Load ``source`` (a model file or ``exp:<name>``; default: the model being served, read again), warm it
        up in the loading thread while the old model goes on serving, then swap: requests that started before the
        swap finish on the old model (`Batcher` never mixes models in a batch), later ones run on the new one. No
        request fails because of a reload. One reload at a time.

        Returns:
            ``{"version", "previous_version", "model", "runtime", "seconds"}``.
        Raises:
            Rejected: 503 not started yet, 409 a reload is running, 422 the model cannot be loaded (the old one
                keeps serving; the reason on one line).
        """
        if not self.ready:
            raise Rejected(503, "model not loaded yet: nothing to reload", {"Retry-After": str(RETRY_AFTER_S)})
        if self.reloading:
            raise Rejected(409, "a reload is already running; retry once it is done")
        source = source or self.served.source
        self.reloading = True
        t0 = time.perf_counter()
        try:
            served = await asyncio.get_running_loop().run_in_executor(self.load_pool, self._load_warm, source)
        except StageError as e:
            self.metrics.reloads.labels("failed").inc()
            log.error("serve: reload of %s failed, still serving version %s: %s", source, self.served.version, e)
            raise Rejected(422, f"reload failed, still serving version {self.served.version}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the old model goes on serving; one line to the caller
            self.metrics.reloads.labels("failed").inc()
            log.exception("serve: reload of %s failed", source)
            raise Rejected(422, f"reload failed, still serving version {self.served.version}: {source}: cannot "
                                f"load the model ({type(e).__name__}: {e})") from None
        finally:
            self.reloading = False
        previous = self.served
        self._swap(served)
        self.metrics.reloads.labels("ok").inc()
        seconds = time.perf_counter() - t0
        log.info("serve: reloaded in %.1f s: now version %s (%s), was %s", seconds, served.version,
                 served.predictor.runtime, previous.version)
        return {"version": served.version, "previous_version": previous.version, "model": served.source,
                "runtime": served.predictor.runtime, "seconds": seconds}

    def reload_in_background(self) -> None:
        """SIGHUP: reload the model being served (its file read again) as `reload` does; the outcome is logged."""
        async def run():
            try:
                await self.reload()
            except Rejected as e:
                log.error("serve: SIGHUP reload: %s", e.reason)
        log.info("serve: SIGHUP: reloading %s", self.model_name)
        self._tasks.append(asyncio.create_task(run(), name="serve-reload"))

    async def stop(self) -> None:
        """Stop the batcher and the loading, wait for the model's thread (its current batch) to finish."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown_pools)
        shutil.rmtree(self.fetched, ignore_errors=True)

    def _shutdown_pools(self) -> None:
        self.decode_pool.shutdown(wait=True, cancel_futures=True)
        self.load_pool.shutdown(wait=True, cancel_futures=True)
        self.model_pool.shutdown(wait=True, cancel_futures=True)

    def status(self) -> dict:
        """``/readyz``'s body."""
        b, served = self.batcher, self.served
        return {"ready": self.ready, "model": self.model_name,
                "version": served.version if served else None,
                "runtime": served.predictor.runtime if served else None,
                "loaded_at": served.loaded_at if served else None, "reloading": self.reloading,
                "queue_size": self.limits.queue_size, "max_batch": self.limits.max_batch,
                "waiting": b.pending, "batches": b.batches, "images": b.images, "largest_batch": b.largest_batch}

    async def predict(self, request: Request) -> JSONResponse:
        """``POST /predict``: see `detpipe.serve`. The body is read (within ``--body-timeout``) and decoded before
        the request is admitted into the model's queue; it runs on the model served when it started."""
        if not self.ready:
            raise Rejected(503, "model not loaded yet (GET /readyz answers 200 once it is)",
                           {"Retry-After": str(RETRY_AFTER_S)})
        limits, served = self.limits, self.served
        predictor = served.predictor
        image_id = query(request, "image_id", int, 1, rule="an integer")
        threshold = query(request, "score_threshold", float, limits.score_threshold, lambda v: 0.0 <= v <= 1.0,
                           "a number in [0, 1]")
        body = await read_body(request, limits.max_bytes, limits.body_timeout_s,
                               lambda: self.metrics.slow_clients.labels("body").inc())
        name = None
        if request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data":
            body, name = await form_image(request, body)
        name = request.query_params.get("file_name") or name or "image"
        loop = asyncio.get_running_loop()
        image, scale, orig_size = await loop.run_in_executor(self.decode_pool, decode, body, name, predictor.cfg,
                                                             limits.max_pixels)
        try:
            self.batcher.admit()
        except QueueFull as e:
            raise Rejected(503, str(e), {"Retry-After": str(RETRY_AFTER_S)}) from None
        det, batch_size = await self.batcher.submit(image, predictor.run)
        results = await loop.run_in_executor(self.decode_pool, predictor.results, det, (scale, orig_size),
                                             image_id, name, threshold)
        return JSONResponse(results, headers={"X-Batch-Size": str(batch_size), "X-Model-Version": served.version})

    async def admin_reload(self, request: Request) -> JSONResponse:
        """``POST /admin/reload``: body empty (reload the model being served, its file read again) or JSON
        ``{"model": "<path or exp:name>"}``; loopback clients only unless ``admin_remote``."""
        host = request.client.host if request.client else ""
        if not self.admin_remote and not is_loopback(host):
            raise Rejected(403, f"POST /admin/reload from {host or '?'}: only from this machine (loopback) unless "
                                "the server runs with --admin-remote")
        body = await read_body(request, 64_000, self.limits.body_timeout_s,
                               lambda: self.metrics.slow_clients.labels("body").inc())
        source = None
        if body.strip():
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or set(doc) - {"model"} or not isinstance(doc.get("model", ""), str):
                raise Rejected(400, 'body: expected nothing or JSON {"model": "<model file or exp:name>"}')
            source = doc.get("model") or None
        return JSONResponse(await self.reload(source))



def create_app(service: Service):
    """The ASGI application of ``service`` (a Starlette app inside `MetricsMiddleware`): ``POST /predict``,
    ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, ``POST /admin/reload``; every error a JSON
    ``{"error": "<one line>"}`` (unknown route 404, wrong method 405, bad request 4xx, internal 500: never a
    traceback in a response)."""

    def guarded(handler: Callable, what: str) -> Callable:
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Rejected as e:
                return error_response(e.status, e.reason, e.headers)
            except HTTPException:
                raise
            except StageError as e:   # e.g. the model predicts a label the data meta lacks: the server's setup
                log.error("serve: %s", e)
                return error_response(500, str(e))
            except Exception as e:  # noqa: BLE001 - one line to the client, the traceback to the log
                log.exception("serve: %s failed", what)
                return error_response(500, f"internal error ({type(e).__name__}: {e}); see the server's log")
        return route

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"alive": True})

    async def readyz(request: Request) -> JSONResponse:
        status = service.status()
        if not service.ready:
            return JSONResponse(status, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse(status)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            reason = f"{where}: no such route ({ROUTES_HELP})"
        elif exc.status_code == 405:
            reason = f"{where}: method not allowed (allowed: {(exc.headers or {}).get('Allow', '?')})"
        else:
            reason = f"{where}: {exc.detail}"
        return error_response(exc.status_code, reason, dict(exc.headers or {}))

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error ({type(exc).__name__}); see the server's log")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(service.start(), name="serve-load")
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, service.reload_in_background)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGHUP)   # (which restores SIGHUP's default action: ending the process)
            signal.signal(signal.SIGHUP, lambda signum, frame: log.warning("serve: SIGHUP while stopping: ignored"))
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await service.stop()

    routes = [Route("/predict", guarded(service.predict, "POST /predict"), methods=["POST"]),
              Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/admin/reload", guarded(service.admin_reload, "POST /admin/reload"), methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error},
                    lifespan=lifespan)
    return MetricsMiddleware(app, service.metrics)
