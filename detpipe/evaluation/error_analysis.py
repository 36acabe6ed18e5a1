"""Error analysis of bbox detections: what kind of mistakes the detector makes, from the COCO API's own matching.

Three views, all computed by `analyze` from the ground truth and detections the evaluate stage scores with COCOeval
(`detpipe.evaluation.coco_metrics`), and written by `detpipe.evaluation.plots.write_error_plots`:

* the **TIDE error breakdown** (Bolya, Foley, Hays, Hoffman, "TIDE: A General Toolbox for Identifying Object Detection
  Errors", ECCV 2020, https://arxiv.org/abs/2008.08115; reference code ``tidecv`` 1.0.1,
  https://github.com/dbolya/tide, ``tidecv/quantify.py``): ΔAP50, how much AP50 would rise if all errors of one type
  were fixed, for six types, plus the false-positive and false-negative ΔAP (`TIDE_ERRORS`, `SPECIAL_ERRORS`);
* a **confusion matrix** over the dataset's classes plus background (rows ground truth, columns prediction), and
* the **errors per image**, to draw the worst val images (`worst_images`), both from one class-agnostic matching of
  the detections with score ≥ a threshold (the evaluate stage's ``evaluate.plot_score_threshold``): per image, in
  the same order and cap as below, each takes the unmatched non-crowd ground truth *of any class* with the highest
  IoU ≥ 0.5 (a diagonal cell, or off the diagonal for a wrong class); one matching none is ignored if it lies in a
  crowd region of its class (as COCO does), else a false positive (background row); a ground truth no detection
  took is missed (background column). Ultralytics' and mmdetection's confusion matrices also match by IoU
  regardless of class; their assignment rules (and so some counts) differ from this greedy COCO-ordered one.

Matching (`FG_IOU` = 0.5): exactly COCOeval's (pycocotools ``cocoeval.py``, ``evaluateImg`` at IoU 0.5, area
"all", maxDets 100): per image and class, detections in descending score order (ties: input order), at most
`MAX_DETS` per image *and class*; each takes the unmatched non-crowd ground truth of its class with the highest IoU
≥ 0.5 (equal IoUs: the last one), else a crowd region (``iscrowd=1``, IoU = intersection / detection area) of its
class at ≥ 0.5, which marks the detection *ignored* (neither true nor false positive; crowd regions are never
missed and can absorb many detections). IoU is ``pycocotools.mask.iou``, as COCOeval's. AP is COCO's (101-point
interpolated precision, classes without non-crowd ground truth left out of the mean), so the base AP50 here is
COCOeval's AP50 (tests/unit/test_error_analysis.py checks it to 1e-9 on the COCO API's example detections).

TIDE error types of a false positive (paper, "Main Error Types"; tidecv ``TIDERun._eval_image``, checked in this order;
IoU with non-crowd ground truth; `BG_IOU` = 0.1):

* ``loc``: its highest IoU with a ground truth of its class is in [0.1, 0.5];
* ``cls``: IoU ≥ 0.5 with a ground truth of another class;
* ``dupe``: IoU ≥ 0.5 with a ground truth of its class that a higher-scoring detection already matched;
* ``bkg``: IoU ≤ 0.1 with every ground truth (or the image has none);
* ``both``: anything else (wrong class and IoU in (0.1, 0.5) with some ground truth);
* ``miss``: a non-crowd ground truth no detection matched and no ``cls``/``loc`` error could fix.

Fixes (tidecv ``fix_errors``; each type is fixed alone, all others left as they are): a ``cls`` / ``loc`` error
whose ground truth is still unmatched becomes a true positive (of the ground truth's class for ``cls``), only the
highest-scoring such error per ground truth (cls and loc errors compete for it), the others are removed; ``dupe``,
``bkg``, ``both`` errors are removed; fixing ``miss`` removes the missed objects from the class's ground-truth count.
ΔAP = max(AP50_fixed - AP50, 0) (tidecv clamps the main errors at 0: a negative value is a binning effect). ``FP``:
every false positive scored below every true positive (perfect precision, same recall); ``FN``: every unmatched
ground truth removed (perfect recall, same precision); these two are not clamped.

Where this departs from tidecv 1.0.1 (the numbers agree within 0.1 AP points where none of these occur:
tests/unit/test_error_analysis.py):

1. classes with detections but no ground truth: tidecv puts them in the mean with AP 0; COCO (and this module)
   leaves them out. After a fix leaves a class with no ground truth (``miss``, ``FN``), both give it AP 0 if it
   still has detections and leave it out otherwise;
2. crowd regions: tidecv ignores a detection whose crowd IoU is > 0.5 (strictly), COCO at ≥ 0.5; tidecv also gives
   ignored detections an error type (a ``cls``/``loc`` fix can turn one into a true positive), here they have none;
3. the detection cap: tidecv keeps the 100 highest-scoring detections per image over all classes, COCO (and this
   module) 100 per image and class;
4. equal IoUs: tidecv takes the first ground truth, COCO the last.

Units: IoU and AP are fractions in [0, 1] (tidecv prints AP points, ×100). Boxes are COCO ``[x, y, w, h]`` pixels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from detpipe.evaluation.coco_metrics import validated_inputs

FG_IOU = 0.5
"""Foreground IoU: a detection is a true positive at IoU ≥ this (AP50); TIDE's t_f."""
BG_IOU = 0.1
"""Background IoU: a false positive with IoU ≤ this with every ground truth is a background error; TIDE's t_b."""
MAX_DETS = 100
"""Detections per image and class that count (COCOeval's maxDets[-1])."""
TIDE_ERRORS = ("cls", "loc", "both", "dupe", "bkg", "miss")
"""The six TIDE error types, in the paper's order (tidecv names: Cls, Loc, Both, Dupe, Bkg, Miss)."""
SPECIAL_ERRORS = ("FP", "FN")
"""tidecv's special errors: all false positives / all false negatives fixed (FalsePos, FalseNeg)."""
BACKGROUND = "background"
"""The confusion matrix's extra row and column (a category of that name gets ``"(background)"``)."""

