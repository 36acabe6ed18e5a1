"""Multi-image train-time augmentation ops and the v2 sample they work on (`detpipe.data.train_transforms` draws
their parameters and applies them): `mosaic` (Ultralytics' ``Mosaic``), `mixup` (Ultralytics' ``MixUp``),
`copy_paste` (Ghiasi et al. 2021, arXiv:2012.07177), and `boxes_from_masks` (detectron2's ``recompute_boxes``),
which makes every box of a mask sample its mask's pixel bounds after the geometric ops. Short implementations on top
of `torchvision.transforms.v2` functionals (kornia's ``RandomMosaic`` carries no instance masks; docs/augment.md).
No random draw happens here: the caller passes every drawn parameter, so resume stays exact.
"""
from __future__ import annotations

from typing import Optional

import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

__all__ = ["Sample", "make_sample", "to_size", "mosaic", "mixup", "boxes_from_masks", "copy_paste", "YOLO_FILL"]

YOLO_FILL = 114
"""Ultralytics' padding grey (mosaic canvas, affine border)."""


Sample = dict
"""A v2 sample: ``{"image": Image uint8 (3, H, W), "boxes": BoundingBoxes XYXY float32 (N, 4), "labels": int64
(N,), "masks": Mask uint8 (N, H, W)}`` (masks only for mask datasets)."""


def make_sample(image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor,
                masks: Optional[torch.Tensor] = None) -> Sample:
    """A v2 sample dict: ``image`` ``uint8 (3, H, W)``, ``boxes`` ``float32 (N, 4)`` XYXY pixels, ``labels``
    ``int64 (N,)``, optional ``masks`` ``uint8 (N, H, W)``."""
    h, w = image.shape[-2:]
    out = {"image": tv_tensors.Image(image), "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY",
                                                                               canvas_size=(h, w)),
           "labels": labels}
    if masks is not None:
        out["masks"] = tv_tensors.Mask(masks)
    return out


def to_size(sample: Sample, size: tuple[int, int]) -> Sample:
    """``sample`` resized (v2 ``F.resize``; masks nearest) to ``size`` ``(H, W)`` pixels if it is not that size."""
    if tuple(sample["image"].shape[-2:]) == tuple(size):
        return sample
    return {k: (F.resize(v, list(size), antialias=True) if k != "labels" else v) for k, v in sample.items()}


def mosaic(tiles: list[Sample], centre: tuple[float, float], size: tuple[int, int],
           fill: tuple[int, int, int] = (YOLO_FILL,) * 3) -> Sample:
    """Four samples ``tiles`` of size ``size`` ``(H, W)`` placed around ``centre`` ``(cx, cy)`` (pixels) of a
    ``(2H, 2W)`` canvas: tile 0 ends at the centre (top-left quadrant), 1 starts right of it (top-right), 2 below
    it (bottom-left), 3 at it (bottom-right), as Ultralytics' ``Mosaic._mosaic4``. Each tile is moved with v2
    ``F.crop`` (boxes shifted and clipped, masks moved), uncovered canvas is ``fill`` (RGB, 0..255). Returns the
    canvas sample: ``image`` uint8 ``(3, 2H, 2W)``, the tiles' boxes (XYXY canvas pixels, float32) and labels in
    tile order, masks uint8 ``(N, 2H, 2W)`` when the tiles have them (boxes not yet sanitized)."""
    h, w = size
    cx, cy = int(centre[0]), int(centre[1])
    corners = [(cx - w, cy - h), (cx, cy - h), (cx - w, cy), (cx, cy)]
    device = tiles[0]["image"].device
    image = torch.tensor(fill, dtype=torch.uint8, device=device).view(3, 1, 1).expand(3, 2 * h, 2 * w).clone()
    boxes, labels, masks = [], [], []
    for tile, (x0, y0) in zip(tiles, corners):
        moved = {k: (F.crop(v, -y0, -x0, 2 * h, 2 * w) if k != "labels" else v) for k, v in tile.items()}
        ys, xs = slice(max(0, y0), min(2 * h, y0 + h)), slice(max(0, x0), min(2 * w, x0 + w))
        image[:, ys, xs] = moved["image"][:, ys, xs]
        boxes.append(moved["boxes"].as_subclass(torch.Tensor))
        labels.append(tile["labels"])
        if "masks" in tile:
            masks.append(moved["masks"].as_subclass(torch.Tensor))
    out = make_sample(image, torch.cat(boxes), torch.cat(labels), torch.cat(masks) if masks else None)
    return out


def mixup(a: Sample, b: Sample, ratio: float) -> Sample:
    """``ratio * a + (1 - ratio) * b`` (pixels, rounded to uint8) with both samples' boxes, labels and masks
    (Ultralytics' ``MixUp``); ``a`` and ``b`` have the same size."""
    image = (a["image"].float() * ratio + b["image"].float() * (1 - ratio)).round_().clamp_(0, 255).to(torch.uint8)
    masks = torch.cat([a["masks"], b["masks"]]) if "masks" in a else None
    return make_sample(image, torch.cat([a["boxes"].as_subclass(torch.Tensor), b["boxes"].as_subclass(torch.Tensor)]),
                       torch.cat([a["labels"], b["labels"]]), masks)


