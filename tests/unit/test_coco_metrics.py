"""Tests of detpipe/evaluation/coco_metrics.py against the COCO API's published figures on its own example detections
(tests/data/coco_eval_reference, see its README), plus robustness cases built from the same real data."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from detpipe.core.errors import StageError
from detpipe.evaluation.coco_metrics import BACKENDS, STAT_NAMES, CocoResult, coco_evaluate, pr_curve_rows

REF = Path(__file__).resolve().parents[1] / "data" / "coco_eval_reference"

# Published figures (pycocotools COCOeval on the fake results; /work/shared/data/README.md and
# faster_coco_eval's test-suite): full precision for AP/AP50/AP75 (bbox) and AP (segm), 4 decimals for the rest.
PUBLISHED_FULL = {"bbox": {"AP": 0.5045806987, "AP50": 0.6969727247, "AP75": 0.5729816670},
                  "segm": {"AP": 0.3195452759}}
PUBLISHED_4DP_BBOX = {"APs": 0.5856, "APm": 0.5194, "APl": 0.5014, "AR1": 0.3868, "AR10": 0.5937,
                      "AR100": 0.5954, "ARs": 0.6398, "ARm": 0.5664, "ARl": 0.5643}


def _load(name: str):
    return json.loads((REF / name).read_text())


@pytest.fixture(scope="module")
def gt() -> dict:
    return _load("gt/instances_val2014_100.json")


@pytest.fixture(scope="module")
def dets() -> dict:
    return {t: _load(f"cocoapi/results/instances_val2014_fake{t}100_results.json") for t in ("bbox", "segm")}


@pytest.fixture(scope="module")
def printout() -> dict[str, dict[str, float]]:
    """The twelve 3-decimal figures per iou type from the COCO API's printout."""
    out, kind = {}, None
    for line in (REF / "cocoapi/results/val2014_fake_eval_res.txt").read_text().splitlines():
        if m := re.match(r"type=(\w+)", line):
            kind = m.group(1)
            out[kind] = []
        elif "] = " in line:
            out[kind].append(float(line.rsplit("=", 1)[1]))
    return {k: dict(zip(STAT_NAMES, v)) for k, v in out.items() if k in ("bbox", "segm")}


@pytest.fixture(scope="module")
def results(gt, dets) -> dict[tuple[str, str], CocoResult]:
    return {(t, b): coco_evaluate(gt, dets[t], t, b) for t in ("bbox", "segm") for b in BACKENDS}


def _assert_same(a: CocoResult, b: CocoResult, tol: float = 0.0):
    for n in STAT_NAMES:
        assert a.stats[n] == pytest.approx(b.stats[n], abs=tol), n
    np.testing.assert_allclose(a.precision, b.precision, rtol=0, atol=tol)
    assert a.per_class_ap.keys() == b.per_class_ap.keys()
    for k in a.per_class_ap:
        assert a.per_class_ap[k] == pytest.approx(b.per_class_ap[k], abs=tol), k


# ------------------------------------------------------------------------------------------ reference figures


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_published_figures(results, printout, iou_type, backend):
    r = results[iou_type, backend]
    assert set(r.stats) == set(STAT_NAMES)
    for name, value in PUBLISHED_FULL[iou_type].items():
        assert abs(r.stats[name] - value) < 1e-9, name
    if iou_type == "bbox":
        for name, value in PUBLISHED_4DP_BBOX.items():
            assert abs(r.stats[name] - value) <= 0.5e-4 + 1e-12, name
    for name, value in printout[iou_type].items():  # all twelve, to the printout's 3 decimals
        assert abs(r.stats[name] - value) <= 0.5e-3 + 1e-12, name
    assert r.summary.count("\n") == 12 and f"= {printout[iou_type]['AP']:.3f}" in r.summary.splitlines()[0]
    assert r.num_images == 100 and r.num_detections == 734
    assert r.precision.shape == (10, 101, 80, 4, 3) and r.precision.dtype == np.float64
    assert r.recall.shape == (10, 80, 4, 3)
    np.testing.assert_array_equal(r.recall_thresholds, np.linspace(0, 1, 101))
    assert r.category_ids == sorted(c["id"] for c in _load("gt/instances_val2014_100.json")["categories"])