_RECALL_THRESHOLDS = np.linspace(0.0, 1.0, 101)   # COCOeval's recThrs
_FP_TYPES = TIDE_ERRORS[:5]                        # error types of a detection (miss is a ground truth's)


@dataclass
class ImageErrors:
    """One val image's detections at score ≥ the analysis' score threshold, matched class-agnostically (the confusion
    matrix's rule, module docstring).

    Attributes:
        image_id: the image's id.
        true_positives: ``(detection index, ground-truth index)`` pairs of the same class.
        wrong_class: ``(detection index, ground-truth index)`` pairs of different classes.
        false_positives: detection indices matching no ground truth (and no crowd region of their class).
        missed: indices of the non-crowd ground truth no detection matched.
        Indices are into `ErrorAnalysis.detections` / ``ErrorAnalysis.ground_truth``.
    """

    image_id: int
    true_positives: list[tuple[int, int]] = field(default_factory=list)
    wrong_class: list[tuple[int, int]] = field(default_factory=list)
    false_positives: list[int] = field(default_factory=list)
    missed: list[int] = field(default_factory=list)

    @property
    def num_errors(self) -> int:
        """False positives plus missed objects: a wrong-class match counts twice (a false positive of the predicted
        class and a miss of the true one, as COCO's class-wise matching counts it)."""
        return len(self.false_positives) + len(self.missed) + 2 * len(self.wrong_class)


