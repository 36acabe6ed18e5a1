"""Tests of detpipe/evaluation/error_analysis.py (TIDE error breakdown, confusion matrix, worst images): the base AP50 is
COCOeval's to 1e-9 and the ΔAP agree with the reference ``tidecv`` package (Bolya et al., ECCV 2020; test-only
dependency, as pycocotools is for mAP) within 0.1 AP points on the COCO API's example detections
(tests/data/coco_eval_reference); where tidecv's own matching departs from COCO's, a hand-made case each, worked by
hand; the confusion matrix on hand-checked boxes; the worst-image ranking."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from detpipe.core.errors import StageError
from detpipe.evaluation.coco_metrics import BACKENDS, coco_evaluate
from detpipe.evaluation.error_analysis import SPECIAL_ERRORS, TIDE_ERRORS, analyze, confusion_rows, worst_images
from support.tide_reference import comparable_detections, ours_points, tidecv_points

REF = Path(__file__).resolve().parents[1] / "data" / "coco_eval_reference"
TOL_POINTS = 0.1    # AP points (tidecv's unit: AP x 100)


@pytest.fixture(scope="module")
def gt() -> dict:
    return json.loads((REF / "gt/instances_val2014_100.json").read_text())


@pytest.fixture(scope="module")
def dets() -> list[dict]:
    return json.loads((REF / "cocoapi/results/instances_val2014_fakebbox100_results.json").read_text())


# ------------------------------------------------------------------------------------------ COCO and tidecv


@pytest.mark.parametrize("backend", BACKENDS)
def test_base_ap50_is_cocoevals(gt, dets, backend):
    """Our matches are COCOeval's: the AP50 recomputed from them equals the COCO API's to 1e-9 (published
    0.6969727247), with and without the detections of classes that have no ground truth."""
    ref = coco_evaluate(gt, dets, "bbox", backend).stats["AP50"]
    assert abs(ref - 0.6969727247) < 1e-9
    assert abs(analyze(gt, dets, 0.3).ap50 - ref) < 1e-9
    assert abs(analyze(gt, comparable_detections(gt, dets), 0.3).ap50 - ref) < 1e-9


def test_agrees_with_tidecv_on_coco_examples(gt, dets):
    """Base AP50 and every ΔAP within 0.1 AP points of tidecv's on the COCO API's example detections (those of
    classes with ground truth: `support.tide_reference.comparable_detections`; at most 39 per image, so no cap)."""
    kept = comparable_detections(gt, dets)
    assert len(dets) - len(kept) == 9            # 9 detections of 6 classes without ground truth
    ours, theirs = ours_points(analyze(gt, kept, 0.3)), tidecv_points(gt, kept)
    print({k: (round(ours[k], 3), round(theirs[k], 3)) for k in ours})
    for k in ours:
        assert abs(ours[k] - theirs[k]) <= TOL_POINTS, f"{k}: ours {ours[k]:.3f}, tidecv {theirs[k]:.3f}"
    assert ours["cls"] > 1 and ours["miss"] > 1 and ours["FN"] > 1     # the comparison is not of zeros


def test_error_counts_and_types_respond_to_the_fault(gt, dets):
    """Detections moved to another class show up as classification errors, boxes shifted by half their size as
    localization errors, each the largest main ΔAP and above the clean run's."""
    kept = comparable_detections(gt, dets)
    clean = analyze(gt, kept, 0.3)
    cats = sorted(c["id"] for c in gt["categories"])
    relabeled = [dict(d, category_id=cats[(cats.index(d["category_id"]) + 1) % len(cats)]) for d in kept]
    shifted = [dict(d, bbox=[d["bbox"][0] + d["bbox"][2] / 2, d["bbox"][1], d["bbox"][2], d["bbox"][3]]) for d in kept]
    for broken, kind in ((relabeled, "cls"), (shifted, "loc")):
        a = analyze(gt, broken, 0.3)
        main = {k: a.delta_ap50[k] for k in TIDE_ERRORS}
        assert max(main, key=main.get) == kind, main
        assert a.delta_ap50[kind] > clean.delta_ap50[kind] + 0.1
        assert a.error_counts[kind] > clean.error_counts[kind]


# ------------------------------------------------------------------------------------------ departures from tidecv


