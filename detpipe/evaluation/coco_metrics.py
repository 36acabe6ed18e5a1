"""COCO detection metrics (AP, AR, per-class AP, precision-recall curves) from in-memory COCO dicts.

A thin, validated wrapper around the reference COCO API (``pycocotools.cocoeval.COCOeval``, Lin et al.,
https://github.com/cocodataset/cocoapi) and its C++ re-implementation ``faster_coco_eval.COCOeval_faster``
(https://github.com/MiXaiLL76/faster_coco_eval). Both give the same numbers (tested to 1e-9 on the COCO API's
own example detections); ``faster_coco_eval`` is several times faster on thousands of images.

Used by the evaluate stage; not a stage itself. Inputs are checked first so that bad data gives a one-line
`StageError` naming the record and the rule instead of an assertion or ``KeyError`` deep inside the COCO API.

Conventions (all taken from the COCO API, ``cocoeval.py``):

* boxes are COCO ``[x, y, w, h]`` in pixels; IoU thresholds 0.50:0.05:0.95 (T=10), 101 recall thresholds
  0:0.01:1 (R=101), area ranges all / small (< 32^2 px^2) / medium (32^2..96^2) / large (> 96^2) (A=4),
  maxDets 1 / 10 / 100 (M=3);
* a metric with no ground truth to measure against is ``-1`` (e.g. APs when there is no small object);
* ``iscrowd=1`` ground truth is an ignore region: detections matched to it count neither as true nor as false
  positives, and it is never a miss.
"""
from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass, field

import numpy as np

from detpipe.data.coco_schema import (COCO_ARRAYS, array_problem, is_crowd_flag, is_finite_number, is_int,
                                      segmentation_area, segmentation_problem, to_rle)
from detpipe.core.errors import StageError

STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
"""Names of the 12 numbers of ``COCOeval.stats``, in its order (pycocotools ``COCOeval.summarize``)."""

BACKENDS = ("pycocotools", "faster_coco_eval")
IOU_TYPES = ("bbox", "segm")


@dataclass
class CocoResult:
    """Result of `coco_evaluate`.

    Attributes:
        stats: the 12 standard ``COCOeval.stats`` keyed by `STAT_NAMES` (Python floats in [0, 1], or ``-1.0``
            where COCO gives -1: no ground truth in that area range / no category with ground truth).
        per_class_ap: category name -> AP@[.50:.95] (area all, maxDets 100), the mean of
            ``precision[:, :, k, 0, 2]``; ``-1.0`` for a category with no (non-crowd) ground truth among the
            evaluated images (COCO's convention; such categories do not enter ``stats["AP"]``). ``0.0`` means
            ground truth exists but nothing was found.
        precision: ``COCOeval.eval["precision"]``, shape ``[T=10, R=101, K, A=4, M=3]``, float64: interpolated
            precision at IoU threshold t, recall threshold r, category k, area range a, maxDets m; -1 where the
            category has no ground truth in that area range.
        recall_thresholds: shape ``[R=101]`` float64, 0.00, 0.01, ..., 1.00.
        category_ids: the K category ids in the order of ``precision``'s K axis (ascending).
        num_images: images evaluated (all of ``gt["images"]``, with or without ground truth).
        num_detections: detections evaluated (``len(detections)``).
        backend: the COCO API that computed it, ``"pycocotools"`` or ``"faster_coco_eval"`` (`coco_evaluate`'s
            ``backend``; no default here, so it cannot disagree with `coco_evaluate`'s).
        recall: ``COCOeval.eval["recall"]``, shape ``[T=10, K, A=4, M=3]``, float64, -1 as for precision.
        iou_thresholds: shape ``[T=10]`` float64, 0.50, 0.55, ..., 0.95.
        summary: the COCO API's 12-line printed summary (for logs).
        iou_type: ``"bbox"`` or ``"segm"``.
        seconds: wall time of the COCO API's evaluate + accumulate + summarize, in seconds.
        dataset, results: the validated ground truth and detections handed to the COCO API (`validated_inputs`), for
            analyses that must see the same records (`detpipe.evaluation.error_analysis.analyze_validated`).
    """

    stats: dict[str, float]
    per_class_ap: dict[str, float]
    precision: np.ndarray
    recall_thresholds: np.ndarray
    category_ids: list[int]
    num_images: int
    num_detections: int
    backend: str
    recall: np.ndarray = field(default_factory=lambda: np.zeros((10, 0, 4, 3)))
    iou_thresholds: np.ndarray = field(default_factory=lambda: np.linspace(0.5, 0.95, 10))
    summary: str = ""
    iou_type: str = "bbox"
    seconds: float = 0.0
    dataset: dict = field(default_factory=dict, repr=False)
    results: list = field(default_factory=list, repr=False)


