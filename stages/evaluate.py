"""Evaluate stage: COCO bbox (and, for mask models, segm) metrics of the trained model on the val split, in
original image coordinates.

``python -m stages.evaluate`` runs ``models/model.pt`` on ``data/cache/val`` (the resized cache), maps the
predicted boxes back to original pixels (``orig = cached / scale + offset``), converts them to COCO results
(``[x, y, w, h]``, ``category_id``, ``score``) and scores them with pycocotools ``COCOeval`` (or
faster-coco-eval, ``evaluate.backend``) against the val ground truth rebuilt from ``data/arrow/val``.

Mask models (Mask R-CNN: ``roi_heads.has_mask()``): each detection's mask probabilities (the model's
``masks`` output, at the cached size) are resampled to the original image size by the same mapping
(`masks_to_rles`), thresholded at 0.5 and RLE-encoded (``pycocotools.mask.encode``); ``COCOeval`` with
``iouType="segm"`` scores them against the val ground truth's polygons / RLE.

Writes ``metrics/eval.json`` (DVC metrics): ``bbox`` (the 12 standard stats: AP, AP50, AP75, APs, APm, APl,
AR1, AR10, AR100, ARs, ARm, ARl), for mask models ``segm`` (the same 12 stats of the masks), ``per_class_AP``
(bbox), ``num_images``, ``num_detections``; for ``dvc plots show``
``plots/pr_curve.json`` (bbox precision-recall at IoU 0.5 and 0.75) and ``plots/per_class_ap.json``; and
``plots/val_images/*.png``: a few val images with predicted (red, score ≥ ``evaluate.plot_score_threshold``;
masks shaded for mask models) and ground-truth (green) boxes.

With ``evaluate.nproc_per_node > 1`` the stage launches ``torchrun`` like the train stage: each rank predicts
images ``rank, rank + world, ...`` of val and rank 0 gathers the detections and scores them.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pycocotools import mask as mask_utils
from torch.utils.data import DataLoader

from stages import params as params_mod
from stages.cocoeval import coco_evaluate, pr_curve_rows
from stages.common import StageError, atomic_dir, atomic_write_bytes, atomic_write_json, run_stage
from stages.data import CachedDetectionDataset, collate, read_meta, uses_masks
from stages.imageio import decode_rgb
from stages.models import build_from_config

log = logging.getLogger("stages.evaluate")

ARROW_DIR = Path("data/arrow")
CACHE_DIR = Path("data/cache")
MODEL = Path("models/model.pt")
METRICS = Path("metrics/eval.json")
PLOTS = Path("plots")
MASK_THRESHOLD = 0.5  # mask probability -> binary, as torchvision's references/detection/coco_eval.py


def gt_from_arrow(split_dir: Path, meta: dict) -> dict:
    """Rebuild a COCO instances dict (images, annotations, categories) from converted Arrow shards.

    Boxes are ``[x, y, w, h]`` original pixels (float32 in Arrow), ``segmentation`` is parsed back from its
    JSON text (omitted when empty), ids are int64.
    Raises:
        StageError: no shards in ``split_dir``.
    """
    shards = sorted(Path(split_dir).glob("*.arrow"))
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


def load_model(path: Path = MODEL, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict]:
    """Rebuild the trained model from ``models/model.pt`` (eval mode). Returns ``(model, checkpoint)``.
    Raises `StageError` if the file is missing."""
    if not Path(path).is_file():
        raise StageError(f"{path}: not found (run the train stage first)")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = build_from_config(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt


def masks_to_rles(masks: torch.Tensor, scale, offset, orig_size, threshold: float = MASK_THRESHOLD) -> list[dict]:
    """Predicted mask probabilities in cached pixels -> COCO compressed RLEs at the original image size.

    The inverse of the cache's resize (`stages.augment`: ``orig = cached / scale + offset``): the centre
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
    for images, targets in loader:
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