@dataclass
class ErrorAnalysis:
    """Result of `analyze`.

    Attributes:
        classes: category names in ascending category id order (the confusion matrix's first K rows/columns).
        category_ids: the category ids in that order.
        background: the name of the matrix's last row/column (`BACKGROUND`).
        confusion: ``int64 [K+1, K+1]``: rows ground truth, columns prediction, last row/column background.
        ap50: COCOeval's AP50 (area all, maxDets 100) recomputed from these matches, in [0, 1]; -1.0 (COCO's
            "undefined") when no class has non-crowd ground truth, every ΔAP then 0.
        delta_ap50: error type (`TIDE_ERRORS` + `SPECIAL_ERRORS`) -> ΔAP50 in [0, 1] (×100 for tidecv's points).
        error_counts: error type (`TIDE_ERRORS`) -> how many detections (ground truths for ``miss``) have it.
        images: one `ImageErrors` per image, in ascending image id order.
        detections: the validated detections (``category_id``, ``bbox``, ``score``, ``image_id``).
        ground_truth: the validated ground-truth annotations.
        score_threshold: the confusion matrix's and `images`' lowest detection score.
    """

    classes: list[str]
    category_ids: list[int]
    background: str
    confusion: np.ndarray
    ap50: float
    delta_ap50: dict[str, float]
    error_counts: dict[str, int]
    images: list[ImageErrors]
    detections: list[dict]
    ground_truth: list[dict]
    score_threshold: float


def box_iou(dt_boxes: np.ndarray, gt_boxes: np.ndarray, gt_crowd: np.ndarray) -> np.ndarray:
    """IoU of COCO boxes as COCOeval computes it (``pycocotools.mask.iou``).

    Args:
        dt_boxes: ``float64 [D, 4]`` ``[x, y, w, h]`` pixels.
        gt_boxes: ``float64 [G, 4]``.
        gt_crowd: ``bool [G]``: for a crowd region the "IoU" is intersection / detection area.
    Returns:
        ``float64 [D, G]`` in [0, 1] (zeros-shaped when D or G is 0).
    """
    if len(dt_boxes) == 0 or len(gt_boxes) == 0:
        return np.zeros((len(dt_boxes), len(gt_boxes)))
    from pycocotools import mask as mask_utils

    return np.asarray(mask_utils.iou(np.ascontiguousarray(dt_boxes, dtype=np.float64),
                                     np.ascontiguousarray(gt_boxes, dtype=np.float64),
                                     [int(c) for c in gt_crowd]), dtype=np.float64).reshape(len(dt_boxes), len(gt_boxes))


def _coco_match(ious: np.ndarray, order: np.ndarray, d_cls: np.ndarray, g_cls: np.ndarray, g_crowd: np.ndarray,
                class_aware: bool) -> tuple[np.ndarray, np.ndarray]:
    """Greedy matching of one image at `FG_IOU` (COCOeval ``evaluateImg``): detections ``order`` (score order) each
    take the unmatched non-crowd ground truth with the highest IoU ≥ 0.5 (last among equal), else a crowd region
    of their class. ``class_aware``: only ground truth of the detection's class (COCO); else any class for non-crowd
    ground truth (the confusion matrix). Returns (``int64 [D]`` matched ground-truth index or -1, ``int64 [G]``
    matching detection index or -1); a detection matched to a crowd region has its index there, the region -1."""
    D, G = ious.shape
    dt_match = np.full(D, -1, dtype=np.int64)
    gt_match = np.full(G, -1, dtype=np.int64)
    if D == 0 or G == 0:
        return dt_match, gt_match
    same = d_cls[:, None] == g_cls[None, :]
    over = ious >= FG_IOU
    crowd_cand = over & same & g_crowd[None, :]
    plain_cand = over & ~g_crowd[None, :] & (same if class_aware else True)
    hopeful = (plain_cand | crowd_cand).any(axis=1)
    # Python loop over the few detections with a candidate (plain lists: faster than numpy on a handful of items)
    plain_of, crowd_of = _candidates(plain_cand, hopeful), _candidates(crowd_cand, hopeful)
    taken = [False] * G
    for d in order[hopeful[order]].tolist():
        row, m, best = ious[d], -1, -1.0
        for g in plain_of.get(d, ()):        # ascending ground-truth order: >= keeps the last among equal IoUs
            if not taken[g] and row[g] >= best:
                m, best = g, row[g]
        if m >= 0:
            taken[m] = True
            dt_match[d], gt_match[m] = m, d
            continue
        for g in crowd_of.get(d, ()):
            if row[g] >= best:
                m, best = g, row[g]
        dt_match[d] = m
    return dt_match, gt_match


