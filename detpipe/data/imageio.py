"""Decode encoded image bytes the same way everywhere: EXIF orientation applied, converted to 8-bit RGB; and
check them cheaply (`inspect_image`: JPEG at 1/8 scale) the way the convert stage validates images, optionally
with the perceptual hashes of the small decode (`phash_pair`: the convert stage's near-duplicate leak check)."""
from __future__ import annotations

import dataclasses
import io
import re

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from detpipe.core.errors import StageError


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
    ``palette``, ``high_bit_depth``, ``alpha``); ``phash`` the `phash_pair` (whole frame, central part) when asked
    for.
    """

    format: str | None
    mode: str
    width: int
    height: int
    orientation: int
    flags: tuple[str, ...]
    phash: tuple[int, int] | None = None
    """`phash_pair` of the image (``inspect(..., phash=True)``), else None."""

    @property
    def display_size(self) -> tuple[int, int]:
        """(width, height) in pixels after EXIF orientation, i.e. of ``decode_rgb``'s output."""
        return (self.height, self.width) if self.orientation in (5, 6, 7, 8) else (self.width, self.height)


class Unreadable(Exception):
    """The bytes are not a readable image (the message says why, without a file name)."""


#: EXIF orientation 2..8 -> the transposition that displays the stored raster (PIL.ImageOps.exif_transpose's table,
#: Pillow source); the one table of the decoder here and of the annotation geometry (`detpipe.data.geometry`).
EXIF_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}

PHASH_MARGIN = 0.05
"""Share of the width and of the height cut from each side for `phash_pair`'s second hash (the central 90 % x 90 %
of the frame): a copy cropped by about this much per side is then compared with the original's central part."""


def phash64(image: Image.Image) -> int:
    """ImageHash's ``phash`` of ``image`` (a well-kept library, `imagehash.phash`, hash_size 8: the image converted
    to 8-bit grayscale, resized to 32 x 32 with Lanczos, 2-D DCT-II, the top-left 8 x 8 coefficients, each bit 1
    where the coefficient exceeds their median: the DCT hash of hackerfactor.com's "Looks Like It", which
    ImageHash cites) as one unsigned 64-bit integer: the 8 x 8 bits in row-major order, the first bit the most
    significant. Near-duplicates are compared by the Hamming distance of two such integers (0..64; it is always even when
    neither hash has coefficients equal to the median: each has 32 bits set).

    Args:
        image: a PIL image of any size and mode that converts to ``L``.
    Returns:
        int in [0, 2**64).
    """
    import imagehash

    bits = imagehash.phash(image).hash                     # (8, 8) bool
    return int.from_bytes(np.packbits(bits.ravel()).tobytes(), "big")


def preload_phash() -> None:
    """Import ImageHash and the SciPy DCT its ``phash`` uses (~0.4 s and ~30 MB once per process) ahead of the first
    hash: the convert stage has its workers do it while it reads the annotation file."""
    import imagehash  # noqa: F401
    import scipy.fftpack  # noqa: F401


def phash_pair(image: Image.Image) -> tuple[int, int]:
    """``(phash64 of the whole frame, phash64 of its central part)``: the second hashes the frame without a margin
    of `PHASH_MARGIN` (5 %) of the width and height on each side, resampled to 32 x 32 with Lanczos (what
    ``phash`` resizes to). One pHash alone does not survive a crop: on COCO128 a copy cropped 5 % per side lies
    4-20 bits from its original, as far as the nearest distinct image (16); compared with the central part's hash
    it lies 0-8 bits away (docs/convert.md, "Near-duplicate leaks", ``python -m benchmarks.leak_threshold``).

    Args:
        image: the displayed frame (EXIF orientation applied), any size, mode ``L`` or ``RGB``.
    Returns:
        two ints in [0, 2**64).
    """
    gray = image.convert("L")
    w, h = gray.size
    m = PHASH_MARGIN
    centre = gray.resize((32, 32), Image.Resampling.LANCZOS, box=(w * m, h * m, w * (1 - m), h * (1 - m)))
    return phash64(gray), phash64(centre)


def inspect(data: bytes, phash: bool = False) -> ImageInfo:
    """`inspect_image` raising `Unreadable` (no file name), for callers that count rather than stop; with
    ``phash`` the result's ``phash`` is the `phash_pair` of the displayed frame, computed on the decode the check
    makes anyway: a JPEG's 1/8-scale draft (e.g. 80 x 60 for 640 x 480), other formats' full `decode_rgb`."""
    hashes = small = None
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
                if phash:
                    small = im.copy() if im.mode in ("L", "RGB") else im.convert("RGB")
        if fmt != "JPEG":
            rgb = decode_rgb(data)    # the exact decoder later stages use (rare formats: cost is fine)
            if phash:
                small = Image.fromarray(rgb)
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
    if phash:                           # outside the try: a failure here is a bug, not an unreadable image
        if fmt == "JPEG" and orientation != 1:
            small = small.transpose(EXIF_TRANSPOSE[orientation])
        hashes = phash_pair(small)
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
    return ImageInfo(fmt, mode, width, height, orientation, tuple(flags), hashes)


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