@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_backends_agree(results, iou_type):
    a, b = results[iou_type, "pycocotools"], results[iou_type, "faster_coco_eval"]
    _assert_same(a, b, tol=1e-9)
    np.testing.assert_allclose(a.recall, b.recall, rtol=0, atol=1e-9)
    assert a.category_ids == b.category_ids
    assert a.summary == b.summary


def test_inputs_not_modified(gt, dets):
    g, d = copy.deepcopy(gt), copy.deepcopy(dets["segm"])
    for backend in BACKENDS:
        coco_evaluate(g, d, "segm", backend)
    assert g == gt and d == dets["segm"]


# ------------------------------------------------------------------------------------------ per class / PR curve


@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_per_class_ap_consistent_with_precision(results, gt, iou_type):
    r = results[iou_type, "pycocotools"]
    names = {c["id"]: c["name"] for c in gt["categories"]}
    with_gt = {a["category_id"] for a in gt["annotations"] if not a["iscrowd"]}
    assert list(r.per_class_ap) == [names[c] for c in r.category_ids]
    for k, cid in enumerate(r.category_ids):
        ap = r.per_class_ap[names[cid]]
        if cid in with_gt:
            assert 0.0 <= ap <= 1.0
            assert ap == pytest.approx(r.precision[:, :, k, 0, 2].mean(), abs=1e-12)
        else:
            assert ap == -1.0 and (r.precision[:, :, k, 0, 2] == -1).all()
    valid = [v for v in r.per_class_ap.values() if v != -1.0]
    assert len(valid) == len(with_gt) < 80  # some categories have no ground truth in these 100 images
    assert np.mean(valid) == pytest.approx(r.stats["AP"], abs=1e-12)


def test_pr_curve_rows(results):
    r = results["bbox", "pycocotools"]
    for iou, stat in ((0.5, "AP50"), (0.75, "AP75")):
        rows = pr_curve_rows(r, iou=iou)
        assert len(rows) == 101 and set(rows[0]) == {"recall", "precision"}
        assert [row["recall"] for row in rows] == [i / 100 for i in range(101)]
        prec = [row["precision"] for row in rows]
        assert all(a >= b for a, b in zip(prec, prec[1:]))  # interpolated precision never rises with recall
        assert np.mean(prec) == pytest.approx(r.stats[stat], abs=1e-6)  # rows are rounded to 6 decimals
    assert pr_curve_rows(r, 0.5) != pr_curve_rows(r, 0.75)
    with pytest.raises(ValueError, match="not an evaluated threshold"):
        pr_curve_rows(r, iou=0.3)