def _candidates(cand: np.ndarray, rows: np.ndarray) -> dict[int, list[int]]:
    """Row -> its True columns in ascending order, for the rows where ``rows`` is True."""
    r, c = np.nonzero(cand & rows[:, None])
    out: dict[int, list[int]] = {}
    for i, j in zip(r.tolist(), c.tolist()):
        out.setdefault(i, []).append(j)
    return out


def _average_precision(tp_in_score_order: np.ndarray, num_gt: int) -> float:
    """COCOeval's AP of one class at one IoU (``accumulate``): 101-point interpolated precision. ``tp_in_score_order``
    is ``bool [N]`` (True: true positive) in descending score order; ``num_gt`` > 0 non-crowd ground truths."""
    if tp_in_score_order.size == 0:
        return 0.0
    tp = np.cumsum(tp_in_score_order, dtype=np.float64)
    fp = np.cumsum(~tp_in_score_order, dtype=np.float64)
    recall = tp / num_gt
    precision = tp / (fp + tp + np.spacing(1))
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    idx = np.searchsorted(recall, _RECALL_THRESHOLDS, side="left")
    q = np.where(idx < precision.size, precision[np.minimum(idx, precision.size - 1)], 0.0)
    return float(q.mean())


def _mean_ap(cls: np.ndarray, tp: np.ndarray, keep: np.ndarray, num_gt: np.ndarray, classes: np.ndarray) -> float:
    """Mean over ``classes`` of `_average_precision`; ``cls``/``tp``/``keep`` are per detection in global COCO order
    (score descending, ties by image then input order). A class whose ground-truth count a fix made 0 gets AP 0 if
    it still has detections, else is left out (tidecv's rule); with none left the mean is 0."""
    cls, tp = cls[keep], tp[keep]
    by_class = np.argsort(cls, kind="stable")
    cls, tp = cls[by_class], tp[by_class]
    bounds = np.searchsorted(cls, np.concatenate([classes, classes + 1]))
    aps = []
    for k, lo, hi in zip(classes, bounds[:len(classes)], bounds[len(classes):]):
        if num_gt[k] > 0:
            aps.append(_average_precision(tp[lo:hi], int(num_gt[k])))
        elif hi > lo:
            aps.append(0.0)
    return float(np.mean(aps)) if aps else 0.0


def analyze(gt: dict, detections: list[dict], score_threshold: float, *, gt_source: str = "ground truth",
            dt_source: str = "detections") -> ErrorAnalysis:
    """TIDE error breakdown, confusion matrix and per-image errors of bbox detections (module docstring: rules and
    sources).

    Args:
        gt: COCO instances dict (as for `detpipe.evaluation.coco_metrics.coco_evaluate`; ``iscrowd`` regions kept).
        detections: COCO results with ``bbox`` [x, y, w, h] pixels, ``score``, ``category_id``, ``image_id``
            (masks, if any, are not looked at: the analysis is of boxes).
        score_threshold: lowest score of a detection in the confusion matrix and the per-image errors (the TIDE
            breakdown, like AP, uses every detection).
        gt_source, dt_source: names used in error messages.
    Returns:
        `ErrorAnalysis`.
    Raises:
        StageError: malformed ground truth or detections (the same checks as COCOeval's wrapper, naming the record
            and the rule).
        ValueError: ``score_threshold`` not in [0, 1].
    """
    if not 0.0 <= score_threshold <= 1.0:
        raise ValueError(f"score_threshold must be in [0, 1], got {score_threshold!r}")
    dataset, dets = validated_inputs(gt, detections, "bbox", gt_source=gt_source, dt_source=dt_source)
    return analyze_validated(dataset, dets, score_threshold)


