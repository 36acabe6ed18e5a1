"""Geometry of EXIF orientation: points, COCO boxes and segmentations mapped from the stored raster to the
frame that ``PIL.ImageOps.exif_transpose`` (and so `detpipe.data.imageio.decode_rgb`) displays."""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
from PIL import Image

from detpipe.core.boxes import xyxy_to_xywh
from detpipe.data.imageio import EXIF_TRANSPOSE


def orient_points(xy: np.ndarray, width: int, height: int, orientation: int) -> np.ndarray:
    """Map points from a stored raster to the frame that EXIF ``orientation`` displays (as ``exif_transpose``).

    Args:
        xy: float array ``(N, 2)`` of continuous pixel coordinates (x, y) in the stored raster.
        width, height: stored raster size in pixels.
        orientation: EXIF orientation 1..8 (TIFF/EXIF 2.3 tag 0x0112; transposes as in Pillow's
            ``ImageOps.exif_transpose``).
    Returns:
        float64 array ``(N, 2)`` in the displayed frame (size ``(height, width)`` for orientations 5..8).
    """
    xy = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
    x, y = xy[:, 0], xy[:, 1]
    w, h = float(width), float(height)
    out = {
        1: (x, y), 2: (w - x, y), 3: (w - x, h - y), 4: (x, h - y),
        5: (y, x), 6: (h - y, x), 7: (h - y, w - x), 8: (y, w - x),
    }[orientation]
    return np.stack(out, axis=1)


def orient_box(box: Sequence[float], width: int, height: int, orientation: int) -> list[float]:
    """COCO box ``[x, y, w, h]`` (pixels, stored raster of ``width`` x ``height``) -> same box in the
    displayed frame of EXIF ``orientation`` (see `orient_points`)."""
    x, y, w, h = box
    p = orient_points([[x, y], [x + w, y + h]], width, height, orientation)
    x0, y0 = p.min(axis=0)
    x1, y1 = p.max(axis=0)
    return xyxy_to_xywh(float(x0), float(y0), float(x1), float(y1))


def orient_segmentation(seg: Any, width: int, height: int, orientation: int) -> Any:
    """A COCO segmentation of the stored ``width`` x ``height`` raster in the displayed frame of EXIF
    ``orientation``. Polygons (list of flat [x0, y0, x1, y1, ...] lists, pixels): each point mapped
    (`orient_points`, rounded to 1e-6 px). RLE (a pycocotools compressed RLE dict, ``counts`` bytes or str):
    mask decoded, transposed with the same PIL transpose as ``exif_transpose``, re-encoded as compressed RLE
    (``{"size": [h, w], "counts": str}``). Other values are returned unchanged."""
    from pycocotools import mask as mask_utils

    if isinstance(seg, list):
        out = []
        for poly in seg:
            p = orient_points(np.asarray(poly, dtype=np.float64), width, height, orientation)
            out.append([round(v, 6) for v in p.reshape(-1).tolist()])
        return out
    if isinstance(seg, dict):
        with warnings.catch_warnings():   # pycocotools 2.0.11 + numpy 2: harmless copy=False DeprecationWarning
            warnings.simplefilter("ignore", DeprecationWarning)
            m = mask_utils.decode(_compressed(seg))
        m = np.asarray(Image.fromarray(m).transpose(EXIF_TRANSPOSE[orientation]))
        rle = mask_utils.encode(np.asfortranarray(m))
        return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}
    return seg


def _compressed(seg: dict) -> dict:
    """A compressed RLE dict with ``counts`` as bytes, as pycocotools' C functions want it."""
    counts = seg["counts"]
    return {"size": list(seg["size"]), "counts": counts.encode("ascii") if isinstance(counts, str) else counts}
