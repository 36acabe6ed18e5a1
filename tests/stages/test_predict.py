"""`python -m detpipe.predict` (issue 27.2, 27.4) on a model that fits real images: the session fixture
`fitted_workdir` (tests/stages/test_learns.py's clean run: ssdlite320 trained on 4 COCO128 images of 4 classes until it
fits them), exported here ONNX-only by the real export stage.

What is proven: the ONNX file and model.pt give the same predictions under the export gate's own comparison
(raw pre-NMS outputs within ``export.rtol``, final detections matched by `detpipe.export.parity.parity`); boxes
come back in original-image pixels (IoU >= 0.5 with the ground truth on images that are not 320x320, while the
same boxes left in the model's 320x320 frame are not); category ids are the dataset's COCO ids, not the
contiguous training labels, and a YOLO copy of the dataset's are its class indices (predictions and model card); EXIF orientation and 16-bit images decode as the pipeline decodes them; corrupt,
empty and non-image files are skipped, counted and named; every source kind (folder, glob, file, http URL, s3
prefix) lists the same images; a missing model, missing data meta or empty source is a one-line error.
"""
from __future__ import annotations

import io
import json
import shutil
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.ops import box_iou

from detpipe import params as params_mod
from detpipe.data.imageio import decode_rgb
from detpipe.core.errors import StageError
from detpipe.export.batched import session_runner
from detpipe.export.exporter import DetectionExport
from detpipe.export.parity import parity, split_outputs
from detpipe.models import load_model, uses_masks
from detpipe.predict import data_meta, predict, prepare
from support.pipeline import COCO128, LEARNS_IMAGE_IDS, set_params, stage_cli
from support.procs import run

# The fitted images the model is surest of: a dog (category 18) scored ~1.0 and a giraffe (25) ~0.95, both at
# IoU ~0.8 with their ground truth (the other two images' best detections are of another class, see docs).
SUREST = ("000000000042.jpg", "000000000072.jpg")
# COCO128 images outside the learns set, of several sizes (640x480, 640x426, 640x428, 481x640)
OTHER_IMAGES = ("000000000009.jpg", "000000000025.jpg", "000000000030.jpg", "000000000036.jpg")


@pytest.fixture(scope="module")
def exported(fitted_workdir, tmp_path_factory) -> Path:
    """A copy of `fitted_workdir` after the real export stage with ``export.torch_export: false``:
    ``models/model.onnx`` next to ``models/model.pt``."""
    work = tmp_path_factory.mktemp("predict") / "w"
    shutil.copytree(fitted_workdir, work)
    set_params(work, {"export": {"torch_export": False}})
    stage_cli("export", work)
    assert (work / "models" / "model.onnx").is_file()
    return work


@pytest.fixture(scope="module")
def gt(exported) -> dict:
    """The learns images' COCO ground truth (original pixels, COCO category ids)."""
    return json.loads((exported / "data/raw/annotations/train.json").read_text())


def _folder(dest: Path, work: Path, others: tuple[str, ...] = ()) -> Path:
    """``dest`` with the 4 learns images and ``others`` from COCO128."""
    dest.mkdir(parents=True)
    for f in (work / "data/raw/images").iterdir():
        shutil.copyfile(f, dest / f.name)
    for name in others:
        shutil.copyfile(COCO128 / "train2017" / name, dest / name)
    return dest


def _run(work: Path, source, out: Path, model: str = "models/model.onnx", **kw) -> tuple[dict, list[dict]]:
    """`predict` in ``work`` (its data/ and model); returns ``(report, predictions)``."""
    report = predict(str(source), work / model, out, data_dir=work / "data", **kw)
    return report, json.loads((out / "predictions.json").read_text())


def _dets(preds: list[dict], file_name: str) -> dict:
    """One image's predictions as `detpipe.export.parity.match_detections` input: XYXY original pixels."""
    rows = [p for p in preds if p["file_name"] == file_name]
    return {"boxes": torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (p["bbox"] for p in rows)]).reshape(-1, 4),
            "scores": torch.tensor([p["score"] for p in rows]),
            "labels": torch.tensor([p["category_id"] for p in rows], dtype=torch.int64)}