# ----------------------------------------------------------------------------------------------- checks


def _referenced_image(rec: dict, images: dict, cat_ids, where: str, what: tuple[str, str], rule: str) -> dict:
    """The image record ``rec["image_id"]`` names, after checking it and ``rec["category_id"]`` exist.
    Raises `StageError` ``<where>: image_id X <what[0]> (rule: ...)`` (or the category's, with ``what[1]``)."""
    iid = rec.get("image_id")
    img = images.get(iid) if is_int(iid) else None
    if img is None:
        raise StageError(f"{where}: image_id {iid!r} {what[0]} (rule: {rule.format('image_id')})")
    cid = rec.get("category_id")
    if not is_int(cid) or int(cid) not in cat_ids:
        raise StageError(f"{where}: category_id {cid!r} {what[1]} (rule: {rule.format('category_id')})")
    return img

def _check_box(bbox) -> str | None:
    """Return why ``bbox`` is not a COCO box ``[x, y, w, h]`` (4 finite numbers, w, h >= 0), or None."""
    if not isinstance(bbox, (list, tuple, np.ndarray)) or len(bbox) != 4:
        return f"bbox {bbox!r} is not 4 numbers [x, y, w, h]"
    if not all(is_finite_number(v) for v in bbox):
        return f"bbox {list(bbox)!r} has a value that is not a finite number"
    if bbox[2] < 0 or bbox[3] < 0:
        return f"bbox {list(bbox)!r} has a negative width or height"
    return None


def _check_segm(segm, img: dict) -> str | None:
    """Return why ``segm`` is not a usable COCO segmentation for image ``img``, or None: the convert stage's
    definition (`detpipe.data.coco_schema.segmentation_problem`: polygons of >= 3 finite points, RLE of the image's
    size whose runs cover it exactly), and not empty."""
    if isinstance(segm, list) and not segm:
        return "segmentation polygons must be a non-empty list of [x1, y1, x2, y2, ...] with >= 3 points"
    why = segmentation_problem(segm, img["height"], img["width"])
    return None if why is None else f"segmentation {why}"


