"""Evaluate stage: coordinates mapped back to original pixels, real COCOeval numbers, metrics file."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from support.pipeline import stage_cli
from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.meta import read_meta
from detpipe.evaluation.detections import label_to_category_id
from detpipe.evaluation.ground_truth import gt_from_arrow
from detpipe.evaluation.coco_metrics import coco_evaluate


def test_cached_boxes_map_back_to_original(cached_workdir):
    """Cached XYXY boxes divided by the stored scale give the COCO [x, y, w, h] boxes of the Arrow rows."""
    meta = read_meta(cached_workdir / "data/arrow/meta.json")
    gt = gt_from_arrow(cached_workdir / "data/arrow/val", meta)
    by_image = {}
    for a in gt["annotations"]:
        if not a["iscrowd"]:
            by_image.setdefault(a["image_id"], []).append(a["bbox"])
    ds = CachedDetectionDataset(cached_workdir / "data/cache", "val")
    checked = 0
    for i in range(len(ds)):
        _, t = ds[i]
        sy, sx = t["scale"].tolist()
        b = t["boxes"].double().numpy()
        xywh = np.stack([b[:, 0] / sx, b[:, 1] / sy, (b[:, 2] - b[:, 0]) / sx, (b[:, 3] - b[:, 1]) / sy], 1)
        expected = np.array(by_image.get(int(t["image_id"]), []), dtype=np.float64).reshape(-1, 4)
        np.testing.assert_allclose(xywh, expected, atol=1e-3)
        checked += len(expected)
    assert checked > 10


def test_ground_truth_as_detections_scores_perfect(cached_workdir):
    """Sanity of the whole GT path: the val ground truth submitted as detections gives AP 1."""
    meta = read_meta(cached_workdir / "data/arrow/meta.json")
    gt = gt_from_arrow(cached_workdir / "data/arrow/val", meta)
    dets = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
            for a in gt["annotations"] if not a["iscrowd"]]
    result = coco_evaluate(gt, dets)
    assert result.stats["AP"] == pytest.approx(1.0)
    assert result.stats["AR100"] == pytest.approx(1.0)


@pytest.fixture(scope="module")
def evaluated(trained_workdir, tmp_path_factory):
    """A copy of `trained_workdir` after the real evaluate stage (the params as they are: 1 process), and that
    run's `subprocess.CompletedProcess`: ``(work, proc)``. Tests must not modify it: copy it."""
    work = tmp_path_factory.mktemp("evaluated") / "w"
    shutil.copytree(trained_workdir, work)
    return work, stage_cli("evaluate", work)


def test_evaluate_stage(evaluated):
    trained_workdir, proc = evaluated       # the evaluate stage's run on a copy of `trained_workdir`
    metrics = json.loads((trained_workdir / "metrics/eval.json").read_text())
    assert list(metrics["bbox"]) == ["AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs",
                                     "ARm", "ARl"]
    assert all(math.isfinite(v) and (v == -1 or 0 <= v <= 1) for v in metrics["bbox"].values())
    meta = read_meta(trained_workdir / "data/arrow/meta.json")
    assert metrics["num_images"] == meta["splits"]["val"]["images"]
    assert metrics["num_detections"] > 0
    assert "Average Precision" in proc.stderr
    pr = json.loads((trained_workdir / "plots/pr_curve.json").read_text())["pr_curve"]
    assert {r["iou"] for r in pr} == {0.5, 0.75}
    # per-class AP only in its plots file (issue 16.3: `dvc exp show` lists the headline metrics only); the TIDE
    # error breakdown (issue 33) is headline: its base is COCOeval's AP50, its bars the same figures
    assert set(metrics) == {"bbox", "num_images", "num_detections", "errors"}
    assert list(metrics["errors"]) == ["AP50", "cls", "loc", "both", "dupe", "bkg", "miss", "FP", "FN"]
    assert metrics["errors"]["AP50"] == pytest.approx(metrics["bbox"]["AP50"], abs=1e-6)
    bars = json.loads((trained_workdir / "plots/errors.json").read_text())["errors"]
    assert {b["error"]: b["dAP50"] for b in bars} == {k: v for k, v in metrics["errors"].items() if k != "AP50"}
    table = json.loads((trained_workdir / "plots/confusion_counts.json").read_text())
    rows = json.loads((trained_workdir / "plots/confusion.json").read_text())["confusion"]
    assert len(rows) == sum(map(sum, table["counts"])) and table["classes"][-1] == "background"
    assert (trained_workdir / "plots/worst_images").is_dir()
    per_class = json.loads((trained_workdir / "plots/per_class_ap.json").read_text())["per_class_ap"]
    gt_val = gt_from_arrow(trained_workdir / "data/arrow/val", meta)
    names = {c["id"]: c["name"] for c in gt_val["categories"]}
    with_gt = {names[a["category_id"]] for a in gt_val["annotations"] if not a["iscrowd"]}
    assert {r["class"] for r in per_class} == with_gt
    assert all(0 <= r["AP"] <= 1 for r in per_class)
    assert "(faster_coco_eval)" in proc.stderr  # the default backend
    # val images drawn at their original size
    from PIL import Image
    pngs = sorted((trained_workdir / "plots/val_images").glob("*.png"))
    assert len(pngs) == min(4, metrics["num_images"])
    gt = gt_from_arrow(trained_workdir / "data/arrow/val", meta)
    sizes = {im["id"]: (im["width"], im["height"]) for im in gt["images"]}
    for p in pngs:
        assert Image.open(p).size == sizes[int(p.stem)]


@pytest.mark.slow
def test_two_process_evaluate_equals_one(evaluated, tmp_path):
    """evaluate.nproc_per_node: 2 ranks each predict half of val; rank 0 gathers: same stats as 1 process (the
    1-process run is `evaluated`'s, shared with test_evaluate_stage)."""
    from support.pipeline import write_params

    work = tmp_path / "w"
    shutil.copytree(evaluated[0], work)
    one = json.loads((work / "metrics/eval.json").read_text())
    write_params(work, {"evaluate": {"nproc_per_node": 2}})
    proc = stage_cli("evaluate", work)
    assert "--nproc-per-node 2" in proc.stderr
    two = json.loads((work / "metrics/eval.json").read_text())
    assert two["num_detections"] == one["num_detections"]
    for k, v in one["bbox"].items():
        assert two["bbox"][k] == pytest.approx(v, abs=1e-12), k


def test_label_mapping_roundtrip(cached_workdir):
    meta = read_meta(cached_workdir / "data/arrow/meta.json")
    l2c = label_to_category_id(meta)
    assert sorted(l2c) == list(range(1, meta["num_classes"]))
    assert sorted(l2c.values()) == sorted(c["id"] for c in meta["categories"])


def test_missing_model_is_one_line_error(cached_workdir, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(cached_workdir, work)
    proc = stage_cli("evaluate", work, check=False)
    assert proc.returncode == 2 and "models/model.pt: not found" in proc.stderr
    assert "Traceback" not in proc.stderr and not (work / "metrics").exists()