def test_prepared_images_are_the_cached_ones(exported, gt):
    """predict's preprocessing (`detpipe.predict.prepare` with the cache's meta) gives the model exactly the
    pixels (bit for bit) and scale that the augment stage stored for the same images, which training and the
    evaluate stage read."""
    from detpipe.data.dataset import CachedDetectionDataset

    _, cfg = data_meta(exported / "data")
    cache = CachedDetectionDataset(exported / "data/cache", "train")
    names = {im["id"]: im["file_name"] for im in gt["images"]}
    assert len(cache) == len(LEARNS_IMAGE_IDS)
    for i in range(len(cache)):
        image, target = cache[i]
        name = names[int(target["image_id"])]
        prep = prepare((exported / "data/raw/images" / name).read_bytes(), name, cfg)
        assert torch.equal(prep.image, image), name
        assert np.allclose(prep.scale, target["scale"].numpy(), rtol=0, atol=1e-12), name
        assert prep.orig_size == tuple(int(v) for v in target["orig_size"]), name


def test_onnx_and_eager_predictions_agree(exported, tmp_path):
    """On 8 real images (the 4 fitted ones, 4 others): (1) the export gate's verdict on predict's prepared inputs:
    every raw pre-NMS output of the ONNX file equals model.pt's within ``export.rtol`` of its rms; (2) the
    predictions written by ``--model model.onnx`` and ``--model model.pt`` (eager, batches of 3), boxes in original
    pixels, match by the gate's detection matching (same category, IoU >= ``export.iou_match``, ties at the
    top-k boundary apart) for every eager detection with score >= ``export.score_threshold``."""
    cfg = params_mod.Export()
    folder = _folder(tmp_path / "images", exported, OTHER_IMAGES)
    _, prep_cfg = data_meta(exported / "data")
    inputs = [prepare(f.read_bytes(), f.name, prep_cfg).image for f in sorted(folder.iterdir())]

    model, _ = load_model(exported / "models/model.pt")
    masks = uses_masks(model)
    wrapper = DetectionExport(model, masks).eval()
    names = wrapper.output_names(inputs[0])[3 + int(masks):]
    import onnxruntime as ort
    session = ort.InferenceSession(str(exported / "models/model.onnx"), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        eager = [split_outputs(wrapper(im), masks) for im in inputs]
    onnx = [split_outputs(o, masks) for o in session_runner(session).many(inputs)]   # one call (batched graph)
    gate = parity(eager, onnx, names, cfg.rtol, cfg.score_threshold, cfg.iou_match)
    assert gate["raw"]["ok"] and gate["raw"]["compared"] == len(inputs) * len(names), gate["raw"]

    rep_onnx, p_onnx = _run(exported, folder, tmp_path / "onnx", score_threshold=0.0, batch_size=3,
                            draw_images=False)
    rep_pt, p_pt = _run(exported, folder, tmp_path / "pt", "models/model.pt", score_threshold=0.0, batch_size=3,
                        draw_images=False)
    assert rep_onnx["runtime"].startswith("onnxruntime") and rep_pt["runtime"].startswith("torch")
    assert rep_onnx["images"] == rep_pt["images"] and rep_onnx["num_images"] == len(inputs)
    from detpipe.export.parity import match_detections, summarize_detections
    per_image = [match_detections(_dets(p_pt, im["file_name"]), _dets(p_onnx, im["file_name"]),
                                  cfg.score_threshold, cfg.iou_match) for im in rep_pt["images"]]
    summary = summarize_detections(per_image)
    print(f"raw max rel diff {gate['raw']['max_rel_diff']:.2g}; detections {summary}")
    assert summary["compared"] >= len(LEARNS_IMAGE_IDS) and summary["match"] == 1.0, summary


def test_boxes_in_original_pixels_with_dataset_category_ids(exported, gt, tmp_path):
    """The command as a user runs it (defaults: models/model.onnx, data/) on the 4 fitted images (none 320x320):
    on the two it fits best (`SUREST`) the best detection is of the ground truth's category and overlaps its box
    by IoU >= 0.5 in original pixels, while the same box left in the model's 320x320 frame does not (the check
    can tell); every category id and name is one of the dataset's COCO ones (18 dog, 22 elephant, 24 zebra,
    25 giraffe), never a training label 1..4; drawn images are written, one per input."""
    folder = _folder(tmp_path / "images", exported)
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "detpipe.predict", str(folder), "--out", str(out)], exported)
    assert "Traceback" not in proc.stderr
    report = json.loads((out / "report.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    cats = {c["id"]: c["name"] for c in gt["categories"]}
    assert sorted(cats) == [18, 22, 24, 25]
    assert {p["category_id"] for p in preds} <= set(cats)
    assert all(p["category_name"] == cats[p["category_id"]] for p in preds)
    assert sorted(f.name for f in (out / "images").iterdir()) == sorted(f.name for f in folder.iterdir())
    by_name = {im["file_name"]: im for im in gt["images"]}
    checked = 0
    for image in report["images"]:
        truth = by_name[image["file_name"]]
        assert (image["width"], image["height"]) == (truth["width"], truth["height"]) != (320, 320)
        mine = [p for p in preds if p["file_name"] == image["file_name"]]
        assert all(p["image_id"] == image["id"] for p in mine)
        if image["file_name"] not in SUREST:
            continue
        top = max(mine, key=lambda p: p["score"])
        assert top["score"] >= 0.5, top
        boxes = [a["bbox"] for a in gt["annotations"] if a["image_id"] == truth["id"]
                 and a["category_id"] == top["category_id"]]
        assert boxes, f"{image['file_name']}: best detection is a {top['category_name']}, not in the image"
        xyxy = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in [top["bbox"], *boxes]], dtype=torch.float64)
        iou = box_iou(xyxy[:1], xyxy[1:]).max().item()
        scale = torch.tensor([320 / truth["width"], 320 / truth["height"]] * 2, dtype=torch.float64)
        iou_model_frame = box_iou(xyxy[:1] * scale, xyxy[1:]).max().item()
        print(f"{image['file_name']}: {top['category_name']} {top['score']:.2f}, IoU {iou:.3f} "
              f"(in the 320x320 frame {iou_model_frame:.3f})")
        assert iou >= 0.5 and iou_model_frame < 0.5
        checked += 1
    assert checked == len(SUREST)


