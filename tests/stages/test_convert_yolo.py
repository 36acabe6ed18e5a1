"""Tests of the YOLO reader (detpipe/data/yolo_reader.py) and ``convert.format`` on real COCO128 images whose YOLO
labels were written by an independent converter (globox 2.9.0: ``AnnotationSet.from_coco`` then ``save_yolo_v5``)
and read back both by globox (``from_yolo_v5``, its own image-header parser) and by our convert stage."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from detpipe.data.convert import convert
from detpipe.core.errors import StageError
from detpipe.params import Convert
from support import formats
from support.formats import ANN, COCO, N_TRAIN, N_VAL, REPO, coco_copy
from support.pipeline import read_rows



def params(**kw) -> Convert:
    return formats.params("yolo", **kw)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict:
    """COCO128's first 14 images (by id): a COCO copy (train 10 / val 4 as two files) and a YOLO copy written by
    globox (``raw_yolo``: data.yaml, images/{train,val}, labels/{train,val})."""
    from globox import AnnotationSet

    root = tmp_path_factory.mktemp("yolo")
    base = coco_copy(root)
    src, parts = base["src"], base["parts"]
    names = [c["name"] for c in sorted(src["categories"], key=lambda c: c["id"])]
    coco_raw = base["coco_raw"]
    yolo_raw = root / "raw_yolo"
    for split, data in parts.items():
        (yolo_raw / "images" / split).mkdir(parents=True)
        (yolo_raw / "labels").mkdir(exist_ok=True)
        for im in data["images"]:
            shutil.copyfile(COCO / "train2017" / im["file_name"], yolo_raw / "images" / split / im["file_name"])
        gt = AnnotationSet.from_coco(coco_raw / f"{split}.json")
        gt.save_yolo_v5(yolo_raw / "labels" / split, label_to_id={n: i for i, n in enumerate(names)})
    (yolo_raw / "data.yaml").write_text(yaml.safe_dump({"path": ".", "train": "images/train", "val": "images/val",
                                                        "names": names}))
    return {"root": root, "coco_raw": coco_raw, "yolo_raw": yolo_raw, "names": names, "parts": parts}


def yolo_copy(dataset: dict, dest: Path) -> Path:
    shutil.copytree(dataset["yolo_raw"], dest)
    return dest


@pytest.fixture(scope="module")
def converted(dataset) -> dict:
    """Both copies converted: ``{"yolo": result, "coco": result, "yolo_out": path, "coco_out": path}``."""
    root = dataset["root"]
    res_y = convert(dataset["yolo_raw"], root / "arrow_yolo", params(), progress=False)
    res_c = formats.convert_coco_copy(dataset["coco_raw"], root / "arrow_coco", "yolo")
    return {"yolo": res_y, "coco": res_c, "yolo_out": root / "arrow_yolo", "coco_out": root / "arrow_coco"}


def test_boxes_equal_globox_and_coco_path(dataset, converted):
    """Every box equals (1e-3 px) what globox wrote, read back by globox with its own image-header parser; and is
    within 0.5 px of the COCO path's box for the same image and object; every class name equal."""
    from globox import AnnotationSet

    names = dataset["names"]
    meta = json.loads((converted["yolo_out"] / "meta.json").read_text())
    assert meta["format"] == "yolo"
    assert meta["label_names"] == ["__background__"] + names
    assert [c["id"] for c in meta["categories"]] == list(range(len(names)))
    got = formats.compare_with_globox_and_coco(
        converted["yolo_out"], converted["coco_out"], dataset["parts"],
        lambda split: AnnotationSet.from_yolo_v5(dataset["yolo_raw"] / "labels" / split,
                                                 image_folder=dataset["yolo_raw"] / "images" / split),
        lambda split, name: f"images/{split}/{name}", names.__getitem__, lambda box: names[int(box.label)])
    print(f"{got['boxes']} boxes: max |ours - globox| = {got['globox']:.2e} px, max |ours - COCO path| = "
          f"{got['coco']:.2e} px")
    assert got["boxes"] > 50
    assert got["globox"] <= 1e-3
    assert got["coco"] <= 0.5


