"""`detpipe.core.boxes`: every box conversion is torchvision's ``box_convert`` (the scalar helpers of the per-object
readers equal it exactly in float64), and drawing takes a model's XYXY boxes as they are."""
from __future__ import annotations

import numpy as np
import torch
from torchvision.ops import box_convert
from torchvision.utils import draw_bounding_boxes

from detpipe.core.boxes import convert, cxcywh_to_xywh, xyxy_to_xywh
from detpipe.vis.drawing import draw_boxes


def _random_boxes(n: int = 500) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(n, 2, generator=g, dtype=torch.float64) * 640
    wh = torch.rand(n, 2, generator=g, dtype=torch.float64) * 300 + 1e-3
    return torch.cat([xy, xy + wh], dim=1)


def test_scalar_helpers_equal_box_convert_exactly():
    xyxy = _random_boxes()
    want = box_convert(xyxy, "xyxy", "xywh").tolist()
    assert [xyxy_to_xywh(*b) for b in xyxy.tolist()] == want
    cxcywh = box_convert(xyxy, "xyxy", "cxcywh")
    got = torch.tensor([cxcywh_to_xywh(*b) for b in cxcywh.tolist()], dtype=torch.float64)
    assert torch.equal(got[:, :2], box_convert(cxcywh, "cxcywh", "xyxy")[:, :2])  # the corner: exactly
    assert torch.equal(got[:, 2:], cxcywh[:, 2:])                                   # the size: as given
    # torchvision's own cxcywh -> xywh goes through the corners: equal within rounding, not bit for bit
    torch.testing.assert_close(got, box_convert(cxcywh, "cxcywh", "xywh"), rtol=1e-12, atol=1e-9)


def test_convert_keeps_the_container_and_dtype():
    xyxy = _random_boxes(7)
    arr = convert(xyxy.numpy(), "xyxy", "xywh")
    assert isinstance(arr, np.ndarray) and arr.dtype == np.float64
    np.testing.assert_array_equal(arr, box_convert(xyxy, "xyxy", "xywh").numpy())
    t = convert(xyxy.float(), "xyxy", "cxcywh")
    assert t.dtype == torch.float32 and torch.equal(t, box_convert(xyxy.float(), "xyxy", "cxcywh"))
    assert convert([[1, 2, 3, 4]], "xywh", "xyxy").tolist() == [[1, 2, 4, 6]]


def test_drawing_xyxy_boxes_draws_what_torchvision_draws():
    image = torch.zeros(3, 60, 80, dtype=torch.uint8)
    xyxy = [[5.0, 6.0, 40.0, 50.0], [20.5, 10.25, 70.0, 30.0]]
    want = draw_bounding_boxes(image, torch.tensor(xyxy), colors="red", width=2)
    assert torch.equal(draw_boxes(image, xyxy, "red", width=2, fmt="xyxy"), want)
    assert torch.equal(draw_boxes(image, convert(xyxy, "xyxy", "xywh").tolist(), "red", width=2), want)