# ------------------------------------------------------------------------------------------ robustness


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_zero_detections(gt, iou_type, backend):
    r = coco_evaluate(gt, [], iou_type, backend)
    with_gt = {a["category_id"] for a in gt["annotations"] if not a["iscrowd"]}
    assert r.num_detections == 0
    assert all(v == 0.0 for v in r.stats.values())  # every area range has ground truth here: 0, not -1
    names = {c["id"]: c["name"] for c in gt["categories"]}
    assert {n: v for n, v in r.per_class_ap.items()} == {
        names[c]: (0.0 if c in with_gt else -1.0) for c in r.category_ids}
    assert pr_curve_rows(r) == [{"recall": i / 100, "precision": 0.0} for i in range(101)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_image_without_ground_truth(gt, dets, results, backend):
    base = results["bbox", backend]
    g = copy.deepcopy(gt)
    new_id = max(im["id"] for im in g["images"]) + 1
    g["images"].append({"id": new_id, "height": 480, "width": 640, "file_name": "empty.jpg"})
    same = coco_evaluate(g, dets["bbox"], "bbox", backend)
    assert same.num_images == 101
    _assert_same(same, base)  # an image with neither GT nor detections changes nothing
    # a confident detection on it is a false positive ranked first: its category's AP drops, no other changes
    person = next(c for c in gt["categories"] if c["name"] == "person")
    fp = {"image_id": new_id, "category_id": person["id"], "bbox": [10.0, 20.0, 100.0, 200.0], "score": 1.0}
    worse = coco_evaluate(g, dets["bbox"] + [fp], "bbox", backend)
    assert worse.per_class_ap["person"] < base.per_class_ap["person"]
    assert worse.stats["AP"] < base.stats["AP"]
    assert all(worse.per_class_ap[n] == base.per_class_ap[n] for n in base.per_class_ap if n != "person")
    assert worse.stats["AR100"] == base.stats["AR100"]  # recall is unaffected by false positives


@pytest.mark.parametrize("backend", BACKENDS)
def test_crowd_regions_are_ignored(gt, dets, results, backend):
    base = results["bbox", backend]
    crowd = [a for a in gt["annotations"] if a["iscrowd"]]
    assert len(crowd) == 9
    low = min(d["score"] for d in dets["bbox"]) / 2
    on_crowd = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": low}
                for a in crowd]
    _assert_same(coco_evaluate(gt, dets["bbox"] + on_crowd, "bbox", backend), base)
    # the same regions as ordinary objects change the figures (they become objects to find)
    g = copy.deepcopy(gt)
    for a in g["annotations"]:
        a["iscrowd"] = 0
    r = coco_evaluate(g, dets["bbox"] + on_crowd, "bbox", backend)
    assert r.stats["AR100"] != base.stats["AR100"] and r.stats["AP"] != base.stats["AP"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_ids_and_missing_info(gt, dets, results, backend):
    off = 2**40
    g = copy.deepcopy(gt)
    del g["info"], g["licenses"]
    for im in g["images"]:
        im["id"] += off
    for a in g["annotations"]:
        a["image_id"] += off
        a["id"] += off
        a["category_id"] += off
    for c in g["categories"]:
        c["id"] += off
    d = [dict(x, image_id=x["image_id"] + off, category_id=np.int64(x["category_id"] + off))
         for x in dets["bbox"]]
    r = coco_evaluate(g, d, "bbox", backend)
    base = results["bbox", backend]
    _assert_same(r, base)
    assert r.category_ids == [c + off for c in base.category_ids]


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_area_bbox(gt, dets, results, backend):
    no_area, box_area = copy.deepcopy(gt), copy.deepcopy(gt)
    for a, b in zip(no_area["annotations"], box_area["annotations"]):
        del a["area"]
        b["area"] = b["bbox"][2] * b["bbox"][3]
    r = coco_evaluate(no_area, dets["bbox"], "bbox", backend)
    _assert_same(r, coco_evaluate(box_area, dets["bbox"], "bbox", backend))  # documented rule: w * h
    base = results["bbox", backend]
    for n in ("AP", "AP50", "AP75", "AR1", "AR10", "AR100"):  # area "all" does not depend on area
        assert r.stats[n] == base.stats[n], n
    assert r.stats["APl"] != base.stats["APl"]  # box area is not the official (mask) area: objects move bins


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_area_segm(gt, dets, results, backend):
    """Ground truth without ``area`` gets the convert stage's rule (`coco_schema.segmentation_area`, COCO's own:
    polygons their shoelace area, RLE its pixel count): every one of the 12 figures equals the published run's with
    the official areas; the rasterized polygon area (pycocotools ``mask.area``) moves objects between the size
    ranges and changes a size-range figure (the broken variant)."""
    no_area, mask_area = copy.deepcopy(gt), copy.deepcopy(gt)
    imgs = {im["id"]: im for im in gt["images"]}
    for a, b in zip(no_area["annotations"], mask_area["annotations"]):
        del a["area"]
        h, w = imgs[b["image_id"]]["height"], imgs[b["image_id"]]["width"]
        s = b["segmentation"]
        rle = (mask_utils.merge(mask_utils.frPyObjects(s, h, w)) if isinstance(s, list)
               else mask_utils.frPyObjects(s, h, w))
        b["area"] = float(mask_utils.area(rle))
    r = coco_evaluate(no_area, dets["segm"], "segm", backend)
    _assert_same(r, results["segm", backend])
    rasterized = coco_evaluate(mask_area, dets["segm"], "segm", backend)
    assert any(rasterized.stats[n] != r.stats[n] for n in ("APs", "APm", "APl", "ARs", "ARm", "ARl"))


def _uncompressed(rle: dict) -> dict:
    """Compressed RLE -> uncompressed RLE (counts as a list of run lengths, column-major, starting with 0s)."""
    m = mask_utils.decode(rle).ravel(order="F")
    change = np.flatnonzero(np.diff(m)) + 1
    bounds = np.concatenate([[0], change, [m.size]])
    counts = np.diff(bounds).tolist()
    if m[0] == 1:
        counts = [0] + counts
    return {"size": list(rle["size"]), "counts": counts}


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools decode, numpy 2
def test_segm_uncompressed_rle_detections(gt, dets, results):
    d = [dict(x, segmentation=_uncompressed(x["segmentation"])) for x in dets["segm"]]
    _assert_same(coco_evaluate(gt, d, "segm", "pycocotools"), results["segm", "pycocotools"])


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("change, message", [
    ({"image_id": 123456789}, r"detection 5: image_id 123456789 is not an image of the ground truth \(rule: "),
    ({"category_id": 999}, r"detection 5: category_id 999 is not a category of the ground truth \(rule: "),
    ({"category_id": "1"}, r"detection 5: category_id '1' is not a category"),
    ({"score": float("nan")}, r"detection 5: score nan is not a finite number"),
    ({"bbox": [1.0, 2.0, -3.0, 4.0]}, r"detection 5: bbox .* negative width or height"),
    ({"bbox": [1.0, 2.0, 3.0]}, r"detection 5: bbox .* is not 4 numbers"),
])
def test_bad_detection(gt, dets, change, message):
    d = copy.deepcopy(dets["bbox"][:10])
    d[5].update(change)
    for backend in BACKENDS:
        with pytest.raises(StageError, match="^preds.json: " + message):
            coco_evaluate(gt, d, "bbox", backend, dt_source="preds.json")


def test_bad_segm_detection(gt, dets):
    d = copy.deepcopy(dets["segm"][:3])
    d[2]["segmentation"] = dict(d[2]["segmentation"], size=[10, 10])
    with pytest.raises(StageError, match=r"detection 2: segmentation RLE size \[10, 10\] != image"):
        coco_evaluate(gt, d, "segm")
    del d[2]["segmentation"]
    with pytest.raises(StageError, match=r"detection 2: no segmentation"):
        coco_evaluate(gt, d, "segm")


def test_bad_ground_truth(gt):
    g = copy.deepcopy(gt)
    g["annotations"][3]["category_id"] = 999
    aid = g["annotations"][3]["id"]
    with pytest.raises(StageError, match=rf"^gt.json: annotation id {aid}: category_id 999 is not in 'categories'"):
        coco_evaluate(g, [], gt_source="gt.json")
    g = copy.deepcopy(gt)
    g["images"].append(dict(g["images"][0]))
    with pytest.raises(StageError, match=r"image id \d+ appears twice"):
        coco_evaluate(g, [])
    g = copy.deepcopy(gt)
    del g["annotations"]
    with pytest.raises(StageError, match=r"key 'annotations' missing"):
        coco_evaluate(g, [])
    with pytest.raises(ValueError, match="backend"):
        coco_evaluate(gt, [], backend="detectron")
    with pytest.raises(ValueError, match="iou_type"):
        coco_evaluate(gt, [], iou_type="keypoints")


def test_faster_backend_is_the_default():
    """Issue 15.8: the evaluate stage and `coco_evaluate` default to faster_coco_eval, whose numbers
    `test_backends_agree` shows equal to pycocotools'."""
    import inspect

    from detpipe.params import Evaluate

    assert Evaluate().backend == "faster_coco_eval"
    assert inspect.signature(coco_evaluate).parameters["backend"].default == "faster_coco_eval"