def test_yolo_dataset_ids_and_names_in_predictions_and_model_card(exported, gt, tmp_path):
    """The fitted model with its 4 images converted from a YOLO copy of them (labels written by globox 2.9.0 from
    the COCO annotations; data.yaml ``names`` in COCO id order, so the training labels 1..4 are the same classes):
    predict's category ids are the YOLO class indices of ``names`` (dog 0, elephant 1, zebra 2, giraffe 3) with
    their names, never the COCO ids (18, 22, 24, 25) the same model reports with the COCO meta; the model card's
    class table lists label -> the dataset's id -> name for each (YOLO indices, then COCO ids)."""
    import yaml
    from globox import AnnotationSet

    from detpipe.data.convert import convert
    from detpipe.export.model_card import model_card

    names = [c["name"] for c in sorted(gt["categories"], key=lambda c: c["id"])]
    assert names == ["dog", "elephant", "zebra", "giraffe"]
    work = tmp_path / "w"
    shutil.copytree(exported, work, ignore=shutil.ignore_patterns("checkpoints", ".dvc"))
    yraw = tmp_path / "yolo"
    (yraw / "labels").mkdir(parents=True)
    shutil.copytree(exported / "data/raw/images", yraw / "images" / "train")
    AnnotationSet.from_coco(exported / "data/raw/annotations/train.json").save_yolo_v5(
        yraw / "labels" / "train", label_to_id={n: i for i, n in enumerate(names)})
    shutil.copytree(exported / "data/raw/val_images", yraw / "images" / "val")     # same pixels, other bytes
    shutil.copytree(yraw / "labels" / "train", yraw / "labels" / "val")
    (yraw / "data.yaml").write_text(yaml.safe_dump({"train": "images/train", "val": "images/val", "names": names}))
    cfg = params_mod.load("convert", work / "params.yaml").model_copy(update={"format": "yolo", "workers": 0})
    shutil.rmtree(work / "data/arrow")
    convert(yraw, work / "data/arrow", cfg, progress=False)
    meta = json.loads((work / "data/arrow/meta.json").read_text())
    assert meta["format"] == "yolo" and meta["label_names"][1:] == names

    _, preds = _run(work, _folder(tmp_path / "images", work), tmp_path / "out")
    assert preds and {p["category_id"] for p in preds} <= {0, 1, 2, 3}
    assert all(p["category_name"] == names[p["category_id"]] for p in preds)
    for file_name, name in zip(SUREST, ("dog", "giraffe")):
        top = max((p for p in preds if p["file_name"] == file_name), key=lambda p: p["score"])
        assert (top["category_id"], top["category_name"]) == (names.index(name), name), top
    _, coco_preds = _run(exported, _folder(tmp_path / "images_coco", exported), tmp_path / "out_coco")
    assert {p["category_id"] for p in coco_preds} <= {18, 22, 24, 25}

    ckpt = torch.load(work / "models/model.pt", weights_only=True)
    report = json.loads((work / "models/export_report.json").read_text())
    for arrow, ids in ((work / "data/arrow", [0, 1, 2, 3]), (exported / "data/arrow", [18, 22, 24, 25])):
        card = model_card(ckpt, report, arrow, work / "metrics/eval.json")
        assert ("label 0 is the background); yolo dataset: ids are the class indices of data.yaml:" in card) == \
            (ids[0] == 0)
        assert ("label 0 is the background):\n" in card) == (ids[0] != 0)
        for label, (cid, name) in enumerate(zip(ids, names), 1):
            assert f"| {label} | {cid} | {name} |" in card.splitlines(), card