def analyze_validated(dataset: dict, dets: list[dict], score_threshold: float) -> ErrorAnalysis:
    """`analyze` of inputs already checked: ``dataset`` and ``dets`` as
    `detpipe.evaluation.coco_metrics.validated_inputs` returns them (``CocoResult.dataset`` / ``.results`` of the
    bbox evaluation: the very records COCOeval matched). Raises ValueError for ``score_threshold`` not in [0, 1]."""
    if not 0.0 <= score_threshold <= 1.0:
        raise ValueError(f"score_threshold must be in [0, 1], got {score_threshold!r}")
    cats = sorted(c["id"] for c in dataset["categories"])
    cat_index = {cid: k for k, cid in enumerate(cats)}
    names_by_id = {c["id"]: c["name"] for c in dataset["categories"]}
    classes = [names_by_id[cid] for cid in cats]
    K = len(classes)
    anns = dataset["annotations"]

    g_box = np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4)
    g_cls = np.array([cat_index[a["category_id"]] for a in anns], dtype=np.int64)
    g_crowd = np.array([a["iscrowd"] == 1 for a in anns], dtype=bool)
    d_box = np.array([d["bbox"] for d in dets], dtype=np.float64).reshape(-1, 4)
    d_cls = np.array([cat_index[d["category_id"]] for d in dets], dtype=np.int64)
    d_score = np.array([d["score"] for d in dets], dtype=np.float64)
    image_ids = sorted(im["id"] for im in dataset["images"])
    image_pos = {iid: i for i, iid in enumerate(image_ids)}
    g_img = np.array([image_pos[a["image_id"]] for a in anns], dtype=np.int64)
    d_img = np.array([image_pos[d["image_id"]] for d in dets], dtype=np.int64)
    g_of = np.split(np.argsort(g_img, kind="stable"), np.searchsorted(np.sort(g_img), np.arange(1, len(image_ids))))
    d_of = np.split(np.argsort(d_img, kind="stable"), np.searchsorted(np.sort(d_img), np.arange(1, len(image_ids))))

    N = len(dets)
    counted = np.zeros(N, dtype=bool)       # within the cap and not ignored (crowd): in AP
    tp = np.zeros(N, dtype=bool)
    err = np.full(N, -1, dtype=np.int64)     # index into _FP_TYPES for a false positive
    fixes_to_tp = np.zeros(N, dtype=bool)    # cls/loc error that becomes the true positive of its ground truth
    fix_cls = d_cls.copy()
    num_gt = np.bincount(g_cls[~g_crowd], minlength=K)
    missed = np.zeros(K, dtype=np.int64)     # unfixable misses per class
    unmatched = np.zeros(K, dtype=np.int64)  # every unmatched non-crowd ground truth per class
    confusion = np.zeros((K + 1, K + 1), dtype=np.int64)
    images = []

    for pos, iid in enumerate(image_ids):
        gi, di = g_of[pos], d_of[pos]
        ious = box_iou(d_box[di], g_box[gi], g_crowd[gi])
        dc, gc, gcrowd, ds = d_cls[di], g_cls[gi], g_crowd[gi], d_score[di]
        order = np.lexsort((np.arange(len(di)), -ds))          # score descending, ties in input order
        # COCO's cap: the first MAX_DETS of each class in that order
        oc = dc[order]
        by_c = np.argsort(oc, kind="stable")
        rank = np.empty(len(di), dtype=np.int64)
        rank[by_c] = np.arange(len(di)) - np.searchsorted(oc[by_c], oc[by_c], side="left")
        order = order[rank < MAX_DETS]
        in_cap = np.zeros(len(di), dtype=bool)
        in_cap[order] = True

        dt_m, gt_m = _coco_match(ious, order, dc, gc, gcrowd, class_aware=True)
        is_tp = (dt_m >= 0) & ~gcrowd[np.maximum(dt_m, 0)] if len(gi) else np.zeros(len(di), dtype=bool)
        ignored = (dt_m >= 0) & ~is_tp
        counted[di] = in_cap & ~ignored
        tp[di] = is_tp
        plain = np.flatnonzero(~gcrowd)
        used = gt_m[plain] >= 0
        unmatched += np.bincount(gc[plain][~used], minlength=K)

        # TIDE error types of the false positives, in score order (tidecv TIDERun._eval_image)
        fps = order[~is_tp[order] & ~ignored[order]]
        usable = np.zeros(len(plain), dtype=bool)
        if len(fps):
            if len(plain) == 0:
                err[di[fps]] = _FP_TYPES.index("bkg")
            else:
                iou = ious[np.ix_(fps, plain)]
                same = dc[fps][:, None] == gc[plain][None, :]
                iou_same, iou_other = iou * same, iou * ~same
                s_idx, o_idx = iou_same.argmax(axis=1), iou_other.argmax(axis=1)
                s_max = iou_same[np.arange(len(fps)), s_idx]
                o_max = iou_other[np.arange(len(fps)), o_idx]
                dup_max = (iou_same * used[None, :]).max(axis=1)
                kind = np.select([(s_max >= BG_IOU) & (s_max <= FG_IOU), o_max >= FG_IOU, dup_max >= FG_IOU,
                                  iou.max(axis=1) <= BG_IOU],
                                 [_FP_TYPES.index(t) for t in ("loc", "cls", "dupe", "bkg")], _FP_TYPES.index("both"))
                err[di[fps]] = kind
                target = np.where(kind == _FP_TYPES.index("loc"), s_idx, o_idx)
                claimed = set()
                for f in np.flatnonzero((kind <= _FP_TYPES.index("loc"))):   # cls or loc, score order
                    t = int(target[f])
                    if used[t]:
                        continue                                    # fixed = removed (a duplicate)
                    usable[t] = True
                    if t not in claimed:                            # the highest-scoring error gets the object
                        claimed.add(t)
                        fixes_to_tp[di[fps[f]]] = True
                        if kind[f] == _FP_TYPES.index("cls"):
                            fix_cls[di[fps[f]]] = gc[plain[t]]
        missed += np.bincount(gc[plain][~used & ~usable], minlength=K)

        # confusion matrix and worst-image errors: score >= threshold, class-agnostic matching
        sel = order[ds[order] >= score_threshold]
        cm_dt, cm_gt = _coco_match(ious, sel, dc, gc, gcrowd, class_aware=False)
        rec = ImageErrors(int(iid))
        for d in sel:
            g = int(cm_dt[d])
            if g < 0:
                rec.false_positives.append(int(di[d]))
                confusion[K, dc[d]] += 1
            elif not gcrowd[g]:
                (rec.true_positives if gc[g] == dc[d] else rec.wrong_class).append((int(di[d]), int(gi[g])))
                confusion[gc[g], dc[d]] += 1
        for g in plain[cm_gt[plain] < 0]:
            rec.missed.append(int(gi[g]))
            confusion[gc[g], K] += 1
        images.append(rec)

    # AP50 for the base and each fix, in COCO's global order: score descending, ties by image then input order
    glob = np.lexsort((np.arange(N), d_img, -d_score))
    cls_o, tp_o, cnt_o, err_o = d_cls[glob], tp[glob], counted[glob], err[glob]
    fix_tp_o, fix_cls_o = fixes_to_tp[glob], fix_cls[glob]
    with_gt = np.flatnonzero(num_gt > 0)
    base = _mean_ap(cls_o, tp_o, cnt_o, num_gt, with_gt)
    delta = {}
    for t, name in enumerate(_FP_TYPES if with_gt.size else ()):
        hit = err_o == t
        if name in ("cls", "loc"):
            fixed_ap = _mean_ap(np.where(hit & fix_tp_o, fix_cls_o, cls_o), tp_o | (hit & fix_tp_o),
                                cnt_o & ~(hit & ~fix_tp_o), num_gt, with_gt)
        else:
            fixed_ap = _mean_ap(cls_o, tp_o, cnt_o & ~hit, num_gt, with_gt)
        delta[name] = max(fixed_ap - base, 0.0)
    if with_gt.size:
        delta["miss"] = max(_mean_ap(cls_o, tp_o, cnt_o, num_gt - missed, with_gt) - base, 0.0)
        # FP: true positives first within each class (scores 1 / 0), order otherwise kept
        fp_first = np.argsort(~tp_o, kind="stable")
        delta["FP"] = _mean_ap(cls_o[fp_first], tp_o[fp_first], cnt_o[fp_first], num_gt, with_gt) - base
        delta["FN"] = _mean_ap(cls_o, tp_o, cnt_o, num_gt - unmatched, with_gt) - base
    else:       # no object to find: COCO's AP is -1 (undefined), and no error changes it
        base, delta = -1.0, dict.fromkeys((*TIDE_ERRORS, *SPECIAL_ERRORS), 0.0)
    counts = {name: int(((err == t) & counted).sum()) for t, name in enumerate(_FP_TYPES)}
    counts["miss"] = int(missed.sum())
    background = BACKGROUND if BACKGROUND not in classes else f"({BACKGROUND})"
    return ErrorAnalysis(classes=classes, category_ids=[int(c) for c in cats], background=background, confusion=confusion, ap50=base,
                         delta_ap50={k: float(delta[k]) for k in (*TIDE_ERRORS, *SPECIAL_ERRORS)},
                         error_counts=counts, images=images, detections=dets, ground_truth=anns,
                         score_threshold=float(score_threshold))


