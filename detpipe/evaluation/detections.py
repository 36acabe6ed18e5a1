"""A detector's outputs as COCO results in original-image pixels: the one mapping used by the evaluate stage
(`detpipe.evaluation.evaluate`), training's eval hook (`detpipe.evaluation.periodic.make_eval_fn`) and
``python -m detpipe.predict``.

The model sees an image resized (and, in the cache, possibly cropped) by the augment stage's rule; a pixel
coordinate ``c`` of that image is ``c / scale + offset`` in the original image (`boxes_to_original`; predict's
prepared images have offset 0). `masks_to_rles` applies the same mapping to mask probabilities, `image_detections`
turns one image's outputs into COCO result dicts, `detect_dataset` runs a model over the cached val split.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from pycocotools import mask as mask_utils
from torch.utils.data import DataLoader

from detpipe.core.boxes import convert
from detpipe.data.dataset import CachedDetectionDataset, collate
from detpipe.core.errors import StageError
from detpipe.core.progress import track

MASK_THRESHOLD = 0.5  # mask probability -> binary, as torchvision's references/detection/coco_eval.py


def label_to_category_id(meta: dict) -> dict[int, int]:
    """Contiguous training label (int, 1..num_classes - 1) → the dataset's COCO ``category_id`` (int), from the
    convert stage's ``data/arrow/meta.json`` (its ``category_id_to_label``). Raises KeyError when ``meta`` has no
    ``category_id_to_label``."""
    return {int(label): int(cat) for cat, label in meta["category_id_to_label"].items()}


def boxes_to_original(boxes: torch.Tensor, scale, orig_size, offset=(0.0, 0.0),
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Boxes in the model's image (cached or prepared pixels) → original-image pixels.

    ``orig = box / scale + offset`` per axis (the augment stage's resize rule inverted; the offset is added only
    when it is not zero), then clipped to ``[0, width] x [0, height]``.

    Args:
        boxes: ``(N, 4)`` (or anything that reshapes to it) XYXY boxes in the model's image pixels, any float
            dtype, any device.
        scale: ``(scale_y, scale_x)``: model-image pixels per original pixel (two numbers, or a 2-element tensor
            as the cache's targets hold; likewise ``orig_size`` and ``offset``).
        orig_size: ``(height, width)`` of the original image in pixels.
        offset: ``(offset_y, offset_x)``: original-pixel coordinate of the model image's pixel 0 (a crop's corner).
        dtype: the float type of the arithmetic and of the result: float64 for predict, float32 for the
            evaluate stage and the eval hook (what their metrics have always been computed from).
    Returns:
        ``(N, 4)`` XYXY boxes in original-image pixels, ``dtype``, on the CPU.
    """
    (sy, sx), (oy, ox), (oh, ow) = ((float(v) for v in scale), (float(v) for v in offset),
                                    (int(v) for v in orig_size))
    out = boxes.detach().reshape(-1, 4).to("cpu", dtype) / torch.tensor([sx, sy, sx, sy], dtype=dtype)
    if ox or oy:
        out = out + torch.tensor([ox, oy, ox, oy], dtype=dtype)
    return torch.stack([out[:, 0].clamp(0, ow), out[:, 1].clamp(0, oh), out[:, 2].clamp(0, ow),
                        out[:, 3].clamp(0, oh)], dim=1)


