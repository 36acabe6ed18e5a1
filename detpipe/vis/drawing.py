"""Drawing COCO boxes and masks on images: the evaluate stage's ``plots/val_images/`` (`detpipe.evaluation.plots`)
and ``python -m detpipe.predict``'s ``images/``.

Images are ``uint8 (3, H, W)`` RGB tensors at the original size; boxes are COCO ``[x, y, w, h]`` in that image's
pixels (what `detpipe.evaluation.detections` returns and the ground truth holds). Each function returns a new
image (``torchvision.utils.draw_bounding_boxes`` / ``draw_segmentation_masks``).
"""
from __future__ import annotations

import torch

from detpipe.core.boxes import Fmt, convert


def line_width(orig_size) -> int:
    """Box line width in pixels that stays visible on a large image: ``max(2, round(max(H, W) / 320))`` for
    ``orig_size`` ``(H, W)`` in pixels."""
    return max(2, round(max(orig_size) / 320))


def draw_boxes(image: torch.Tensor, bboxes: list, color: str, width: int = 2,
               labels: list[str] | None = None, fmt: Fmt = "xywh") -> torch.Tensor:
    """``image`` with ``bboxes`` drawn as rectangles of ``color`` (a colour name, e.g. ``"red"``).

    Args:
        image: ``uint8 (3, H, W)`` RGB.
        bboxes: COCO ``[x, y, w, h]`` boxes (floats, pixels of ``image``), or boxes of format ``fmt``
            (`detpipe.core.boxes`: ``xyxy`` for a model's output); none: ``image`` is returned as it is.
        color: the boxes' (and labels') colour.
        width: line width in pixels.
        labels: one text per box, written at its top-left corner (None: no text).
    Returns:
        ``uint8 (3, H, W)``.
    Raises:
        ValueError: (torchvision) ``image`` not ``uint8 (3, H, W)``, or ``labels`` not one per box.
    """
    if not len(bboxes):
        return image
    from torchvision.utils import draw_bounding_boxes

    xyxy = convert(torch.as_tensor(bboxes, dtype=torch.float64).reshape(-1, 4), fmt, "xyxy").float()
    return draw_bounding_boxes(image, xyxy, labels=labels, colors=color, width=width)


def draw_masks(image: torch.Tensor, rles: list[dict], color: str, alpha: float = 0.4) -> torch.Tensor:
    """``image`` with the masks of ``rles`` shaded in ``color`` at opacity ``alpha``.

    Args:
        image: ``uint8 (3, H, W)`` RGB.
        rles: COCO compressed RLEs (``{"size": [H, W], "counts": str}``, `detpipe.evaluation.detections.masks_to_rles`)
            of the image's size; none: ``image`` is returned as it is.
        color: the shading's colour name.
        alpha: opacity in [0, 1].
    Returns:
        ``uint8 (3, H, W)``.
    Raises:
        ValueError: (torchvision) a mask's size is not the image's.
    """
    if not rles:
        return image
    from pycocotools import mask as mask_utils
    from torchvision.utils import draw_segmentation_masks

    m = mask_utils.decode(rles)  # (H, W, N) uint8
    return draw_segmentation_masks(image, torch.from_numpy(m).permute(2, 0, 1).bool(), alpha=alpha, colors=color)


def add_legend(image: torch.Tensor, entries: list[tuple[str, str]], row_height: int = 16) -> torch.Tensor:
    """``image`` with a black legend strip added below it: one swatch per entry, its text written in its colour.

    Args:
        image: ``uint8 (3, H, W)`` RGB.
        entries: ``(text, colour name)`` pairs, left to right, wrapped onto more rows when the image is narrow.
        row_height: height of one legend row in pixels (the text is torchvision's default font, about 10 px).
    Returns:
        ``uint8 (3, H + rows * row_height, W)``.
    """
    from torchvision.utils import draw_bounding_boxes

    _, H, W = image.shape
    char_px, pad = 6, 6                    # the default bitmap font is about 6 px per character
    rows, x, y = [], pad, 0
    for text, color in entries:
        w = len(text) * char_px + 2 * pad
        if x > pad and x + w > W:
            x, y = pad, y + 1
        rows.append((x, y, w, text, color))
        x += w + pad
    strip = torch.zeros((3, (y + 1) * row_height, W), dtype=torch.uint8)
    boxes = torch.tensor([[bx, by * row_height + 1, min(bx + w, W - 1), (by + 1) * row_height - 2]
                          for bx, by, w, _, _ in rows], dtype=torch.float32)
    colors = [c for *_, c in rows]
    strip = draw_bounding_boxes(strip, boxes, labels=[t for _, _, _, t, _ in rows], colors=colors, width=1)
    return torch.cat([image, strip], dim=1)


def encode_png(image: torch.Tensor) -> bytes:
    """PNG bytes of a ``uint8 (3, H, W)`` image (``torchvision.io.encode_png``, libpng, default compression): the one
    PNG encoder of the plots (the train batch, val images, worst images)."""
    from torchvision.io import encode_png as _encode

    return _encode(image).numpy().tobytes()
