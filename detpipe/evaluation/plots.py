"""The evaluate stage's DVC plots (`write_plots`): precision-recall curves, per-class AP and val images drawn
with predicted and true boxes, under ``plots/``."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from detpipe.data.imageio import decode_rgb
from detpipe.data.meta import arrow_shards
from detpipe.evaluation.coco_metrics import pr_curve_rows
from detpipe.evaluation.drawing import draw_boxes, draw_masks
from detpipe.files import atomic_dir, atomic_write_bytes, atomic_write_json


def write_plots(plots_dir: Path, result, dets: list[dict], gt: dict, val_dir: Path, num_images: int,
                score_threshold: float) -> None:
    """``pr_curve.json`` (IoU 0.5 and 0.75), ``per_class_ap.json`` (``{"per_class_ap": [{"class", "AP"}]}``, bbox
    AP@[.5:.95] of the classes with ground truth) and ``val_images/<image_id>.png`` (the first ``num_images``
    val images of the Arrow shards in ``val_dir``, original size, predicted boxes red with score ≥
    ``score_threshold`` and their masks shaded red when detections carry a ``segmentation``, ground truth
    green, 2 pixels wide: `detpipe.evaluation.drawing`), all replaced atomically.

    Args:
        plots_dir: the plots folder (``plots/``).
        result: the bbox `detpipe.evaluation.coco_metrics.CocoResult`.
        dets: COCO results (`detpipe.evaluation.detections.detect_dataset`), original pixels.
        gt: the COCO instances dict (`detpipe.evaluation.ground_truth.gt_from_arrow`), original pixels.
        val_dir: the val split's Arrow folder (``data/arrow/val``).
        num_images: how many val images to draw.
        score_threshold: the lowest score of a drawn prediction.
    Raises:
        StageError: an image of the shards cannot be decoded (`detpipe.data.imageio.decode_rgb`).
    """
    from torchvision.io import encode_png

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
            image = draw_masks(image, by_image_masks.get(row["image_id"], []), "red")
            image = draw_boxes(image, by_image_gt.get(row["image_id"], []), "green")
            image = draw_boxes(image, by_image_dt.get(row["image_id"], []), "red")
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
