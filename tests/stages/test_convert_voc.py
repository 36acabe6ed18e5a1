"""Tests of the Pascal VOC reader (detpipe/data/voc_reader.py) and ``convert.format: voc`` on real COCO128 images
whose VOC annotation files were written by an independent converter (globox 2.9.0: ``AnnotationSet.from_coco`` then
``save_pascal_voc``, which writes each box as the float corners ``x, y, x + w, y + h`` of the COCO box, without the
devkit's 1-based offset) and read back both by globox (``from_pascal_voc``) and by our convert stage.

Our rule (module docstring; detectron2's ``load_voc_instances``): the corners are 1-based inclusive pixel indices,
COCO ``[x, y, w, h] = [xmin - 1, ymin - 1, xmax - xmin + 1, ymax - ymin + 1]``. So every box must equal globox's
corners mapped by that rule (1e-3 px, after the COCO path's clipping), and lie within 1 px of the COCO path's box
for the same object (the right/bottom edges are the same, the left/top ones 1 px further out)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from detpipe.data.convert import convert
from detpipe.core.errors import StageError
from detpipe.params import Convert
from support import formats
from support.formats import ANN, COCO, N_TRAIN, N_VAL, REPO, coco_copy, subset
from support.pipeline import read_rows



def params(**kw) -> Convert:
    return formats.params("voc", **kw)


def write_voc(coco_json: Path, raw: Path, images_dir: Path, splits: dict[str, list[str]] | None) -> None:
    """A VOC copy in ``raw`` of COCO file ``coco_json`` (images in ``images_dir``) written by globox, with
    ``ImageSets/Main/<split>.txt`` listing the file stems of ``splits`` (None: no lists)."""
    from globox import AnnotationSet

    data = json.loads(coco_json.read_text())
    (raw / "JPEGImages").mkdir(parents=True, exist_ok=True)
    for im in data["images"]:
        shutil.copyfile(images_dir / im["file_name"], raw / "JPEGImages" / im["file_name"])
    AnnotationSet.from_coco(coco_json).save_pascal_voc(raw / "Annotations")
    if splits:
        (raw / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
        for split, names in splits.items():
            (raw / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{Path(n).stem}\n" for n in names))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict:
    """COCO128's first 14 images (by id): a COCO copy (train 10 / val 4 as two files) and a VOC copy written by
    globox (``raw_voc``: JPEGImages, Annotations, ImageSets/Main/{train,val}.txt)."""
    root = tmp_path_factory.mktemp("voc")
    base = coco_copy(root)
    src, images, parts = base["src"], base["images"], base["parts"]
    coco_raw = base["coco_raw"]
    voc_raw = root / "raw_voc"
    (root / "all.json").write_text(json.dumps(subset(images, src)))
    write_voc(root / "all.json", voc_raw, COCO / "train2017",
              {s: [im["file_name"] for im in parts[s]["images"]] for s in parts})
    names = {c["id"]: c["name"] for c in src["categories"]}
    return {"root": root, "coco_raw": coco_raw, "voc_raw": voc_raw, "parts": parts, "names": names}


def voc_copy(dataset: dict, dest: Path) -> Path:
    shutil.copytree(dataset["voc_raw"], dest)
    return dest


@pytest.fixture(scope="module")
def converted(dataset) -> dict:
    """Both copies converted: ``{"voc": result, "coco": result, "voc_out": path, "coco_out": path}``."""
    root = dataset["root"]
    res_v = convert(dataset["voc_raw"], root / "arrow_voc", params(), progress=False)
    res_c = formats.convert_coco_copy(dataset["coco_raw"], root / "arrow_coco", "voc")
    return {"voc": res_v, "coco": res_c, "voc_out": root / "arrow_voc", "coco_out": root / "arrow_coco"}


def compare_with_globox_and_coco(voc_raw: Path, voc_out: Path, coco_out: Path) -> dict:
    """Row by row: every VOC-path box against globox's corners read back by globox mapped by the documented rule
    (then clipped to the image as the COCO rules do), and against the COCO path's box of the same image and object;
    class names compared per object. Returns the worst differences in pixels and the counts."""
    from globox import AnnotationSet

    meta = json.loads((voc_out / "meta.json").read_text())
    vnames = {c["id"]: c["name"] for c in meta["categories"]}
    coco_meta = json.loads((coco_out / "meta.json").read_text())
    cnames = dict(zip(map(int, coco_meta["category_id_to_label"]), coco_meta["label_names"][1:]))
    back = AnnotationSet.from_pascal_voc(voc_raw / "Annotations")
    out = {"globox": 0.0, "coco": 0.0, "boxes": 0, "images": 0, "crowd_differs": 0, "names": set()}
    for split in ("train", "val"):
        rows = read_rows(voc_out, split)
        coco_rows = {r["file_name"]: r for r in read_rows(coco_out, split)}
        assert len(rows) == len(coco_rows)
        for row in rows:
            name = Path(row["file_name"]).name
            assert row["file_name"] == f"JPEGImages/{name}"
            ann, ref = back[name], coco_rows[name]
            W, H = row["width"], row["height"]
            assert (W, H) == ann.image_size == (ref["width"], ref["height"])
            assert len(row["bbox"]) == len(ann.boxes) == len(ref["bbox"])
            assert [vnames[c] for c in row["category_id"]] == [b.label for b in ann.boxes] == \
                [cnames[c] for c in ref["category_id"]]
            out["names"].update(b.label for b in ann.boxes)
            for (x, y, w, h), box, (cx, cy, cw, ch) in zip(row["bbox"], ann.boxes, ref["bbox"]):
                xmin, ymin, xmax, ymax = box.ltrb
                want = (max(xmin - 1, 0.0), max(ymin - 1, 0.0), min(xmax, W), min(ymax, H))   # rule, clipped
                out["globox"] = max(out["globox"], *(abs(a - b) for a, b in zip((x, y, x + w, y + h), want)))
                out["coco"] = max(out["coco"], abs(x - cx), abs(y - cy), abs(w - cw), abs(h - ch))
                out["boxes"] += 1
            out["crowd_differs"] += sum(a != b for a, b in zip(row["iscrowd"], ref["iscrowd"]))
            out["images"] += 1
    return out


def test_boxes_follow_the_rule_and_match_the_coco_path(dataset, converted):
    """Every box equals (1e-3 px) globox's corners mapped by ``[xmin - 1, ymin - 1, xmax - xmin + 1, ymax - ymin +
    1]``, is within 1 px of the COCO path's box for the same image and object, and every class name is equal."""
    got = compare_with_globox_and_coco(dataset["voc_raw"], converted["voc_out"], converted["coco_out"])
    print(f"{got['boxes']} boxes: max |ours - rule(globox)| = {got['globox']:.2e} px, max |ours - COCO path| = "
          f"{got['coco']:.4f} px")
    assert got["images"] == N_TRAIN + N_VAL and got["boxes"] > 50
    assert got["globox"] <= 1e-3
    assert got["coco"] <= 1 + 1e-3
    assert got["coco"] >= 1 - 1e-3          # the 1-based offset is applied (globox's corners are 0-based)