def _mask_bounds(masks: torch.Tensor) -> torch.Tensor:
    """Pixel bounds of non-empty ``masks`` ``(N, H, W)``: float32 ``(N, 4)`` XYXY, ``torchvision.ops.masks_to_boxes``
    + 1 on x2 and y2 (it returns the last pixel's index; a box ends at that pixel's far edge)."""
    from torchvision.ops import masks_to_boxes

    return masks_to_boxes(masks) + torch.tensor([0.0, 0.0, 1.0, 1.0], device=masks.device)


def _occluded_boxes(boxes: torch.Tensor, masks: torch.Tensor, occluded: torch.Tensor) -> torch.Tensor:
    """``boxes`` float32 ``(N, 4)`` XYXY with the rows ``occluded`` (bool ``(N,)``) replaced by the pixel bounds of
    ``masks`` ``(N, H, W)`` (non-empty there, `_mask_bounds`)."""
    boxes = boxes.clone()
    if bool(occluded.any()):
        boxes[occluded] = _mask_bounds(masks[occluded])
    return boxes


def boxes_from_masks(sample: Sample, recompute: bool = True) -> Sample:
    """``sample`` (with ``masks`` uint8 ``(N, H, W)``) without the objects whose mask has no pixel left, and with
    ``recompute`` every box replaced by its mask's pixel bounds: ``torchvision.ops.masks_to_boxes`` + 1 on x2 and y2
    (it returns the last pixel's index; a box ends at that pixel's far edge), float32 XYXY pixels.

    Why: v2 transforms boxes and masks separately, so an object that a crop, zoom or mosaic tile cuts keeps the
    clamped box, larger than what is left of its mask when the object is not a rectangle (an L-shaped object cut
    by the crop edge), and nearest-neighbour resampling moves a mask edge by up to a source pixel. What the field
    does for instance masks after geometric ops: detectron2's ``DatasetMapper`` (``recompute_boxes``:
    ``gt_masks.get_bounding_boxes()``, then ``filter_empty_instances``), Ultralytics' ``random_perspective`` (boxes
    from the transformed segments, ``segment2box``). `TrainTransforms` calls it last (before the flip, which moves
    both exactly) on every sample an op touched; no random draw, so resume stays exact. Runs on the tensors'
    device."""
    masks = sample["masks"].as_subclass(torch.Tensor)
    keep = masks.flatten(1).bool().any(1)  # an object whose mask an op cut or sampled away has nothing to learn from
    if not bool(keep.all()):
        sample = {k: (tv_tensors.wrap(v.as_subclass(torch.Tensor)[keep], like=v)
                      if isinstance(v, tv_tensors.TVTensor) and k != "image" else v[keep] if k != "image" else v)
                  for k, v in sample.items()}
        masks = masks[keep]
    if recompute and len(masks):
        boxes = _mask_bounds(masks).to(sample["boxes"].dtype)
        sample = {**sample, "boxes": tv_tensors.wrap(boxes, like=sample["boxes"])}
    return sample


def copy_paste(dst: Sample, src: Sample, pick: torch.Tensor) -> tuple[Sample, int]:
    """Paste the objects ``pick`` of ``src`` onto ``dst`` (Ghiasi et al. 2021, arXiv:2012.07177, "Simple Copy-Paste",
    without its scale jitter): the pixels under the union of the picked objects' masks are ``src``'s, every ``dst``
    mask loses those pixels, a ``dst`` object that lost some has its box re-derived from what is left of its mask by
    ``torchvision.ops.masks_to_boxes`` (+1 on x2 and y2: it returns the last pixel's index, boxes end at its far
    edge), one that lost all of them is dropped. Untouched objects keep their boxes; pasted objects keep ``src``'s.

    Args:
        dst, src: v2 samples (`make_sample`) of the same size ``(H, W)``, both with ``masks`` uint8 ``(N, H, W)``.
        pick: bool ``(N_src,)``, which ``src`` objects to paste.

    Returns:
        ``(sample, dropped)``: the composite (``dst``'s objects that remain, then the pasted ones; ``image`` uint8
        ``(3, H, W)``, ``boxes`` float32 XYXY pixels, ``labels``, ``masks``) and how many ``dst`` objects were
        covered entirely.
    """
    d_masks = dst["masks"].as_subclass(torch.Tensor)
    s_masks = src["masks"].as_subclass(torch.Tensor)[pick]
    if s_masks.shape[0] == 0:
        return dst, 0
    cover = s_masks.bool().any(0)  # (H, W)
    image = torch.where(cover, src["image"].as_subclass(torch.Tensor), dst["image"].as_subclass(torch.Tensor))
    before = d_masks.flatten(1).sum(1)
    cut = d_masks * (~cover).to(d_masks.dtype)
    after = cut.flatten(1).sum(1)
    keep = after > 0
    boxes = _occluded_boxes(dst["boxes"].as_subclass(torch.Tensor), cut, keep & (after < before))
    out = make_sample(image, torch.cat([boxes[keep], src["boxes"].as_subclass(torch.Tensor)[pick]]),
                      torch.cat([dst["labels"][keep], src["labels"][pick]]), torch.cat([cut[keep], s_masks]))
    return out, int((~keep).sum())