def test_exif_orientation_and_bit_depth_decode_like_the_pipeline(exported, tmp_path):
    """A fitted image stored rotated with EXIF orientation 6 predicts as the upright image (same detections and
    size, the displayed one); a 16-bit grayscale PNG as the 8-bit grayscale PNG of the same content."""
    src = exported / "data/raw/images" / "000000000042.jpg"
    upright = decode_rgb(src.read_bytes(), src.name)
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(upright).save(folder / "upright.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated 90 degrees counter-clockwise; viewers (exif_transpose) turn it back
    Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90).save(folder / "exif6.png", exif=exif)
    assert np.array_equal(decode_rgb((folder / "exif6.png").read_bytes()), upright)
    gray = np.asarray(Image.fromarray(upright).convert("L"))
    Image.fromarray(gray).save(folder / "gray8.png")
    buf = io.BytesIO()
    Image.fromarray(gray.astype(np.uint16) * 257).save(buf, format="PNG")  # v * 257: 16-bit, >> 8 gives v back
    (folder / "gray16.png").write_bytes(buf.getvalue())
    assert Image.open(folder / "gray16.png").mode.startswith("I")

    from detpipe.export.parity import match_detections
    report, preds = _run(exported, folder, tmp_path / "out", score_threshold=0.05, draw_images=False)
    sizes = {im["file_name"]: (im["width"], im["height"]) for im in report["images"]}
    assert sizes["exif6.png"] == sizes["upright.png"] == (upright.shape[1], upright.shape[0])
    for a, b in (("upright.png", "exif6.png"), ("gray8.png", "gray16.png")):
        ref = _dets(preds, a)
        assert len(ref["scores"]) > 0
        m = match_detections(ref, _dets(preds, b), 0.05, 0.99)
        assert m["matched"] == m["compared"] == len(ref["scores"]), (a, b, m)


