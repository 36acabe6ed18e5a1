"""Tests of the CVAT reader (detpipe/data/cvat_reader.py) and ``convert.format: cvat`` on real COCO128 images whose
CVAT for images 1.1 XML was written by an independent converter (globox 2.9.0: ``AnnotationSet.from_coco`` then
``save_cvat``) and read back both by globox (``from_cvat``) and by our convert stage.

globox writes ``<annotations>`` with ``<image name width height>`` and ``<box label xtl ytl xbr ybr>`` only: no
``<meta>``, no image ``id`` or ``subset``, no polygons, no ``occluded``. The test's `_cvat_file` joins globox's
train and val files into one annotations.xml the way CVAT's project export lays it out: a ``<meta><project>
<labels>`` with COCO's 80 names in COCO order, ``id`` attributes, and ``subset="Train"`` / ``"Validation"``
(images under ``images/``, the task layout). Polygons, occlusion and the other elements are added by the tests
themselves (a second path, since globox writes none of them)."""
from __future__ import annotations

import json
import shutil
import tracemalloc
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from detpipe.data import cvat_reader
from detpipe.data.convert import convert
from detpipe.core.errors import StageError
from detpipe.params import Convert
from support import formats
from support.formats import COCO, N_TRAIN, N_VAL, coco_copy
from support.pipeline import read_rows

SUBSET = {"train": "Train", "val": "Validation"}


def params(**kw) -> Convert:
    return formats.params("cvat", **kw)


