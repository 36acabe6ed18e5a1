"""Tests of the LabelMe reader (detpipe/data/labelme_reader.py) and ``convert.format: labelme`` on real COCO128
images whose LabelMe files were written by an independent converter (globox 2.9.0: ``AnnotationSet.from_coco``
then ``save_labelme``) and read back both by globox (``from_labelme``) and by our convert stage.

globox writes one ``<stem>.json`` per image with ``imagePath`` = the image's file name, rectangles only (2 points,
``[[xmin, ymin], [xmax, ymax]]``), no ``group_id``, and no split: the train / val split is the test's own
``train/`` and ``val/`` folders (one globox call per folder). globox cannot write polygons, so the polygon test
writes COCO128's own segmentation polygons as LabelMe shapes itself (a second path, `_polygon_copy`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from detpipe.data import labelme_reader
from detpipe.data.convert import convert
from detpipe.core.errors import StageError
from detpipe.params import Convert
from support import formats
from support.formats import COCO, N_TRAIN, N_VAL, REPO, coco_copy
from support.pipeline import read_rows



def params(**kw) -> Convert:
    return formats.params("labelme", **kw)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict:
    """COCO128's first 14 images (by id): a COCO copy (train 10 / val 4 as two files) and a LabelMe copy written by
    globox (``raw_labelme``: train/ and val/, each image beside its JSON)."""
    from globox import AnnotationSet

    root = tmp_path_factory.mktemp("labelme")
    base = coco_copy(root)
    src, parts = base["src"], base["parts"]
    coco_raw = base["coco_raw"]
    lm_raw = root / "raw_labelme"
    for split, data in parts.items():
        (lm_raw / split).mkdir(parents=True)
        for im in data["images"]:
            shutil.copyfile(COCO / "train2017" / im["file_name"], lm_raw / split / im["file_name"])
        AnnotationSet.from_coco(coco_raw / f"{split}.json").save_labelme(lm_raw / split)
    names = {c["id"]: c["name"] for c in src["categories"]}
    return {"root": root, "coco_raw": coco_raw, "lm_raw": lm_raw, "parts": parts, "names": names}


def lm_copy(dataset: dict, dest: Path) -> Path:
    shutil.copytree(dataset["lm_raw"], dest)
    return dest


def _first_json(raw: Path, split: str = "train") -> Path:
    return sorted((raw / split).glob("*.json"))[0]


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def converted(dataset) -> dict:
    root = dataset["root"]
    res_l = convert(dataset["lm_raw"], root / "arrow_labelme", params(), progress=False)
    res_c = formats.convert_coco_copy(dataset["coco_raw"], root / "arrow_coco", "labelme")
    return {"labelme": res_l, "coco": res_c, "out": root / "arrow_labelme", "coco_out": root / "arrow_coco"}


def test_boxes_equal_globox_and_coco_path(dataset, converted):
    """Every box equals (1e-3 px) the rectangle globox wrote, read back by globox (``from_labelme``) and mapped by
    the documented rule (``[min x, min y, max x - min x, max y - min y]``, clipped to the image by the COCO rules);
    is within 0.5 px of the COCO path's box for the same image and object; every class name equal; categories are
    the sorted set of the labels used."""
    from globox import AnnotationSet

    meta = json.loads((converted["out"] / "meta.json").read_text())
    assert meta["format"] == "labelme"
    used = sorted({dataset["names"][a["category_id"]] for p in dataset["parts"].values() for a in p["annotations"]})
    assert meta["label_names"] == ["__background__"] + used
    assert [c["id"] for c in meta["categories"]] == list(range(1, len(used) + 1))
    names = {c["id"]: c["name"] for c in meta["categories"]}
    got = formats.compare_with_globox_and_coco(
        converted["out"], converted["coco_out"], dataset["parts"],
        lambda split: AnnotationSet.from_labelme(dataset["lm_raw"] / split),
        lambda split, name: f"{split}/{name}", names.__getitem__, lambda box: box.label)
    print(f"{got['boxes']} boxes: max |ours - globox| = {got['globox']:.2e} px, max |ours - COCO path| = "
          f"{got['coco']:.2e} px")
    assert got["boxes"] > 50
    assert got["globox"] <= 1e-3
    assert got["coco"] <= 0.5


def test_report_same_rules_and_labelme_section(dataset, converted):
    rep = converted["labelme"]["report"]
    assert rep["format"] == "labelme"
    assert list(rep["rules"]) == list(converted["coco"]["report"]["rules"])
    lm = rep["labelme"]
    assert lm["split"] == "train/ and val/ folders" and lm["json_files"] == {"train": N_TRAIN, "val": N_VAL}
    for key in ("json_not_labelme", "skipped_shapes", "images_without_objects", "grouped_objects",
                "labels_not_in_list"):
        assert lm[key]["count"] == 0, key
    assert lm["label_list"] is None and lm["image_data_not_decoded"] == 0
    assert {s: v["annotations_out"] for s, v in rep["splits"].items()} == \
        {s: v["annotations_out"] for s, v in converted["coco"]["report"]["splits"].items()}
    assert converted["labelme"]["meta"]["annotations_file"] == "."


def _polygon_copy(dataset: dict, dest: Path) -> Path:
    """The LabelMe copy with every object written as polygons from COCO128's own segmentation (our writer, not
    globox's: globox writes rectangles only); an object of several polygons as shapes sharing a group_id."""
    raw = lm_copy(dataset, dest)
    for split, data in dataset["parts"].items():
        for im in data["images"]:
            shapes = []
            for k, a in enumerate(a for a in data["annotations"] if a["image_id"] == im["id"]):
                for poly in a["segmentation"]:
                    shapes.append({"label": dataset["names"][a["category_id"]], "shape_type": "polygon",
                                   "points": np.asarray(poly).reshape(-1, 2).tolist(),
                                   "group_id": k if len(a["segmentation"]) > 1 else None, "flags": {}})
            path = raw / split / Path(im["file_name"]).with_suffix(".json")
            _edit(path, lambda d: d.update(shapes=shapes))
    return raw