@pytest.mark.parametrize("model", ["models/model.onnx", "models/model.pt"])
def test_unreadable_files_are_skipped_counted_and_named(exported, tmp_path, model):
    """A folder with 2 good images, a truncated JPEG, an empty .jpg and a text file: the command (both runtimes)
    exits 0, predicts the 2 images, counts the 3 others as skipped, names each in its log and report.json, and
    prints no traceback."""
    folder = tmp_path / "images"
    folder.mkdir()
    good = [COCO128 / "train2017" / name for name in OTHER_IMAGES[:2]]
    for f in good:
        shutil.copyfile(f, folder / f.name)
    data = good[0].read_bytes()
    (folder / "truncated.jpg").write_bytes(data[:len(data) // 2])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.txt").write_text("not an image\n")
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "detpipe.predict", str(folder), "--model", model, "--out", str(out),
                "--batch-size", "2"], exported)
    assert "Traceback" not in proc.stderr
    report = json.loads((out / "report.json").read_text())
    bad = {"truncated.jpg", "empty.jpg", "notes.txt"}
    assert report["num_images"] == 2 and report["num_skipped"] == 3
    assert {s["file_name"] for s in report["skipped"]} == bad
    assert {im["file_name"] for im in report["images"]} == {f.name for f in good}
    for name in bad:
        assert f"skipped {name}" in proc.stderr
    assert "3 skipped (" in proc.stderr
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(f.name for f in good)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_every_source_kind_lists_the_same_images(exported, tmp_path, s3_server, monkeypatch):
    """A folder, a glob, one file, an http:// URL (Python's http.server on 127.0.0.1) and an s3:// prefix
    (SeaweedFS): the same images give the same predictions; names are relative to the source's folder."""
    folder = _folder(tmp_path / "images", exported)
    (folder / "sub").mkdir()
    shutil.copyfile(COCO128 / "train2017" / OTHER_IMAGES[0], folder / "sub" / OTHER_IMAGES[0])
    names = sorted(f.name for f in folder.iterdir() if f.is_file())

    def listed(source, **kw) -> tuple[list[str], list[dict]]:
        report, preds = _run(exported, source, tmp_path / "out", score_threshold=0.3, draw_images=False, **kw)
        return [im["file_name"] for im in report["images"]], sorted(
            (p["file_name"], p["category_id"], round(p["score"], 4)) for p in preds)

    base = listed(folder)
    assert base[0] == names  # the folder's own files, not its subfolder's
    assert listed(f"{folder}/*.jpg") == base
    assert listed(f"{folder}/**/*.jpg")[0] == sorted([*names, f"sub/{OTHER_IMAGES[0]}"])
    one = listed(folder / names[0])
    assert one == ([names[0]], [p for p in base[1] if p[0] == names[0]])

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert listed(f"http://127.0.0.1:{server.server_address[1]}/{names[0]}") == one
    finally:
        server.shutdown()
        server.server_close()

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.create_bucket()
    fs = s3_server.filesystem()
    for name in names:
        fs.put_file(str(folder / name), f"{bucket}/photos/{name}")
    assert listed(f"s3://{bucket}/photos", endpoint_url=s3_server.endpoint_url) == base


@pytest.mark.parametrize("case", ["model", "data", "empty", "nomatch", "missing", "all_bad"])
def test_clear_errors(exported, tmp_path, case):
    """Each bad invocation is a `StageError` naming the file or source and the rule; the command prints it as one
    line (``error: ...``, exit status 2), no traceback, and writes nothing."""
    folder = _folder(tmp_path / "images", exported)
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jpg").write_bytes(b"\xff\xd8 not really")
    source, model, data, expect = {
        "model": (folder, "models/nothing.onnx", "data", "models/nothing.onnx: model not found"),
        "data": (folder, "models/model.onnx", str(tmp_path), "arrow/meta.json: not found"),
        "empty": (empty, "models/model.onnx", "data", "the folder has no files"),
        "nomatch": (f"{folder}/*.webp", "models/model.onnx", "data", "the glob matches no file"),
        "missing": (tmp_path / "nowhere", "models/model.onnx", "data", "nowhere: not found"),
        "all_bad": (tmp_path / "bad", "models/model.onnx", "data", "none of its 1 files could be read"),
    }[case]
    out = tmp_path / "out"
    with pytest.raises(StageError, match=expect.replace("*", r"\*")):
        predict(str(source), exported / model, out, data_dir=exported / data)
    assert not (out / "predictions.json").exists()
    if case == "model":
        proc = run([sys.executable, "-m", "detpipe.predict", str(source), "--model", model, "--out", str(out)],
                   exported, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {expect}")