def test_report_meta_and_voc_section(dataset, converted):
    rep, meta = converted["voc"]["report"], converted["voc"]["meta"]
    parts = dataset["parts"]
    assert rep["format"] == meta["format"] == "voc"
    assert meta["annotations_file"] == meta["val_annotations_file"] == "Annotations"
    assert list(rep["rules"]) == list(converted["coco"]["report"]["rules"])
    used = sorted({dataset["names"][a["category_id"]] for p in parts.values() for a in p["annotations"]})
    assert [(c["id"], c["name"]) for c in meta["categories"]] == list(enumerate(used, 1))
    assert meta["label_names"] == ["__background__"] + used
    assert meta["category_id_to_label"] == {str(i): i for i in range(1, len(used) + 1)}
    voc = rep["voc"]
    assert voc["names"] == used
    assert voc["images"] == {"train": N_TRAIN, "val": N_VAL}
    assert voc["objects"] == sum(len(p["annotations"]) for p in parts.values())
    assert voc["difficult_as_iscrowd"] == 0
    assert voc["image_sets"] == "ImageSets/Main/train.txt -> train, ImageSets/Main/val.txt -> val"
    for key in ("files_without_objects", "filename_from_stem", "size_from_image", "listed_without_annotation",
                "annotations_not_listed"):
        assert voc[key]["count"] == 0, key
    cats = {s: {dataset["names"][a["category_id"]] for a in parts[s]["annotations"]} for s in parts}
    assert cats["val"] - cats["train"]
    assert sorted(c["name"] for c in voc["val_classes_not_in_train"]) == sorted(cats["val"] - cats["train"])
    assert {s: v["annotations_out"] for s, v in rep["splits"].items()} == \
        {s: v["annotations_out"] for s, v in converted["coco"]["report"]["splits"].items()}


