"""The reference TIDE figures for tests: ``tidecv`` 1.0.1 (Bolya et al., "TIDE: A General Toolbox for Identifying
Object Detection Errors", ECCV 2020; test-only dependency, as pycocotools is for mAP) run on COCO-format ground truth
and detections, and ours (`detpipe.evaluation.error_analysis`) in the same unit, AP points (AP x 100).

tidecv's matching departs from COCOeval's in the ways detpipe/evaluation/error_analysis.py's docstring lists;
`comparable_detections` removes from a detection set what would make them differ (so any remaining difference is the
analysis', not the matching conventions')."""
from __future__ import annotations

from detpipe.evaluation.error_analysis import SPECIAL_ERRORS, TIDE_ERRORS

TIDE_NAMES = {"cls": "Cls", "loc": "Loc", "both": "Both", "dupe": "Dupe", "bkg": "Bkg", "miss": "Miss",
              "FP": "FalsePos", "FN": "FalseNeg"}
"""Our error names -> tidecv's ``short_name``."""


def tidecv_points(gt: dict, dets: list[dict]) -> dict[str, float]:
    """tidecv's bbox AP50 (``"AP50"``) and ΔAP per error type (our names), AP points, at its defaults (foreground
    IoU 0.5, background IoU 0.1, 100 detections per image): ground truth as ``add_ground_truth``, ``iscrowd``
    regions as ``add_ignore_region`` of their class (what ``tidecv.datasets.COCO`` does), detections as
    ``add_detection``."""
    from tidecv import TIDE, Data

    g, p = Data("gt", max_dets=100), Data("dets", max_dets=100)
    for im in gt["images"]:
        g.add_image(im["id"], str(im["id"]))
    for c in gt["categories"]:
        g.add_class(c["id"], c["name"])
    for a in gt["annotations"]:
        if a.get("iscrowd", 0):
            g.add_ignore_region(a["image_id"], a["category_id"], a["bbox"])
        else:
            g.add_ground_truth(a["image_id"], a["category_id"], a["bbox"])
    for d in dets:
        p.add_detection(d["image_id"], d["category_id"], d["score"], d["bbox"])
    run = TIDE(pos_threshold=0.5, background_threshold=0.1, mode=TIDE.BOX).evaluate(g, p)
    out = {"AP50": run.ap}
    out.update({e.short_name: v for e, v in run.fix_main_errors().items()})
    out.update({e.short_name: v for e, v in run.fix_special_errors().items()})
    return {k: float(out[k if k == "AP50" else TIDE_NAMES[k]]) for k in ("AP50", *TIDE_ERRORS, *SPECIAL_ERRORS)}


def ours_points(analysis) -> dict[str, float]:
    """`detpipe.evaluation.error_analysis.ErrorAnalysis`' AP50 and ΔAP in AP points, keyed as `tidecv_points`."""
    return {"AP50": 100 * analysis.ap50, **{k: 100 * v for k, v in analysis.delta_ap50.items()}}


def comparable_detections(gt: dict, dets: list[dict], max_per_image: int = 100) -> list[dict]:
    """``dets`` without what tidecv and COCO count differently: detections of classes with no non-crowd ground truth
    (COCO leaves such classes out of the mean, tidecv averages them in as AP 0) and all but the ``max_per_image``
    highest-scoring detections of each image (tidecv caps per image, COCO per image and class). Input order kept."""
    classes = {a["category_id"] for a in gt["annotations"] if not a.get("iscrowd", 0)}
    by_image: dict[int, list[int]] = {}
    for i, d in enumerate(dets):
        if d["category_id"] in classes:
            by_image.setdefault(d["image_id"], []).append(i)
    keep = set()
    for idx in by_image.values():
        keep.update(sorted(idx, key=lambda i: -dets[i]["score"])[:max_per_image])
    return [d for i, d in enumerate(dets) if i in keep]