def test_report_same_rules_and_yolo_section(dataset, converted):
    rep = converted["yolo"]["report"]
    assert rep["format"] == "yolo"
    assert list(rep["rules"]) == list(converted["coco"]["report"]["rules"])
    assert rep["yolo"]["images_without_labels"]["count"] == 0
    assert rep["yolo"]["labels_without_image"]["count"] == 0
    counts = {s: v["annotations_out"] for s, v in rep["splits"].items()}
    names = {c["id"]: c["name"] for c in dataset["parts"]["train"]["categories"]}
    cats = {s: {names[a["category_id"]] for a in dataset["parts"][s]["annotations"]} for s in ("train", "val")}
    assert sorted(c["name"] for c in rep["yolo"]["val_classes_not_in_train"]) == sorted(cats["val"] - cats["train"])
    assert cats["val"] - cats["train"]
    assert counts == {s: v["annotations_out"] for s, v in converted["coco"]["report"]["splits"].items()}


def _first_label(raw: Path, split: str = "train") -> Path:
    return sorted((raw / "labels" / split).glob("*.txt"))[0]


def test_label_line_with_4_numbers(dataset, tmp_path):
    raw = yolo_copy(dataset, tmp_path / "raw")
    lab = _first_label(raw)
    lines = lab.read_text().splitlines()
    lines.insert(1, "0 0.5 0.5 0.25")
    lab.write_text("\n".join(lines) + "\n")
    with pytest.raises(StageError, match=rf"{lab.name}:2: 4 values; .*rule 'yolo_label_line'"):
        convert(raw, tmp_path / "arrow", params(), progress=False)
    assert not (tmp_path / "arrow").exists()


@pytest.mark.parametrize("value, pattern", [("80", r"class id 80 is outside data.yaml's names \(0..79\)"),
                                            ("-1", r"class id -1 is outside"),
                                            ("1.5", r"class id '1.5' is not an integer"),
                                            ("cat", r"class id 'cat' is not an integer")])