def _cvat_file(globox_files: dict[str, Path], names: list[str], dest: Path) -> None:
    """One CVAT project-style annotations.xml from globox's per-split files (see the module docstring)."""
    root = ET.Element("annotations")
    ET.SubElement(root, "version").text = "1.1"
    labels = ET.SubElement(ET.SubElement(ET.SubElement(root, "meta"), "project"), "labels")
    for n in names:
        ET.SubElement(ET.SubElement(labels, "label"), "name").text = n
    k = 0
    for split, path in globox_files.items():
        for im in ET.parse(path).getroot().iter("image"):
            im.set("id", str(k))
            im.set("subset", SUBSET[split])
            root.append(im)
            k += 1
    dest.write_text('<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict:
    """COCO128's first 14 images (by id): a COCO copy (train 10 / val 4 as two files), globox's two CVAT files
    (``globox_train.xml``, ``globox_val.xml``) and the CVAT copy (``raw_cvat``: annotations.xml, images/)."""
    from globox import AnnotationSet

    root = tmp_path_factory.mktemp("cvat")
    base = coco_copy(root)
    src, parts = base["src"], base["parts"]
    coco_raw = base["coco_raw"]
    cvat_raw = root / "raw_cvat"
    (cvat_raw / "images").mkdir(parents=True)
    globox_files = {}
    for split, data in parts.items():
        for im in data["images"]:
            shutil.copyfile(COCO / "train2017" / im["file_name"], cvat_raw / "images" / im["file_name"])
        globox_files[split] = root / f"globox_{split}.xml"
        AnnotationSet.from_coco(coco_raw / f"{split}.json").save_cvat(globox_files[split])
    names = [c["name"] for c in sorted(src["categories"], key=lambda c: c["id"])]
    _cvat_file(globox_files, names, cvat_raw / "annotations.xml")
    return {"root": root, "coco_raw": coco_raw, "cvat_raw": cvat_raw, "parts": parts, "names": names,
            "globox": globox_files, "cat_names": {c["id"]: c["name"] for c in src["categories"]}}


def cvat_copy(dataset: dict, dest: Path) -> Path:
    shutil.copytree(dataset["cvat_raw"], dest)
    return dest


def _xml(raw: Path) -> ET.ElementTree:
    return ET.parse(raw / "annotations.xml")


def _save(tree: ET.ElementTree, raw: Path) -> Path:
    tree.write(raw / "annotations.xml", encoding="utf-8", xml_declaration=True)
    return raw / "annotations.xml"


@pytest.fixture(scope="module")
def converted(dataset) -> dict:
    root = dataset["root"]
    res_x = convert(dataset["cvat_raw"], root / "arrow_cvat", params(), progress=False)
    res_c = formats.convert_coco_copy(dataset["coco_raw"], root / "arrow_coco", "cvat")
    return {"cvat": res_x, "coco": res_c, "out": root / "arrow_cvat", "coco_out": root / "arrow_coco"}


def test_boxes_equal_globox_and_coco_path(dataset, converted):
    """Every box equals (1e-3 px) the ``<box>`` globox wrote, read back by globox (``from_cvat``) and mapped by
    the documented rule ``[xtl, ytl, xbr - xtl, ybr - ytl]`` (clipped to the image by the COCO rules); is within
    0.5 px of the COCO path's box for the same image and object; every class name equal; categories are
    ``<labels>`` in order (ids 1..80); ``subset`` Train / Validation are the splits."""
    from globox import AnnotationSet

    meta = json.loads((converted["out"] / "meta.json").read_text())
    assert meta["format"] == "cvat" and meta["annotations_file"] == "annotations.xml"
    assert meta["label_names"] == ["__background__"] + dataset["names"]
    assert [c["id"] for c in meta["categories"]] == list(range(1, 81))
    names = {c["id"]: c["name"] for c in meta["categories"]}
    back = AnnotationSet.from_cvat(dataset["cvat_raw"] / "annotations.xml")
    got = formats.compare_with_globox_and_coco(
        converted["out"], converted["coco_out"], dataset["parts"], lambda split: back,
        lambda split, name: f"images/{name}", names.__getitem__, lambda box: box.label)
    print(f"{got['boxes']} boxes: max |ours - globox| = {got['globox']:.2e} px, max |ours - COCO path| = "
          f"{got['coco']:.2e} px")
    assert got["boxes"] > 50
    assert got["globox"] <= 1e-3
    assert got["coco"] <= 0.5


def test_report_same_rules_and_cvat_section(dataset, converted):
    rep = converted["cvat"]["report"]
    assert rep["format"] == "cvat"
    assert list(rep["rules"]) == list(converted["coco"]["report"]["rules"])
    cv = rep["cvat"]
    assert cv["labels_from"] == "meta" and cv["split"] == "subset"
    assert cv["subsets"] == {"Train": N_TRAIN, "Validation": N_VAL}
    for key in ("skipped_shapes", "images_other_subset", "images_without_objects", "occluded_objects",
                "rotated_boxes"):
        assert cv[key]["count"] == 0, key
    assert {s: v["annotations_out"] for s, v in rep["splits"].items()} == \
        {s: v["annotations_out"] for s, v in converted["coco"]["report"]["splits"].items()}


def test_globox_file_as_written(dataset, tmp_path, caplog):
    """globox's own file (no <meta>, no subset): classes are the sorted labels its boxes use (logged), every image
    is train, split by val_fraction."""
    raw = cvat_copy(dataset, tmp_path / "raw")
    shutil.copyfile(dataset["globox"]["train"], raw / "annotations.xml")
    with caplog.at_level("WARNING"):
        res = convert(raw, tmp_path / "arrow", params(val_fraction=0.2), progress=False)
    used = sorted({dataset["cat_names"][a["category_id"]] for a in dataset["parts"]["train"]["annotations"]})
    assert res["meta"]["label_names"] == ["__background__"] + used
    assert res["report"]["cvat"]["labels_from"] == "objects"
    assert res["report"]["cvat"]["split"] == "convert.val_fraction"
    assert res["meta"]["splits"]["val"]["images"] == round(N_TRAIN * 0.2)
    assert any("has no <labels> in <meta>" in r.message for r in caplog.records)


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE annotations [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol9 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
]>
<annotations><image id="0" name="x.jpg" width="10" height="10"><box label="&lol9;" xtl="1" ytl="1" xbr="2" ybr="2"/>
</image></annotations>
"""
EXTERNAL_ENTITY = """<?xml version="1.0"?>
<!DOCTYPE annotations [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<annotations><image id="0" name="&xxe;" width="10" height="10"/></annotations>
"""


@pytest.mark.parametrize("text", [BILLION_LAUGHS, EXTERNAL_ENTITY], ids=["billion_laughs", "external_entity"])
def test_dtd_entities_refused(dataset, tmp_path, text):
    """A document type declaration (where entity expansion and external entities live) is refused before any
    entity is declared or resolved: one line naming the file, the line and the rule."""
    raw = cvat_copy(dataset, tmp_path / "raw")
    (raw / "annotations.xml").write_text(text)
    with pytest.raises(StageError, match=rf"{raw / 'annotations.xml'}: line 2: XML document type declaration "
                                         r"<!DOCTYPE annotations> refused.*rule 'cvat_xml'") as e:
        convert(raw, tmp_path / "arrow", params(), progress=False)
    assert "root:" not in str(e.value) and "lol" not in str(e.value)
    assert cvat_reader.detect(raw) == raw / "annotations.xml"      # still CVAT's file: read() names the error


@pytest.mark.parametrize("how, where", [("truncated", r"line 2, column \d+: malformed XML \(no element found\)"),
                                        ("mismatched", r"line 4, column \d+: malformed XML \(mismatched tag\)")])
def test_malformed_xml(dataset, tmp_path, how, where):
    raw = cvat_copy(dataset, tmp_path / "raw")
    path = raw / "annotations.xml"
    text = path.read_text()
    if how == "truncated":
        path.write_text(text[: text.index("</image>") + len("</image>")])      # ends after the first image
    else:
        lines = text.replace("><", ">\n<").splitlines()
        lines[3] = lines[3].replace("</label>", "</lable>") if "</label>" in lines[3] else lines[3] + "</oops>"
        path.write_text("\n".join(lines))
    with pytest.raises(StageError, match=rf"{path}: {where} \(rule 'cvat_xml'\)"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


@pytest.mark.parametrize("text, message", [
    ("<annotation><filename>x.jpg</filename></annotation>", r"root element <annotation>; a CVAT for images 1.1 "
                                                             r"file has <annotations>"),
    ('<annotations><track id="0" label="a"><box frame="0" xtl="1" ytl="1" xbr="2" ybr="2"/></track></annotations>',
     r"<track> elements: this is CVAT for video 1.1; export the task as 'CVAT for images 1.1'")],
    ids=["voc_root", "cvat_for_video"])
def test_not_cvat_for_images(dataset, tmp_path, text, message):
    raw = cvat_copy(dataset, tmp_path / "raw")
    (raw / "annotations.xml").write_text(text)
    with pytest.raises(StageError, match=rf"annotations.xml: {message} \(rule 'cvat_xml'\)"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_label_not_in_labels(dataset, tmp_path):
    raw = cvat_copy(dataset, tmp_path / "raw")
    tree = _xml(raw)
    im = [im for im in tree.getroot().findall("image") if len(im) > 1][2]
    im[1].set("label", "unicorn")
    path = _save(tree, raw)
    with pytest.raises(StageError, match=rf"{path}, image '{im.get('name')}' element 2 \(<box>\): label 'unicorn' "
                                         r"is not in <meta> <labels> \(person, .*\) \(rule 'cvat_label'\)"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


@pytest.mark.parametrize("attr, value", [("xtl", "abc"), ("ybr", "nan"), ("xbr", None)])
def test_non_numeric_coordinate(dataset, tmp_path, attr, value):
    raw = cvat_copy(dataset, tmp_path / "raw")
    tree = _xml(raw)
    im = tree.getroot().findall("image")[0]
    if value is None:
        del im[0].attrib[attr]
    else:
        im[0].set(attr, value)
    path = _save(tree, raw)
    what = "missing" if value is None else f"'{value}' is not a finite number"
    with pytest.raises(StageError, match=rf"{path}, image '{im.get('name')}' element 1 \(<box>\): attribute "
                                         rf"'{attr}' {what} \(rule 'cvat_shape'\)"):
        convert(raw, tmp_path / "arrow", params(), progress=False)


def test_box_outside_image_counted(dataset, tmp_path):
    """A box wholly outside is dropped (``bbox_outside``), one partly outside clipped (``bbox_clipped``), as the
    COCO path does; the examples name annotations.xml, the image and the element."""
    raw = cvat_copy(dataset, tmp_path / "raw")
    tree = _xml(raw)
    im = tree.getroot().findall("image")[0]
    W = int(im.get("width"))
    n = len(im)
    ET.SubElement(im, "box", label="person", occluded="0", xtl=str(W + 5), ytl="5", xbr=str(W + 50), ybr="40")
    ET.SubElement(im, "box", label="person", occluded="0", xtl=str(W - 30), ytl="50", xbr=str(W + 20), ybr="90")
    path = _save(tree, raw)
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    rules = res["report"]["rules"]
    assert rules["bbox_outside"]["count"] == 1 and rules["bbox_clipped"]["count"] == 1
    ex = rules["bbox_outside"]["examples"][0]
    assert ex["file"] == str(path)
    assert ex["record"] == f"image '{im.get('name')}' element {n + 1} (image id 1)"
    assert rules["bbox_clipped"]["examples"][0]["record"] == f"image '{im.get('name')}' element {n + 2} (image id 1)"
    row = read_rows(tmp_path / "arrow", "train")[0]
    x, y, w, h = row["bbox"][-1]
    assert abs(x - (W - 30)) < 1e-3 and abs(x + w - W) < 1e-3
    with pytest.raises(StageError, match=rf"annotations.xml, image '{im.get('name')}' element {n + 1} "
                                         r"\(image id 1\): rule 'bbox_outside'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_polygons_from_coco_segmentation(dataset, tmp_path):
    """``<polygon points="x,y;...">`` (COCO128's segmentation, written by the test: globox writes boxes only):
    box = the polygon's bounds (COCO's own bbox within 0.5 px), segmentation = the polygon, area = its shoelace
    area. A polygon of 2 points is an error naming the image and element."""
    raw = cvat_copy(dataset, tmp_path / "raw")
    tree = _xml(raw)
    by_name = {im.get("name"): im for im in tree.getroot().findall("image")}
    expect = {}
    for data in dataset["parts"].values():
        for im in data["images"]:
            el = by_name[im["file_name"]]
            for child in list(el):
                el.remove(child)
            expect[im["file_name"]] = []
            for a in (a for a in data["annotations"] if a["image_id"] == im["id"]):
                poly = a["segmentation"][0]
                ET.SubElement(el, "polygon", label=dataset["cat_names"][a["category_id"]], occluded="0",
                              points=";".join(f"{x!r},{y!r}" for x, y in zip(poly[0::2], poly[1::2])))
                expect[im["file_name"]].append(poly)
    _save(tree, raw)
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    assert res["report"]["rules"]["segmentation_invalid"]["count"] == 0
    n = 0
    for split in ("train", "val"):
        for row in read_rows(tmp_path / "arrow", split):
            polys = expect[Path(row["file_name"]).name]
            assert len(row["bbox"]) == len(polys)
            for poly, box, seg, area in zip(polys, row["bbox"], row["segmentation"], row["area"]):
                xs, ys = np.asarray(poly[0::2]), np.asarray(poly[1::2])
                ref = [xs.min(), ys.min(), xs.max() - xs.min(), ys.max() - ys.min()]
                assert max(abs(u - v) for u, v in zip(box, ref)) <= 1e-3
                assert np.allclose(json.loads(seg)[0], poly, atol=1e-9)
                shoelace = abs(float(np.dot(xs, np.roll(ys, -1)) - np.dot(ys, np.roll(xs, -1)))) / 2
                assert abs(area - shoelace) <= 1e-6 * max(shoelace, 1)
                n += 1
    assert n > 50
    el = by_name[dataset["parts"]["val"]["images"][0]["file_name"]]
    el[0].set("points", "1,2;3,4")
    path = _save(tree, raw)
    with pytest.raises(StageError, match=rf"{path}, image '{el.get('name')}' element 1 \(<polygon>\): a polygon has "
                                         r"2 points, at least 3 are needed \(rule 'cvat_shape'\)"):
        convert(raw, tmp_path / "arrow2", params(), progress=False)


def test_occluded_kept(dataset, converted, tmp_path):
    """``occluded="1"``: the object is kept with ``occluded`` 1 in its Arrow row (every other column the same as
    without the flag, every other object 0), the translated COCO annotation carries ``"attributes": {"occluded":
    true}`` (CVAT's COCO exporter's key), and report.json's ``cvat.occluded_objects`` counts it with the image and
    element."""
    raw = cvat_copy(dataset, tmp_path / "raw")
    tree = _xml(raw)
    ims = tree.getroot().findall("image")
    flagged = [(ims[0].get("name"), 1), (ims[0].get("name"), 3), (ims[N_TRAIN].get("name"), 1)]
    for name, k in flagged:
        next(im for im in ims if im.get("name") == name)[k - 1].set("occluded", "1")
    path = _save(tree, raw)
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    occ = res["report"]["cvat"]["occluded_objects"]
    assert occ["count"] == 3
    assert [e["record"] for e in occ["examples"]] == [f"image '{n}' element {k}" for n, k in flagged]
    assert all(e["file"] == str(path) for e in occ["examples"])
    want = {}
    for name, k in flagged:
        want.setdefault(name, set()).add(k)
    seen = 0
    for split in ("train", "val"):
        rows, plain = read_rows(tmp_path / "arrow", split), read_rows(converted["out"], split)
        assert [{c: v for c, v in r.items() if c != "occluded"} for r in rows] == \
            [{c: v for c, v in r.items() if c != "occluded"} for r in plain]
        assert all(not any(r["occluded"]) for r in plain)
        for row in rows:
            flags = want.get(Path(row["file_name"]).name, set())
            assert list(row["occluded"]) == [int(k in flags) for k in range(1, len(row["bbox"]) + 1)]
            seen += sum(row["occluded"])
    assert seen == len(flagged)
    (tmp_path / "scratch").mkdir()
    ds = cvat_reader.read(raw, params(), tmp_path / "scratch")
    coco = json.loads(ds.translated["train"].json_path.read_text())
    marked = [a["id"] for a in coco["annotations"] if a.get("attributes") == {"occluded": True}]
    assert marked == [1, 3]
    assert all("attributes" not in a for a in coco["annotations"] if a["id"] not in marked)


def test_subsets_and_project_layout(dataset, tmp_path):
    """Subsets map to splits case-insensitively; a ``Test`` subset is counted and skipped (an error with strict);
    images under ``images/<subset>/`` (CVAT's project export) are found."""
    raw = cvat_copy(dataset, tmp_path / "raw")
    tree = _xml(raw)
    ims = tree.getroot().findall("image")
    for im in ims[:N_TRAIN]:
        im.set("subset", "train")
        (raw / "images" / "train").mkdir(exist_ok=True)
        shutil.move(raw / "images" / im.get("name"), raw / "images" / "train" / im.get("name"))
    ims[-1].set("subset", "Test")
    path = _save(tree, raw)
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    assert res["meta"]["splits"]["train"]["images"] == N_TRAIN
    assert res["meta"]["splits"]["val"]["images"] == N_VAL - 1
    assert res["report"]["rules"]["image_missing"]["count"] == 0
    assert all(r["file_name"].startswith("images/train/") for r in read_rows(tmp_path / "arrow", "train"))
    other = res["report"]["cvat"]["images_other_subset"]
    assert other["count"] == 1 and other["examples"][0]["record"] == f"image '{ims[-1].get('name')}'"
    assert res["report"]["cvat"]["subsets"] == {"train": N_TRAIN, "Validation": N_VAL - 1, "Test": 1}
    with pytest.raises(StageError, match=rf"{path}, image '{ims[-1].get('name')}': subset 'Test' is neither .*"
                                         r"rule 'images_other_subset'"):
        convert(raw, tmp_path / "arrow2", params(strict=True), progress=False)


def test_skipped_elements_and_rotation(dataset, tmp_path):
    """polyline, points, tag (and any other element) are counted by name and skipped; an image left without a
    box is a negative; a rotated box becomes the bounds of the rotated rectangle."""
    raw = cvat_copy(dataset, tmp_path / "raw")
    tree = _xml(raw)
    ims = tree.getroot().findall("image")
    ET.SubElement(ims[0], "polyline", label="person", points="1,1;5,5")
    ET.SubElement(ims[0], "points", label="person", points="1,1")
    ET.SubElement(ims[0], "tag", label="person")
    neg = ims[1]
    for child in list(neg):
        neg.remove(child)
    ET.SubElement(neg, "polyline", label="person", points="1,1;5,5")
    ET.SubElement(ims[2], "box", label="person", xtl="100", ytl="100", xbr="140", ybr="120", rotation="90")
    _save(tree, raw)
    res = convert(raw, tmp_path / "arrow", params(), progress=False)
    cv = res["report"]["cvat"]
    assert cv["skipped_shapes"]["count"] == 4
    assert cv["skipped_shapes"]["by_type"] == {"polyline": 2, "points": 1, "tag": 1}
    assert cv["images_without_objects"]["count"] == 1 and res["report"]["rules"]["image_no_annotations"]["count"] == 1
    assert cv["rotated_boxes"]["count"] == 1
    row = next(r for r in read_rows(tmp_path / "arrow", "train") if r["file_name"] == f"images/{ims[2].get('name')}")
    assert np.allclose(row["bbox"][-1], [110, 90, 20, 40], atol=1e-3)      # 40 x 20 about (120, 110), turned
    assert abs(row["area"][-1] - 800) < 1e-6


def test_format_auto(dataset, tmp_path, caplog):
    with caplog.at_level("INFO"):
        res = convert(dataset["cvat_raw"], tmp_path / "a", params(format="auto"), progress=False)
    assert res["meta"]["format"] == "cvat"
    assert any("format auto: found cvat" in r.message for r in caplog.records)
    assert cvat_reader.detect(dataset["coco_raw"]) is None
    voc_like = tmp_path / "voc"
    voc_like.mkdir()
    (voc_like / "annotations.xml").write_text("<annotation><filename>x.jpg</filename></annotation>")
    assert cvat_reader.detect(voc_like) is None


def _big_xml(path: Path, n_images: int) -> None:
    box = '<box label="a" occluded="0" xtl="1.00" ytl="2.00" xbr="30.50" ybr="40.25" z_order="0"/>'
    with open(path, "w") as f:
        f.write('<?xml version="1.0" encoding="utf-8"?>\n<annotations><version>1.1</version><meta><task><labels>'
                '<label><name>a</name></label></labels></task></meta>\n')
        for k in range(n_images):
            f.write(f'<image id="{k}" name="img_{k:07d}.jpg" width="64" height="48">{box * 5}</image>\n')
        f.write("</annotations>\n")


def test_streaming_memory_bounded(tmp_path):
    """`cvat_reader.iter_cvat` holds one image's elements: the Python heap's peak while streaming 5,000 images is
    within 1.5x of the peak for 500 (a parse that kept the tree would grow ~10x)."""
    peaks = {}
    for n in (500, 5_000):
        path = tmp_path / f"a{n}.xml"
        _big_xml(path, n)
        tracemalloc.start()
        count = sum(1 for kind, _ in cvat_reader.iter_cvat(path) if kind == "image")
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert count == n
    print(f"peak heap while streaming: {peaks}")
    assert peaks[5_000] < 1.5 * peaks[500]
