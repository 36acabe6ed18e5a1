"""detpipe.data.imageio.decode_rgb scales 16-bit, 32-bit integer and float images to 8 bit as its docstring says,
on a real COCO128 image turned into such files with PIL."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from detpipe.data.imageio import decode_rgb, inspect_image

COCO_IMAGE = Path(__file__).resolve().parents[2] / "data" / "coco128" / "train2017" / "000000000009.jpg"


def _gray() -> np.ndarray:
    """(480, 640) uint8 luminance of a real photo."""
    with Image.open(COCO_IMAGE) as im:
        return np.asarray(im.convert("L"))


def _encode(arr: np.ndarray, mode: str, fmt: str) -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(arr)
    assert im.mode == mode
    im.save(buf, fmt)
    return buf.getvalue()


def _cases(gray: np.ndarray) -> dict[str, tuple[bytes, np.ndarray]]:
    """name -> (encoded file, expected 8-bit gray per the documented rule)."""
    v16 = gray.astype(np.uint16) * 256 + 128                      # 16-bit photo: v16 >> 8 == gray
    f01 = gray.astype(np.float32) / 255.0                          # float photo in [0, 1]
    return {
        "png16": (_encode(v16, "I;16", "PNG"), gray),
        "tiff16": (_encode(v16, "I;16", "TIFF"), gray),
        "tiff_int32": (_encode(v16.astype(np.int32), "I", "TIFF"), gray),
        "tiff_float01": (_encode(f01, "F", "TIFF"), gray),
        "tiff_float_out_of_range": (_encode(f01 * 4 - 1.5, "F", "TIFF"),
                                    np.rint((f01 * 4 - 1.5).astype(np.float64) * 255).clip(0, 255).astype(np.uint8)),
    }


@pytest.mark.parametrize("case", ["png16", "tiff16", "tiff_int32", "tiff_float01", "tiff_float_out_of_range"])
def test_high_bit_depth_and_float_images_are_scaled_to_8_bit(case):
    gray = _gray()
    data, want = _cases(gray)[case]
    rgb = decode_rgb(data, case)
    assert rgb.shape == (*gray.shape, 3) and rgb.dtype == np.uint8
    assert np.array_equal(rgb[..., 0], want) and np.array_equal(rgb[..., 0], rgb[..., 2])
    assert "high_bit_depth" in inspect_image(data, case).flags
    # what an unscaled conversion gives (PIL's own convert("L") clips float [0, 1] to 0/1: almost black;
    # 16-bit values saturate to 255): the test would see it
    with Image.open(io.BytesIO(data)) as im:
        naive = np.asarray(im.convert("L"))
    assert not np.array_equal(naive, want)