def _prepare_gt(gt: dict, iou_type: str, src: str, mask_utils) -> tuple[dict, dict]:
    """Validate ``gt`` and build the dataset dict handed to the COCO API (fresh dicts: the input is never
    modified). Returns (dataset, images by id)."""
    if not isinstance(gt, dict):
        raise StageError(f"{src}: not a COCO instances dict (got {type(gt).__name__})")
    for key in COCO_ARRAYS:
        if array_problem(gt, key) is not None:
            raise StageError(f"{src}: key '{key}' missing or not a list (rule: a COCO instances dict has "
                             f"'images', 'annotations' and 'categories' lists)")
    if not gt["images"]:
        raise StageError(f"{src}: 'images' is empty (rule: nothing to evaluate without images)")
    if not gt["categories"]:
        raise StageError(f"{src}: 'categories' is empty (rule: COCO evaluation needs at least one category)")

    images: dict[int, dict] = {}
    for i, im in enumerate(gt["images"]):
        iid = im.get("id") if isinstance(im, dict) else None
        if not is_int(iid):
            raise StageError(f"{src}: images[{i}]: id {iid!r} is not an integer (rule: image ids are integers)")
        iid = int(iid)
        if iid in images:
            raise StageError(f"{src}: image id {iid} appears twice (rule: image ids are unique)")
        rec = {"id": iid}
        for k in ("height", "width"):
            if k in im:
                if not is_int(im[k]) or im[k] <= 0:
                    raise StageError(f"{src}: image id {iid}: {k} {im[k]!r} is not a positive integer")
                rec[k] = int(im[k])
            elif iou_type == "segm":
                raise StageError(f"{src}: image id {iid}: no '{k}' (rule: segm evaluation needs image sizes)")
        images[iid] = rec

    cats: dict[int, dict] = {}
    names: set[str] = set()
    for i, c in enumerate(gt["categories"]):
        cid = c.get("id") if isinstance(c, dict) else None
        if not is_int(cid):
            raise StageError(f"{src}: categories[{i}]: id {cid!r} is not an integer")
        cid = int(cid)
        name = c.get("name")
        if not isinstance(name, str) or not name:
            raise StageError(f"{src}: category id {cid}: name {name!r} is not a non-empty string")
        if cid in cats:
            raise StageError(f"{src}: category id {cid} appears twice (rule: category ids are unique)")
        if name in names:
            raise StageError(f"{src}: category id {cid}: name {name!r} is used twice (rule: category names "
                             f"are unique, per-class AP is keyed by name)")
        names.add(name)
        cats[cid] = {"id": cid, "name": name, "supercategory": c.get("supercategory", "")}

    anns = []
    for i, a in enumerate(gt["annotations"]):
        if not isinstance(a, dict):
            raise StageError(f"{src}: annotations[{i}] is not a dict")
        rec_name = f"annotation id {a['id']}" if "id" in a else f"annotations[{i}]"
        img = _referenced_image(a, images, cats, f"{src}: {rec_name}", ("is not in 'images'", "is not in 'categories'"),
                                "every annotation's {} is listed in the dataset")
        if (why := _check_box(a.get("bbox"))) is not None:
            raise StageError(f"{src}: {rec_name}: {why}")
        crowd = a.get("iscrowd", 0)
        if not is_crowd_flag(crowd):
            raise StageError(f"{src}: {rec_name}: iscrowd {crowd!r} is not 0 or 1")
        bbox = [float(v) for v in a["bbox"]]
        rec = {"id": len(anns) + 1, "image_id": img["id"], "category_id": int(a["category_id"]), "bbox": bbox,
               "iscrowd": int(crowd)}
        if iou_type == "segm":
            segm = a.get("segmentation")
            if segm is None or (why := _check_segm(segm, img)) is not None:
                raise StageError(f"{src}: {rec_name}: {why or 'no segmentation'} "
                                 f"(rule: segm evaluation needs a mask for every ground-truth object)")
            rec["segmentation"] = segm
        area = a.get("area")
        if area is None:    # the convert stage's rule (`segmentation_area`: COCO's own), else the box's
            seg_area = segmentation_area(rec["segmentation"], img["height"], img["width"]) if iou_type == "segm" \
                else None
            area = seg_area if seg_area is not None else bbox[2] * bbox[3]
        elif not is_finite_number(area) or area < 0:
            raise StageError(f"{src}: {rec_name}: area {area!r} is not a non-negative number")
        rec["area"] = float(area)
        anns.append(rec)

    dataset = {"info": {}, "licenses": [], "images": list(images.values()), "annotations": anns,
               "categories": list(cats.values())}
    return dataset, images


def _prepare_dt(detections: list, iou_type: str, images: dict, cat_ids: set, src: str, mask_utils) -> list:
    """Validate detections and build the result annotations as pycocotools ``COCO.loadRes`` would
    (``id`` 1..N in input order, ``iscrowd`` 0, ``area`` w*h for bbox or mask area for segm)."""
    if not isinstance(detections, (list, tuple)):
        raise StageError(f"{src}: detections must be a list of dicts (got {type(detections).__name__})")
    out = []
    for i, d in enumerate(detections):
        if not isinstance(d, dict):
            raise StageError(f"{src}: detection {i}: not a dict")
        img = _referenced_image(d, images, cat_ids, f"{src}: detection {i}",
                                ("is not an image of the ground truth", "is not a category of the ground truth"),
                                "every detection's {} must be in the ground truth")
        score = d.get("score")
        if not is_finite_number(score):
            raise StageError(f"{src}: detection {i}: score {score!r} is not a finite number")
        rec = {"id": i + 1, "image_id": img["id"], "category_id": int(d["category_id"]), "score": float(score), "iscrowd": 0}
        if iou_type == "bbox":
            if (why := _check_box(d.get("bbox"))) is not None:
                raise StageError(f"{src}: detection {i}: {why} (rule: bbox detections carry a COCO [x, y, w, h] box)")
            rec["bbox"] = [float(v) for v in d["bbox"]]
            rec["area"] = rec["bbox"][2] * rec["bbox"][3]
        else:
            segm = d.get("segmentation")
            if segm is None or (why := _check_segm(segm, img)) is not None:
                raise StageError(f"{src}: detection {i}: {why or 'no segmentation'} "
                                 f"(rule: segm detections carry a mask of their image's size)")
            rle = to_rle(segm, img["height"], img["width"])
            rec["segmentation"] = rle
            if "bbox" in d:
                if (why := _check_box(d["bbox"])) is not None:
                    raise StageError(f"{src}: detection {i}: {why}")
                rec["bbox"] = [float(v) for v in d["bbox"]]
        out.append(rec)
    if iou_type == "segm" and out:
        rles = [r["segmentation"] for r in out]
        # pycocotools 2.0.11 + numpy 2: mask.area() of a list of more than 255 RLEs raises OverflowError
        # (it sizes its output with np.array((n,), dtype=uint8)), so measure in chunks of 255.
        areas = np.concatenate([mask_utils.area(rles[j:j + 255]) for j in range(0, len(rles), 255)])
        boxes = mask_utils.toBbox(rles)
        for r, a, b in zip(out, areas, boxes):
            r["area"] = float(a)
            r.setdefault("bbox", [float(v) for v in b])
    return out


