"""Box format conversions, one place for all of them: ``xyxy`` (corners), ``xywh`` (COCO ``bbox``: top-left corner,
width, height) and ``cxcywh`` (centre, width, height; RT-DETR's and YOLO's normalized boxes), in any unit (pixels, or
fractions of the image side).

`convert` is ``torchvision.ops.box_convert`` (the library's, used as it is) for tensors and numpy arrays. The
per-object readers (YOLO, LabelMe, EXIF orientation) convert one box of Python floats at a time, where a tensor round
trip costs ~0.1-0.25 ms per box (measured 2026-11-29 on this CPU, 1 thread); for them `xyxy_to_xywh` and
`cxcywh_to_xywh` do the same arithmetic on floats, and tests/unit/test_boxes.py checks them against
``box_convert`` in float64.
"""
from __future__ import annotations

from typing import Literal, TypeVar

import numpy as np

Fmt = Literal["xyxy", "xywh", "cxcywh"]
A = TypeVar("A")


def convert(boxes: A, in_fmt: Fmt, out_fmt: Fmt) -> A:
    """``boxes`` ``(..., 4)`` from ``in_fmt`` to ``out_fmt`` (``torchvision.ops.box_convert``): a tensor gives a
    tensor of its dtype and device, a numpy array (or nested list, read as float64) a numpy array of its dtype.

    Raises:
        ValueError: (torchvision) an unknown format.
    """
    import torch
    from torchvision.ops import box_convert

    if isinstance(boxes, torch.Tensor):
        return box_convert(boxes, in_fmt, out_fmt)
    arr = np.asarray(boxes, dtype=np.float64) if not isinstance(boxes, np.ndarray) else boxes
    shape = arr.shape
    out = box_convert(torch.from_numpy(np.ascontiguousarray(arr).reshape(-1, 4)), in_fmt, out_fmt)
    return out.numpy().reshape(shape)


def xyxy_to_xywh(x0: float, y0: float, x1: float, y1: float) -> list[float]:
    """One box of floats: corners -> ``[x, y, w, h]`` (as ``box_convert(..., "xyxy", "xywh")``)."""
    return [x0, y0, x1 - x0, y1 - y0]


def cxcywh_to_xywh(cx: float, cy: float, w: float, h: float) -> list[float]:
    """One box of floats: centre and size -> ``[x, y, w, h]``: the corner as ``box_convert(..., "cxcywh", "xyxy")``
    computes it (``x = cx - 0.5 w``), the size as given (``box_convert(..., "cxcywh", "xywh")`` goes through the
    corners, ``w = (cx + 0.5 w) - (cx - 0.5 w)``, which can differ from ``w`` in the last bit)."""
    return [cx - 0.5 * w, cy - 0.5 * h, w, h]