def _dataset(images: list[int], anns: list[tuple], cats=((1, "a"), (2, "b"))) -> dict:
    """COCO ground truth from ``(image_id, category_id, [x, y, w, h], iscrowd)`` tuples."""
    return {"images": [{"id": i, "width": 640, "height": 480} for i in images],
            "categories": [{"id": c, "name": n} for c, n in cats],
            "annotations": [{"id": k + 1, "image_id": i, "category_id": c, "bbox": b, "iscrowd": z,
                             "area": b[2] * b[3]} for k, (i, c, b, z) in enumerate(anns)]}


def _det(image_id, category_id, bbox, score) -> dict:
    return {"image_id": image_id, "category_id": category_id, "bbox": bbox, "score": score}


def test_departure_class_without_ground_truth():
    """A class with detections but no ground truth: COCO leaves it out of the mean, tidecv averages it in as 0.
    One image, one object of class a found exactly (score .9), one detection of class b (no ground truth of b) far
    away (score .8). COCO AP50 = AP_a = 1; tidecv (AP_a + AP_b) / 2 = 50 points, and removing the b detection
    (a background error) empties class b, so tidecv's bkg ΔAP is 50 points; ours 0 (b never counted)."""
    gt = _dataset([1], [(1, 1, [0, 0, 10, 10], 0)])
    dets = [_det(1, 1, [0, 0, 10, 10], 0.9), _det(1, 2, [100, 100, 10, 10], 0.8)]
    ours, theirs = analyze(gt, dets, 0.3), tidecv_points(gt, dets)
    assert ours.ap50 == pytest.approx(coco_evaluate(gt, dets).stats["AP50"], abs=1e-12)
    assert ours.ap50 == pytest.approx(1.0, abs=1e-12)
    assert ours.error_counts["bkg"] == 1 and ours.delta_ap50["bkg"] == 0.0
    assert theirs["AP50"] == pytest.approx(50.0) and theirs["bkg"] == pytest.approx(50.0)


def test_departure_crowd_region_at_iou_one_half():
    """COCO ignores a detection covering a crowd region of its class by ≥ 0.5 (intersection / detection area),
    tidecv only by > 0.5. The detection [110, 100, 20, 10] (area 200) overlaps the crowd region [100, 100, 20, 10]
    by 10 x 10 = 100 px^2: exactly 0.5. With it scored .95 above the true positive (.9): COCO ignores it, AP50 = 1;
    tidecv counts a false positive first: precision 0 then 1/2 at recall 1, interpolated 1/2 everywhere: 50 points,
    and calls it a background error (no IoU with any object), worth 50."""
    gt = _dataset([1], [(1, 1, [0, 0, 10, 10], 0), (1, 1, [100, 100, 20, 10], 1)])
    dets = [_det(1, 1, [0, 0, 10, 10], 0.9), _det(1, 1, [110, 100, 20, 10], 0.95)]
    ours, theirs = analyze(gt, dets, 0.3), tidecv_points(gt, dets)
    assert ours.ap50 == pytest.approx(coco_evaluate(gt, dets).stats["AP50"], abs=1e-12)
    assert ours.ap50 == pytest.approx(1.0, abs=1e-12)
    assert sum(ours.error_counts.values()) == 0 and all(v == 0 for v in ours.delta_ap50.values())
    assert theirs["AP50"] == pytest.approx(50.0) and theirs["bkg"] == pytest.approx(50.0)


def test_departure_detection_cap():
    """COCO keeps 100 detections per image *and class*, tidecv 100 per image. One image, one object of each class;
    100 class-b detections far from everything (score .9) and one exact class-a detection (score .5). COCO: AP_a = 1,
    AP_b = 0 (100 false positives, its object missed): AP50 0.5. tidecv keeps the 100 b detections only: AP_a = 0,
    AP50 0."""
    gt = _dataset([1], [(1, 1, [0, 0, 10, 10], 0), (1, 2, [20, 0, 10, 10], 0)])
    dets = [_det(1, 2, [300 + 11 * i, 300, 10, 10], 0.9) for i in range(100)] + [_det(1, 1, [0, 0, 10, 10], 0.5)]
    ours, theirs = analyze(gt, dets, 0.3), tidecv_points(gt, dets)
    assert ours.ap50 == pytest.approx(coco_evaluate(gt, dets).stats["AP50"], abs=1e-12)
    assert ours.ap50 == pytest.approx(0.5, abs=1e-12)
    assert ours.error_counts["bkg"] == 100 and ours.error_counts["miss"] == 1
    assert theirs["AP50"] == pytest.approx(0.0)