def validated_inputs(gt: dict, detections: list[dict], iou_type: str = "bbox", *, gt_source: str = "ground truth",
                     dt_source: str = "detections") -> tuple[dict, list[dict]]:
    """The ground truth and detections exactly as `coco_evaluate` hands them to the COCO API, after the same checks:
    ``(dataset, results)``, ``dataset`` a fresh COCO instances dict (annotation ids renumbered 1..N in input order,
    ``iscrowd`` 0/1, ``area`` filled in), ``results`` the detections as ``COCO.loadRes`` would make them (``id``
    1..N in input order, ``bbox`` floats). Used by `detpipe.evaluation.error_analysis` so that its matching sees the same
    records as COCOeval.

    Raises:
        ValueError: unknown ``iou_type``.
        StageError: as `coco_evaluate` (names the record and the rule).
    """
    if iou_type not in IOU_TYPES:
        raise ValueError(f"iou_type must be one of {IOU_TYPES}, got {iou_type!r}")
    from pycocotools import mask as mask_utils

    dataset, images = _prepare_gt(gt, iou_type, gt_source, mask_utils)
    dets = _prepare_dt(detections, iou_type, images, {c["id"] for c in dataset["categories"]}, dt_source, mask_utils)
    return dataset, dets


# ----------------------------------------------------------------------------------------------- evaluation


def _run_pycocotools(dataset: dict, dets: list, iou_type: str):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = dataset
        coco_gt.createIndex()
        coco_dt = COCO()  # built directly: COCO.loadRes crashes on an empty result list
        coco_dt.dataset = {"images": dataset["images"], "categories": dataset["categories"], "annotations": dets}
        coco_dt.createIndex()
        ev = COCOeval(coco_gt, coco_dt, iou_type)
        t0 = time.perf_counter()
        ev.evaluate()
        ev.accumulate()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ev.summarize()
    return ev, buf.getvalue(), time.perf_counter() - t0


def _run_faster(dataset: dict, dets: list, iou_type: str):
    from faster_coco_eval import COCO, COCOeval_faster

    quiet = lambda *args, **kwargs: None  # noqa: E731
    coco_gt = COCO(print_function=quiet)
    coco_gt.dataset = dataset
    coco_gt.createIndex()
    coco_dt = COCO(print_function=quiet)
    coco_dt.dataset = {"images": dataset["images"], "categories": dataset["categories"], "annotations": dets}
    coco_dt.createIndex()
    ev = COCOeval_faster(coco_gt, coco_dt, iou_type, print_function=quiet)
    t0 = time.perf_counter()
    ev.evaluate()
    ev.accumulate()
    lines: list[str] = []
    ev.print_function = lambda *args, **kwargs: lines.append(" ".join(str(a) for a in args))
    ev.summarize()
    # faster_coco_eval prints two more lines (AR at IoU .50 and .75); keep the 12 standard ones.
    return ev, "".join(line + "\n" for line in lines[: len(STAT_NAMES)]), time.perf_counter() - t0