def _xml(raw: Path, k: int = 0) -> Path:
    return sorted((raw / "Annotations").glob("*.xml"))[k]


def _add_objects(xml: Path, *objects: str) -> int:
    """Append ``<object>`` elements (XML text) to ``xml``; the 1-based index of the first one added."""
    text = xml.read_text()
    n = text.count("<object>")
    xml.write_text(text.replace("</annotation>", "".join(objects) + "</annotation>"))
    return n + 1


def _obj(name="dog", box=("10", "20", "110", "220"), extra="") -> str:
    corners = "".join(f"<{t}>{v}</{t}>" for t, v in zip(("xmin", "ymin", "xmax", "ymax"), box))
    return f"<object><name>{name}</name>{extra}<bndbox>{corners}</bndbox></object>"


def _row(out: Path, xml: Path, split: str = "train") -> dict:
    name = re.search(r"<filename>(.*?)</filename>", xml.read_text()).group(1)
    return next(r for r in read_rows(out, split) if r["file_name"] == f"JPEGImages/{name}")


def test_difficult_is_iscrowd(dataset, tmp_path):
    """``<difficult>1</difficult>`` (or ``true``) -> iscrowd 1, kept; 0 / empty / missing -> 0; counted."""
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw)
    k = _add_objects(xml, _obj(extra="<difficult>1</difficult>"), _obj(extra="<difficult>0</difficult>"),
                     _obj(extra="<difficult>True</difficult>"), _obj(extra="<difficult></difficult>"))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    row = _row(tmp_path / "arrow", xml)
    assert row["iscrowd"][k - 1:] == [1, 0, 1, 0] and set(row["iscrowd"][:k - 1]) == {0}
    assert [list(b) for b in row["bbox"][k - 1:]] == [[9.0, 19.0, 101.0, 201.0]] * 4
    assert res["report"]["voc"]["difficult_as_iscrowd"] == 2
    _add_objects(xml, _obj(extra="<difficult>2</difficult>"))
    with pytest.raises(StageError, match=rf"{xml.name}, object {k + 4} \('dog'\): <difficult> '2' is not 0 or 1 "
                                         r"\(rule 'voc_object'\)"):
        convert(raw, tmp_path / "arrow2", params(), progress=False)


HOSTILE = {
    "billion_laughs": ('<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
                       + "".join(f' <!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">\n'
                                 for i in range(1, 10))
                       + ']>\n<annotation><filename>&lol9;</filename></annotation>\n'),
    "external_entity": ('<?xml version="1.0"?>\n<!DOCTYPE annotation [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>\n'
                        '<annotation><filename>&xxe;</filename></annotation>\n'),
    "external_dtd": ('<?xml version="1.0"?>\n<!DOCTYPE annotation SYSTEM "http://example.invalid/voc.dtd">\n'
                     '<annotation><filename>x.jpg</filename></annotation>\n'),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_xml_refused(dataset, tmp_path, kind):
    """Entity expansion (billion laughs: 10^9 'lol's), an external entity and an external DTD: each refused before
    any expansion or fetch, one error naming the file and rule 'voc_xml'; the output is left as it was."""
    import resource

    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw, 3)
    xml.write_text(HOSTILE[kind])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(StageError, match=rf"{re.escape(str(xml))}: line 2: XML document type declaration "
                                         r"<!DOCTYPE \w+.*> refused.*\(rule 'voc_xml'\)"):
        convert(raw, tmp_path / "arrow", params(), progress=False)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000      # KiB: nothing expanded
    assert not (tmp_path / "arrow").exists()