# ------------------------------------------------------------------------------------------ confusion, worst images


def test_confusion_matrix_hand_checked():
    """Classes cat, dog; score threshold 0.3. Image 1: cat found (TP cat/cat); a cat detection on the dog (wrong
    class: dog/cat); a dog detection on nothing (background/dog); a second cat detection on the found cat (duplicate:
    background/cat); the third object, a cat, only detected below the threshold (missed: cat/background); a dog
    detection inside a dog crowd region (ignored). Image 2: a dog found at IoU 90/110 (dog/dog).
    Rows cat, dog, background; columns cat, dog, background: [[1, 0, 1], [1, 1, 0], [1, 1, 0]]."""
    gt = _dataset([1, 2], [(1, 1, [0, 0, 10, 10], 0), (1, 2, [20, 0, 10, 10], 0), (1, 1, [40, 0, 10, 10], 0),
                           (1, 2, [200, 200, 50, 50], 1), (2, 2, [0, 0, 10, 10], 0)], cats=((1, "cat"), (2, "dog")))
    dets = [_det(1, 1, [0, 0, 10, 10], 0.9), _det(1, 1, [20, 0, 10, 10], 0.8), _det(1, 2, [100, 100, 10, 10], 0.7),
            _det(1, 1, [0, 0, 10, 10], 0.6), _det(1, 2, [40, 0, 10, 10], 0.2), _det(1, 2, [210, 210, 20, 20], 0.9),
            _det(2, 2, [1, 0, 10, 10], 0.95)]
    a = analyze(gt, dets, 0.3)
    assert a.classes == ["cat", "dog"] and a.background == "background"
    np.testing.assert_array_equal(a.confusion, [[1, 0, 1], [1, 1, 0], [1, 1, 0]])
    rows = confusion_rows(a)
    assert len(rows) == 6 and {"actual": "dog", "predicted": "cat"} in rows
    assert rows.count({"actual": "background", "predicted": "dog"}) == 1
    im1, im2 = a.images
    assert (im1.true_positives, im1.wrong_class) == ([(0, 0)], [(1, 1)])
    assert sorted(im1.false_positives) == [2, 3] and im1.missed == [2]
    assert im1.num_errors == 2 + 1 + 2 * 1 and im2.num_errors == 0
    assert worst_images(a, 4) == [im1]


def test_worst_image_is_the_one_with_a_removed_object(gt):
    """Detections equal to the ground truth (score 1) leave no error; removing one object from image B and one from
    image A (B's id < A's) makes each detection there a false positive: B ranks first, A second (ties by image id),
    no other image is listed."""
    dets = [_det(x["image_id"], x["category_id"], x["bbox"], 1.0) for x in gt["annotations"] if not x["iscrowd"]]
    assert worst_images(analyze(gt, dets, 0.3), 4) == []
    counts = {}
    for x in gt["annotations"]:
        counts[x["image_id"]] = counts.get(x["image_id"], 0) + 1
    a_id, b_id = sorted(i for i, n in counts.items() if n >= 2)[-1], sorted(counts)[0]
    removed = {next(x["id"] for x in gt["annotations"] if x["image_id"] == i and not x["iscrowd"]) for i in (a_id, b_id)}
    gt2 = dict(gt, annotations=[x for x in gt["annotations"] if x["id"] not in removed])
    ranked = worst_images(analyze(gt2, dets, 0.3), 4)
    assert [im.image_id for im in ranked] == [b_id, a_id]
    assert all(len(im.false_positives) == 1 and im.num_errors == 1 for im in ranked)


