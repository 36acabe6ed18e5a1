"""Decode encoded image bytes the same way everywhere: EXIF orientation applied, converted to 8-bit RGB."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from detpipe.errors import StageError


def decode_rgb(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode an encoded image (JPEG, PNG, ...) to RGB pixels.

    EXIF orientation is applied (``PIL.ImageOps.exif_transpose``); grayscale, palette, CMYK, alpha and
    16-bit images are converted to 8-bit RGB (16-bit values are scaled by 1/256, alpha is dropped).

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
            if im.mode in ("I;16", "I;16B", "I;16L", "I"):
                arr = np.asarray(im, dtype=np.uint32 if im.mode == "I" else np.uint16)
                arr = (arr >> 8).clip(0, 255).astype(np.uint8)
                return np.repeat(arr[:, :, None], 3, axis=2)
            if im.mode != "RGB":
                im = im.convert("RGBA").convert("RGB") if im.mode == "P" else im.convert("RGB")
            return np.asarray(im, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise StageError(f"{source}: unreadable or corrupt image ({e})") from None