def masks_to_rles(masks: torch.Tensor, scale, offset, orig_size, threshold: float = MASK_THRESHOLD) -> list[dict]:
    """Predicted mask probabilities in cached pixels -> COCO compressed RLEs at the original image size.

    The inverse of the cache's resize (`detpipe.data.augment`: ``orig = cached / scale + offset``): the centre
    ``(i + 0.5, j + 0.5)`` of original pixel ``(i, j)`` lies at cached coordinates
    ``((i + 0.5 - offset_y) * scale_y, (j + 0.5 - offset_x) * scale_x)``; the probability there is interpolated
    bilinearly (``torch.nn.functional.grid_sample``, ``align_corners=False``, float64; edge values held within
    half a pixel of the border, as ``F.interpolate(mode="bilinear")`` does; 0 for positions outside the cached
    image, e.g. regions a crop variant cut off) and the pixel is in the mask when it exceeds ``threshold``
    (0.5 as in torchvision's ``references/detection/coco_eval.py``). Only the rectangle that can exceed the
    threshold is resampled: a bilinear value is a convex combination of its 4 neighbours, so it exceeds the
    threshold only next to a cached pixel that does.

    Args:
        masks: ``(N, 1, h, w)`` or ``(N, h, w)`` float probabilities in [0, 1] (Mask R-CNN's ``masks`` output
            for an image of the cached size ``(h, w)``), any device.
        scale: ``(scale_y, scale_x)``, cached pixels per original pixel.
        offset: ``(offset_y, offset_x)``, original-pixel coordinate of cached pixel 0.
        orig_size: ``(height, width)`` of the original image in pixels.
        threshold: probability above which a pixel belongs to the mask.
    Returns:
        N dicts ``{"size": [height, width], "counts": str}``: ``pycocotools.mask.encode`` of the Fortran-ordered
        uint8 ``(height, width)`` mask, counts as ASCII text (JSON-ready).
    """
    (sy, sx), (oy, ox), (oh, ow) = ((float(v) for v in scale), (float(v) for v in offset),
                                    (int(v) for v in orig_size))
    m = masks.detach().float().cpu()
    if m.dim() == 4:
        m = m[:, 0]
    n, h, w = m.shape
    on = m > threshold
    rows_on, cols_on = on.any(2), on.any(1)
    out = []
    for k in range(n):
        full = np.zeros((oh, ow), dtype=np.uint8, order="F")
        rows, cols = rows_on[k].nonzero()[:, 0], cols_on[k].nonzero()[:, 0]
        if len(rows):
            # original i samples cached index y = (i + 0.5 - oy) * sy - 0.5, with neighbours floor(y), floor(y) + 1:
            # keep the i whose y lies in (r0 - 1, r1 + 1), with a pixel of margin against rounding
            r0, r1, c0, c1 = int(rows[0]), int(rows[-1]), int(cols[0]), int(cols[-1])
            i0 = max(0, math.floor((r0 - 0.5) / sy + oy - 0.5) - 1)
            i1 = min(oh, math.ceil((r1 + 1.5) / sy + oy - 0.5) + 2)
            j0 = max(0, math.floor((c0 - 0.5) / sx + ox - 0.5) - 1)
            j1 = min(ow, math.ceil((c1 + 1.5) / sx + ox - 0.5) + 2)
            if i1 > i0 and j1 > j0:
                ys = (torch.arange(i0, i1, dtype=torch.float64) + 0.5 - oy) * sy  # continuous cached coords
                xs = (torch.arange(j0, j1, dtype=torch.float64) + 0.5 - ox) * sx
                gy, gx = torch.meshgrid(2 * ys / h - 1, 2 * xs / w - 1, indexing="ij")
                v = F.grid_sample(m[k][None, None].double(), torch.stack([gx, gy], -1)[None], mode="bilinear",
                                  padding_mode="border", align_corners=False)[0, 0]
                inside = ((ys >= 0) & (ys <= h))[:, None] & ((xs >= 0) & (xs <= w))[None, :]
                full[i0:i1, j0:j1] = ((v > threshold) & inside).numpy()
        rle = mask_utils.encode(full)
        out.append({"size": [oh, ow], "counts": rle["counts"].decode("ascii")})
    return out


