"""The evaluate stage's DVC plots under ``plots/``: precision-recall curves, per-class AP and val images drawn
with predicted and true boxes (`write_plots`); the error analysis' confusion matrix, TIDE error bars and worst val
images (`write_error_plots`, from `detpipe.evaluation.error_analysis`)."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from detpipe.data.imageio import decode_rgb
from detpipe.data.meta import arrow_shards
from detpipe.evaluation.coco_metrics import pr_curve_rows
from detpipe.vis.drawing import add_legend, draw_boxes, draw_masks, encode_png, line_width
from detpipe.evaluation.error_analysis import (SPECIAL_ERRORS, TIDE_ERRORS, ErrorAnalysis, confusion_rows, confusion_table,
                                       worst_images)
from detpipe.core.errors import StageError
from detpipe.core.files import atomic_dir, atomic_write_bytes, atomic_write_json


def write_plots(plots_dir: Path, result, dets: list[dict], gt: dict, val_dir: Path, num_images: int,
                score_threshold: float, errors: ErrorAnalysis | None = None, num_worst_images: int = 0) -> None:
    """``pr_curve.json`` (IoU 0.5 and 0.75), ``per_class_ap.json`` (``{"per_class_ap": [{"class", "AP"}]}``, bbox
    AP@[.5:.95] of the classes with ground truth) and ``val_images/<image_id>.png`` (the first ``num_images``
    val images of the Arrow shards in ``val_dir``, original size, predicted boxes red with score ≥
    ``score_threshold`` and their masks shaded red when detections carry a ``segmentation``, ground truth
    green, 2 pixels wide: `detpipe.vis.drawing`), all replaced atomically.

    Args:
        plots_dir: the plots folder (``plots/``).
        result: the bbox `detpipe.evaluation.coco_metrics.CocoResult`.
        dets: COCO results (`detpipe.evaluation.detections.detect_dataset`), original pixels.
        gt: the COCO instances dict (`detpipe.evaluation.ground_truth.gt_from_arrow`), original pixels.
        val_dir: the val split's Arrow folder (``data/arrow/val``).
        num_images: how many val images to draw.
        score_threshold: the lowest score of a drawn prediction.
        errors, num_worst_images: the error analysis of the same detections (`detpipe.evaluation.error_analysis.analyze`)
            and how many worst images to draw: `write_error_plots` (None: no error plots).
    Raises:
        StageError: an image of the shards cannot be decoded (`detpipe.data.imageio.decode_rgb`).
    """
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
            atomic_write_bytes(tmp / f"{row['image_id']}.png", encode_png(image))
    if errors is not None:
        write_error_plots(plots_dir, errors, val_dir, num_worst_images)


# Colours of the worst-image drawings (legend text in brackets).
WORST_IMAGE_COLORS = {"true positive": "lime", "false positive (class score)": "red",
                      "missed (true class)": "yellow", "wrong class (predicted/true)": "magenta"}


def write_error_plots(plots_dir: Path, analysis: ErrorAnalysis, val_dir: Path, num_worst: int) -> None:
    """The error analysis' plots, each replaced atomically:

    * ``confusion.json``: `detpipe.evaluation.error_analysis.confusion_rows` (``{"confusion": [{"actual", "predicted"}]}``,
      one row per count, for DVC's ``confusion`` template);
    * ``confusion_counts.json``: `detpipe.evaluation.error_analysis.confusion_table` (counts and row-normalized);
    * ``errors.json``: ``{"errors": [{"error": type, "dAP50": ΔAP50}]}`` for the six TIDE types then FP, FN (a bar
      plot; fractions of 1 like ``bbox.AP50``);
    * ``worst_images/<rank>_<image_id>.png``: `detpipe.evaluation.error_analysis.worst_images`' ``num_worst`` images (rank
      from 1, zero-padded so names sort), original size, boxes in `WORST_IMAGE_COLORS` with a legend strip below.

    Args:
        plots_dir: the plots folder (``plots/``).
        analysis: `detpipe.evaluation.error_analysis.analyze`'s result on the val split.
        val_dir: the val split's Arrow folder (``data/arrow/val``), where the images are read.
        num_worst: how many worst images to draw (fewer when fewer images have errors).
    Raises:
        StageError: an image cannot be decoded (`detpipe.data.imageio.decode_rgb`), or a worst image is not in the
            shards of ``val_dir``.
    """
    atomic_write_json(plots_dir / "confusion.json", {"confusion": confusion_rows(analysis)})
    atomic_write_json(plots_dir / "confusion_counts.json", confusion_table(analysis))
    atomic_write_json(plots_dir / "errors.json", {"errors": [{"error": k, "dAP50": round(analysis.delta_ap50[k], 6)}
                                                             for k in (*TIDE_ERRORS, *SPECIAL_ERRORS)]})
    worst = worst_images(analysis, num_worst)
    rows = _val_image_rows_by_id(val_dir, [im.image_id for im in worst])
    dets, gts = analysis.detections, analysis.ground_truth
    cat_name = dict(zip(analysis.category_ids, analysis.classes))
    digits = len(str(len(worst)))
    colors = list(WORST_IMAGE_COLORS.values())
    with atomic_dir(plots_dir / "worst_images") as tmp:
        for rank, im in enumerate(worst, start=1):
            row = rows.get(im.image_id)
            if row is None:
                raise StageError(f"{val_dir}: image_id {im.image_id} of the ground truth is not in the split's shards "
                                 f"(rule: the val ground truth is rebuilt from these shards)")
            image = torch.from_numpy(decode_rgb(row["image"], row["file_name"])).permute(2, 0, 1).contiguous()
            width = line_width(image.shape[1:])
            layers = [
                ([gts[g]["bbox"] for g in im.missed], [f"{cat_name[gts[g]['category_id']]}" for g in im.missed], colors[2]),
                ([dets[d]["bbox"] for d, _ in im.true_positives],
                 [f"{cat_name[dets[d]['category_id']]} {dets[d]['score']:.2f}" for d, _ in im.true_positives], colors[0]),
                ([dets[d]["bbox"] for d, _ in im.wrong_class],
                 [f"{cat_name[dets[d]['category_id']]} {dets[d]['score']:.2f}/{cat_name[gts[g]['category_id']]}"
                  for d, g in im.wrong_class], colors[3]),
                ([dets[d]["bbox"] for d in im.false_positives],
                 [f"{cat_name[dets[d]['category_id']]} {dets[d]['score']:.2f}" for d in im.false_positives], colors[1]),
            ]
            for boxes, labels, color in layers:
                image = draw_boxes(image, boxes, color, width, labels)
            image = add_legend(image, list(WORST_IMAGE_COLORS.items()))
            atomic_write_bytes(tmp / f"{rank:0{digits}d}_{im.image_id}.png", encode_png(image))


def _val_image_rows_by_id(split_dir: Path, image_ids: list[int]) -> dict[int, dict]:
    """image_id -> row (``image_id``, ``file_name``, ``image``) of the split's shards, for ``image_ids`` only."""
    wanted, rows = set(image_ids), {}
    if not wanted:
        return rows
    import pyarrow.compute as pc

    for shard in arrow_shards(split_dir):
        table = ipc.open_file(pa.memory_map(str(shard))).read_all().select(["image_id", "file_name", "image"])
        hit = table.filter(pc.is_in(table["image_id"], value_set=pa.array(sorted(wanted), type=table["image_id"].type)))
        rows.update((r["image_id"], r) for r in hit.to_pylist())
    return rows


def _val_image_rows(split_dir: Path, n: int) -> list[dict]:
    """The first ``n`` rows (``image_id``, ``file_name``, ``image``) of the split's shards, in order."""
    rows = []
    for shard in arrow_shards(split_dir):
        if len(rows) >= n:
            break
        table = ipc.open_file(pa.memory_map(str(shard))).read_all().select(["image_id", "file_name", "image"])
        rows += table.slice(0, n - len(rows)).to_pylist()
    return rows
