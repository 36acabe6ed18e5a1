"""Export stage: TorchScript and ONNX files that agree with the eager model, and a failing parity gate."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import recalibrated_model, run_stage
from detpipe.errors import StageError
from detpipe.data import CachedDetectionDataset
from stages.export import match_detections


@pytest.fixture(scope="module")
def confident_workdir(trained_workdir, tmp_path_factory):
    """`trained_workdir` with a model whose scores depend on the image and are well separated.

    A few tiny training steps leave BatchNorm's running statistics near their initial values, so that model's
    outputs hardly depend on the input and every score is ≈ 1/81 (comparing exports on it means nothing).
    Here BatchNorm statistics are recalibrated on the training images (cumulative average) and the
    classification logits doubled: a cheap stand-in for a trained model.
    """
    work = tmp_path_factory.mktemp("confident")
    shutil.copytree(trained_workdir, work, dirs_exist_ok=True)
    model, ckpt = recalibrated_model(work)
    with torch.no_grad():
        for m in model.head.classification_head.module_list:
            last = [c for c in m.modules() if isinstance(c, torch.nn.Conv2d)][-1]
            last.weight.mul_(2)
            last.bias.mul_(2)
    ckpt["model"] = model.state_dict()
    torch.save(ckpt, work / "models/model.pt")
    return work


def test_untrained_model_report_is_vacuous(trained_workdir, tmp_path):
    """A barely trained model has no detection above the threshold: the report says nothing was compared."""
    work = tmp_path / "w"
    shutil.copytree(trained_workdir, work)
    proc = run_stage("export", work)
    report = json.loads((work / "models/export_report.json").read_text())
    assert report["onnx"]["vacuous"] and report["onnx"]["compared"] == 0
    assert "nothing was compared" in proc.stderr


def test_export_stage(confident_workdir, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(confident_workdir, work)
    run_stage("export", work)
    report = json.loads((work / "models/export_report.json").read_text())
    for fmt in ("torchscript", "onnx"):
        assert report[fmt]["compared"] > 20 and report[fmt]["match"] >= 0.99 and not report[fmt]["vacuous"]
    card = (work / "models/model_card.md").read_text()
    assert "ssdlite320_mobilenet_v3_large" in card and "onnxruntime" in card and "sha256" in card
    # the files load and run on their own, on an image of a size other than the export example's
    image = CachedDetectionDataset(work / "data/cache", "val")[0][0]
    image = torch.nn.functional.interpolate(image[None], size=(300, 400))[0]
    ts = torch.jit.load(str(work / "models/model.ts"))
    _, dets = ts([image])
    sess = ort.InferenceSession(str(work / "models/model.onnx"), providers=["CPUExecutionProvider"])
    boxes, scores, labels = sess.run(None, {"image": image.numpy()})
    assert boxes.shape[1] == 4 and len(boxes) == len(scores) == len(labels) == len(dets[0]["boxes"]) > 0
    ref = {k: dets[0][k] for k in ("boxes", "scores", "labels")}
    got = {"boxes": torch.from_numpy(boxes), "scores": torch.from_numpy(scores),
           "labels": torch.from_numpy(labels.astype(np.int64))}
    m = match_detections(ref, got, 0.05, 0.99)
    assert m["matched"] == m["compared"] > 0


def test_match_detections_detects_disagreement():
    ref = {"boxes": torch.tensor([[0., 0, 10, 10], [20, 20, 40, 40]]), "scores": torch.tensor([0.9, 0.8]),
           "labels": torch.tensor([1, 2])}
    same = match_detections(ref, ref, 0.5, 0.99)
    assert same == {"compared": 2, "matched": 2, "boundary": 0, "max_box_diff": 0.0, "max_score_diff": 0.0}
    moved = {**ref, "boxes": ref["boxes"] + torch.tensor([[0., 0, 0, 0], [2, 2, 2, 2]])}
    assert match_detections(ref, moved, 0.5, 0.99)["matched"] == 1
    relabeled = {**ref, "labels": torch.tensor([1, 3])}
    assert match_detections(ref, relabeled, 0.5, 0.99)["matched"] == 1
    missing = {k: v[:1] for k, v in ref.items()}
    assert match_detections(ref, missing, 0.5, 0.99) == {"compared": 2, "matched": 1, "boundary": 0,
                                                         "max_box_diff": 0.0, "max_score_diff": 0.0}


def test_zero_area_boxes_match_themselves():
    """Boxes clipped flat at the image border have zero area (IoU NaN): equal coordinates still match."""
    ref = {"boxes": torch.tensor([[320., 10, 320, 50], [0, 0, 10, 10]]), "scores": torch.tensor([0.9, 0.8]),
           "labels": torch.tensor([1, 1])}
    assert match_detections(ref, ref, 0.5, 0.99)["matched"] == 2
    moved = {**ref, "boxes": torch.tensor([[318., 10, 318, 50], [0, 0, 10, 10]])}
    assert match_detections(ref, moved, 0.5, 0.99)["matched"] == 1


def test_truncation_boundary_is_not_a_disagreement():
    """A full output that kept another of two near-equal candidates is not counted against parity, but a
    missing detection scoring clearly above the other's lowest kept score is."""
    ref = {"boxes": torch.tensor([[0., 0, 10, 10], [20, 20, 40, 40]]),
           "scores": torch.tensor([0.0123401, 0.0123400]), "labels": torch.tensor([1, 1])}
    other = {"boxes": torch.tensor([[0., 0, 10, 10], [50, 50, 60, 60]]),
             "scores": torch.tensor([0.0123401, 0.0123400]), "labels": torch.tensor([1, 1])}
    m = match_detections(ref, other, 0.0, 0.99)
    assert m["matched"] == 1 and m["boundary"] == 1 and m["compared"] == 1
    confident = {**ref, "scores": torch.tensor([0.9, 0.8])}
    m = match_detections(confident, {**other, "scores": torch.tensor([0.9, 0.1])}, 0.0, 0.99)
    assert m["matched"] == 1 and m["boundary"] == 0 and m["compared"] == 2


def test_parity_gate_fails_and_writes_nothing(confident_workdir, tmp_path, monkeypatch):
    """An exported model that disagrees with the eager one stops the stage, and no model file is left."""
    import stages.export as export_mod
    from detpipe.params import Export

    work = tmp_path / "w"
    shutil.copytree(confident_workdir, work)
    monkeypatch.chdir(work)
    real_match = export_mod.match_detections

    def shifted(ref, other, thr, iou):  # the exported boxes seen 5 pixels off
        return real_match(ref, {**other, "boxes": other["boxes"] + 5.0}, thr, iou)

    monkeypatch.setattr(export_mod, "match_detections", shifted)
    with pytest.raises(StageError, match="parity check failed"):
        export_mod.export(Export(num_images=2))
    assert not any((work / "models").glob("model.ts")) and not any((work / "models").glob("model.onnx"))