def image_detections(det: dict, image_id: int, label_to_category: dict[int, int], scale, orig_size,
                     offset=(0.0, 0.0), score_threshold: float = 0.0, *, file_name: str | None = None,
                     label_names: list[str] | None = None, masks: bool = True,
                     dtype: torch.dtype = torch.float64) -> list[dict]:
    """One image's detections as COCO result dicts in original-image pixels, those with
    ``score >= score_threshold``, highest score first (a stable sort: a model's NMS output keeps its order).

    Each dict: ``image_id`` (int), [``file_name`` (str)], ``category_id`` (int, the dataset's), [``category_name``
    (str)], ``bbox`` ``[x, y, w, h]`` (float, original pixels, `boxes_to_original`, clipped to the image),
    ``score`` (float in [0, 1]), [``segmentation``: compressed RLE at the original size, `masks_to_rles`].

    Args:
        det: the model's output for the image: ``boxes`` ``(N, 4)`` XYXY float in the model image's pixels,
            ``scores`` ``(N,)`` float, ``labels`` ``(N,)`` int64 (contiguous training labels), optionally
            ``masks`` ``(N, 1, h, w)`` float probabilities (Mask R-CNN); any device.
        image_id: the image's id in the results.
        label_to_category: `label_to_category_id`.
        scale, orig_size, offset: the mapping back to original pixels (`boxes_to_original`).
        score_threshold: lower scores are left out (compared in ``dtype``).
        file_name: when given, each dict carries it (predict's output).
        label_names: when given, each dict carries ``category_name`` = ``label_names[label]`` (predict's output).
        masks: encode ``det["masks"]``, when there, as ``segmentation``; False: never.
        dtype: the arithmetic's float type (`boxes_to_original`).
    Raises:
        StageError: a label that ``label_to_category`` does not know (model and data meta from different runs),
            naming ``file_name`` (or the image id) and the labels known.
    """
    boxes = boxes_to_original(det["boxes"], scale, orig_size, offset, dtype)
    xywh = convert(boxes, "xyxy", "xywh")  # COCO bbox
    scores = det["scores"].detach().reshape(-1).to("cpu", dtype)
    labels = det["labels"].detach().reshape(-1).cpu()
    order = torch.argsort(scores, descending=True, stable=True)
    keep = order[scores[order] >= score_threshold].tolist()
    rles = masks_to_rles(det["masks"][keep], scale, offset, orig_size) if masks and "masks" in det else None
    out = []
    for n, k in enumerate(keep):
        label = int(labels[k])
        if label not in label_to_category:
            raise StageError(f"{file_name or f'image {image_id}'}: the model predicts label {label}, the data meta "
                             f"knows labels {min(label_to_category)}..{max(label_to_category)}: model and data come "
                             "from different runs")
        result = {"image_id": image_id}
        if file_name is not None:
            result["file_name"] = file_name
        result["category_id"] = label_to_category[label]
        if label_names is not None:
            result["category_name"] = label_names[label]
        result["bbox"] = xywh[k].tolist()
        result["score"] = float(scores[k])
        if rles is not None:
            result["segmentation"] = rles[n]
        out.append(result)
    return out


@torch.inference_mode()
def detect_dataset(model: torch.nn.Module, dataset: CachedDetectionDataset, label_to_category: dict[int, int],
                   batch_size: int = 16, score_threshold: float = 0.0, device: torch.device | str = "cpu",
                   indices: list[int] | None = None, masks: bool | None = None) -> list[dict]:
    """Run ``model`` over a cached split (or its ``indices``) and return COCO result dicts in original pixels.

    Each result (`image_detections`, float32 arithmetic): ``image_id`` (int), ``category_id`` (int), ``bbox``
    ``[x, y, w, h]`` (float, original pixels, ``orig = cached / scale + offset``, clipped to the original
    image), ``score`` (float in [0, 1]); with masks also ``segmentation``: compressed RLE at the original size
    (`masks_to_rles`). Images in dataset order, each image's results highest score first.

    Args:
        model: a torchvision detector in eval mode, taking a list of ``float32 (3, h, w)`` images in [0, 1].
        dataset: the augment stage's cache split (`detpipe.data.dataset.CachedDetectionDataset`): its targets
            give ``image_id``, ``scale``, ``offset`` and ``orig_size``.
        label_to_category: `label_to_category_id`.
        batch_size: images per model call.
        score_threshold: lower scores are left out.
        device: where the images go (the model's device).
        indices: the dataset's items to run on (None: all).
        masks: encode the model's ``masks`` output (Mask R-CNN) as ``segmentation``; None (default): when the
            model outputs masks; False: never (bbox-only evaluation of a mask model).
    Raises:
        StageError: the model predicts a label ``label_to_category`` does not know.
    """
    results = []
    subset = torch.utils.data.Subset(dataset, indices) if indices is not None else dataset
    loader = DataLoader(subset, batch_size=batch_size, collate_fn=collate, shuffle=False)
    for images, targets in track(loader, "predict", images=lambda batch: len(batch[0])):
        outputs = model([im.to(device) for im in images])
        for out, t in zip(outputs, targets):
            results += image_detections(out, int(t["image_id"]), label_to_category, t["scale"], t["orig_size"],
                                        t["offset"], score_threshold, masks=masks is None or masks,
                                        dtype=torch.float32)
    return results
