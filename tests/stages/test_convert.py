"""Tests of detpipe/data/convert.py (the convert stage) on real COCO128 images and annotations (files crafted from them with PIL)."""
from __future__ import annotations

import copy
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pytest
from PIL import Image, ImageDraw
from pycocotools import mask as mask_utils

from detpipe.core.errors import StageError
from detpipe.data import coco_json
from detpipe.data.coco_json import load_json, read_coco
from detpipe.data.coco_schema import RULES, check_coco
from detpipe.data.convert import convert, inspect_image, split_ids
from detpipe.data.imageio import decode_rgb
from detpipe.params import Convert
from support.pipeline import read_rows

REPO = Path(__file__).resolve().parents[2]
COCO = REPO / "data" / "coco128"
ANN = "annotations/instances_train2017.json"
BASE_IDS = (9, 25, 30)           # RGB JPEGs with 8, 2 and 2 annotations


@pytest.fixture(scope="module")
def coco() -> dict:
    return json.loads((COCO / ANN).read_text())


def subset(coco: dict, ids) -> dict:
    """Deep copy of the COCO128 categories + the given images and their annotations."""
    ids = set(ids)
    return {"info": {"description": "test"}, "categories": copy.deepcopy(coco["categories"]),
            "images": [copy.deepcopy(i) for i in coco["images"] if i["id"] in ids],
            "annotations": [copy.deepcopy(a) for a in coco["annotations"] if a["image_id"] in ids]}


def write_raw(root: Path, data: dict, files: dict[str, bytes] | None = None, *, images: str = "train2017",
              ann: str = ANN) -> Path:
    """Lay out ``root/raw`` like the download stage: the JSON and the image files (COCO128 copies unless
    given in ``files``; a name mapped to None is left out)."""
    raw = root / "raw"
    (raw / images).mkdir(parents=True, exist_ok=True)
    (raw / ann).parent.mkdir(parents=True, exist_ok=True)
    files = files or {}
    for im in data["images"]:
        name = im["file_name"]
        if name in files:
            continue
        if (COCO / "train2017" / name).exists():
            shutil.copyfile(COCO / "train2017" / name, raw / images / name)
    for name, blob in files.items():
        if blob is not None:
            (raw / images / name).write_bytes(blob)
    (raw / ann).write_text(json.dumps(data))       # json.dumps writes NaN/Infinity literals
    return raw


def params(**kw) -> Convert:
    base = dict(annotations=ANN, images="train2017", val_fraction=0.0, seed=0, shard_mb=64, strict=False,
                workers=0)
    base.update(kw)
    return Convert(**base)


def run(raw: Path, **kw) -> dict:
    return convert(raw, raw.parent / "arrow", params(**kw), progress=False)


def findings(res: dict) -> dict[str, int]:
    return {rule: v["count"] for rule, v in res["report"]["rules"].items() if v["count"]}


def jpeg_bytes(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=92, **kw)
    return buf.getvalue()


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def coco_image(name: str) -> Image.Image:
    with Image.open(COCO / "train2017" / name) as im:
        return im.convert("RGB")


def anns_of(data: dict, image_id: int) -> list[dict]:
    return [a for a in data["annotations"] if a["image_id"] == image_id]


# ------------------------------------------------------------------------------------------ round trip


def test_round_trip_real_images(tmp_path, coco):
    ids = (9, 25, 36, 257, 250)      # 257 has a crowd RLE with id 900100000257; 250 has no annotations
    data = subset(coco, ids)
    raw = write_raw(tmp_path, data)
    res = run(raw)
    rows = read_rows(tmp_path / "arrow")
    assert [r["image_id"] for r in rows] == sorted(ids)
    assert findings(res) == {"image_no_annotations": 1}
    labels = {c["id"]: k + 1 for k, c in enumerate(sorted(coco["categories"], key=lambda c: c["id"]))}
    for row in rows:
        im = next(i for i in data["images"] if i["id"] == row["image_id"])
        assert row["file_name"] == im["file_name"]
        assert (row["width"], row["height"]) == (im["width"], im["height"])
        assert row["image"] == (COCO / "train2017" / im["file_name"]).read_bytes()
        anns = anns_of(data, im["id"])
        assert row["ann_id"] == [a["id"] for a in anns]
        assert np.array_equal(np.array(row["bbox"], np.float32).reshape(-1, 4),
                              np.array([a["bbox"] for a in anns], np.float32).reshape(-1, 4))
        assert row["category_id"] == [a["category_id"] for a in anns]
        assert row["label"] == [labels[a["category_id"]] for a in anns]
        assert row["iscrowd"] == [a["iscrowd"] for a in anns]
        assert row["area"] == [a["area"] for a in anns]
        assert [json.loads(s) for s in row["segmentation"]] == [a["segmentation"] for a in anns]
    assert 900100000257 in rows[[r["image_id"] for r in rows].index(257)]["ann_id"]
    meta = res["meta"]
    assert meta["num_classes"] == 81 and len(meta["label_names"]) == 81
    assert meta["label_names"][0] == "__background__" and meta["label_names"][1] == "person"
    assert meta["category_id_to_label"]["90"] == 80
    assert meta["categories"] == coco["categories"]


def test_large_ids_round_trip(tmp_path, coco):
    data = subset(coco, [9])
    big_image = 2**40 + 9
    data["images"][0]["id"] = big_image
    for k, a in enumerate(data["annotations"]):
        a["image_id"] = big_image
        a["id"] = 2**62 + k
    data["categories"].append({"supercategory": "x", "id": 2**35, "name": "huge"})
    data["annotations"][0]["category_id"] = 2**35
    raw = write_raw(tmp_path, data)
    res = run(raw)
    (row,) = read_rows(tmp_path / "arrow")
    assert row["image_id"] == big_image
    assert row["ann_id"] == [2**62 + k for k in range(len(data["annotations"]))]
    assert row["category_id"][0] == 2**35 and row["label"][0] == 81
    assert res["meta"]["category_id_to_label"][str(2**35)] == 81


def test_all_coco128_split_and_determinism(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "annotations").symlink_to(COCO / "annotations")
    (raw / "train2017").symlink_to(COCO / "train2017")
    res = convert(raw, tmp_path / "a", params(val_fraction=0.2, workers=2), progress=False)
    assert findings(res) == {"grayscale": 1, "image_no_annotations": 2}
    assert res["report"]["rules"]["grayscale"]["examples"][0]["record"] == "image id 86"
    splits = res["meta"]["splits"]
    assert splits["val"]["images"] == round(128 * 0.2) and splits["train"]["images"] == 128 - 26
    assert splits["train"]["annotations"] + splits["val"]["annotations"] == 939
    train, val = read_rows(tmp_path / "a", "train"), read_rows(tmp_path / "a", "val")
    t_ids, v_ids = [r["image_id"] for r in train], [r["image_id"] for r in val]
    assert t_ids == sorted(t_ids) and v_ids == sorted(v_ids)
    assert not set(t_ids) & set(v_ids) and len(set(t_ids) | set(v_ids)) == 128
    assert (t_ids, v_ids) == tuple(split_ids(t_ids + v_ids, 0.2, 0))
    # same seed, in process instead of 2 workers: byte-identical shards
    convert(raw, tmp_path / "b", params(val_fraction=0.2, workers=0), progress=False)
    for shard in splits["train"]["shards"] + splits["val"]["shards"]:
        assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    # another seed: another split
    convert(raw, tmp_path / "c", params(val_fraction=0.2, seed=1, workers=0), progress=False)
    v_ids_1 = [r["image_id"] for r in read_rows(tmp_path / "c", "val")]
    assert len(v_ids_1) == 26 and v_ids_1 != v_ids