@pytest.mark.parametrize("text, where", [
    ("<annotation><filename>x.jpg</filename><object><name>dog</name></annotation>",
     r"line 1, column 65: malformed XML \(mismatched tag\)"),
    ("<annotation>\n<filename>x.jpg</filename>\n<object><name>a & b</name></object>\n</annotation>",
     r"line 3, column 18: malformed XML \(not well-formed \(invalid token\)\)"),
    ("", r"line 1, column 1: malformed XML \(no element found\)"),
])
def test_malformed_xml(dataset, tmp_path, text, where):
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw, 2)
    xml.write_text(text)
    with pytest.raises(StageError, match=rf"{xml.name}: {where} \(rule 'voc_xml'\)"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_root_not_annotation(dataset, tmp_path):
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw)
    xml.write_text("<annotations><image/></annotations>")
    with pytest.raises(StageError, match=rf"{xml.name}: root element <annotations>, not <annotation>"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


@pytest.mark.parametrize("obj, pattern", [
    (_obj(box=("10", "20", "abc", "220")), r"object {k} \('dog'\): <xmax> 'abc' is not a finite number"),
    (_obj(box=("nan", "20", "30", "220")), r"object {k} \('dog'\): <xmin> 'nan' is not a finite number"),
    (_obj(box=("10", "1e400", "30", "220")), r"object {k} \('dog'\): <ymin> '1e400' is not a finite number"),
    (_obj(box=("10", "20", "30", "")), r"object {k} \('dog'\): <ymax> '' is not a finite number"),
    ("<object><name>dog</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>5</xmax></bndbox></object>",
     r"object {k} \('dog'\): <bndbox> has no <ymax>"),
    ("<object><name>dog</name><pose>Left</pose></object>", r"object {k} \('dog'\): no <bndbox> \(rule 'voc_bndbox'"),
    ("<object><name> </name><bndbox/></object>", r"object {k}: no <name> \(rule 'voc_object'"),
])
def test_bad_object_is_a_named_error(dataset, tmp_path, obj, pattern):
    """A non-numeric, non-finite or missing coordinate, a missing box or name: one error naming the file and the
    object (1-based, in file order)."""
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw, 11)
    k = _add_objects(xml, obj)
    with pytest.raises(StageError, match=rf"{re.escape(str(xml))}, {pattern.format(k=k)}"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_box_outside_image_counted(dataset, converted, tmp_path):
    """A box wholly outside is dropped (``bbox_outside``), one partly outside clipped (``bbox_clipped``), one with
    ``xmax < xmin`` dropped (``bbox_nonpositive``), as the COCO path does; the examples name the annotation file and
    object; with strict, the error names them too."""
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw)                                     # image id 1 of train: its findings come first
    xml.write_text(re.sub(r"<object>.*?</object>", "", xml.read_text()))
    _add_objects(xml, _obj(box=("5000", "5000", "5100", "5100")), _obj(box=("600", "10", "9000", "40")),
                 _obj(box=("50", "10", "40", "40")), _obj(box=("1", "1", "640", "480")))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    rules, before = res["report"]["rules"], converted["voc"]["report"]["rules"]
    assert [rules[r]["count"] - before[r]["count"] for r in ("bbox_outside", "bbox_nonpositive")] == [1, 1]
    for rule, n in (("bbox_outside", 1), ("bbox_clipped", 2), ("bbox_nonpositive", 3)):
        ex = rules[rule]["examples"][0]
        assert ex["file"] == str(xml) and ex["record"] == f"object {n} (image id 1)", (rule, ex)
    row = _row(tmp_path / "arrow", xml)
    assert (row["width"], row["height"]) == (640, 480)
    assert [list(b) for b in row["bbox"]] == [[599.0, 9.0, 41.0, 31.0], [0.0, 0.0, 640.0, 480.0]]
    with pytest.raises(StageError, match=rf"{re.escape(str(xml))}, object 1 \(image id 1\): rule 'bbox_outside'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_missing_image_counted_naming_the_annotation_file(dataset, tmp_path):
    """An annotation file naming an image that does not exist: the COCO rule ``image_missing`` (dropped with its
    objects), the example naming the annotation file and the image; with strict, an error naming both."""
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw, 12)                 # a val image
    name = re.search(r"<filename>(.*?)</filename>", xml.read_text()).group(1)
    (raw / "JPEGImages" / name).unlink()
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    rule = res["report"]["rules"]["image_missing"]
    assert rule["count"] == 1
    ex = rule["examples"][0]
    assert ex["file"] == str(xml) and ex["record"] == "image id 3" and ex["split"] == "val"
    assert ex["detail"].startswith(f"image {raw / 'JPEGImages' / name}: file not found; dropped with its ")
    assert res["meta"]["splits"]["val"]["images"] == N_VAL - 1
    with pytest.raises(StageError, match=rf"{re.escape(str(xml))}: names image .*{name}, which does not exist "
                                         r"\(rule 'image_missing'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_size_mismatch_and_missing_size(dataset, converted, tmp_path):
    """``<size>`` disagreeing with the image: the COCO rule ``image_size_mismatch`` (dropped), naming the
    annotation file; no ``<size>``: the size is read from the image (counted ``size_from_image``), boxes kept."""
    raw = voc_copy(dataset, tmp_path / "raw")
    bad, nosize = _xml(raw, 1), _xml(raw, 2)
    bad.write_text(re.sub(r"<width>\d+</width>", "<width>999</width>", bad.read_text()))
    nosize.write_text(re.sub(r"<size>.*?</size>", "", nosize.read_text()))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    rule = res["report"]["rules"]["image_size_mismatch"]
    assert rule["count"] == 1 and rule["examples"][0]["file"] == str(bad)
    assert "the annotation file says 999x" in rule["examples"][0]["detail"]
    voc = res["report"]["voc"]
    assert voc["size_from_image"]["count"] == 1 and voc["size_from_image"]["examples"][0]["file"] == str(nosize)
    ref, row = _row(converted["voc_out"], nosize), _row(tmp_path / "arrow", nosize)
    assert (row["width"], row["height"], row["bbox"]) == (ref["width"], ref["height"], ref["bbox"])
    assert res["meta"]["splits"]["train"]["images"] == N_TRAIN - 1
    nosize.write_text(nosize.read_text().replace("</filename>", "</filename><size><width>-3</width>"
                                                                "<height>4</height></size>"))
    with pytest.raises(StageError, match=rf"{nosize.name}: <size><width> '-3' is not a non-negative integer"):
        convert(raw, tmp_path / "arrow2", params(), progress=False)


def test_filename_missing_and_outside(dataset, tmp_path):
    """No ``<filename>``: ``JPEGImages/<annotation stem>.jpg`` (counted); one that leaves JPEGImages: an error."""
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw)
    xml.write_text(re.sub(r"<filename>.*?</filename>", "", xml.read_text()))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    assert res["report"]["voc"]["filename_from_stem"]["count"] == 1
    assert read_rows(tmp_path / "arrow", "train")[0]["file_name"] == f"JPEGImages/{xml.stem}.jpg"
    xml.write_text(xml.read_text().replace("<annotation>", "<annotation><filename>../../etc/passwd</filename>"))
    with pytest.raises(StageError, match=rf"{xml.name}: <filename> '../../etc/passwd' is not a file inside "
                                         r"JPEGImages/ \(rule 'voc_filename'\)"):
        convert(raw, tmp_path / "arrow2", params(), progress=False)


