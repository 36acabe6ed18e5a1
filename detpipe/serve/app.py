"""The serve command's HTTP application (Starlette, ASGI): the routes, the request and decode limits, the model's
loading and warm-up (`create_app`)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import io
import logging
import re
import time
from typing import Callable

import torch
from PIL import Image
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from detpipe import params as params_mod
from detpipe.data.augmentation import target_size
from detpipe.errors import StageError
from detpipe.predict import Predictor, prepare
from detpipe.serve import Limits
from detpipe.serve.batcher import Batcher, QueueFull

log = logging.getLogger("detpipe.serve")

# What POST /predict decodes (Pillow's format names; JPEG includes the multi-picture JPEG (MPO) many cameras write).
# Anything else (EPS, PDF, PSD, ...) is refused before a decoder runs: 415.
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
RETRY_AFTER_S = 1  # the Retry-After of a 503 (queue full, model not ready), in seconds
ROUTES_HELP = "POST /predict (an image), GET /healthz, GET /readyz"


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


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, at most ``max_bytes`` (a ``Content-Length`` above it is refused unread).

    Raises:
        Rejected: 413 the body is larger than ``max_bytes``.
    """
    too_large = Rejected(413, f"request body larger than --max-bytes {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
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


class Service:
    """The state behind the routes: the model (loaded in the background, `start`), its `Batcher`, the pools.

    Args:
        load: returns the `detpipe.predict.Predictor` (runs in the model's thread).
        limits: `Limits`.
        model_name: shown by ``/readyz``.
        on_fatal: called with the one-line reason when the model cannot be loaded (the server then stops).
    """

    def __init__(self, load: Callable[[], Predictor], limits: Limits, model_name: str,
                 on_fatal: Callable[[str], None]):
        self.load, self.limits, self.model_name, self.on_fatal = load, limits, model_name, on_fatal
        self.predictor: Predictor | None = None
        self.batcher: Batcher | None = None
        self.failed: str | None = None
        self.ready = False
        self.model_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="serve-model")
        self.decode_pool = cf.ThreadPoolExecutor(limits.workers, thread_name_prefix="serve-decode")
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Load the model and run it once on a blank image of the preprocessing's size (warm-up), then start the
        batcher and be ready. A failure is logged as one line and handed to ``on_fatal``."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            predictor = await loop.run_in_executor(self.model_pool, self.load)
            warm = torch.zeros(3, *target_size(480, 640, predictor.cfg))
            await loop.run_in_executor(self.model_pool, predictor.run, [warm])
        except StageError as e:
            self.failed = one_line(e, 2000)
        except Exception as e:  # noqa: BLE001 - reported as one line; the server stops
            log.exception("serve: loading the model failed")
            self.failed = one_line(f"{self.model_name}: cannot load the model ({type(e).__name__}: {e})", 2000)
        if self.failed:
            self.on_fatal(self.failed)
            return
        self.predictor = predictor
        limits = self.limits
        self.batcher = Batcher(predictor.run, self.model_pool, limits.max_batch, limits.max_wait_s, limits.queue_size)
        self._tasks.append(asyncio.create_task(self.batcher.run_forever(), name="serve-batcher"))
        self.ready = True
        log.info("serve: ready in %.1f s (model loaded and warmed up): %s; batches of up to %d, queue of %d",
                 time.perf_counter() - t0, predictor.runtime, limits.max_batch, limits.queue_size)

    async def stop(self) -> None:
        """Stop the batcher and the loading, wait for the model's thread (its current batch) to finish."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown_pools)

    def _shutdown_pools(self) -> None:
        self.decode_pool.shutdown(wait=True, cancel_futures=True)
        self.model_pool.shutdown(wait=True, cancel_futures=True)

    def status(self) -> dict:
        """``/readyz``'s body."""
        b = self.batcher
        return {"ready": self.ready, "model": self.model_name,
                "runtime": self.predictor.runtime if self.predictor else None,
                "queue_size": self.limits.queue_size, "max_batch": self.limits.max_batch,
                "waiting": b.pending if b else 0, "batches": b.batches if b else 0,
                "images": b.images if b else 0, "largest_batch": b.largest_batch if b else 0}

    async def predict(self, request: Request) -> JSONResponse:
        """``POST /predict``: see `detpipe.serve`."""
        if not self.ready:
            raise Rejected(503, "model not loaded yet (GET /readyz answers 200 once it is)",
                           {"Retry-After": str(RETRY_AFTER_S)})
        limits = self.limits
        image_id = _query(request, "image_id", int, 1, rule="an integer")
        threshold = _query(request, "score_threshold", float, limits.score_threshold, lambda v: 0.0 <= v <= 1.0,
                           "a number in [0, 1]")
        body = await read_body(request, limits.max_bytes)
        name = None
        if request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data":
            body, name = await form_image(request, body)
        name = request.query_params.get("file_name") or name or "image"
        try:
            self.batcher.admit()
        except QueueFull as e:
            raise Rejected(503, str(e), {"Retry-After": str(RETRY_AFTER_S)}) from None
        loop = asyncio.get_running_loop()
        try:
            image, scale, orig_size = await loop.run_in_executor(self.decode_pool, decode, body, name,
                                                                 self.predictor.cfg, limits.max_pixels)
        except BaseException:
            self.batcher.release()
            raise
        det, batch_size = await self.batcher.submit(image)
        results = await loop.run_in_executor(self.decode_pool, self.predictor.results, det, (scale, orig_size),
                                             image_id, name, threshold)
        return JSONResponse(results, headers={"X-Batch-Size": str(batch_size)})


def create_app(service: Service) -> Starlette:
    """The ASGI application of ``service``: ``POST /predict``, ``GET /healthz``, ``GET /readyz``; every error a JSON
    ``{"error": "<one line>"}`` (unknown route 404, wrong method 405, bad request 4xx, internal 500: never a
    traceback in a response)."""

    async def predict(request: Request) -> JSONResponse:
        try:
            return await service.predict(request)
        except Rejected as e:
            return error_response(e.status, e.reason, e.headers)
        except HTTPException:
            raise
        except StageError as e:   # e.g. the model predicts a label the data meta lacks: the server's setup
            log.error("serve: %s", e)
            return error_response(500, str(e))
        except Exception as e:  # noqa: BLE001 - one line to the client, the traceback to the log
            log.exception("serve: POST /predict failed")
            return error_response(500, f"internal error ({type(e).__name__}: {e}); see the server's log")

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
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await service.stop()

    routes = [Route("/predict", predict, methods=["POST"]), Route("/healthz", healthz, methods=["GET"]),
              Route("/readyz", readyz, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error},
                     lifespan=lifespan)