def _shoelace(poly) -> float:
    x, y = np.asarray(poly[0::2]), np.asarray(poly[1::2])
    return abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1)))) / 2


def test_polygons_from_coco_segmentation(dataset, converted, tmp_path):
    """Polygons (COCO128's, written by the test): box = the polygon's bounds (COCO's own bbox within 0.5 px),
    segmentation = the polygons as written, area = their shoelace area; an object of several polygons (one
    group_id) is one object, counted ``grouped_objects``."""
    raw = _polygon_copy(dataset, tmp_path / "raw")
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    grouped = sum(1 for p in dataset["parts"].values() for a in p["annotations"] if len(a["segmentation"]) > 1)
    assert grouped > 0 and res["report"]["labelme"]["grouped_objects"]["count"] == grouped
    assert res["report"]["rules"]["segmentation_invalid"]["count"] == 0
    worst = 0.0
    n = 0
    for split, data in dataset["parts"].items():
        by_name = {r["file_name"]: r for r in read_rows(tmp_path / "arrow", split)}
        for im in data["images"]:
            row = by_name[f"{split}/{im['file_name']}"]
            anns = [a for a in data["annotations"] if a["image_id"] == im["id"]]
            assert len(row["bbox"]) == len(anns)
            for a, box, seg, area in zip(anns, row["bbox"], row["segmentation"], row["area"]):
                worst = max(worst, max(abs(u - v) for u, v in zip(box, a["bbox"])))
                got = json.loads(seg)
                assert len(got) == len(a["segmentation"])
                assert all(np.allclose(g, p, atol=1e-6) for g, p in zip(got, a["segmentation"]))
                assert abs(area - sum(_shoelace(p) for p in a["segmentation"])) < 1e-6 * max(area, 1)
                n += 1
    print(f"{n} polygon objects: max |box - COCO bbox| = {worst:.2e} px")
    assert worst <= 0.5


