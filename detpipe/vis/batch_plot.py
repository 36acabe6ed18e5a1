"""The first training batch, drawn: what the model is fed after augmentation (the train stage's
``plots/train_batch.png``, written by `detpipe.engine.hooks.TrainBatchPlotHook`).

`draw_batch` tiles the images of one optimizer step's micro-batches exactly as the loader yielded them (cached
size, horizontally flipped where the sample was flipped) with their target boxes drawn over them (and their
instance masks shaded, for mask models), one colour per class, the class name at each box's top-left corner
(`detpipe.vis.drawing`). A box that does not sit on its object here is a box the model learns from.

Layout (`grid_layout`): the first ``max_images`` images in loader order, row-major in a grid of ``ceil(sqrt(n))``
columns; every cell is as large as the largest (scaled) image plus `PAD` pixels, the image at the cell's top-left
corner, the rest of the cell black. An image whose longer side exceeds ``max_side`` is scaled down to it (bilinear,
antialiased; masks nearest; boxes multiplied by the same factor) before drawing, so lines stay sharp.
"""
from __future__ import annotations

import math

import numpy as np
import torch

PAD = 4
"""Pixels between two cells of the grid."""
PALETTE = ("#e6194b", "#3cb44b", "#ffe119", "#4363d8", "#f58231", "#911eb4", "#46f0f0", "#f032e6", "#bcf60c",
           "#fabebe", "#008080", "#e6beff", "#9a6324", "#fffac8", "#800000", "#aaffc3", "#808000", "#ffd8b1",
           "#000075", "#808080")
"""Box colours: class label ``k`` is drawn in ``PALETTE[k % len(PALETTE)]`` (20 distinct colours)."""


def class_color(label: int) -> str:
    """The colour (``#rrggbb``) of class label ``label`` in `draw_batch`."""
    return PALETTE[int(label) % len(PALETTE)]


def grid_layout(sizes: list[tuple[int, int]], max_side: int) -> tuple[list[float], list[tuple[int, int]],
                                                                     tuple[int, int]]:
    """Where `draw_batch` puts images of ``sizes`` ``(H, W)``: ``(scales, top-left corners (y, x), grid (H, W))``
    (see the module docstring)."""
    scales = [min(1.0, max_side / max(h, w)) for h, w in sizes]
    scaled = [(round(h * s), round(w * s)) for (h, w), s in zip(sizes, scales)]
    cols = math.ceil(math.sqrt(len(sizes)))
    rows = math.ceil(len(sizes) / cols)
    cell_h = max(h for h, _ in scaled) + PAD
    cell_w = max(w for _, w in scaled) + PAD
    corners = [((k // cols) * cell_h, (k % cols) * cell_w) for k in range(len(sizes))]
    return scales, corners, (rows * cell_h - PAD, cols * cell_w - PAD)


def _tile(image: torch.Tensor, target: dict, scale: float, label_names: list[str] | None) -> torch.Tensor:
    """One sample drawn: ``uint8 (3, h, w)``."""
    from detpipe.vis.drawing import draw_boxes, draw_masks, line_width

    img = image.detach().to("cpu", torch.float32)
    boxes = target["boxes"].detach().to("cpu", torch.float64)
    masks = target.get("masks")
    if scale != 1.0:
        size = (round(img.shape[1] * scale), round(img.shape[2] * scale))
        img = torch.nn.functional.interpolate(img[None], size=size, mode="bilinear", antialias=True,
                                              align_corners=False)[0]
        boxes = boxes * scale
        if masks is not None:
            masks = torch.nn.functional.interpolate(masks.detach().cpu()[None].float(), size=size,
                                                    mode="nearest")[0].to(torch.uint8)
    tile = img.mul(255).round_().clamp_(0, 255).to(torch.uint8)
    labels = target["labels"].tolist()
    width = line_width(tile.shape[1:])
    by_class: dict[int, list[int]] = {}
    for j, k in enumerate(labels):
        by_class.setdefault(int(k), []).append(j)
    if masks is not None and len(labels):
        from pycocotools import mask as mask_utils

        m = np.asfortranarray(masks.detach().cpu().numpy().astype(np.uint8).transpose(1, 2, 0))
        rles = mask_utils.encode(m)
        for rle in rles:
            rle["counts"] = rle["counts"].decode()
        for k, js in by_class.items():
            tile = draw_masks(tile, [rles[j] for j in js], class_color(k))
    for k, js in by_class.items():
        names = None if label_names is None else \
            [label_names[k] if 0 <= k < len(label_names) else str(k)] * len(js)
        tile = draw_boxes(tile, boxes[js].tolist(), class_color(k), width=width, labels=names, fmt="xyxy")
    return tile


def draw_batch(micro: list[tuple[list[torch.Tensor], list[dict]]], label_names: list[str] | None = None,
               max_images: int = 16, max_side: int = 640) -> torch.Tensor:
    """One step's micro-batches ``[(images, targets), ...]`` (float ``(3, H, W)`` images in [0, 1], on any
    device; targets with ``boxes`` XYXY in the image's pixels, ``labels``, optional ``masks``) drawn into one grid
    (module docstring), ``uint8 (3, H, W)``. ``label_names[k]``: the name written beside class ``k``'s boxes."""
    pairs = [(im, t) for images, targets in micro for im, t in zip(images, targets)][:max_images]
    scales, corners, (gh, gw) = grid_layout([(int(im.shape[1]), int(im.shape[2])) for im, _ in pairs], max_side)
    grid = torch.zeros(3, gh, gw, dtype=torch.uint8)
    for (image, target), scale, (y, x) in zip(pairs, scales, corners):
        tile = _tile(image, target, scale, label_names)
        grid[:, y:y + tile.shape[1], x:x + tile.shape[2]] = tile
    return grid