def test_image_sets_variants(dataset, tmp_path):
    """No lists: every annotation file is train, split by val_fraction; trainval.txt alone: the same over its ids;
    trainval.txt + val.txt: train = trainval minus val; val.txt alone: an error."""
    raw = voc_copy(dataset, tmp_path / "raw")
    main = raw / "ImageSets" / "Main"
    stems = sorted(p.stem for p in (raw / "Annotations").glob("*.xml"))
    shutil.rmtree(raw / "ImageSets")
    res = convert(raw, tmp_path / "a", params(val_fraction=0.25), progress=False)
    assert (res["meta"]["splits"]["train"]["images"], res["meta"]["splits"]["val"]["images"]) == (10, 4)
    assert res["meta"]["val_fraction"] == 0.25 and res["meta"]["val_annotations_file"] is None
    assert res["report"]["voc"]["image_sets"].startswith("no lists")
    main.mkdir(parents=True)
    (main / "trainval.txt").write_text("".join(s + "\n" for s in stems[:12]))
    res = convert(raw, tmp_path / "b", params(val_fraction=0.25), progress=False)
    assert (res["meta"]["splits"]["train"]["images"], res["meta"]["splits"]["val"]["images"]) == (9, 3)
    assert res["report"]["voc"]["annotations_not_listed"]["count"] == 2
    (main / "val.txt").write_text("".join(s + "\n" for s in stems[9:12]))
    res = convert(raw, tmp_path / "c", params(val_fraction=0.25), progress=False)
    assert (res["meta"]["splits"]["train"]["images"], res["meta"]["splits"]["val"]["images"]) == (9, 3)
    assert [Path(r["file_name"]).stem for r in read_rows(tmp_path / "c", "val")] == stems[9:12]
    assert res["report"]["voc"]["image_sets"] == ("ImageSets/Main/trainval.txt minus ImageSets/Main/val.txt -> "
                                                  "train, ImageSets/Main/val.txt -> val")
    (main / "trainval.txt").unlink()
    with pytest.raises(StageError, match=r"val.txt: a val list without ImageSets/Main/train.txt or trainval.txt"):
        convert(raw, tmp_path / "d", params(), progress=False)


