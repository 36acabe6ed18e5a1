"""Evaluating the trained model: COCO bbox (and, for mask models, segm) metrics on the val split, in original image
coordinates: the evaluate stage's work (`evaluate`; ``python -m stages.evaluate`` calls `evaluate_or_launch`).

`evaluate` runs ``models/model.pt`` on ``data/cache/val`` (the resized cache), maps the predicted boxes back to
original pixels (``orig = cached / scale + offset``) and converts them to COCO results (``[x, y, w, h]``,
``category_id``, ``score``): `detpipe.evaluation.detections.detect_dataset`; then scores them with faster-coco-eval's
``COCOeval_faster`` (or pycocotools, ``evaluate.backend``) against the val ground truth rebuilt from
``data/arrow/val`` (`detpipe.evaluation.ground_truth.gt_from_arrow`).

Mask models (Mask R-CNN: ``roi_heads.has_mask()``): each detection's mask probabilities (the model's
``masks`` output, at the cached size) are resampled to the original image size by the same mapping
(`detpipe.evaluation.detections.masks_to_rles`), thresholded at 0.5 and RLE-encoded (``pycocotools.mask.encode``);
``COCOeval`` with ``iouType="segm"`` scores them against the val ground truth's polygons / RLE.

Writes ``metrics/eval.json`` (DVC metrics, the headline figures `dvc exp show` lists): ``bbox`` (the 12
standard stats: AP, AP50, AP75, APs, APm, APl, AR1, AR10, AR100, ARs, ARm, ARl), for mask models ``segm`` (the same
12 stats of the masks), ``num_images``, ``num_detections``; for ``dvc plots show``
(`detpipe.evaluation.plots.write_plots`) ``plots/pr_curve.json`` (bbox precision-recall at IoU 0.5 and 0.75) and
``plots/per_class_ap.json`` (bbox AP per class with ground truth: kept out of the metrics file so experiment tables
stay narrow); and ``plots/val_images/*.png``: a few val images with predicted (red, score ≥
``evaluate.plot_score_threshold``; masks shaded for mask models) and ground-truth (green) boxes
(`detpipe.vis.drawing`).

Error analysis (`detpipe.evaluation.error_analysis`, bbox only: for mask models the boxes of the same detections are
analysed, not the masks), from COCOeval's own matching at IoU 0.5 (its base AP50 must equal COCOeval's): the TIDE
ΔAP50 per error type in ``metrics/eval.json`` under ``errors`` (``AP50``, ``cls``, ``loc``, ``both``, ``dupe``,
``bkg``, ``miss``, ``FP``, ``FN``) and ``plots/errors.json``; the confusion matrix (``plots/confusion.json``,
``plots/confusion_counts.json``) and ``plots/worst_images/`` (the ``evaluate.num_worst_images`` val images with the
most errors), both at score ≥ ``evaluate.plot_score_threshold``
(`detpipe.evaluation.plots.write_error_plots`).

With ``evaluate.nproc_per_node > 1`` `evaluate_or_launch` launches ``torchrun`` like the train stage: each rank predicts
images ``rank, rank + world, ...`` of val and rank 0 gathers the detections and scores them.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch.distributed as dist

from detpipe import params as params_mod
from detpipe.evaluation.coco_metrics import coco_evaluate
from detpipe.core.errors import StageError
from detpipe.core.files import atomic_write_json
from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.meta import read_meta
from detpipe.core.distributed import setup_distributed
from detpipe.evaluation.detections import detect_dataset, label_to_category_id
from detpipe.evaluation.error_analysis import analyze_validated, error_metrics
from detpipe.evaluation.ground_truth import gt_from_arrow
from detpipe.evaluation.plots import write_plots
from detpipe.launch.stage import LaunchParams, run_stage
from detpipe.models import load_model, uses_masks
from detpipe.core.paths import ARROW_DIR, CACHE_DIR, METRICS, MODEL, PLOTS

log = logging.getLogger(__name__)


def evaluate(cfg: params_mod.Evaluate, arrow_dir: Path = ARROW_DIR, cache_dir: Path = CACHE_DIR,
             model_path: Path = MODEL, metrics_path: Path = METRICS, plots_dir: Path = PLOTS) -> dict | None:
    """Predict on val, score with COCOeval, write ``metrics_path`` and the plots; return the metrics dict
    (on rank 0; None on other ranks of a distributed run). Run by every rank of a torchrun launch.

    Args:
        cfg: params section ``evaluate``.
        arrow_dir, cache_dir: the converted data (val ground truth) and the augmentation cache (val images).
        model_path: the trained model (``models/model.pt``).
        metrics_path, plots_dir: where the metrics JSON and the plots go (each written atomically).
    Returns:
        ``{"bbox": {stat: value}, ["segm": {...},] "num_images": int, "num_detections": int, "errors": {type:
        ΔAP50}}``, or None.
    Raises:
        StageError: missing inputs; a non-finite stat (never expected from COCOeval); the error analysis' AP50 not
            COCOeval's (never expected).
    """
    # detections are gathered as Python objects: gloo works everywhere
    rank, world, _, device = setup_distributed(backend="gloo")
    meta = read_meta(Path(arrow_dir) / "meta.json")
    model, _ = load_model(model_path, device)
    with_masks = uses_masks(model)
    dataset = CachedDetectionDataset(cache_dir, "val")
    l2c = label_to_category_id(meta)
    dets = detect_dataset(model, dataset, l2c, cfg.batch_size, cfg.score_threshold, device,
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
    analysis = analyze_validated(result.dataset, result.results, cfg.plot_score_threshold)
    if abs(analysis.ap50 - result.stats["AP50"]) > 1e-6:   # the same matches: never expected
        raise StageError(f"{metrics_path}: the error analysis' AP50 {analysis.ap50:.9f} is not COCOeval's "
                         f"{result.stats['AP50']:.9f} (rule: the analysis replays COCOeval's matching at IoU 0.5)")
    log.info("TIDE errors (dAP50, bbox): %s", ", ".join(f"{k} {v:.4f}" for k, v in analysis.delta_ap50.items()))
    metrics = {"bbox": result.stats, **({"segm": results["segm"].stats} if with_masks else {}),
               "num_images": result.num_images, "num_detections": result.num_detections,
               "errors": error_metrics(analysis)}
    write_plots(Path(plots_dir), result, dets, gt, Path(arrow_dir) / "val", cfg.num_plot_images,
                cfg.plot_score_threshold, analysis, cfg.num_worst_images)
    atomic_write_json(metrics_path, metrics)
    return metrics


def evaluate_or_launch(cfg: params_mod.Evaluate, module: str) -> dict | None:
    """The evaluate stage (`detpipe.launch.stage.run_stage`): `evaluate` here, or with ``cfg.nproc_per_node > 1``
    (outside a torchrun worker) launch ``python -m <module>`` under torchrun on this node, one worker per process
    (`detpipe.launch.stage.LaunchParams.of_evaluate`: no restarts), each running `evaluate`.

    Args:
        cfg: params section ``evaluate``.
        module: the module torchrun runs (``"stages.evaluate"``), which must call this function again.
    Returns:
        the metrics dict on rank 0 of a run here, else None.
    Raises:
        StageError: as `evaluate`; a failed worker.
    """
    return run_stage(module, LaunchParams.of_evaluate(cfg), lambda: evaluate(cfg), in_process=cfg.nproc_per_node == 1)
