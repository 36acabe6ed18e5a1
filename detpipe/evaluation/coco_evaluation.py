"""Prediction and ground truth for COCO evaluation, shared by the evaluate stage and training's eval hook.

`predict` runs a detector over the cached val split and maps its boxes (and masks) back to original image
pixels (``orig = cached / scale + offset``); `gt_from_arrow` rebuilds the COCO ground truth from the converted
Arrow shards. Scoring itself is `detpipe.evaluation.coco_metrics.coco_evaluate`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
import torch.nn.functional as F
from pycocotools import mask as mask_utils
from torch.utils.data import DataLoader

from detpipe.evaluation.coco_metrics import pr_curve_rows
from detpipe.data.dataset import CachedDetectionDataset, collate
from detpipe.data.meta import arrow_shards
from detpipe.progress import track
from detpipe.errors import StageError
from detpipe.data.imageio import decode_rgb
from detpipe.files import atomic_dir, atomic_write_bytes, atomic_write_json

MASK_THRESHOLD = 0.5  # mask probability -> binary, as torchvision's references/detection/coco_eval.py


def gt_from_arrow(split_dir: Path, meta: dict) -> dict:
    """Rebuild a COCO instances dict (images, annotations, categories) from converted Arrow shards.

    Boxes are ``[x, y, w, h]`` original pixels (float32 in Arrow), ``segmentation`` is parsed back from its
    JSON text (omitted when empty), ids are int64.

    Args:
        split_dir: the split's folder (``data/arrow/val``); its shards are those ``meta`` lists
            (`detpipe.data.meta.arrow_shards`).
        meta: the convert stage's ``meta.json`` (`detpipe.data.meta.read_meta`).
    Raises:
        StageError: no shards listed for the split, or a listed shard missing.
    """
    shards = arrow_shards(split_dir, meta)
    if not shards:
        raise StageError(f"{split_dir}: no Arrow shards found (run the convert stage first)")
    images, annotations = [], []
    cols = ["image_id", "file_name", "width", "height", "ann_id", "bbox", "category_id", "iscrowd", "area",
            "segmentation"]
    for shard in shards:
        table = ipc.open_file(pa.memory_map(str(shard))).read_all().select(cols)
        for row in table.to_pylist():
            images.append({"id": row["image_id"], "file_name": row["file_name"], "width": row["width"],
                           "height": row["height"]})
            for k in range(len(row["ann_id"])):
                ann = {"id": row["ann_id"][k], "image_id": row["image_id"], "category_id": row["category_id"][k],
                       "bbox": [float(v) for v in row["bbox"][k]], "area": float(row["area"][k]),
                       "iscrowd": int(row["iscrowd"][k])}
                if row["segmentation"][k]:
                    ann["segmentation"] = json.loads(row["segmentation"][k])
                annotations.append(ann)
    return {"images": images, "annotations": annotations, "categories": meta["categories"]}


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


@torch.inference_mode()
def predict(model: torch.nn.Module, dataset: CachedDetectionDataset, label_to_category: dict[int, int],
            batch_size: int = 16, score_threshold: float = 0.0,
            device: torch.device | str = "cpu", indices: list[int] | None = None,
            masks: bool | None = None) -> list[dict]:
    """Run ``model`` over ``dataset`` (or its ``indices``) and return COCO result dicts in original pixels.

    Each result: ``image_id`` (int), ``category_id`` (int), ``bbox`` ``[x, y, w, h]`` (float, original
    pixels, ``orig = cached / scale + offset``, clipped to the original image), ``score`` (float in [0, 1]);
    with masks also ``segmentation``: compressed RLE at the original size (`masks_to_rles`).

    Args:
        masks: encode the model's ``masks`` output (Mask R-CNN) as ``segmentation``; None (default): when the
            model outputs masks; False: never (bbox-only evaluation of a mask model).
    """
    results = []
    subset = torch.utils.data.Subset(dataset, indices) if indices is not None else dataset
    loader = DataLoader(subset, batch_size=batch_size, collate_fn=collate, shuffle=False)
    for images, targets in track(loader, "predict", images=lambda batch: len(batch[0])):
        outputs = model([im.to(device) for im in images])
        for out, t in zip(outputs, targets):
            sy, sx = (float(v) for v in t["scale"])
            oy, ox = (float(v) for v in t["offset"])
            oh, ow = (int(v) for v in t["orig_size"])
            boxes = out["boxes"].float().cpu()
            x1 = (boxes[:, 0] / sx + ox).clamp(0, ow)
            y1 = (boxes[:, 1] / sy + oy).clamp(0, oh)
            x2 = (boxes[:, 2] / sx + ox).clamp(0, ow)
            y2 = (boxes[:, 3] / sy + oy).clamp(0, oh)
            scores = out["scores"].float().cpu()
            keep = (scores >= score_threshold).nonzero()[:, 0].tolist()
            rles = None
            if (masks is None or masks) and "masks" in out:
                rles = masks_to_rles(out["masks"][keep], (sy, sx), (oy, ox), (oh, ow))
            for n, k in enumerate(keep):
                det = {"image_id": int(t["image_id"]),
                       "category_id": int(label_to_category[int(out["labels"][k])]),
                       "bbox": [float(x1[k]), float(y1[k]), float(x2[k] - x1[k]), float(y2[k] - y1[k])],
                       "score": float(scores[k])}
                if rles is not None:
                    det["segmentation"] = rles[n]
                results.append(det)
    return results


def label_to_category_id(meta: dict) -> dict[int, int]:
    """Contiguous label → COCO ``category_id`` from ``data/arrow/meta.json``."""
    return {int(label): int(cat) for cat, label in meta["category_id_to_label"].items()}


def write_plots(plots_dir: Path, result, dets: list[dict], gt: dict, val_dir: Path, num_images: int,
                score_threshold: float) -> None:
    """``pr_curve.json`` (IoU 0.5 and 0.75), ``per_class_ap.json`` (``{"per_class_ap": [{"class", "AP"}]}``, bbox
    AP@[.5:.95] of the classes with ground truth) and ``val_images/<image_id>.png`` (the first ``num_images``
    val images of the Arrow shards in ``val_dir``, original size, predicted boxes red with score ≥
    ``score_threshold`` and their masks shaded red when detections carry a ``segmentation``, ground truth
    green), all replaced atomically. ``result``: the bbox `detpipe.evaluation.coco_metrics.CocoResult`; ``dets``, ``gt``: COCO
    results and instances dicts in original pixels."""
    from torchvision.io import encode_png
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

    rows = [{**r, "iou": iou} for iou in (0.5, 0.75) for r in pr_curve_rows(result, iou=iou)]
    atomic_write_json(plots_dir / "pr_curve.json", {"pr_curve": rows})
    per_class = [{"class": name, "AP": ap} for name, ap in result.per_class_ap.items() if ap >= 0]
    atomic_write_json(plots_dir / "per_class_ap.json", {"per_class_ap": per_class})
    arrow_rows = _val_image_rows(val_dir, num_images)
    by_image_dt: dict[int, list] = {}
    by_image_masks: dict[int, list] = {}
    for d in dets:
        if d["score"] >= score_threshold:
            by_image_dt.setdefault(d["image_id"], []).append(d["bbox"])
            if "segmentation" in d:
                by_image_masks.setdefault(d["image_id"], []).append(d["segmentation"])
    by_image_gt: dict[int, list] = {}
    for a in gt["annotations"]:
        by_image_gt.setdefault(a["image_id"], []).append(a["bbox"])
    with atomic_dir(plots_dir / "val_images") as tmp:
        for row in arrow_rows:
            image = torch.from_numpy(decode_rgb(row["image"], row["file_name"])).permute(2, 0, 1).contiguous()
            if by_image_masks.get(row["image_id"]):
                m = mask_utils.decode(by_image_masks[row["image_id"]])  # (H, W, N)
                image = draw_segmentation_masks(image, torch.from_numpy(m).permute(2, 0, 1).bool(), alpha=0.4,
                                                colors="red")
            for boxes, color in ((by_image_gt.get(row["image_id"], []), "green"),
                                 (by_image_dt.get(row["image_id"], []), "red")):
                if boxes:
                    xyxy = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in boxes], dtype=torch.float32)
                    image = draw_bounding_boxes(image, xyxy, colors=color, width=2)
            atomic_write_bytes(tmp / f"{row['image_id']}.png", encode_png(image).numpy().tobytes())


def _val_image_rows(split_dir: Path, n: int) -> list[dict]:
    """The first ``n`` rows (``image_id``, ``file_name``, ``image``) of the split's shards, in order."""
    rows = []
    for shard in arrow_shards(split_dir):
        if len(rows) >= n:
            break
        table = ipc.open_file(pa.memory_map(str(shard))).read_all().select(["image_id", "file_name", "image"])
        rows += table.slice(0, n - len(rows)).to_pylist()
    return rows