def test_listed_id_without_annotation(dataset, tmp_path):
    """An id in train.txt without Annotations/<id>.xml: skipped and counted (the list file and line named); an
    error with strict."""
    raw = voc_copy(dataset, tmp_path / "raw")
    lst = raw / "ImageSets" / "Main" / "train.txt"
    lst.write_text(lst.read_text() + "no_such_id\n")
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    entry = res["report"]["voc"]["listed_without_annotation"]
    assert entry["count"] == 1 and entry["examples"][0]["file"] == str(lst)
    assert entry["examples"][0]["record"] == f"line {N_TRAIN + 1}"
    assert res["meta"]["splits"]["train"]["images"] == N_TRAIN
    with pytest.raises(StageError, match=rf"train.txt:{N_TRAIN + 1}: image id 'no_such_id' has no "
                                         r"Annotations/no_such_id.xml"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_file_without_objects_is_a_negative(dataset, tmp_path):
    raw = voc_copy(dataset, tmp_path / "raw")
    xml = _xml(raw)
    xml.write_text(re.sub(r"<object>.*?</object>", "", xml.read_text()))
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    assert res["report"]["voc"]["files_without_objects"]["count"] == 1
    ex = res["report"]["rules"]["image_no_annotations"]["examples"][0]
    assert res["report"]["rules"]["image_no_annotations"]["count"] == 1 and ex["file"] == str(xml)
    assert _row(tmp_path / "arrow", xml)["bbox"] == []


def test_format_auto(dataset, tmp_path, caplog):
    with caplog.at_level("INFO"):
        res = convert(dataset["voc_raw"], tmp_path / "a", params(format="auto"), progress=False)
    assert res["meta"]["format"] == "voc"
    assert any("format auto: found voc" in r.message for r in caplog.records)
    both = voc_copy(dataset, tmp_path / "both")
    shutil.copyfile(dataset["coco_raw"] / "train.json", both / "train.json")
    with pytest.raises(StageError, match=r"ambiguous: .*Annotations \(voc\) and .*train.json \(coco\)"):
        convert(both, tmp_path / "c", params(format="auto", annotations="train.json"), progress=False)
    (tmp_path / "empty" / "Annotations").mkdir(parents=True)
    (tmp_path / "empty" / "JPEGImages").mkdir()
    with pytest.raises(StageError, match=r"found no dataset \(.*voc: Annotations/\*.xml beside JPEGImages/"):
        convert(tmp_path / "empty", tmp_path / "d", params(format="auto"), progress=False)


def test_cli_voc_error_is_one_line(dataset, tmp_path):
    """``python -m stages.convert`` with ``convert.format: voc``: writes the rows; a malformed annotation file ->
    exit 2 and one line naming it, no traceback."""
    import os
    import subprocess
    import sys

    raw = voc_copy(dataset, tmp_path / "data" / "raw")
    conf = yaml.safe_load((REPO / "params.yaml").read_text())
    conf["convert"].update({"format": "voc", "workers": 1, "annotations": None, "images": None})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(conf))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "stages.convert"]
    ok = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    meta = json.loads((tmp_path / "data" / "arrow" / "meta.json").read_text())
    assert meta["format"] == "voc" and meta["splits"]["val"]["images"] == N_VAL
    xml = _xml(raw)
    xml.write_text("<annotation><object>")
    bad = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert f"{xml.name}: line 1, column 21: malformed XML" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_coco128_as_voc_matches_the_coco_path(tmp_path):
    """All of COCO128 written as VOC by globox, with ImageSets lists equal to the COCO path's split (params.yaml's
    convert section), converted with ``format: voc``: row by row the same images per split, the same class names
    per object, boxes within 1 px of the COCO path's and equal to globox's corners mapped by the rule; no lists
    (val_fraction, seed) gives the same split, since the file stems sort as the COCO ids do."""
    conf = yaml.safe_load((REPO / "params.yaml").read_text())["convert"]
    res_c = convert(COCO, tmp_path / "arrow_coco", Convert(**{**conf, "format": "coco"}), progress=False)
    coco_rows = {s: [r["file_name"] for r in read_rows(tmp_path / "arrow_coco", s)] for s in ("train", "val")}
    raw = tmp_path / "raw"
    write_voc(COCO / ANN, raw, COCO / "train2017", coco_rows)
    res_v = convert(raw, tmp_path / "arrow_voc", Convert(**{**conf, "format": "voc"}), progress=False)
    got = compare_with_globox_and_coco(raw, tmp_path / "arrow_voc", tmp_path / "arrow_coco")
    print(f"COCO128 as VOC: {got['images']} images, {got['boxes']} boxes, {len(got['names'])} class names; max "
          f"|ours - rule(globox)| = {got['globox']:.2e} px, max |ours - COCO path| = {got['coco']:.4f} px; iscrowd "
          f"differs on {got['crowd_differs']} (COCO crowd regions, which VOC cannot express)")
    assert got["images"] == 128 and got["boxes"] == res_c["meta"]["splits"]["train"]["annotations"] + \
        res_c["meta"]["splits"]["val"]["annotations"]
    assert got["globox"] <= 1e-3 and 1 - 1e-3 <= got["coco"] <= 1 + 1e-3
    assert {s: res_v["meta"]["splits"][s]["images"] for s in coco_rows} == {s: len(v) for s, v in coco_rows.items()}
    assert res_v["report"]["voc"]["files_without_objects"]["count"] == 2
    shutil.rmtree(raw / "ImageSets")
    convert(raw, tmp_path / "arrow_nolists", Convert(**{**conf, "format": "voc"}), progress=False)
    for s in coco_rows:
        assert [Path(r["file_name"]).name for r in read_rows(tmp_path / "arrow_nolists", s)] == coco_rows[s]