def worst_images(analysis: ErrorAnalysis, n: int) -> list[ImageErrors]:
    """The ``n`` images with the most errors (`ImageErrors.num_errors`), most first, ties by ascending image id;
    images without an error are never listed (so fewer than ``n`` may come back). Raises ValueError for n < 0."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    ranked = sorted((im for im in analysis.images if im.num_errors > 0), key=lambda im: (-im.num_errors, im.image_id))
    return ranked[:n]


def confusion_rows(analysis: ErrorAnalysis) -> list[dict]:
    """The confusion matrix as DVC's ``confusion`` template reads it: one ``{"actual": ground-truth class,
    "predicted": predicted class}`` row per count (background: `ErrorAnalysis.background`), rows in matrix order."""
    names = [*analysis.classes, analysis.background]
    return [{"actual": names[i], "predicted": names[j]}
            for i, j in zip(*np.nonzero(analysis.confusion)) for _ in range(int(analysis.confusion[i, j]))]


def confusion_table(analysis: ErrorAnalysis) -> dict:
    """The confusion matrix for reading: ``classes`` (row/column names, background last), ``counts`` (``int``
    [K+1][K+1], rows ground truth, columns prediction), ``row_normalized`` (each row divided by its sum: the fraction
    of a class's objects predicted as each class, 6 decimals; an empty row stays 0), and the matching rule."""
    counts = analysis.confusion
    sums = counts.sum(axis=1, keepdims=True)
    norm = np.divide(counts, sums, out=np.zeros(counts.shape), where=sums > 0)
    return {"classes": [*analysis.classes, analysis.background], "rows": "ground truth", "columns": "prediction",
            "iou_threshold": FG_IOU, "score_threshold": analysis.score_threshold,
            "counts": counts.tolist(), "row_normalized": np.round(norm, 6).tolist()}


def error_metrics(analysis: ErrorAnalysis) -> dict[str, float]:
    """``metrics/eval.json``'s ``errors``: ``AP50`` (the base) and the ΔAP50 of every type, fractions in [0, 1]
    rounded to 6 decimals."""
    return {"AP50": round(analysis.ap50, 6), **{k: round(v, 6) for k, v in analysis.delta_ap50.items()}}