def evaluate(cfg: params_mod.Evaluate, arrow_dir: Path = ARROW_DIR, cache_dir: Path = CACHE_DIR,
             model_path: Path = MODEL, metrics_path: Path = METRICS, plots_dir: Path = PLOTS) -> dict | None:
    """Predict on val, score with COCOeval, write ``metrics_path`` and the plots; return the metrics dict
    (on rank 0; None on other ranks of a distributed run).

    Raises:
        StageError: missing inputs; a non-finite stat (never expected from COCOeval).
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # detections are gathered as Python objects: gloo works everywhere
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    meta = read_meta(Path(arrow_dir) / "meta.json")
    model, _ = load_model(model_path, device)
    with_masks = uses_masks(model)
    dataset = CachedDetectionDataset(cache_dir, "val")
    l2c = label_to_category_id(meta)
    dets = predict(model, dataset, l2c, cfg.batch_size, cfg.score_threshold, device,
                   indices=list(range(rank, len(dataset), world)), masks=with_masks)
    if world > 1:
        parts = [None] * world if rank == 0 else None
        dist.gather_object(dets, parts, dst=0)
        dist.destroy_process_group()
        if rank != 0:
            return None
        dets = [d for part in parts for d in part]
    gt = gt_from_arrow(Path(arrow_dir) / "val", meta)
    results = {}
    for iou_type in ("bbox", "segm") if with_masks else ("bbox",):
        result = results[iou_type] = coco_evaluate(gt, dets, iou_type, cfg.backend, gt_source=f"{arrow_dir}/val",
                                                   dt_source=f"predictions of {model_path}")
        log.info("COCOeval %s (%s) on %d images, %d detections:\n%s", iou_type, cfg.backend, result.num_images,
                 result.num_detections, result.summary)
        bad = [k for k, v in result.stats.items() if not math.isfinite(v)]
        if bad:
            raise StageError(f"{metrics_path}: non-finite COCO {iou_type} stats {bad}")
    result = results["bbox"]
    metrics = {"bbox": result.stats, **({"segm": results["segm"].stats} if with_masks else {}),
               "per_class_AP": result.per_class_ap,
               "num_images": result.num_images, "num_detections": result.num_detections}
    write_plots(Path(plots_dir), result, dets, gt, cfg, Path(arrow_dir) / "val")
    atomic_write_json(metrics_path, metrics)
    return metrics


def write_plots(plots_dir: Path, result, dets: list[dict], gt: dict, cfg: params_mod.Evaluate,
                val_dir: Path) -> None:
    """``pr_curve.json`` (IoU 0.5 and 0.75), ``per_class_ap.json`` (classes with ground truth) and
    ``val_images/<image_id>.png`` (the first ``cfg.num_plot_images`` val images, original size, predicted
    boxes red with score ≥ ``cfg.plot_score_threshold`` and their masks shaded red when detections carry a
    ``segmentation``, ground truth green), all replaced atomically."""
    from torchvision.io import encode_png
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

    rows = [{**r, "iou": iou} for iou in (0.5, 0.75) for r in pr_curve_rows(result, iou=iou)]
    atomic_write_json(plots_dir / "pr_curve.json", {"pr_curve": rows})
    per_class = [{"class": name, "AP": ap} for name, ap in result.per_class_ap.items() if ap >= 0]
    atomic_write_json(plots_dir / "per_class_ap.json", {"per_class_ap": per_class})
    arrow_rows = _val_image_rows(val_dir, cfg.num_plot_images)
    by_image_dt: dict[int, list] = {}
    by_image_masks: dict[int, list] = {}
    for d in dets:
        if d["score"] >= cfg.plot_score_threshold:
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
    rows = []
    for shard in sorted(Path(split_dir).glob("*.arrow")):
        if len(rows) >= n:
            break
        table = ipc.open_file(pa.memory_map(str(shard))).read_all().select(["image_id", "file_name", "image"])
        rows += table.slice(0, n - len(rows)).to_pylist()
    return rows


def main() -> None:
    cfg = params_mod.load("evaluate")
    if cfg.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from stages.launch import launch_module

        launch_module(["--standalone", "--nproc-per-node", str(cfg.nproc_per_node), "-m", "stages.evaluate"])
    else:
        evaluate(cfg)


if __name__ == "__main__":
    run_stage(main)
