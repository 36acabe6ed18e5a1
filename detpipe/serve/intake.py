"""One ``POST`` request's intake for the serve command: its body read within the size and time limits
(`read_body`), the image part of a multipart form (`form_image`), query parameters (`query`), the image's header
checked and its pixels decoded and prepared as predict prepares them (`decode`); every refusal a `Rejected` with its
HTTP status and one line (`error_response`)."""
from __future__ import annotations

import asyncio
import io
import logging
import re
from typing import Callable

import torch
from PIL import Image
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from detpipe.predict import prepare

log = logging.getLogger("detpipe.serve")

# What POST /predict decodes (Pillow's format names; JPEG includes the multi-picture JPEG (MPO) many cameras write).
# Anything else (EPS, PDF, PSD, ...) is refused before a decoder runs: 415.
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")


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


def query(request: Request, name: str, kind: type, default, check: Callable = lambda v: True, rule: str = ""):
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

