"""The transformers family (RT-DETRv2, issue 45) through the stages after training: the session fixture
`fitted_detr_workdir` (rtdetr_v2_tiny trained by the real train stage on the learns test's 4 images at 128 px until
it fits them, AP50 >= 0.9 by the real evaluate stage: tests/stages/test_learns.py) exported by the real export
stage (ONNX and OpenVINO behind the parity gate, int8 behind the accuracy gate; torch.export declared unsupported
for the family), then
``python -m detpipe.predict`` and ``python -m detpipe.serve`` on the exported ONNX file.

What is proven: the export stage passes its gate with this family and says why torch.export is absent; predict's
COCO results from the ONNX file score AP50 >= 0.9 against the images' ground truth in original pixels with the
dataset's COCO category ids (pycocotools on the predictions file, not the evaluate stage's code); the server answers a
POSTed image with exactly predict's results for it.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from support.pipeline import LEARNS_IMAGE_IDS, set_params, stage_cli
from support.procs import run
from support.serve import results_differ, running_server

AP50_MIN = 0.9      # as tests/stages/test_learns.py's DETR_AP50_MIN: the same images, now through ONNX and predict


@pytest.fixture(scope="module")
def detr_exported(fitted_detr_workdir, tmp_path_factory) -> Path:
    """A copy of `fitted_detr_workdir` after the real export stage with the default params (torch.export asked
    for: the family declines it) and ``export.formats: [openvino, int8]`` (issue 45 item 4)."""
    work = tmp_path_factory.mktemp("detr_export") / "w"
    shutil.copytree(fitted_detr_workdir, work)
    set_params(work, {"export": {"formats": ["openvino", "int8"]}})
    proc = stage_cli("export", work)
    assert "Traceback" not in proc.stderr
    return work


def _coco_ap50(gt_path: Path, preds: list[dict]) -> float:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = COCO(str(gt_path))
    ev = COCOeval(gt, gt.loadRes(preds), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return float(ev.stats[1])


@pytest.mark.slow
def test_export_and_predict_on_onnx(detr_exported, tmp_path):
    """The export report lists ONNX (its parity gate passed: raw outputs compared on every image) and torch.export
    as unsupported; `python -m detpipe.predict` with the default ``models/model.onnx`` on the 4 original images
    writes COCO results (the dataset's category ids, boxes in original pixels inside each image) that score
    AP50 >= `AP50_MIN` by pycocotools against the training JSON."""
    work = detr_exported
    report = json.loads((work / "models" / "export_report.json").read_text())
    assert "onnx" in report["formats"] and (work / "models" / "model.onnx").is_file(), report
    assert "torch_export" in report.get("unsupported", {}) and "torch_export" not in report["formats"], report
    assert not (work / "models" / "torch_export" / "model.pt2").exists()
    onnx = report["formats"]["onnx"]
    assert onnx["gate"] == "parity" and onnx["raw"]["ok"] and onnx["raw"]["compared"] > 0, onnx
    assert onnx["detections"]["compared"] > 0 and onnx["detections"]["match"] == 1.0, onnx

    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "detpipe.predict", str(work / "data/raw/images"), "--out", str(out),
                "--score-threshold", "0", "--no-draw"], work)
    assert "Traceback" not in proc.stderr
    pred_report = json.loads((out / "report.json").read_text())
    assert pred_report["runtime"].startswith("onnxruntime") and pred_report["num_images"] == len(LEARNS_IMAGE_IDS)
    preds = json.loads((out / "predictions.json").read_text())
    gt = json.loads((work / "data/raw/annotations/train.json").read_text())
    size = {im["file_name"]: (im["width"], im["height"]) for im in gt["images"]}
    ids = {im["file_name"]: im["id"] for im in gt["images"]}
    assert {p["category_id"] for p in preds} <= {c["id"] for c in gt["categories"]}
    for p in preds:
        x, y, w, h = p["bbox"]
        width, height = size[p["file_name"]]
        assert -1e-3 <= x <= x + w <= width + 1e-3 and -1e-3 <= y <= y + h <= height + 1e-3, p
    # predict numbers images in its own order: give each result the ground truth's id of its file
    ap50 = _coco_ap50(work / "data/raw/annotations/train.json",
                      [dict(p, image_id=ids[p["file_name"]]) for p in preds])
    print(f"rtdetr_v2_tiny via ONNX + predict: AP50 {ap50:.3f}, {len(preds)} detections")
    assert ap50 >= AP50_MIN, f"predict on the exported ONNX: AP50 {ap50:.3f}"


@pytest.mark.slow
def test_openvino_and_int8_pass_their_gates(detr_exported):
    """``export.formats: [openvino, int8]`` with the transformers family: the OpenVINO IR passes the same raw-output
    parity gate as the ONNX file (the encoder's class and box heads on every val image, within ``export.rtol``), and
    the int8 QDQ file passes the accuracy gate (val AP and AP50 by the evaluate stage's COCO code at most
    ``export.max_ap_drop`` below eager's, detections >= ``export.count_score`` within ``export.max_count_ratio``);
    the int8 file is really quantized (its raw outputs differ from eager's by more than the parity tolerance) and
    both files are written; `metrics/export.json` says ``pass`` for all three."""
    work = detr_exported
    report = json.loads((work / "models" / "export_report.json").read_text())
    ov, q = report["formats"]["openvino"], report["formats"]["int8"]
    assert ov["gate"] == "parity" and ov["raw"]["ok"] and ov["raw"]["compared"] > 0, ov
    assert ov["raw"]["max_rel_diff"] <= report["rtol"], ov
    assert all((work / "models" / "openvino" / f).is_file() for f in ("model.xml", "model.bin"))
    assert q["gate"] == "accuracy" and q["ok"] and q["accuracy"]["ok"] and q["scores"]["ok"], q
    assert q["accuracy"]["drop"]["AP"] <= 0.02 and q["accuracy"]["drop"]["AP50"] <= 0.02, q["accuracy"]
    assert q["accuracy"]["int8"]["AP50"] >= AP50_MIN, q["accuracy"]
    assert q["raw_figures"]["max_rel_diff"] > report["rtol"], q["raw_figures"]     # int8, not a float copy
    assert (work / "models" / "int8" / "model.int8.onnx").is_file()
    gates = json.loads((work / "metrics" / "export.json").read_text())["gate"]
    assert gates == {"onnx": "pass", "openvino": "pass", "int8": "pass"}, gates
    print(f"openvino max rel diff {ov['raw']['max_rel_diff']:.1e}; int8 AP {q['accuracy']['int8']['AP']:.4f} "
          f"(eager {q['accuracy']['eager']['AP']:.4f}), AP50 {q['accuracy']['int8']['AP50']:.3f}, "
          f"quantize {q['seconds']['quantize']:.1f} s")


@pytest.mark.slow
def test_serve_answers_as_predict(detr_exported, tmp_path):
    """``python -m detpipe.serve`` on the exported ONNX: one POSTed image (raw body) is answered with predict's
    results for it (same detections, order, category ids; boxes and scores within `results_differ`'s bounds),
    and it finds its objects (a detection >= 0.25)."""
    work = detr_exported
    name = sorted(f.name for f in (work / "data/raw/images").iterdir())[0]
    images = tmp_path / "images"
    images.mkdir()
    shutil.copyfile(work / "data/raw/images" / name, images / name)
    out = tmp_path / "predicted"
    run([sys.executable, "-m", "detpipe.predict", str(images), "--out", str(out), "--batch-size", "1",
         "--no-draw"], work)
    offline = json.loads((out / "predictions.json").read_text())
    assert offline and max(p["score"] for p in offline) >= 0.25, offline
    with running_server(work / "models/model.onnx", work / "data", tmp_path / "serve.log", "--workers", "1",
                        cwd=work) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            ready = client.get("/readyz").json()
            answer = client.post("/predict", content=(images / name).read_bytes(),
                                 headers={"Content-Type": "image/jpeg"},
                                 params={"image_id": offline[0]["image_id"], "file_name": name})
    assert ready["runtime"].startswith("onnxruntime"), ready
    assert answer.status_code == 200, answer.text
    why = results_differ(answer.json(), offline)
    assert why is None, why
