"""Decode encoded image bytes the same way everywhere: EXIF orientation applied, converted to 8-bit RGB; and
check them cheaply (`inspect_image`: JPEG at 1/8 scale) the way the convert stage validates images."""
from __future__ import annotations

import dataclasses
import io
import re

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from detpipe.errors import StageError


def decode_rgb(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode an encoded image (JPEG, PNG, ...) to RGB pixels.

    EXIF orientation is applied (``PIL.ImageOps.exif_transpose``); grayscale, palette, CMYK, alpha, 16-bit,
    32-bit integer and float images are converted to 8-bit RGB, alpha dropped:

    * 16-bit (``I;16*``) and 32-bit integer (``I``, e.g. 16-bit PNG/TIFF opened by Pillow as ``I``) samples are
      taken as 16-bit values: ``v >> 8`` (i.e. ``floor(v / 256)``), clipped to [0, 255];
    * float (``F``) samples are taken as [0, 1] intensities (the convention of e.g. scikit-image's
      ``img_as_ubyte``): ``round(v * 255)``, clipped to [0, 255] (NaN -> 0).

    Args:
        data: the file's bytes.
        source: file name used in error messages.
    Returns:
        ``np.ndarray`` of shape ``(H, W, 3)``, dtype ``uint8`` (H, W in pixels after EXIF orientation).
    Raises:
        StageError: the bytes are not a readable image (names ``source``).
    """
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            im = ImageOps.exif_transpose(im)
            if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
                arr = (np.asarray(im).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)
                return np.repeat(arr[:, :, None], 3, axis=2)
            if im.mode == "F":
                arr = np.nan_to_num(np.asarray(im, dtype=np.float64), nan=0.0, posinf=1.0, neginf=0.0)
                arr = np.rint(arr * 255.0).clip(0, 255).astype(np.uint8)
                return np.repeat(arr[:, :, None], 3, axis=2)
            if im.mode != "RGB":
                im = im.convert("RGBA").convert("RGB") if im.mode == "P" else im.convert("RGB")
            return np.asarray(im, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise StageError(f"{source}: unreadable or corrupt image ({e})") from None

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_EXIF_ORIENTATIONS = range(2, 9)
_GRAY_MODES = {"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
_HIGH_BIT_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """What `inspect_image` learnt about one encoded image.

    ``width``/``height`` are the stored raster's pixels; ``orientation`` is the EXIF orientation that
    ``decode_rgb`` applies (1 = none); ``flags`` are report rules that apply (``grayscale``, ``cmyk``,
    ``palette``, ``high_bit_depth``, ``alpha``).
    """

    format: str | None
    mode: str
    width: int
    height: int
    orientation: int
    flags: tuple[str, ...]

    @property
    def display_size(self) -> tuple[int, int]:
        """(width, height) in pixels after EXIF orientation, i.e. of ``decode_rgb``'s output."""
        return (self.height, self.width) if self.orientation in (5, 6, 7, 8) else (self.width, self.height)


class Unreadable(Exception):
    """The bytes are not a readable image (the message says why, without a file name)."""


def inspect(data: bytes) -> ImageInfo:
    """`inspect_image` raising `Unreadable` (no file name), for callers that count rather than stop."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, mode, (width, height) = im.format, im.mode, im.size
            transparency = "transparency" in im.info
            if fmt == "JPEG":
                # Decode at 1/8 scale in the DCT domain: every entropy-coded block is still decoded (so
                # truncated and garbled streams fail as in decode_rgb); only full-size IDCT/colour work is
                # skipped. Modes a JPEG can have (L, RGB, CMYK) all convert to RGB.
                im.draft(None, (1, 1))
                im.load()
                orientation = im.getexif().get(0x0112, 1)
        if fmt != "JPEG":
            decode_rgb(data)          # the exact decoder later stages use (rare formats: cost is fine)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                orientation = im.getexif().get(0x0112, 1)
    except StageError as e:           # decode_rgb's "<bytes>: unreadable or corrupt image (<reason>)"
        msg = str(e)
        raise Unreadable(_reason(msg[msg.find("(") + 1:-1] if msg.endswith(")") else msg)) from None
    except Exception as e:  # noqa: BLE001 - any failure of a third-party parser on untrusted bytes
        raise Unreadable(_reason(f"{type(e).__name__}: {e}")) from None
    if orientation not in _EXIF_ORIENTATIONS:
        orientation = 1                 # exif_transpose ignores other values
    bits = data[24] if data[:8] == _PNG_SIGNATURE and data[12:16] == b"IHDR" else 8
    flags = []
    if mode in _GRAY_MODES:
        flags.append("grayscale")
    if mode == "CMYK":
        flags.append("cmyk")
    if mode in ("P", "PA"):
        flags.append("palette")
    if mode in _HIGH_BIT_MODES or bits > 8:
        flags.append("high_bit_depth")
    if mode in _ALPHA_MODES or transparency:
        flags.append("alpha")
    return ImageInfo(fmt, mode, width, height, orientation, tuple(flags))


def _reason(msg: str) -> str:
    """Exception text without the object address PIL puts in it (keeps report.json reproducible)."""
    return re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", msg)


def inspect_image(data: bytes, source: str = "<bytes>") -> ImageInfo:
    """Check that encoded image bytes decode, and read their size, EXIF orientation and colour mode.

    JPEG is decoded at 1/8 scale (``PIL.Image.draft``; entropy decoding of all blocks unchanged), other
    formats in full with `detpipe.data.imageio.decode_rgb`.

    Args:
        data: the file's bytes.
        source: file name for the error message.
    Returns:
        `ImageInfo` (sizes in pixels of the stored raster; ``display_size`` after EXIF orientation).
    Raises:
        StageError: the bytes are not a readable image (names ``source``).
    """
    try:
        return inspect(data)
    except Unreadable as e:
        raise StageError(f"{source}: unreadable or corrupt image ({e})") from None