def test_write_error_plots_json(gt, dets, tmp_path):
    """confusion.json (one row per count), confusion_counts.json (row-normalized rows sum to 1), errors.json (the
    eight ΔAP of the analysis), an empty worst_images folder when none is asked for."""
    from detpipe.evaluation.plots import write_error_plots

    a = analyze(gt, dets, 0.3)
    write_error_plots(tmp_path, a, tmp_path / "no_val_needed", 0)
    rows = json.loads((tmp_path / "confusion.json").read_text())["confusion"]
    assert len(rows) == int(a.confusion.sum())
    table = json.loads((tmp_path / "confusion_counts.json").read_text())
    assert table["classes"][-1] == "background" and np.array(table["counts"]).shape == (81, 81)
    norm = np.array(table["row_normalized"])
    full = np.array(table["counts"]).sum(axis=1) > 0
    np.testing.assert_allclose(norm[full].sum(axis=1), 1.0, atol=1e-5)
    bars = json.loads((tmp_path / "errors.json").read_text())["errors"]
    assert [b["error"] for b in bars] == [*TIDE_ERRORS, *SPECIAL_ERRORS]
    assert all(b["dAP50"] == pytest.approx(a.delta_ap50[b["error"]], abs=1e-6) for b in bars)
    assert list((tmp_path / "worst_images").iterdir()) == []


def test_no_ground_truth_is_coco_undefined():
    """No non-crowd object anywhere: AP50 -1 like COCOeval's (the stage compares the two), every ΔAP 0, the
    detections in the background row."""
    gt = _dataset([1], [(1, 1, [0, 0, 10, 10], 1)])
    dets = [_det(1, 2, [50, 50, 10, 10], 0.9)]
    a = analyze(gt, dets, 0.3)
    assert a.ap50 == coco_evaluate(gt, dets).stats["AP50"] == -1.0
    assert set(a.delta_ap50.values()) == {0.0}
    np.testing.assert_array_equal(a.confusion, [[0, 0, 0], [0, 0, 0], [0, 1, 0]])


def test_bad_input_names_the_record(gt, dets):
    bad = copy.deepcopy(dets[:3])
    bad[2]["category_id"] = 999
    with pytest.raises(StageError, match=r"preds.json: detection 2: category_id 999"):
        analyze(gt, bad, 0.3, dt_source="preds.json")
    with pytest.raises(ValueError, match="score_threshold"):
        analyze(gt, dets, 1.5)


def test_worst_images_drawn(monkeypatch, tmp_path):
    """The hand-checked image of `test_confusion_matrix_hand_checked` drawn: ``1_1.png``, the image's size plus a
    legend strip below, with pixels of each colour the drawing uses (true positive, false positive, missed, wrong
    class); image 2 (no error) is not drawn."""
    import io

    from PIL import Image

    from detpipe.evaluation import plots

    gt = _dataset([1, 2], [(1, 1, [0, 0, 30, 30], 0), (1, 2, [60, 0, 30, 30], 0), (1, 1, [120, 0, 30, 30], 0),
                           (2, 2, [0, 0, 10, 10], 0)], cats=((1, "cat"), (2, "dog")))
    dets = [_det(1, 1, [0, 0, 30, 30], 0.9), _det(1, 1, [60, 0, 30, 30], 0.8), _det(1, 2, [100, 100, 30, 30], 0.7),
            _det(2, 2, [0, 0, 10, 10], 0.9)]
    buf = io.BytesIO()
    Image.new("RGB", (320, 240), (128, 128, 128)).save(buf, format="PNG")
    rows = {1: {"image_id": 1, "file_name": "1.png", "image": buf.getvalue()}}
    monkeypatch.setattr(plots, "_val_image_rows_by_id", lambda split_dir, ids: {i: rows[i] for i in ids})
    plots.write_error_plots(tmp_path, analyze(gt, dets, 0.3), tmp_path / "val", 4)
    assert [p.name for p in (tmp_path / "worst_images").iterdir()] == ["1_1.png"]
    drawn = np.asarray(Image.open(tmp_path / "worst_images" / "1_1.png").convert("RGB"))
    assert drawn.shape[1] == 320 and drawn.shape[0] > 240
    from PIL import ImageColor

    for color in plots.WORST_IMAGE_COLORS.values():
        rgb = np.array(ImageColor.getrgb(color))
        assert (np.abs(drawn[:240].astype(int) - rgb).sum(axis=2) == 0).any(), f"no {color} box in the image"
        assert (np.abs(drawn[240:].astype(int) - rgb).sum(axis=2) == 0).any(), f"no {color} in the legend"