def test_class_id_past_names(dataset, tmp_path, value, pattern):
    raw = yolo_copy(dataset, tmp_path / "raw")
    lab = _first_label(raw, "val")
    lab.write_text(lab.read_text().rstrip("\n") + f"\n{value} 0.5 0.5 0.1 0.1\n")
    n = len(lab.read_text().splitlines())
    with pytest.raises(StageError, match=rf"{lab.name}:{n}: {pattern}"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_non_number(dataset, tmp_path):
    raw = yolo_copy(dataset, tmp_path / "raw")
    lab = _first_label(raw)
    lab.write_text("0 0.5 nan 0.1 0.1\n")
    with pytest.raises(StageError, match=rf"{lab.name}:1: value 3 \('nan'\) is not a finite number"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_box_outside_image_counted(dataset, tmp_path):
    """A box wholly outside is dropped (``bbox_outside``), one partly outside clipped (``bbox_clipped``), as the
    COCO path does; the examples name the label file and line."""
    raw = yolo_copy(dataset, tmp_path / "raw")
    lab = _first_label(raw)
    n = len(lab.read_text().splitlines())
    lab.write_text(lab.read_text().rstrip("\n") + "\n0 1.5 1.5 0.2 0.2\n0 0.95 0.5 0.2 0.2\n")
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    rules = res["report"]["rules"]
    assert rules["bbox_outside"]["count"] == 1
    assert rules["bbox_clipped"]["count"] == 1
    ex = rules["bbox_outside"]["examples"][0]
    assert ex["file"] == str(lab) and ex["record"] == f"line {n + 1} (image id 1)"
    assert rules["bbox_clipped"]["examples"][0]["record"] == f"line {n + 2} (image id 1)"
    row = read_rows(tmp_path / "arrow", "train")[0]
    x, y, w, h = row["bbox"][-1]
    assert abs(x + w - row["width"]) < 1e-3                     # clipped at the right edge
    assert len(row["bbox"]) == n + 1
    with pytest.raises(StageError, match=rf"{lab.name}:{n + 1} \(image id 1\): rule 'bbox_outside'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_label_without_image_and_image_without_label(dataset, tmp_path):
    raw = yolo_copy(dataset, tmp_path / "raw")
    orphan = raw / "labels" / "train" / "no_such_image.txt"
    orphan.write_text("0 0.5 0.5 0.1 0.1\n")
    negative = _first_label(raw, "val")
    negative.unlink()
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    y = res["report"]["yolo"]
    assert y["labels_without_image"]["count"] == 1
    assert y["labels_without_image"]["examples"][0]["file"] == str(orphan)
    assert y["images_without_labels"]["count"] == 1
    assert res["report"]["rules"]["image_no_annotations"]["count"] == 1
    val = read_rows(tmp_path / "arrow", "val")
    assert len(val) == N_VAL and sum(1 for r in val if not r["bbox"]) == 1
    with pytest.raises(StageError, match=rf"{orphan}: label file of no listed image"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_polygon_line(dataset, tmp_path):
    """A segment line: box = the polygon's bounds, polygon kept as COCO segmentation in pixels."""
    raw = yolo_copy(dataset, tmp_path / "raw")
    lab = _first_label(raw)
    lab.write_text("3 0.1 0.2 0.5 0.2 0.4 0.6\n")
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    row = read_rows(tmp_path / "arrow", "train")[0]
    W, H = row["width"], row["height"]
    assert row["category_id"] == [3]
    x, y, w, h = row["bbox"][0]
    assert abs(x - 0.1 * W) < 1e-3 and abs(y - 0.2 * H) < 1e-3
    assert abs(w - 0.4 * W) < 1e-3 and abs(h - 0.4 * H) < 1e-3
    seg = json.loads(row["segmentation"][0])
    assert len(seg) == 1 and all(abs(a - b) < 1e-6 for a, b in
                                 zip(seg[0], [0.1 * W, 0.2 * H, 0.5 * W, 0.2 * H, 0.4 * W, 0.6 * H]))
    assert abs(row["area"][0] - 0.5 * (0.4 * W) * (0.4 * H)) < 1e-3
    assert res["report"]["rules"]["segmentation_invalid"]["count"] == 0


def test_val_class_not_in_train_reported(dataset, tmp_path, caplog):
    raw = yolo_copy(dataset, tmp_path / "raw")
    used = {int(line.split()[0]) for p in (raw / "labels").glob("*/*.txt")
            for line in p.read_text().splitlines() if line.strip()}
    unused = min(set(range(80)) - used)
    lab = _first_label(raw, "val")
    lab.write_text(lab.read_text().rstrip("\n") + f"\n{unused} 0.5 0.5 0.1 0.1\n")
    with caplog.at_level("WARNING"):
        res = convert(raw, tmp_path / "arrow", params(), progress=False)
    only = res["report"]["yolo"]["val_classes_not_in_train"]
    assert {"id": unused, "name": dataset["names"][unused], "val_annotations": 1} in only
    assert any("in val but not in train" in r.message for r in caplog.records)


def test_names_as_mapping_and_no_val(dataset, tmp_path):
    """``names`` as {index: name}; without ``val`` the train images are split by val_fraction."""
    raw = yolo_copy(dataset, tmp_path / "raw")
    names = dataset["names"]
    (raw / "data.yaml").write_text(yaml.safe_dump({"train": ["images/train", "images/val"],
                                                   "names": dict(enumerate(names))}))
    res = convert(raw, tmp_path / "arrow", params(val_fraction=0.25), progress=False)
    assert res["meta"]["label_names"][1:] == names
    assert res["meta"]["splits"]["val"]["images"] == round((N_TRAIN + N_VAL) * 0.25)
    assert res["meta"]["splits"]["train"]["images"] + res["meta"]["splits"]["val"]["images"] == N_TRAIN + N_VAL


def test_format_auto(dataset, tmp_path, caplog):
    with caplog.at_level("INFO"):
        res = convert(dataset["yolo_raw"], tmp_path / "a", params(format="auto"), progress=False)
    assert res["meta"]["format"] == "yolo"
    assert any("format auto: found yolo" in r.message for r in caplog.records)
    caplog.clear()
    coco_kw = dict(format="auto", annotations="train.json", images="train", val_annotations="val.json",
                   val_images="val")
    with caplog.at_level("INFO"):
        res = convert(dataset["coco_raw"], tmp_path / "b", params(**coco_kw), progress=False)
    assert "format" not in res["meta"]
    assert any("format auto: found coco" in r.message for r in caplog.records)
    both = yolo_copy(dataset, tmp_path / "both")
    shutil.copyfile(dataset["coco_raw"] / "train.json", both / "train.json")
    with pytest.raises(StageError, match="ambiguous"):
        convert(both, tmp_path / "c", params(**coco_kw), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StageError, match="found no dataset"):
        convert(tmp_path / "empty", tmp_path / "d", params(**coco_kw), progress=False)


_EXIF_INVERSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_90",
                 7: "TRANSVERSE", 8: "ROTATE_270"}     # stored raster = displayed.transpose(this) for orientation k


@pytest.mark.parametrize("orientation", range(2, 9))
def test_exif_orientation_labels_in_displayed_frame(dataset, converted, tmp_path, orientation):
    """YOLO labels are normalized to the displayed image: a file stored rotated/flipped with the EXIF orientation
    that shows it as the original gives the original's boxes (and displayed size)."""
    from PIL import Image

    raw = yolo_copy(dataset, tmp_path / "raw")
    path = sorted((raw / "images" / "train").glob("*.jpg"))[0]
    with Image.open(path) as im:
        shown = im.convert("RGB")
    stored = shown.transpose(getattr(Image.Transpose, _EXIF_INVERSE[orientation]))
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(path, "JPEG", quality=95, exif=exif)
    convert(raw, tmp_path / "arrow", params(), progress=False)
    row = read_rows(tmp_path / "arrow", "train")[0]
    ref = read_rows(converted["yolo_out"], "train")[0]
    assert row["file_name"] == ref["file_name"] and (row["width"], row["height"]) == (ref["width"], ref["height"])
    assert row["category_id"] == ref["category_id"]
    worst = max(abs(a - b) for box, rbox in zip(row["bbox"], ref["bbox"]) for a, b in zip(box, rbox))
    assert worst <= 1e-3


def test_train_as_txt_list(dataset, tmp_path):
    """``train`` as a .txt list of image paths (relative to the list's folder), ``val`` a folder."""
    raw = yolo_copy(dataset, tmp_path / "raw")
    (raw / "lists").mkdir()
    files = sorted((raw / "images" / "train").glob("*.jpg"))[:5]
    (raw / "lists" / "train.txt").write_text("".join(f"../images/train/{f.name}\n" for f in files))
    (raw / "data.yaml").write_text(yaml.safe_dump({"train": "lists/train.txt", "val": "images/val",
                                                   "names": dataset["names"]}))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    assert res["meta"]["splits"]["train"]["images"] == 5
    assert [r["file_name"] for r in read_rows(tmp_path / "arrow", "train")] == \
        [f"images/train/{f.name}" for f in files]
    (raw / "lists" / "train.txt").write_text("/etc/hostname\n")
    with pytest.raises(StageError, match="outside"):
        convert(raw, tmp_path / "arrow2", params(), progress=False)


def test_cli_yolo_and_auto(dataset, tmp_path):
    """``python -m stages.convert`` with params.yaml's ``convert.format: auto`` on a YOLO data/raw: finds yolo
    (one log line) and writes the same rows as convert(); a bad label line -> exit 2 and one line naming it."""
    import os
    import subprocess
    import sys

    raw = yolo_copy(dataset, tmp_path / "data" / "raw")
    conf = yaml.safe_load((REPO / "params.yaml").read_text())
    conf["convert"].update({"format": "coco", "workers": 1})
    del conf["convert"]["annotations"], conf["convert"]["images"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(conf))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    no_files = subprocess.run([sys.executable, "-m", "stages.convert"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
    assert no_files.returncode == 2 and "Traceback" not in no_files.stderr
    assert "key 'convert': Value error, format coco needs annotations" in no_files.stderr, no_files.stderr
    conf["convert"]["format"] = "auto"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(conf))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "stages.convert"]
    ok = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "convert: format auto: found yolo" in ok.stderr
    meta = json.loads((tmp_path / "data" / "arrow" / "meta.json").read_text())
    assert meta["format"] == "yolo" and meta["splits"]["val"]["images"] == N_VAL
    lab = _first_label(raw)
    lab.write_text("0 0.5 0.5 0.1\n")
    bad = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert f"{lab.name}:1: 4 values" in bad.stderr and "Traceback" not in bad.stderr


def test_val_same_as_train_is_a_named_error(dataset, tmp_path):
    """Ultralytics' own coco128.yaml lists the same folder as train and val: every val image is a byte copy of a
    train image (rule val_image_in_train), the val split is emptied: an error naming data.yaml's val list."""
    raw = yolo_copy(dataset, tmp_path / "raw")
    (raw / "data.yaml").write_text(yaml.safe_dump({"train": "images/train", "val": "images/train",
                                                   "names": dataset["names"]}))
    with pytest.raises(StageError, match=r"data.yaml \('val' images\): no usable images in the val split .*"
                                         r"val_image_in_train=10"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


@pytest.mark.slow
def test_coco128_as_yolo_matches_the_coco_path(tmp_path):
    """All of COCO128 written as YOLO by globox (one train folder, ``names`` in COCO id order; the layout the README's
    ``dvc repro`` from a YOLO copy uses, docs/convert.md) and converted with params.yaml's convert section and
    ``format: yolo``: the same images in the same order per split as the COCO path (the val_fraction split, since the
    file stems sort as the COCO ids do), image bytes equal, every box within 0.5 px of the COCO path's, the same
    training labels and class names; only the COCO crowd regions differ (YOLO has no crowd flag: iscrowd 0)."""
    from globox import AnnotationSet

    conf = yaml.safe_load((REPO / "params.yaml").read_text())["convert"]
    res_c = convert(COCO, tmp_path / "arrow_coco", Convert(**{**conf, "format": "coco"}), progress=False)
    src = json.loads((COCO / ANN).read_text())
    names = [c["name"] for c in sorted(src["categories"], key=lambda c: c["id"])]
    raw = tmp_path / "raw"
    (raw / "labels").mkdir(parents=True)
    shutil.copytree(COCO / "train2017", raw / "images" / "train2017")
    AnnotationSet.from_coco(COCO / ANN).save_yolo_v5(raw / "labels" / "train2017",
                                                     label_to_id={n: i for i, n in enumerate(names)})
    (raw / "data.yaml").write_text(yaml.safe_dump({"train": "images/train2017", "names": names}))
    res_y = convert(raw, tmp_path / "arrow_yolo", Convert(**{**conf, "format": "yolo"}), progress=False)
    meta_c, meta_y = res_c["meta"], res_y["meta"]
    assert meta_y["label_names"] == meta_c["label_names"]
    worst, boxes, crowd = 0.0, 0, 0
    for split in ("train", "val"):
        rows_y, rows_c = read_rows(tmp_path / "arrow_yolo", split), read_rows(tmp_path / "arrow_coco", split)
        assert [Path(r["file_name"]).name for r in rows_y] == [Path(r["file_name"]).name for r in rows_c]
        for ry, rc in zip(rows_y, rows_c):
            assert ry["image"] == rc["image"] and (ry["width"], ry["height"]) == (rc["width"], rc["height"])
            assert list(ry["label"]) == list(rc["label"])
            assert [names[c] for c in ry["category_id"]] == [meta_c["label_names"][lab] for lab in rc["label"]]
            for a, b in zip(ry["bbox"], rc["bbox"]):
                worst = max(worst, max(abs(u - v) for u, v in zip(a, b)))
            boxes += len(ry["bbox"])
            crowd += sum(int(u != v) for u, v in zip(ry["iscrowd"], rc["iscrowd"]))
            assert not any(ry["iscrowd"])
    print(f"COCO128 as YOLO: {boxes} boxes, max |ours - COCO path| = {worst:.2e} px; iscrowd differs on {crowd}")
    assert boxes == sum(meta_c["splits"][s]["annotations"] for s in ("train", "val")) and worst <= 0.5
    assert crowd == 10


AREA_IMAGE, AREA_ANN = "000000000564.jpg", 1602301  # COCO's area 1032.08 px^2 (medium); rasterized 1017 (small)


def _size_bucket(area: float) -> str:
    """COCOeval's area ranges (pycocotools ``Params.areaRng``): small < 32^2 <= medium < 96^2 <= large."""
    return "small" if area < 32 ** 2 else "medium" if area < 96 ** 2 else "large"


def test_one_area_rule_for_coco_and_yolo(tmp_path):
    """The same polygon through the COCO path (its ``area`` left out, so the stage computes it) and through a YOLO
    segment line gets the same area and COCOeval size bucket, both equal to COCO 2017's own ``area`` of that object
    (the polygon's shoelace area). The object is the one of COCO128 whose rasterized mask area (pycocotools
    ``mask.area``: 1017 px^2, small) falls in another bucket than COCO's own (1032.08, medium), so computing the
    area from the rasterized mask on either path fails here."""
    from pycocotools import mask as mask_utils

    src = json.loads((COCO / ANN).read_text())
    im = next(i for i in src["images"] if i["file_name"] == AREA_IMAGE)
    ann = next(a for a in src["annotations"] if a["id"] == AREA_ANN)
    assert len(ann["segmentation"]) == 1
    poly, W, H = ann["segmentation"][0], im["width"], im["height"]
    rasterized = float(mask_utils.area(mask_utils.merge(mask_utils.frPyObjects(ann["segmentation"], H, W))))
    assert _size_bucket(rasterized) != _size_bucket(ann["area"])  # the object still tells the two rules apart

    coco_raw = tmp_path / "coco"
    (coco_raw / "images").mkdir(parents=True)
    shutil.copyfile(COCO / "train2017" / AREA_IMAGE, coco_raw / "images" / AREA_IMAGE)
    record = {k: v for k, v in ann.items() if k != "area"}
    (coco_raw / "ann.json").write_text(json.dumps({"images": [im], "annotations": [record],
                                                   "categories": src["categories"]}))
    res_c = convert(coco_raw, tmp_path / "arrow_coco", formats.params("coco", annotations="ann.json",
                                                                    images="images"), progress=False)
    assert res_c["report"]["rules"]["area_missing"]["count"] == 1

    yolo_raw = tmp_path / "yolo"
    (yolo_raw / "images" / "train").mkdir(parents=True)
    (yolo_raw / "labels" / "train").mkdir(parents=True)
    shutil.copyfile(COCO / "train2017" / AREA_IMAGE, yolo_raw / "images" / "train" / AREA_IMAGE)
    names = [c["name"] for c in sorted(src["categories"], key=lambda c: c["id"])]
    cls = [c["id"] for c in sorted(src["categories"], key=lambda c: c["id"])].index(ann["category_id"])
    normalized = " ".join(repr(v / (W if i % 2 == 0 else H)) for i, v in enumerate(poly))
    (yolo_raw / "labels" / "train" / (Path(AREA_IMAGE).stem + ".txt")).write_text(f"{cls} {normalized}\n")
    (yolo_raw / "data.yaml").write_text(yaml.safe_dump({"path": ".", "train": "images/train", "names": names}))
    convert(yolo_raw, tmp_path / "arrow_yolo", params(), progress=False)

    (coco_area,) = read_rows(tmp_path / "arrow_coco", "train")[0]["area"]
    (yolo_area,) = read_rows(tmp_path / "arrow_yolo", "train")[0]["area"]
    print(f"COCO's area {ann['area']}, COCO path {coco_area}, YOLO path {yolo_area}, rasterized {rasterized}")
    assert abs(coco_area - ann["area"]) < 1e-6 * ann["area"]
    assert abs(yolo_area - ann["area"]) < 1e-6 * ann["area"]  # normalized coordinates round-trip to ~1e-16
    assert _size_bucket(coco_area) == _size_bucket(yolo_area) == _size_bucket(ann["area"]) == "medium"