def coco_evaluate(gt: dict, detections: list[dict], iou_type: str = "bbox", backend: str = "faster_coco_eval", *,
                  gt_source: str = "ground truth", dt_source: str = "detections") -> CocoResult:
    """Evaluate detections against COCO ground truth with the COCO API (``COCOeval``), in memory.

    Args:
        gt: COCO instances dict: ``images`` (``id``; ``height``/``width`` required for segm),
            ``annotations`` (``image_id``, ``category_id``, ``bbox`` [x, y, w, h] pixels, optional ``area``
            pixels^2, optional ``iscrowd`` (default 0), ``segmentation`` for segm) and ``categories`` (``id``,
            unique ``name``); ``info``/``licenses`` are optional. Ids may be any integers (int64 included).
            A missing ``area`` is computed as ``w * h`` of the box for bbox evaluation (official COCO ``area``
            is the mask area, so small/medium/large may differ slightly for such data) and as the mask's pixel
            count for segm. Annotation ids are renumbered 1..N internally (the COCO API uses them as match
            markers, so an id 0 or a duplicate id would silently corrupt results).
        detections: COCO result dicts: ``image_id``, ``category_id``, ``score``, and ``bbox`` [x, y, w, h]
            pixels (bbox) or ``segmentation`` (segm: compressed RLE as from ``pycocotools.mask.encode``, size
            [height, width] of its image; uncompressed RLE and polygons are converted). May be empty (AP is
            then 0 for every category with ground truth). Neither argument is modified.
        iou_type: ``"bbox"`` or ``"segm"``.
        backend: ``"faster_coco_eval"`` (default: C++, several times faster, the same numbers: tests/unit/test_coco_metrics.py
            checks both against the COCO API's published figures and each other) or ``"pycocotools"`` (reference).
        gt_source, dt_source: names (e.g. file paths) used to prefix error messages.
    Returns:
        `CocoResult` (stats, per-class AP, the precision array [T=10, R=101, K, A=4, M=3] float64, ...).
    Raises:
        ValueError: unknown ``iou_type`` or ``backend``.
        StageError: malformed ground truth (names the image / category / annotation id and the rule) or a
            malformed detection, e.g. an ``image_id`` or ``category_id`` not in ``gt`` (names the detection's
            index in ``detections`` and the rule).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    dataset, dets = validated_inputs(gt, detections, iou_type, gt_source=gt_source, dt_source=dt_source)
    images = dataset["images"]

    run = _run_pycocotools if backend == "pycocotools" else _run_faster
    ev, summary, seconds = run(dataset, dets, iou_type)

    precision = np.asarray(ev.eval["precision"], dtype=np.float64)
    recall = np.asarray(ev.eval["recall"], dtype=np.float64)
    params = ev.params
    category_ids = [int(c) for c in params.catIds]
    m100 = list(params.maxDets).index(100)
    names = {c["id"]: c["name"] for c in dataset["categories"]}
    per_class = {}
    for k, cid in enumerate(category_ids):
        p = precision[:, :, k, 0, m100]
        valid = p[p > -1]
        per_class[names[cid]] = float(valid.mean()) if valid.size else -1.0
    stats = np.asarray(ev.stats, dtype=np.float64)[: len(STAT_NAMES)]
    return CocoResult(
        stats={n: float(v) for n, v in zip(STAT_NAMES, stats)},
        per_class_ap=per_class,
        precision=precision,
        recall_thresholds=np.asarray(params.recThrs, dtype=np.float64),
        category_ids=category_ids,
        num_images=len(images),
        num_detections=len(dets),
        recall=recall,
        iou_thresholds=np.asarray(params.iouThrs, dtype=np.float64),
        summary=summary,
        iou_type=iou_type,
        backend=backend,
        seconds=seconds,
        dataset=dataset,
        results=dets,
    )


def pr_curve_rows(result: CocoResult, iou: float = 0.5) -> list[dict]:
    """Precision-recall curve at one IoU threshold, for DVC plots (``x: recall, y: precision``).

    The COCO API's interpolated precision at each of the 101 recall thresholds,
    ``result.precision[t, :, k, 0, 2]`` (area all, maxDets 100), averaged over the categories that have ground
    truth (those whose entries are not -1) -- the curve whose mean over recall is AP at that IoU (e.g.
    ``stats["AP50"]`` for ``iou=0.5``). A recall level no detection reaches has precision 0.

    Args:
        result: a `CocoResult`.
        iou: IoU threshold; must be one of ``result.iou_thresholds`` (0.50, 0.55, ..., 0.95).
    Returns:
        101 dicts ``{"recall": r, "precision": p}`` (floats in [0, 1], r = 0.00, 0.01, ..., 1.00, rounded to
        6 decimals), or ``[]`` when no category has ground truth.
    Raises:
        ValueError: ``iou`` is not one of the evaluated thresholds.
    """
    hits = np.flatnonzero(np.isclose(result.iou_thresholds, iou, rtol=0, atol=1e-9))
    if hits.size == 0:
        raise ValueError(f"iou {iou} is not an evaluated threshold {[round(t, 2) for t in result.iou_thresholds]}")
    prec = result.precision[int(hits[0]), :, :, 0, -1]  # [R, K]
    with_gt = (prec > -1).all(axis=0)
    if not with_gt.any():
        return []
    mean = prec[:, with_gt].mean(axis=1)
    return [{"recall": round(float(r), 6), "precision": round(float(p), 6)}
            for r, p in zip(result.recall_thresholds, mean)]
