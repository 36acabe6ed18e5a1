"""The serve command's HTTP application (Starlette, ASGI): the routes, the request and decode limits, the model's
loading and warm-up (`create_app`)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import io
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from PIL import Image
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from detpipe import params as params_mod
from detpipe.data.augmentation import target_size
from detpipe.core.errors import StageError
from detpipe.predict import Predictor, prepare
from detpipe.serve import Limits
from detpipe.serve.batcher import Batcher, QueueFull
from detpipe.serve.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware

log = logging.getLogger("detpipe.serve")

# What POST /predict decodes (Pillow's format names; JPEG includes the multi-picture JPEG (MPO) many cameras write).
# Anything else (EPS, PDF, PSD, ...) is refused before a decoder runs: 415.
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
RETRY_AFTER_S = 1  # the Retry-After of a 503 (queue full, model not ready), in seconds
ROUTES_HELP = "POST /predict (an image), GET /healthz, GET /readyz, GET /metrics, POST /admin/reload"


class Rejected(Exception):
    """A request answered with a 4xx/5xx status and a one-line reason (``{"error": reason}``)."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None):
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line (whitespace runs -> one space), at most ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_response(status: int, reason: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": "<reason on one line>"}`` with ``status``."""
    return JSONResponse({"error": one_line(reason)}, status_code=status, headers=headers)


def decode(data: bytes, name: str, cfg: params_mod.Augment, max_pixels: int
           ) -> tuple[torch.Tensor, tuple[float, float], tuple[int, int]]:
    """Check an uploaded image's header, then decode and prepare it exactly as predict does (`prepare`).

    The header is read first (``PIL.Image.open``, no pixel decoded), the format must be one of `ACCEPTED_FORMATS`
    and width x height at most ``max_pixels``: a decompression bomb (a small file declaring a huge raster) is refused
    before any decoder allocates its pixels.

    Args:
        data: the image's bytes.
        name: its name, for the reasons.
        cfg: the preprocessing (`detpipe.predict.Predictor.cfg`).
        max_pixels: the most pixels (width x height) accepted.
    Returns:
        ``(image, scale, orig_size)``: the prepared ``float32 (3, h, w)`` image in [0, 1], ``(scale_y, scale_x)``
        prepared pixels per original pixel, ``(H, W)`` original pixels (`detpipe.predict.Prepared`).
    Raises:
        Rejected: 400 empty or corrupt image, 415 not an image of an accepted format, 422 more than ``max_pixels``.
    """
    if not data:
        raise Rejected(400, "empty body: send the image's bytes (raw body, or a multipart file field)")
    bomb = f"more than --max-pixels {max_pixels}: refused before decoding (decompression bomb guard)"
    try:
        with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as im:
            width, height = im.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        found = re.search(r"\((\d+) pixels\)", str(e))
        raise Rejected(422, f"{name}: declares {found.group(1) if found else 'too many'} pixels, {bomb}") from None
    except Image.UnidentifiedImageError:
        raise Rejected(415, f"{name}: not an image in a served format ({', '.join(ACCEPTED_FORMATS)})") from None
    except Exception as e:  # noqa: BLE001 - any parser failure on untrusted bytes is the client's bad input
        raise Rejected(400, f"{name}: unreadable image header ({type(e).__name__}: {e})") from None
    if width * height > max_pixels:
        raise Rejected(422, f"{name}: declares {width}x{height} = {width * height} pixels, {bomb}")
    try:
        prep = prepare(data, name, cfg)
    except StageError as e:
        raise Rejected(400, str(e)) from None
    return prep.image, prep.scale, prep.orig_size


async def read_body(request: Request, max_bytes: int, timeout_s: float = 0.0,
                    on_timeout: Callable[[], None] = lambda: None) -> bytes:
    """The request's body, at most ``max_bytes`` (a ``Content-Length`` above it is refused unread), read within
    ``timeout_s`` seconds of the request's headers (0: no limit).

    A client that has not sent its whole body in time (it stalls, or drips it) is answered 408 with ``Connection:
    close`` (uvicorn then closes the connection), ``on_timeout`` is called and one line is logged: it holds neither
    a queue place (requests are admitted only once read and decoded) nor its connection beyond ``timeout_s``.

    Raises:
        Rejected: 413 the body is larger than ``max_bytes``; 408 not read within ``timeout_s``.
    """
    too_large = Rejected(413, f"request body larger than --max-bytes {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    try:
        async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
            await read()
    except TimeoutError:
        client = f"{request.client.host}:{request.client.port}" if request.client else "?"
        log.warning("serve: closed %s %s from %s: request body not complete within --body-timeout %g s (%d of %s "
                    "bytes read)", request.method, request.url.path, client, timeout_s, size, declared or "?")
        on_timeout()
        raise Rejected(408, f"request body not complete within --body-timeout {timeout_s:g} s ({size} bytes "
                            "read): closing the connection", {"Connection": "close"}) from None
    return b"".join(chunks)


async def form_image(request: Request, body: bytes) -> tuple[bytes, str | None]:
    """The file part of a ``multipart/form-data`` ``body`` (Starlette's parser, python-multipart): its bytes and
    file name. One file part at most, a few small fields.

    Raises:
        Rejected: 400 no file part.
        HTTPException: 400 malformed multipart (Starlette's reason).
    """
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async with Request(request.scope, receive).form(max_files=1, max_fields=16, max_part_size=64_000) as form:
        files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
        if not files:
            raise Rejected(400, "multipart form without a file part: send the image as a file field "
                                "(curl -F image=@photo.jpg)")
        return await files[0].read(), files[0].filename


def _query(request: Request, name: str, kind: type, default, check: Callable = lambda v: True, rule: str = ""):
    """Query parameter ``name`` as ``kind`` (``default`` when absent). Raises `Rejected` 400 naming the rule."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not check(value):
        raise Rejected(400, f"query parameter {name}={raw!r}: must be {rule}")
    return value


def model_version(path: Path) -> str:
    """The first 12 hex digits of the sha256 of the model file ``path`` (and, for an OpenVINO ``.xml``, of its
    ``.bin`` after it): what ``/readyz``, the reload's answer and ``detpipe_serve_model_info`` call its version."""
    digest = hashlib.sha256()
    for f in (path, path.with_suffix(".bin")) if path.suffix == ".xml" else (path,):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class Served:
    """A loaded, warmed-up model: its `detpipe.predict.Predictor`, the source it was named by (a path or
    ``exp:<name>``), the file loaded, its version (`model_version`) and when it was loaded (Unix seconds)."""

    predictor: Predictor
    source: str
    path: str
    version: str
    loaded_at: float


EXP_MODEL = "models/model.onnx"   # what ``exp:<name>`` reloads: the export stage's file of that experiment


def fetch_experiment_model(name: str, dest_dir: Path, repo: str | None = None) -> Path:
    """``models/model.onnx`` of DVC experiment, branch or tag ``name`` (``dvc.api.open``: the DVC cache or the
    default remote; the repository of the current folder unless ``repo``), copied into ``dest_dir`` (written to a
    temporary name, then renamed). Returns the copy's path.

    Raises:
        StageError: no name, an unknown revision, or a revision without the file (one line).
    """
    import dvc.api
    from dvc.exceptions import DvcException, PathMissingError
    from scmrepo.exceptions import SCMError

    if not name:
        raise StageError("'exp:' needs an experiment, branch or tag name")
    try:
        with dvc.api.open(EXP_MODEL, repo=repo, rev=name, mode="rb") as f:
            data = f.read()
    except (FileNotFoundError, PathMissingError):
        raise StageError(f"exp:{name}: the revision has no {EXP_MODEL} (neither tracked by DVC nor by git, or not in "
                         "the DVC cache nor on the remote)") from None
    except (DvcException, SCMError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"exp:{name}: cannot read {EXP_MODEL}: {first}") from None
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{hashlib.sha256(data).hexdigest()[:12]}.onnx"
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)
    return dest


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
        image_id = _query(request, "image_id", int, 1, rule="an integer")
        threshold = _query(request, "score_threshold", float, limits.score_threshold, lambda v: 0.0 <= v <= 1.0,
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
        if not self.admin_remote and not _is_loopback(host):
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


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