def test_skipped_shape_types_counted(dataset, tmp_path):
    """circle, line, point, linestrip and mask shapes are counted by type and skipped; a file with only skipped
    shapes is a negative image; strict makes the first skipped shape an error."""
    raw = lm_copy(dataset, tmp_path / "raw")
    path = _first_json(raw)
    extra = [{"label": "person", "shape_type": t, "points": [[1, 1], [5, 5]], "group_id": None, "flags": {}}
             for t in ("circle", "line", "point", "linestrip", "mask")]
    _edit(path, lambda d: d["shapes"].extend(extra))
    n_boxes = len(json.loads(path.read_text())["shapes"]) - len(extra)
    neg = _first_json(raw, "val")
    _edit(neg, lambda d: d.update(shapes=extra[:1]))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    sk = res["report"]["labelme"]["skipped_shapes"]
    assert sk["count"] == 6 and sk["by_type"] == {"circle": 2, "line": 1, "point": 1, "linestrip": 1, "mask": 1}
    assert sk["examples"][0]["file"] == str(path) and sk["examples"][0]["record"] == f"shape {n_boxes + 1}"
    assert res["report"]["labelme"]["images_without_objects"]["count"] == 1
    assert res["report"]["rules"]["image_no_annotations"]["count"] == 1
    assert len(read_rows(tmp_path / "arrow", "train")[0]["bbox"]) == n_boxes
    with pytest.raises(StageError, match=rf"{path.name}, shape {n_boxes + 1}: shape_type 'circle' .*"
                                         r"rule 'skipped_shapes'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_malformed_json(dataset, tmp_path):
    raw = lm_copy(dataset, tmp_path / "raw")
    path = _first_json(raw, "val")
    path.write_text(path.read_text()[:-20])
    with pytest.raises(StageError, match=rf"{path}: not a valid JSON file \(.*\) \(rule 'labelme_json'\)"):
        convert(raw, tmp_path / "arrow", params(), progress=False)
    assert not (tmp_path / "arrow").exists()


def test_rectangle_with_3_points(dataset, tmp_path):
    raw = lm_copy(dataset, tmp_path / "raw")
    path = _first_json(raw)
    _edit(path, lambda d: d["shapes"][1]["points"].append([3.0, 4.0]))
    with pytest.raises(StageError, match=rf"{path}, shape 2: a rectangle has 3 points; .*rule 'labelme_shape'"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


@pytest.mark.parametrize("bad", ["12.5", None, True, float("nan"), [1, 2]])
def test_non_numeric_coordinate(dataset, tmp_path, bad):
    raw = lm_copy(dataset, tmp_path / "raw")
    path = _first_json(raw)
    text = path.read_text()
    doc = json.loads(text)
    doc["shapes"][2]["points"][1][0] = bad
    path.write_text(json.dumps(doc))          # NaN is written as the token NaN, which is not JSON
    pattern = r"not a valid JSON file" if bad != bad else r"shape 3: point 2 \(.*\) is not \[x, y\] with two finite"
    with pytest.raises(StageError, match=rf"{path.name}(, )?.*{pattern}"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_box_outside_image_counted(dataset, tmp_path):
    """A rectangle wholly outside is dropped (``bbox_outside``), one partly outside clipped (``bbox_clipped``), as
    the COCO path does; the examples name the JSON file and the shape."""
    raw = lm_copy(dataset, tmp_path / "raw")
    path = _first_json(raw)
    doc = json.loads(path.read_text())
    n = len(doc["shapes"])
    W = doc["imageWidth"]
    doc["shapes"] += [{"label": "person", "shape_type": "rectangle", "points": [[W + 10, 5], [W + 50, 40]],
                       "group_id": None, "flags": {}},
                      {"label": "person", "shape_type": "rectangle", "points": [[W + 20, 50], [W - 30, 90]],
                       "group_id": None, "flags": {}}]
    path.write_text(json.dumps(doc))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    rules = res["report"]["rules"]
    assert rules["bbox_outside"]["count"] == 1 and rules["bbox_clipped"]["count"] == 1
    ex = rules["bbox_outside"]["examples"][0]
    assert ex["file"] == str(path) and ex["record"] == f"shape {n + 1} (image id 1)"
    assert rules["bbox_clipped"]["examples"][0]["record"] == f"shape {n + 2} (image id 1)"
    row = read_rows(tmp_path / "arrow", "train")[0]
    x, y, w, h = row["bbox"][-1]
    assert abs(x - (W - 30)) < 1e-3 and abs(x + w - W) < 1e-3
    with pytest.raises(StageError, match=rf"{path.name}, shape {n + 1} \(image id 1\): rule 'bbox_outside'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_no_split_folders_val_fraction_and_image_path(dataset, tmp_path):
    """Without train/ and val/ folders every JSON file under data/raw is train, split by val_fraction;
    ``imagePath`` is relative to the JSON's folder; a non-LabelMe JSON (a COCO file) is counted and skipped."""
    raw = tmp_path / "raw"
    (raw / "ann").mkdir(parents=True)
    (raw / "img").mkdir()
    for split in ("train", "val"):
        for f in (dataset["lm_raw"] / split).iterdir():
            if f.suffix == ".json":
                dest = raw / "ann" / f.name
                shutil.copyfile(f, dest)
                _edit(dest, lambda d: d.update(imagePath="..\\img\\" + d["imagePath"]))
            else:
                shutil.copyfile(f, raw / "img" / f.name)
    shutil.copyfile(dataset["coco_raw"] / "train.json", raw / "coco.json")
    res = convert(raw, tmp_path / "arrow", params(val_fraction=0.25), progress=False)
    assert res["meta"]["splits"]["val"]["images"] == round((N_TRAIN + N_VAL) * 0.25)
    assert res["meta"]["splits"]["train"]["images"] + res["meta"]["splits"]["val"]["images"] == N_TRAIN + N_VAL
    assert res["report"]["labelme"]["json_not_labelme"]["count"] == 1
    assert res["report"]["labelme"]["split"] == "convert.val_fraction"
    assert all(r["file_name"].startswith("img/") for r in read_rows(tmp_path / "arrow", "train"))
    assert res["report"]["rules"]["image_missing"]["count"] == 0


def test_image_path_outside_raw(dataset, tmp_path):
    raw = lm_copy(dataset, tmp_path / "raw")
    path = _first_json(raw)
    _edit(path, lambda d: d.update(imagePath="../../outside.jpg"))
    with pytest.raises(StageError, match=rf"{path}: imagePath '../../outside.jpg' points outside data/raw"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_size_mismatch_and_image_data(dataset, tmp_path):
    """imageWidth/imageHeight that the file does not have: the COCO rule ``image_size_mismatch`` (dropped with its
    objects), the finding naming the LabelMe file; ``imageData`` is never decoded (counted), the image is read from imagePath."""
    raw = lm_copy(dataset, tmp_path / "raw")
    path = _first_json(raw)
    _edit(path, lambda d: d.update(imageWidth=d["imageWidth"] + 1))
    other = sorted((raw / "train").glob("*.json"))[1]
    _edit(other, lambda d: d.update(imageData="bm90IGFuIGltYWdl"))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    assert res["report"]["rules"]["image_size_mismatch"]["count"] == 1
    example = res["report"]["rules"]["image_size_mismatch"]["examples"][0]
    assert example["file"] == str(path)            # the LabelMe file that gave the size, the image in the detail
    assert json.loads(path.read_text())["imagePath"] in example["detail"]
    assert "the annotation file says" in example["detail"], example
    assert res["meta"]["splits"]["train"]["images"] == N_TRAIN - 1
    assert res["report"]["labelme"]["image_data_not_decoded"] == 1


def test_labels_txt(dataset, converted, tmp_path):
    """labels.txt (labelme's examples' convention) fixes the class list and order; a label not in it is counted
    and skipped (an error with strict)."""
    raw = lm_copy(dataset, tmp_path / "raw")
    used = converted["labelme"]["meta"]["label_names"][1:]
    order = list(reversed(used))[:-1]           # reversed, the alphabetically first class left out
    (raw / "labels.txt").write_text("__ignore__\n_background_\n" + "\n".join(order) + "\n")
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    assert res["meta"]["label_names"] == ["__background__"] + order
    left_out = used[0]
    n = sum(1 for p in dataset["parts"].values() for a in p["annotations"] if dataset["names"][a["category_id"]]
            == left_out)
    assert res["report"]["labelme"]["labels_not_in_list"]["count"] == n > 0
    assert res["report"]["labelme"]["label_list"] == str(raw / "labels.txt")
    with pytest.raises(StageError, match=rf"label '{left_out}' is not in labels.txt.*rule 'labels_not_in_list'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_format_auto(dataset, tmp_path, caplog):
    with caplog.at_level("INFO"):
        res = convert(dataset["lm_raw"], tmp_path / "a", params(format="auto"), progress=False)
    assert res["meta"]["format"] == "labelme"
    assert any("format auto: found labelme" in r.message for r in caplog.records)
    coco_kw = dict(format="auto", annotations="train.json", images="train", val_annotations="val.json",
                   val_images="val")
    res = convert(dataset["coco_raw"], tmp_path / "b", params(**coco_kw), progress=False)
    assert "format" not in res["meta"]
    assert labelme_reader.detect(dataset["coco_raw"]) is None
    assert labelme_reader.detect(REPO / "data" / "coco128") is None


_EXIF_INVERSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_90",
                 7: "TRANSVERSE", 8: "ROTATE_270"}     # stored raster = displayed.transpose(this) for orientation k


@pytest.mark.parametrize("square", [False, True], ids=["640wide", "square"])
@pytest.mark.parametrize("orientation", range(2, 9))
def test_exif_orientation_labels_in_displayed_frame(dataset, tmp_path, orientation, square):
    """LabelMe shows images after EXIF orientation, so its points are in the displayed frame: a file stored
    rotated / flipped with the EXIF orientation that shows it as the original (JSON unchanged) gives the boxes of
    the original. Where the stored size equals the displayed one (orientations 2-4, and 5-8 on a square image)
    the reader hands the boxes over in the stored frame; elsewhere the COCO path keeps them."""
    from PIL import Image

    rows = {}
    for case in ("plain", "rotated"):
        raw = lm_copy(dataset, tmp_path / case)
        path = sorted((raw / "train").glob("*.jpg"))[0]
        with Image.open(path) as im:
            shown = im.convert("RGB")
        if square:
            s = min(shown.size)
            shown = shown.crop((0, 0, s, s))
            _edit(path.with_suffix(".json"), lambda d: d.update(imageWidth=s, imageHeight=s))
        exif = Image.Exif()
        if case == "rotated":
            shown = shown.transpose(getattr(Image.Transpose, _EXIF_INVERSE[orientation]))
            exif[0x0112] = orientation
        shown.save(path, "JPEG", quality=95, exif=exif)
        res = convert(raw, tmp_path / f"arrow_{case}", params(), progress=False)
        assert res["report"]["rules"]["image_size_mismatch"]["count"] == 0
        rows[case] = read_rows(tmp_path / f"arrow_{case}", "train")[0]
    row, ref = rows["rotated"], rows["plain"]
    assert row["file_name"] == ref["file_name"] and (row["width"], row["height"]) == (ref["width"], ref["height"])
    assert len(row["bbox"]) == len(ref["bbox"]) > 0
    worst = max(abs(a - b) for box, rbox in zip(row["bbox"], ref["bbox"]) for a, b in zip(box, rbox))
    assert worst <= 1e-3