def test_collector_restored_after_convert(tmp_path, coco):
    """convert pauses the cyclic garbage collector while it parses and indexes the JSON, then freezes the parsed
    objects (`gc_paused`); the collector must be running again afterwards with nothing left frozen, also when
    the JSON is rejected."""
    import gc

    frozen = gc.get_freeze_count()
    raw = write_raw(tmp_path, subset(coco, BASE_IDS))
    run(raw)
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    (raw / ANN).write_text('{"images": [')
    with pytest.raises(StageError, match="json_invalid"):
        run(raw)
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_split_ids_deterministic():
    ids = list(range(1000, 1100))[::-1]
    a, b = split_ids(ids, 0.25, 7), split_ids(ids, 0.25, 7)
    assert a == b and len(a[1]) == 25 and sorted(a[0] + a[1]) == sorted(ids)
    assert split_ids(ids, 0.25, 8)[1] != a[1]
    assert split_ids(ids, 0.0, 7) == (sorted(ids), [])
    with pytest.raises(StageError, match="seed"):
        split_ids(ids, 0.2, -1)


def test_shard_mb_bounds_shards(tmp_path, coco):
    ids = [i["id"] for i in coco["images"][:12]]
    raw = write_raw(tmp_path, subset(coco, ids))
    limit = 0.4                           # MB (10^6 bytes); COCO128 images are ~50..300 kB
    res = run(raw, shard_mb=limit)
    shards = res["meta"]["splits"]["train"]["shards"]
    assert len(shards) >= 4
    assert sorted(p.name for p in (tmp_path / "arrow" / "train").iterdir()) == [Path(s).name for s in shards]
    seen = []
    for shard in shards:
        with pa.memory_map(str(tmp_path / "arrow" / shard)) as src:
            t = pa.ipc.open_file(src).read_all()
        sizes = [len(b) for b in t.column("image").to_pylist()]
        assert sum(sizes) <= limit * 1e6 or len(sizes) == 1
        seen += t.column("image_id").to_pylist()
    assert seen == sorted(ids)


# ------------------------------------------------------------------------------------- image rules


def test_image_missing(tmp_path, coco):
    data = subset(coco, BASE_IDS)
    raw = write_raw(tmp_path, data, {"000000000025.jpg": None})
    res = run(raw)
    assert findings(res) == {"image_missing": 1}
    ex = res["report"]["rules"]["image_missing"]["examples"][0]
    assert ex["record"] == "image id 25" and ex["file"].endswith("train2017/000000000025.jpg")
    rows = read_rows(tmp_path / "arrow")
    assert [r["image_id"] for r in rows] == [9, 30]
    assert res["report"]["splits"]["train"]["annotations_out"] == len(anns_of(data, 9)) + len(anns_of(data, 30))


def _garbled(data: bytes, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    b = bytearray(data)
    pos = len(b) // 2
    b[pos:pos + 1000] = rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    return bytes(b)


@pytest.mark.parametrize("kind", ["truncated", "garbled", "not_an_image"])
def test_image_unreadable(tmp_path, coco, kind):
    real = (COCO / "train2017" / "000000000025.jpg").read_bytes()
    blob = {"truncated": real[: len(real) // 2], "garbled": _garbled(real),
            "not_an_image": b"<html>404 not found</html>"}[kind]
    with pytest.raises(StageError):
        decode_rgb(blob)                  # the crafted file really is unreadable for the project's decoder
    raw = write_raw(tmp_path, subset(coco, BASE_IDS), {"000000000025.jpg": blob})
    res = run(raw)
    assert findings(res) == {"image_unreadable": 1}
    assert res["report"]["rules"]["image_unreadable"]["examples"][0]["record"] == "image id 25"
    assert [r["image_id"] for r in read_rows(tmp_path / "arrow")] == [9, 30]


def test_inspect_image_agrees_with_decode_rgb():
    """The cheaper 1/8-scale JPEG check rejects exactly the files decode_rgb rejects."""
    outcomes = set()
    for name in ("000000000009.jpg", "000000000036.jpg", "000000000086.jpg"):
        real = (COCO / "train2017" / name).read_bytes()
        variants = [real[: int(len(real) * f)] for f in (0.01, 0.3, 0.7, 0.99)] + [real + b"\0" * 100]
        variants += [_garbled(real, s) for s in range(6)]
        for s in range(4):
            b = bytearray(real)
            p = len(b) // 5 * (s + 1)
            b[p:p + 3000] = bytes(3000)
            variants.append(bytes(b))
        for blob in variants:
            try:
                decode_rgb(blob)
                ok_full = True
            except StageError:
                ok_full = False
            try:
                inspect_image(blob)
                ok_cheap = True
            except StageError:
                ok_cheap = False
            assert ok_cheap == ok_full
            outcomes.add(ok_full)
    assert outcomes == {True, False}


def test_image_size_mismatch(tmp_path, coco):
    data = subset(coco, BASE_IDS)
    next(i for i in data["images"] if i["id"] == 25)["width"] += 1
    res = run(write_raw(tmp_path, data))
    assert findings(res) == {"image_size_mismatch": 1}
    assert "641x426" in res["report"]["rules"]["image_size_mismatch"]["examples"][0]["detail"]
    assert [r["image_id"] for r in read_rows(tmp_path / "arrow")] == [9, 30]


def _magenta(rgb: np.ndarray) -> np.ndarray:
    rgb = rgb.astype(np.int32)
    return (rgb[..., 0] > 220) & (rgb[..., 1] < 50) & (rgb[..., 2] > 220)


def _magenta_bounds(rgb: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(_magenta(rgb))
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_maps_annotations(tmp_path, coco, orientation):
    """JSON in the stored raster's frame (as COCO): rows come out in decode_rgb's displayed frame."""
    im = coco_image("000000000009.jpg")                 # 640 x 480
    assert not _magenta(np.asarray(im)).any()           # the photo has no such colour of its own
    box = [100, 50, 120, 80]                            # x, y, w, h in the stored raster
    ImageDraw.Draw(im).rectangle([box[0], box[1], box[0] + box[2] - 1, box[1] + box[3] - 1], fill=(255, 0, 255))
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    blob = jpeg_bytes(im, exif=exif.tobytes())
    mask = np.zeros((480, 640), np.uint8, order="F")
    mask[50:130, 100:220] = 1
    rle = mask_utils.encode(mask)
    rle = {"size": rle["size"], "counts": rle["counts"].decode()}
    x0, y0, x1, y1 = 100, 50, 220, 130
    data = subset(coco, [9])
    data["annotations"] = [
        {"id": 1, "image_id": 9, "category_id": 1, "bbox": box, "iscrowd": 0, "area": 9600.0,
         "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]},
        {"id": 2, "image_id": 9, "category_id": 1, "bbox": box, "iscrowd": 1, "area": 9600.0,
         "segmentation": rle},
    ]
    res = run(write_raw(tmp_path, data, {"000000000009.jpg": blob}))
    assert findings(res) == ({} if orientation == 1 else {"exif_orientation": 1})
    (row,) = read_rows(tmp_path / "arrow")
    assert row["image"] == blob
    pixels = decode_rgb(row["image"])
    assert (row["height"], row["width"]) == pixels.shape[:2]
    assert pixels.shape[:2] == ((640, 480) if orientation >= 5 else (480, 640))
    bx, by, bw, bh = row["bbox"][0]
    assert row["bbox"][1] == row["bbox"][0] and bw * bh == pytest.approx(9600)
    mx0, my0, mx1, my1 = _magenta_bounds(pixels)        # where the painted box really is on screen
    assert max(abs(bx - mx0), abs(by - my0), abs(bx + bw - mx1), abs(by + bh - my1)) <= 2
    poly = np.array(json.loads(row["segmentation"][0])[0]).reshape(-1, 2)
    assert poly.min(axis=0).tolist() == pytest.approx([bx, by]) and poly.max(axis=0).tolist() == pytest.approx(
        [bx + bw, by + bh])
    out_rle = json.loads(row["segmentation"][1])
    m = mask_utils.decode({"size": out_rle["size"], "counts": out_rle["counts"].encode()})
    assert m.shape == pixels.shape[:2] and m.sum() == 9600
    ys, xs = np.nonzero(m)
    assert [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] == [bx, by, bx + bw, by + bh]


def test_exif_orientation_json_already_displayed(tmp_path, coco):
    """JSON width/height equal to the displayed size: annotations are kept as they are."""
    im = coco_image("000000000009.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    blob = jpeg_bytes(im, exif=exif.tobytes())
    data = subset(coco, [9])
    data["images"][0].update(width=480, height=640)
    data["annotations"] = [{"id": 1, "image_id": 9, "category_id": 1, "bbox": [10.5, 20, 30, 40], "iscrowd": 0,
                            "area": 1200.0, "segmentation": [[10.5, 20, 40.5, 20, 40.5, 60]]}]
    res = run(write_raw(tmp_path, data, {"000000000009.jpg": blob}))
    assert findings(res) == {"exif_orientation": 1}
    assert "already" in res["report"]["rules"]["exif_orientation"]["examples"][0]["detail"]
    (row,) = read_rows(tmp_path / "arrow")
    assert (row["width"], row["height"]) == (480, 640)
    assert row["bbox"] == [[10.5, 20, 30, 40]]
    assert json.loads(row["segmentation"][0]) == [[10.5, 20, 40.5, 20, 40.5, 60]]


def _modes():
    im = coco_image("000000000025.jpg")
    gray16 = Image.fromarray((np.asarray(im.convert("L"), np.uint16) * 257))
    assert gray16.mode.startswith("I;16")
    rgba = im.convert("RGBA")
    rgba.putalpha(128)
    return {
        "grayscale": (jpeg_bytes(im.convert("L")), "jpg", {"grayscale"}),
        "cmyk": (jpeg_bytes(im.convert("CMYK")), "jpg", {"cmyk"}),
        "png16": (png_bytes(gray16), "png", {"grayscale", "high_bit_depth"}),
        "palette": (png_bytes(im.convert("P")), "png", {"palette"}),
        "rgba": (png_bytes(rgba), "png", {"alpha"}),
    }


@pytest.mark.parametrize("kind", ["grayscale", "cmyk", "png16", "palette", "rgba"])
def test_color_modes_counted_and_kept(tmp_path, coco, kind):
    blob, ext, rules = _modes()[kind]
    data = subset(coco, BASE_IDS)
    name = f"000000000025.{ext}"
    next(i for i in data["images"] if i["id"] == 25)["file_name"] = name
    res = run(write_raw(tmp_path, data, {name: blob}))
    assert findings(res) == {r: 1 for r in rules}
    assert all(res["report"]["rules"][r]["examples"][0]["record"] == "image id 25" for r in rules)
    rows = {r["image_id"]: r for r in read_rows(tmp_path / "arrow")}
    assert sorted(rows) == [9, 25, 30]
    row = rows[25]
    assert row["image"] == blob and row["file_name"] == name
    assert decode_rgb(row["image"]).shape == (426, 640, 3) == (row["height"], row["width"], 3)
    assert row["ann_id"] == [a["id"] for a in anns_of(data, 25)]


# ---------------------------------------------------------------------------------- annotation rules


def _one_image(tmp_path, coco, anns: list[dict], **kw):
    """Image 9 (640 x 480) with the given annotations; returns (result, row)."""
    data = subset(coco, [9])
    data["annotations"] = anns
    res = run(write_raw(tmp_path, data), **kw)
    (row,) = read_rows(tmp_path / "arrow")
    return res, row


def _ann(aid: int, bbox, **kw) -> dict:
    a = {"id": aid, "image_id": 9, "category_id": 1, "bbox": bbox, "iscrowd": 0, "area": 100.0,
         "segmentation": [[bbox[0], bbox[1], bbox[0] + 5, bbox[1], bbox[0] + 5, bbox[1] + 5]]
         if all(map(math.isfinite, bbox)) else []}
    a.update(kw)
    return a


def test_bbox_clipped(tmp_path, coco):
    res, row = _one_image(tmp_path, coco, [_ann(1, [600.5, 400, 100, 100]), _ann(2, [-10, -5, 30, 25]),
                                           _ann(3, [10, 10, 20, 20])])
    assert findings(res) == {"bbox_clipped": 2}
    assert row["ann_id"] == [1, 2, 3]
    assert row["bbox"] == [[600.5, 400, 39.5, 80], [0, 0, 20, 20], [10, 10, 20, 20]]


def test_bbox_nonpositive(tmp_path, coco):
    res, row = _one_image(tmp_path, coco, [_ann(1, [10, 10, 0, 5]), _ann(2, [10, 10, 5, -3]),
                                           _ann(3, [10, 10, 20, 20])])
    assert findings(res) == {"bbox_nonpositive": 2}
    assert row["ann_id"] == [3]


def test_bbox_not_finite(tmp_path, coco):
    res, row = _one_image(tmp_path, coco, [_ann(1, [10, float("nan"), 5, 5]), _ann(2, [10, 10, float("inf"), 5]),
                                           _ann(3, [10, 10, 20, 20])])
    assert findings(res) == {"bbox_not_finite": 2}
    assert row["ann_id"] == [3]


def test_bbox_outside(tmp_path, coco):
    res, row = _one_image(tmp_path, coco, [_ann(1, [700, 10, 20, 20]), _ann(2, [-50, 10, 20, 20]),
                                           _ann(3, [10, 480, 20, 20]), _ann(4, [10, 10, 20, 20])])
    assert findings(res) == {"bbox_outside": 3}
    assert row["ann_id"] == [4]


def test_category_unknown(tmp_path, coco):
    res, row = _one_image(tmp_path, coco, [_ann(1, [10, 10, 20, 20], category_id=999), _ann(2, [1, 1, 5, 5])])
    assert findings(res) == {"category_unknown": 1}
    assert "999" in res["report"]["rules"]["category_unknown"]["examples"][0]["detail"]
    assert row["ann_id"] == [2] and row["label"] == [1]


def test_iscrowd_missing(tmp_path, coco):
    a1 = _ann(1, [10, 10, 20, 20])
    del a1["iscrowd"]
    res, row = _one_image(tmp_path, coco, [a1, _ann(2, [1, 1, 5, 5], iscrowd=None), _ann(3, [1, 1, 5, 5], iscrowd=1)])
    assert findings(res) == {"iscrowd_missing": 2}
    assert row["iscrowd"] == [0, 0, 1]


def test_area_missing(tmp_path, coco):
    real = copy.deepcopy(anns_of(coco, 9)[0])          # a real polygon with COCO's own area
    given = real.pop("area")
    no_seg = _ann(2, [10, 10, 20, 30], area=None)
    del no_seg["segmentation"]
    nan_area = _ann(3, [10, 10, 4, 5], area=float("nan"), segmentation=[])
    res, row = _one_image(tmp_path, coco, [real, no_seg, nan_area])
    assert findings(res) == {"area_missing": 3}
    assert row["area"][0] == pytest.approx(given, rel=1e-9)   # COCO's own rule: the polygon's shoelace area
    assert row["area"][1:] == [600.0, 20.0]
    assert row["segmentation"][1] == ""


def test_convert_and_evaluate_share_the_category_rule(tmp_path, coco):
    """Category names must be unique on both sides (per-class AP and the model card name classes): a COCO file that
    names two categories alike stops the convert stage with one line naming the file, the record and the rule, and
    the same dict is refused by `coco_evaluate` (so a dataset that converts is one that evaluates)."""
    from detpipe.evaluation.coco_metrics import coco_evaluate

    data = subset(coco, BASE_IDS)
    dup = next(c for c in data["categories"] if c["id"] == 2)
    dup["name"] = "person"                                  # category 1's name
    with pytest.raises(StageError, match=rf"{ANN}: categories\[1\] \(id 2\): category name 'person' is also "
                                         r"category id 1's: names must be unique .*\(rule 'coco_schema'\)$"):
        run(write_raw(tmp_path, data))
    with pytest.raises(StageError, match=r"category id 2: name 'person' is used twice"):
        coco_evaluate(data, [])


def test_zero_size_boxes_differ_as_intended(tmp_path, coco):
    """The one deliberate difference between the two rule sets (docs/evaluate.md): a ground-truth box of zero width
    is dropped by the convert stage (``bbox_nonpositive``: nothing to learn or match), while `coco_evaluate` takes
    a zero-width *detection* as pycocotools' ``loadRes`` does (a detector may answer one; it matches nothing)."""
    from detpipe.evaluation.coco_metrics import coco_evaluate

    real = anns_of(coco, 9)[0]
    zero = _ann(2, [10.0, 10.0, 0.0, 30.0])
    res, row = _one_image(tmp_path, coco, [copy.deepcopy(real), zero])
    assert findings(res) == {"bbox_nonpositive": 1} and row["ann_id"] == [real["id"]]
    gt = subset(coco, [9])
    gt["annotations"] = [copy.deepcopy(real)]
    dets = [{"image_id": 9, "category_id": real["category_id"], "bbox": list(real["bbox"]), "score": 0.9},
            {"image_id": 9, "category_id": real["category_id"], "bbox": [10.0, 10.0, 0.0, 30.0], "score": 0.95}]
    assert coco_evaluate(gt, dets[:1]).stats["AP50"] == pytest.approx(1.0)
    # taken, and a false positive ranked above the true one: precision 1/2 at recall 1
    assert coco_evaluate(gt, dets).stats["AP50"] == pytest.approx(0.5)


def test_duplicate_image_id(tmp_path, coco):
    data = subset(coco, BASE_IDS)
    dup = dict(next(i for i in data["images"] if i["id"] == 25), file_name="000000000030.jpg")
    data["images"].append(dup)
    res = run(write_raw(tmp_path, data))
    assert findings(res) == {"duplicate_image_id": 1}
    rows = read_rows(tmp_path / "arrow")
    assert [r["image_id"] for r in rows] == [9, 25, 30]
    assert rows[1]["file_name"] == "000000000025.jpg" and rows[1]["ann_id"] == [a["id"] for a in anns_of(data, 25)]


def test_duplicate_annotation_id(tmp_path, coco):
    data = subset(coco, BASE_IDS)
    first = anns_of(data, 25)[0]
    data["annotations"].append(dict(first, image_id=30, bbox=[1, 2, 3, 4]))
    res = run(write_raw(tmp_path, data))
    assert findings(res) == {"duplicate_annotation_id": 1}
    rows = {r["image_id"]: r for r in read_rows(tmp_path / "arrow")}
    assert rows[25]["ann_id"].count(first["id"]) == 1 and first["id"] not in rows[30]["ann_id"]
    assert res["meta"]["splits"]["train"]["annotations"] == 12


def test_annotation_unknown_image(tmp_path, coco):
    data = subset(coco, BASE_IDS)
    data["annotations"].append(_ann(77, [1, 1, 5, 5], image_id=123456))
    res = run(write_raw(tmp_path, data))
    assert findings(res) == {"annotation_unknown_image": 1}
    assert res["report"]["rules"]["annotation_unknown_image"]["examples"][0]["record"] == \
        "annotation id 77 (image id 123456)"
    assert all(77 not in r["ann_id"] for r in read_rows(tmp_path / "arrow"))
    assert res["meta"]["splits"]["train"]["annotations"] == 12


def test_image_no_annotations_kept(tmp_path, coco):
    data = subset(coco, (9, 25, 250))                   # 250 has no annotations in COCO
    for a in anns_of(data, 25):
        a["category_id"] = 999                          # all of 25's annotations get dropped
    res = run(write_raw(tmp_path, data))
    assert findings(res) == {"image_no_annotations": 2, "category_unknown": 2}
    details = [e["detail"] for e in res["report"]["rules"]["image_no_annotations"]["examples"]]
    assert any("no annotations in the JSON" in d for d in details) and any("all 2" in d for d in details)
    rows = {r["image_id"]: r for r in read_rows(tmp_path / "arrow")}
    assert sorted(rows) == [9, 25, 250]
    for i in (25, 250):
        assert rows[i]["ann_id"] == [] and rows[i]["bbox"] == [] and rows[i]["segmentation"] == []


def test_report_lists_every_rule(tmp_path, coco):
    res = run(write_raw(tmp_path, subset(coco, BASE_IDS)))
    report = json.loads((tmp_path / "arrow" / "report.json").read_text())
    assert report == res["report"]
    assert list(report["rules"]) == list(RULES)
    assert all(v["action"] in ("dropped", "fixed", "kept") for v in report["rules"].values())


def test_report_keeps_first_five_examples(tmp_path, coco):
    res, row = _one_image(tmp_path, coco, [_ann(k, [10, 10, 0, 5]) for k in range(1, 9)] + [_ann(20, [1, 1, 5, 5])])
    rule = res["report"]["rules"]["bbox_nonpositive"]
    assert rule["count"] == 8 and [e["record"] for e in rule["examples"]] == [
        f"annotation id {k} (image id 9)" for k in range(1, 6)]


# ------------------------------------------------------------------------------------------ explicit val


def _two_files(tmp_path, coco, val_data_edit=None):
    train = subset(coco, [i["id"] for i in coco["images"][:6]])
    val = subset(coco, [i["id"] for i in coco["images"][6:9]])
    if val_data_edit:
        val_data_edit(val, train)
    raw = write_raw(tmp_path, train)
    write_raw(tmp_path, val, images="val2017", ann="annotations/instances_val2017.json")
    return raw, train, val


def test_explicit_val_file(tmp_path, coco):
    raw, train, val = _two_files(tmp_path, coco)
    res = run(raw, val_annotations="annotations/instances_val2017.json", val_images="val2017", val_fraction=0.5)
    out = tmp_path / "arrow"
    assert [r["image_id"] for r in read_rows(out, "train")] == sorted(i["id"] for i in train["images"])
    val_rows = read_rows(out, "val")
    assert [r["image_id"] for r in val_rows] == sorted(i["id"] for i in val["images"])
    assert val_rows[0]["image"] == (COCO / "train2017" / val_rows[0]["file_name"]).read_bytes()
    assert res["meta"]["val_fraction"] is None
    assert res["meta"]["val_annotations_file"] == "annotations/instances_val2017.json"
    assert res["meta"]["splits"]["val"]["annotations"] == len(val["annotations"])


def _renumber(data: dict, start: int) -> None:
    """Number the file's images start, start+1, ... (as BCCD/Roboflow exports do per split)."""
    new = {im["id"]: start + k for k, im in enumerate(data["images"])}
    for im in data["images"]:
        im["id"] = new[im["id"]]
    for a in data["annotations"]:
        a["image_id"] = new[a["image_id"]]


@pytest.mark.parametrize("overlap", [True, False])
def test_explicit_val_file_has_its_own_id_space(tmp_path, coco, overlap):
    """A val file whose ids restart at 1 (so they overlap train's) keeps its whole split; ids are unique per
    file only. A repeated id within the val file is still a duplicate (counted under split val)."""
    def edit(val, train):
        _renumber(train, 1)
        _renumber(val, 1 if overlap else 100)
        val["images"].append(dict(val["images"][0], file_name="again.jpg"))
    raw, train, val = _two_files(tmp_path, coco, edit)
    res = run(raw, val_annotations="annotations/instances_val2017.json", val_images="val2017")
    assert findings(res) == {"duplicate_image_id": 1}
    example = res["report"]["rules"]["duplicate_image_id"]["examples"][0]
    assert example["split"] == "val" and example["record"] == f"image id {val['images'][0]['id']}"
    val_rows = read_rows(tmp_path / "arrow", "val")
    assert [(r["image_id"], r["file_name"]) for r in val_rows] == [(i["id"], i["file_name"])
                                                                    for i in val["images"][:3]]
    assert sum(len(r["ann_id"]) for r in val_rows) == len(val["annotations"])
    assert len(read_rows(tmp_path / "arrow", "train")) == 6
    assert res["report"]["splits"]["val"]["images_out"] == 3


def test_explicit_val_categories_must_agree(tmp_path, coco):
    raw, _, _ = _two_files(tmp_path, coco, lambda val, train: val["categories"][3].update(name="motorbike"))
    with pytest.raises(StageError, match=r"instances_val2017.json: categories differ from .*instances_train2017"):
        run(raw, val_annotations="annotations/instances_val2017.json", val_images="val2017")
    assert not (tmp_path / "arrow").exists()


# --------------------------------------------------------------------------------- strict and errors


@pytest.mark.parametrize("rule", ["image_missing", "bbox_clipped", "grayscale", "image_no_annotations",
                                  "duplicate_annotation_id"])
def test_strict_turns_rules_into_errors(tmp_path, coco, rule):
    data = subset(coco, BASE_IDS)
    files = {}
    if rule == "image_missing":
        files["000000000030.jpg"] = None
    elif rule == "bbox_clipped":
        anns_of(data, 30)[0]["bbox"] = [630, 10, 20, 20]
    elif rule == "grayscale":
        files["000000000030.jpg"] = jpeg_bytes(coco_image("000000000030.jpg").convert("L"))
    elif rule == "image_no_annotations":
        data["annotations"] = [a for a in data["annotations"] if a["image_id"] != 30]
    else:
        data["annotations"].append(dict(anns_of(data, 30)[0]))
    raw = write_raw(tmp_path, data, files)
    run(raw)                                             # not strict: fine
    shutil.rmtree(tmp_path / "arrow")
    with pytest.raises(StageError) as e:
        run(raw, strict=True, workers=1)
    msg = str(e.value)
    assert "\n" not in msg and f"rule '{rule}'" in msg
    assert ("000000000030.jpg" in msg) or ("instances_train2017.json" in msg)
    assert ("image id 30" in msg) or ("annotation id" in msg)
    assert not (tmp_path / "arrow").exists()


def test_no_partial_output_after_failure(tmp_path, coco):
    ids = [i["id"] for i in coco["images"][:8]]
    data = subset(coco, ids)
    late = data["images"][5]["file_name"]
    raw = write_raw(tmp_path, data, {late: jpeg_bytes(coco_image(late).convert("L"))})
    out = tmp_path / "arrow"
    out.mkdir()
    (out / "previous.txt").write_text("old output")
    with pytest.raises(StageError, match="grayscale"):
        convert(raw, out, params(strict=True, shard_mb=0.2, workers=2), progress=False)  # fails in a later shard
    assert sorted(p.name for p in out.iterdir()) == ["previous.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arrow", "raw"]      # no temporary folder left


def _malformed_cases():
    def edit(fn):
        return fn
    return {
        "not_json": (b"{\"images\": [", "not valid JSON"),
        "top_level": (b"[]", "top level must be a JSON object"),
        "missing_images": (lambda d: d.pop("images"), "missing key 'images'"),
        "annotations_type": (lambda d: d.update(annotations={}), "key 'annotations' must be an array"),
        "image_id_type": (lambda d: d["images"][0].update(id="9"), "images[0]: key 'id' must be an integer"),
        "width": (lambda d: d["images"][1].update(width=0), "images[1] (id 25): key 'width'"),
        "file_name": (lambda d: d["images"][0].update(file_name="../x.jpg"), "key 'file_name'"),
        "bbox": (lambda d: d["annotations"][2].update(bbox=[1, 2, 3]), "annotations[2] (id "),
        "iscrowd": (lambda d: d["annotations"][0].update(iscrowd=2), "key 'iscrowd' must be 0 or 1"),
        "category_name": (lambda d: d["categories"][0].pop("name"), "categories[0] (id 1): key 'name'"),
        "id_too_big": (lambda d: d["annotations"][0].update(id=2**63), "key 'id' must be in"),
    }


@pytest.mark.parametrize("case", list(_malformed_cases()))
def test_malformed_json_is_one_line_error(tmp_path, coco, case):
    change, expected = _malformed_cases()[case]
    data = subset(coco, BASE_IDS)
    raw = write_raw(tmp_path, data)
    path = raw / ANN
    if isinstance(change, bytes):
        path.write_bytes(change)
    else:
        change(data)
        path.write_text(json.dumps(data))
    with pytest.raises(StageError) as e:
        run(raw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and expected in msg
    if case == "bbox":
        assert "key 'bbox'" in msg
    assert not (tmp_path / "arrow").exists()


def test_missing_annotation_file_and_image_folder(tmp_path, coco):
    raw = write_raw(tmp_path, subset(coco, BASE_IDS))
    with pytest.raises(StageError, match=r"instances_val2017.json: annotation file not found \(rule 'json_invalid'\)$"):
        run(raw, annotations="annotations/instances_val2017.json")
    with pytest.raises(StageError, match="image folder not found"):
        run(raw, images="val2017")
    with pytest.raises(StageError, match="val_images is set but convert.val_annotations is null"):
        run(raw, val_images="train2017")


def test_empty_train_split_is_an_error(tmp_path, coco):
    raw = write_raw(tmp_path, subset(coco, BASE_IDS), {f"{i:012d}.jpg": None for i in BASE_IDS})
    with pytest.raises(StageError, match="no usable images in the train split .*rule 'split_emptied'"):
        run(raw)


def test_cli(tmp_path, coco):
    """``python -m stages.convert`` from a project root: writes data/arrow; broken JSON -> exit 2, one line."""
    (tmp_path / "data").mkdir()
    raw = write_raw(tmp_path / "data", subset(coco, BASE_IDS))
    shutil.copyfile(REPO / "params.yaml", tmp_path / "params.yaml")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "stages.convert"]
    ok = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    meta = json.loads((tmp_path / "data" / "arrow" / "meta.json").read_text())
    assert sum(s["images"] for s in meta["splits"].values()) == 3
    assert "convert: train" in ok.stderr
    # stderr is no terminal (as under Prefect): progress is a log line, the last one at the end
    assert re.search(r"detpipe\.core\.progress INFO convert: image 3/3, [\d.]+ images/s$", ok.stderr, re.M), ok.stderr
    before = {p: p.read_bytes() for p in (tmp_path / "data" / "arrow").rglob("*") if p.is_file()}
    (raw / ANN).write_text('{"images": [], "annotations": []}')
    bad = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert lines[-1] == f"error: data/raw/{ANN}: missing key 'categories' (rule 'coco_schema')"
    assert sum(line.startswith("error:") for line in lines) == 1
    assert {p: p.read_bytes() for p in (tmp_path / "data" / "arrow").rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------ bad input through the stage (subprocess)


def _stage(tmp_path: Path, data: dict | bytes, *, val: dict | None = None, **convert_params):
    """Run ``python -m stages.convert`` in a project folder holding ``data`` (a COCO dict, or raw bytes of the
    annotation file) over COCO128 images and params.yaml with ``convert_params``; returns the process."""
    from support.pipeline import read_rows, write_params

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    raw = write_raw(work / "data", data if isinstance(data, dict) else subset({"categories": [], "images": [],
                                                                             "annotations": []}, []))
    if isinstance(data, bytes):
        (raw / ANN).write_bytes(data)
    if val is not None:
        write_raw(work / "data", val, images="val2017", ann="annotations/instances_val2017.json")
        convert_params.update(val_annotations="annotations/instances_val2017.json", val_images="val2017")
    write_params(work, {"convert": {"workers": 1, **convert_params}}, tiny=False)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "stages.convert"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)


def _error_line(res) -> str:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, res.stderr
    return lines[-1]


def _error_cases(coco):
    def with_name(name):
        data = subset(coco, BASE_IDS)
        data["images"][0]["file_name"] = name
        return data
    deep = b'{"images": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return {
        "nul_file_name": (with_name("0000\x00.jpg"), "file_name_invalid", "images[0] (id 9): key 'file_name'"),
        "surrogate_file_name": (with_name("0000\ud800.jpg"), "file_name_invalid", "images[0] (id 9)"),
        "deep_json_orjson": (deep, "json_too_deep", ANN),
        "deep_json_fallback": (b'{"x": NaN, ' + deep[1:], "json_too_deep", ANN),
    }


@pytest.mark.parametrize("case", ["nul_file_name", "surrogate_file_name", "deep_json_orjson", "deep_json_fallback"])
def test_stage_bad_input_is_one_error_line_with_its_rule(tmp_path, coco, case):
    data, rule, where = _error_cases(coco)[case]
    line = _error_line(_stage(tmp_path, data))
    assert line.endswith(f"(rule '{rule}')") and where in line, line
    assert not (tmp_path / "work" / "data" / "arrow").exists()


def test_stage_a_rule_that_empties_the_val_split_is_an_error(tmp_path, coco):
    """A val file whose every image is missing (here: listed under names not in the folder) stops the stage
    instead of training on without a val split."""
    val = subset(coco, [i["id"] for i in coco["images"][6:9]])
    for im in val["images"]:
        im["file_name"] = "missing-" + im["file_name"]
    line = _error_line(_stage(tmp_path, subset(coco, BASE_IDS), val=val))
    assert "instances_val2017.json: no usable images in the val split (3 listed; findings: image_missing=3)" in line
    assert line.endswith("(rule 'split_emptied')")


BIG = 10 ** 400                  # beyond float64: float(BIG) raises OverflowError


def _bad_annotations(coco) -> tuple[dict, dict[int, str]]:
    """COCO128 image 9 (640x480, 8 annotations) with each annotation breaking one rule:
    {annotation id: expected rule}."""
    data = subset(coco, [9])
    anns = data["annotations"]
    h, w = data["images"][0]["height"], data["images"][0]["width"]
    edits = [
        ("bbox_not_finite", dict(bbox=[BIG, 0, 5, 5])),                       # 400-digit integer
        ("bbox_not_finite", dict(bbox=[1, 1, 1e39, 5])),                      # inf once float32
        ("bbox_nonpositive", dict(bbox=[1, 1, 1e-50, 5])),                    # 0 once float32
        ("area_missing", dict(area=BIG)),
        ("segmentation_invalid", dict(segmentation=[[1, 2, 3, 4, 5, 6, 7]])),  # odd length
        ("segmentation_invalid", dict(segmentation=[[1, 2, 3, BIG, 5, 6]])),
        ("segmentation_invalid", dict(segmentation={"size": [h, w], "counts": [5, 7]}, iscrowd=1)),
        ("segmentation_invalid", dict(segmentation={"size": [10, 10], "counts": [100]}, iscrowd=1)),
    ]
    expected = {}
    for ann, (rule, edit) in zip(anns, edits):
        ann.update(edit)
        expected[ann["id"]] = rule
    data["annotations"].append(dict(anns[0], id=99, bbox=[1, 1, 5, 5], iscrowd=1,
                                    segmentation={"size": [h, w], "counts": "zz~"}))   # not RLE digits
    expected[99] = "segmentation_invalid"
    return data, expected


def test_stage_counts_every_bad_number_and_segmentation_under_its_rule(tmp_path, coco):
    data, expected = _bad_annotations(coco)
    res = _stage(tmp_path, data, val_fraction=0.0)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    out = tmp_path / "work" / "data" / "arrow"
    report = json.loads((out / "report.json").read_text())
    got = {rule: v["count"] for rule, v in report["rules"].items() if v["count"]}
    want: dict[str, int] = {}
    for rule in expected.values():
        want[rule] = want.get(rule, 0) + 1
    assert got == want
    for aid, rule in expected.items():
        assert any(e["record"] == f"annotation id {aid} (image id 9)" for e in report["rules"][rule]["examples"]) \
            or report["rules"][rule]["count"] > 5, (aid, rule)
    (row,) = read_rows(out)
    dropped = {aid for aid, rule in expected.items() if rule.startswith("bbox_")}
    assert sorted(row["ann_id"]) == sorted(a["id"] for a in data["annotations"] if a["id"] not in dropped)
    segs = dict(zip(row["ann_id"], row["segmentation"]))
    assert all(segs[aid] == "" for aid, rule in expected.items() if rule == "segmentation_invalid")
    areas = dict(zip(row["ann_id"], row["area"]))
    big_area = next(aid for aid, rule in expected.items() if rule == "area_missing")
    assert 0 < areas[big_area] < 640 * 480
    assert all(w > 0 and h > 0 for _, _, w, h in row["bbox"])


def test_stage_strict_error_from_a_worker_names_the_rule(tmp_path, coco):
    data, _ = _bad_annotations(coco)
    line = _error_line(_stage(tmp_path, data, val_fraction=0.0, strict=True))
    assert "annotation id" in line and "(image id 9)" in line and "rule 'bbox_not_finite'" in line, line


# ------------------------------------------------------------------------- leaks and copies between images


def _with_comment(jpeg: bytes, text: bytes) -> bytes:
    """The same JPEG (same pixels) with a comment segment after SOI: other bytes."""
    return jpeg[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + jpeg[2:]


def _leaky_val(tmp_path, coco):
    """Train: COCO128 images[:6]; val: images[6:9], plus 'copy.jpg' (the bytes of train's first image, another id
    and name) and 'near.jpg' (the same pixels with a JPEG comment: other bytes)."""
    def edit(val, train):
        first = train["images"][0]
        val["images"] += [dict(first, id=901, file_name="copy.jpg"), dict(first, id=902, file_name="near.jpg")]
    raw, train, val = _two_files(tmp_path, coco, edit)
    original = (COCO / "train2017" / train["images"][0]["file_name"]).read_bytes()
    (raw / "val2017" / "copy.jpg").write_bytes(original)
    (raw / "val2017" / "near.jpg").write_bytes(_with_comment(original, b"re-saved"))
    return raw, train, val


def test_val_image_equal_to_a_train_image_is_dropped(tmp_path, coco):
    raw, train, val = _leaky_val(tmp_path, coco)
    res = run(raw, val_annotations="annotations/instances_val2017.json", val_images="val2017")
    assert findings(res) == {"val_image_in_train": 1, "image_no_annotations": 1,     # near.jpg: no annotations
                             "val_near_duplicate": 1}    # near.jpg: same pixels, reported (convert.leaks: report)
    (near,) = res["report"]["rules"]["val_near_duplicate"]["examples"]
    assert near["record"] == "image id 902" and near["detail"].startswith("pHash Hamming distance 0 <= ")
    (example,) = res["report"]["rules"]["val_image_in_train"]["examples"]
    first = train["images"][0]
    assert example["split"] == "val" and example["record"] == "image id 901"
    assert example["file"].endswith("val2017/copy.jpg")
    assert f"train image id {first['id']} (" in example["detail"] and \
        example["detail"].endswith(f"train2017/{first['file_name']}); dropped with its 0 annotation(s)")
    val_ids = [r["image_id"] for r in read_rows(tmp_path / "arrow", "val")]
    assert val_ids == sorted(i["id"] for i in val["images"][:3]) + [902]      # the near copy is kept
    assert len(read_rows(tmp_path / "arrow", "train")) == 6
    assert res["report"]["splits"]["val"]["images_in"] == 5 and res["report"]["splits"]["val"]["images_out"] == 4


def test_val_image_equal_to_a_train_image_strict_names_both_files(tmp_path, coco):
    raw, train, _ = _leaky_val(tmp_path, coco)
    with pytest.raises(StageError) as e:
        run(raw, val_annotations="annotations/instances_val2017.json", val_images="val2017", strict=True)
    msg = str(e.value)
    assert "\n" not in msg and "rule 'val_image_in_train'" in msg and "image id 901" in msg
    assert str(raw / "val2017" / "copy.jpg") in msg and str(raw / "train2017" / train["images"][0]["file_name"]) in msg
    assert not (tmp_path / "arrow").exists()


def test_copies_within_a_split_are_counted_and_kept(tmp_path, coco):
    data = subset(coco, BASE_IDS)
    data["images"].append(dict(next(i for i in data["images"] if i["id"] == 25), id=777, file_name="again.jpg"))
    raw = write_raw(tmp_path, data, {"again.jpg": (COCO / "train2017" / "000000000025.jpg").read_bytes()})
    res = run(raw)
    assert findings(res) == {"duplicate_image_bytes": 1, "image_no_annotations": 1}
    (example,) = res["report"]["rules"]["duplicate_image_bytes"]["examples"]
    assert example["record"] == "image id 777" and example["file"].endswith("train2017/again.jpg")
    assert "same bytes as image id 25 (" in example["detail"] and "000000000025.jpg" in example["detail"]
    assert [r["image_id"] for r in read_rows(tmp_path / "arrow")] == [9, 25, 30, 777]


def test_copies_across_a_fraction_split(tmp_path, coco):
    """One file listing 12 images twice (the copies under other ids and names), split 50/50: a copy whose twin
    went to train is dropped from val, twins both in val or both in train are counted there and kept."""
    data = subset(coco, [i["id"] for i in coco["images"][:12]])
    files = {}
    for im in list(data["images"]):
        twin = dict(im, id=im["id"] + 10**6, file_name="twin-" + im["file_name"])
        data["images"].append(twin)
        files[twin["file_name"]] = (COCO / "train2017" / im["file_name"]).read_bytes()
    raw = write_raw(tmp_path, data, files)
    res = run(raw, val_fraction=0.5, seed=3)
    train, val = split_ids([i["id"] for i in data["images"]], 0.5, 3)
    pairs = [(i["id"], i["id"] + 10**6) for i in data["images"][:12]]
    leaks = sum((a in train) != (b in train) for a, b in pairs)
    in_val = sum(a in val and b in val for a, b in pairs)
    in_train = sum(a in train and b in train for a, b in pairs)
    assert leaks and in_val and in_train                    # the seed puts twins every way
    got = findings(res)
    assert got.get("val_image_in_train") == leaks and got.get("duplicate_image_bytes") == in_val + in_train
    assert res["meta"]["splits"]["val"]["images"] == len(val) - leaks
    assert res["meta"]["splits"]["train"]["images"] == len(train)


# ------------------------------------------------------------------------------ the streaming JSON reader


def test_top_level_keys_in_any_order(tmp_path, coco):
    """Annotations before images and categories last: the same rows as the usual order."""
    data = subset(coco, BASE_IDS)
    raw = write_raw(tmp_path, data)
    run(raw)
    before = read_rows(tmp_path / "arrow")
    shutil.rmtree(tmp_path / "arrow")
    (raw / ANN).write_text(json.dumps({"annotations": data["annotations"], "info": data["info"],
                                       "images": data["images"], "categories": data["categories"]}))
    run(raw)
    assert read_rows(tmp_path / "arrow") == before


def test_a_file_parsed_whole_converts_the_same(tmp_path, coco):
    """A file the record reader leaves to the whole parse (here "images" twice, valid JSON: the last wins) gives
    the same rows, its annotations read by the workers from a spill file that does not stay in the output."""
    data = subset(coco, BASE_IDS)
    raw = write_raw(tmp_path, data)
    run(raw, workers=1)
    before = read_rows(tmp_path / "arrow")
    shutil.rmtree(tmp_path / "arrow")
    text = json.dumps(data)
    (raw / ANN).write_text('{"images": [{"id": 1}], ' + text[1:])
    (tmp_path / "spill").mkdir()
    assert read_coco(raw / ANN, tmp_path / "spill").source.startswith(str(tmp_path / "spill"))   # parsed whole
    run(raw, workers=1)
    assert read_rows(tmp_path / "arrow") == before
    assert sorted(p.name for p in (tmp_path / "arrow").iterdir()) == ["meta.json", "report.json", "train", "val"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arrow", "raw", "spill"]


def _mutated(text: bytes, rng: np.random.Generator) -> bytes:
    """``text`` with 1-3 random edits: bytes deleted, JSON tokens (brackets, quotes, escapes, NaN, huge numbers,
    a bad UTF-8 byte, a second images key) inserted or written over, a slice repeated."""
    tokens = [b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b" ", b"NaN", b"1e400", b"\\ud800", b'"images": [], ',
              b"18446744073709551616", b"\xff", b"-", b"0"]
    t = bytearray(text)
    for _ in range(rng.integers(1, 4)):
        k, r = int(rng.integers(len(t))), rng.random()
        if r < 0.3:
            del t[k:k + int(rng.integers(1, 4))]
        elif r < 0.7:
            t[k:k] = tokens[rng.integers(len(tokens))]
        elif r < 0.85:
            t[k:k + 1] = tokens[rng.integers(len(tokens))]
        else:
            a = int(rng.integers(len(t)))
            t[k:k] = t[a:a + int(rng.integers(1, 40))]
    return bytes(t)


@pytest.mark.parametrize("seed", range(4))
def test_streaming_reader_agrees_with_the_whole_parse(tmp_path, coco, monkeypatch, seed):
    """`read_coco` (chunks, records parsed alone) on 250 randomly broken annotation files, with chunks of 16 bytes
    to 8 MiB: the same error message as `load_json` + `check_coco` on the whole file, or the same images,
    annotations (parsed again from the bytes it points at) and categories."""
    base = subset(coco, BASE_IDS)
    base["annotations"] = base["annotations"][:6]
    base["categories"] = base["categories"][:5]
    base["info"] = {"note": 'brackets [ { and a quote \\" in a string'}
    base["annotations"][1]["attributes"] = {"note": 'a quote " ] } and backslashes \\\\" [ {'}
    base["licenses"] = [1, "a", {"u": [1, 2]}]
    text = json.dumps(base).encode()
    rng = np.random.default_rng(seed)
    path = tmp_path / "x.json"

    def streamed():
        cols = read_coco(path, tmp_path)
        blob = Path(cols.source).read_bytes()
        parse = orjson.loads if cols.fast else json.loads
        anns = [parse(blob[s:s + n]) for s, n in zip(cols.ann_starts, cols.ann_lengths)]
        return cols.fast, list(cols.image_ids), cols.names.decode(), repr(anns), repr(cols.categories)

    def whole():
        data, fast = load_json(path)
        check_coco(data, path)
        return fast, [i["id"] for i in data["images"]], "".join(i["file_name"] for i in data["images"]), \
            repr(data["annotations"]), repr(data["categories"])

    def outcome(read):
        try:
            return ("ok", *read())
        except StageError as e:
            return ("error", str(e))

    fixed = [text, text.replace(b'"area": ', b'"area": NaN, "was": ', 1),    # valid for Python's json only
             text.replace(b'"name": "', b'"name": "\\udc00', 1), text.replace(b'"id": 9', b'"id": 18446744073709551625', 1),
             text[:-1] + b', "images": []}']                                       # a key twice: the last wins
    kinds = set()
    for k in range(250):
        path.write_bytes(fixed[k] if k < len(fixed) else _mutated(text, rng))
        monkeypatch.setattr(coco_json, "CHUNK_BYTES", int(rng.choice([16, 100, 1000, 8 << 20])))
        got = outcome(streamed)
        assert got == outcome(whole), path.read_bytes()
        kinds.add(got[0] if got[0] == "error" else f"ok fast={got[1]}")
    assert kinds == {"error", "ok fast=True", "ok fast=False"}
    for size in (16, 100, 1000, 8 << 20):       # valid files are read record by record, not parsed whole
        monkeypatch.setattr(coco_json, "CHUNK_BYTES", size)
        for k, fast in ((0, True), (1, False)):
            path.write_bytes(fixed[k])
            cols = read_coco(path, tmp_path)
            assert cols.source == str(path) and cols.fast == fast and len(cols.ann_ids) == 6
