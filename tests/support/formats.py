"""What the tests of the convert stage's format readers share (tests/stages/test_convert_{yolo,voc,labelme,cvat}.py):
COCO128's first 14 images (by id) as a COCO copy split train 10 / val 4 into two files, the reader params, and the
COCO path's conversion of that copy (the reference each reader's rows are compared with)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from detpipe.data.convert import convert
from detpipe.params import Convert

REPO = Path(__file__).resolve().parents[2]
COCO = REPO / "data" / "coco128"
ANN = "annotations/instances_train2017.json"
N_TRAIN, N_VAL = 10, 4


def params(fmt: str, **kw) -> Convert:
    """The ``convert`` params of the readers' tests: format ``fmt``, no COCO files, no val_fraction split, one
    process; ``kw`` overrides."""
    return Convert(**{**dict(format=fmt, val_fraction=0.0, seed=0, shard_mb=64, strict=False, workers=0), **kw})


def subset(images: list[dict], src: dict) -> dict:
    """The COCO file ``src`` restricted to ``images`` (their annotations, all categories)."""
    ids = {im["id"] for im in images}
    return {"info": {}, "categories": src["categories"], "images": images,
            "annotations": [a for a in src["annotations"] if a["image_id"] in ids]}


def coco_copy(root: Path) -> dict:
    """``root/raw_coco/{train,val}/`` (the images) and ``{train,val}.json`` of COCO128's first `N_TRAIN` + `N_VAL`
    images. Returns ``{"src": COCO128's file, "images": the 14 records, "parts": {split: COCO dict},
    "coco_raw": path}``."""
    src = json.loads((COCO / ANN).read_text())
    images = sorted(src["images"], key=lambda im: im["id"])[:N_TRAIN + N_VAL]
    parts = {"train": subset(images[:N_TRAIN], src), "val": subset(images[N_TRAIN:], src)}
    coco_raw = root / "raw_coco"
    for split, data in parts.items():
        (coco_raw / split).mkdir(parents=True)
        for im in data["images"]:
            shutil.copyfile(COCO / "train2017" / im["file_name"], coco_raw / split / im["file_name"])
        (coco_raw / f"{split}.json").write_text(json.dumps(data))
    return {"src": src, "images": images, "parts": parts, "coco_raw": coco_raw}


def convert_coco_copy(coco_raw: Path, out: Path, fmt: str) -> dict:
    """`convert` of `coco_copy`'s folder with `params` (``fmt``'s test params, format coco and the two files)."""
    return convert(coco_raw, out, params(fmt, format="coco", annotations="train.json", images="train",
                                         val_annotations="val.json", val_images="val"), progress=False)


def compare_with_globox_and_coco(out: Path, coco_out: Path, parts: dict, back, path_of, class_name, globox_name) \
        -> dict:
    """Row by row over both splits of a reader's output ``out``: each row's ``file_name`` is ``path_of(split,
    name)``; its image size and box count equal globox's read-back (``back(split)[name]``, a globox
    ``AnnotationSet``), and per object its class name (``class_name(category id)``) equals globox's
    (``globox_name(box)``) and the COCO path's (``coco_out``, same image, same object order).

    Returns ``{"boxes": n, "globox": largest |ours - globox's corners| px (clipped to the image, as the COCO rules
    clip), "coco": largest |ours - the COCO path's box| px}``."""
    from support.pipeline import read_rows

    coco_names = {c["id"]: c["name"] for c in json.loads((coco_out / "meta.json").read_text())["categories"]}
    worst_globox = worst_coco = 0.0
    n_boxes = 0
    for split in ("train", "val"):
        rows = read_rows(out, split)
        coco_rows = {r["file_name"]: r for r in read_rows(coco_out, split)}
        assert len(rows) == len(parts[split]["images"]) == len(coco_rows)
        annotations = back(split)
        for row in rows:
            name = Path(row["file_name"]).name
            assert row["file_name"] == path_of(split, name)
            ann = annotations[name]
            assert (row["width"], row["height"]) == ann.image_size
            assert len(row["bbox"]) == len(ann.boxes) > 0
            for (x, y, w, h), cid, box in zip(row["bbox"], row["category_id"], ann.boxes):
                assert globox_name(box) == class_name(cid)
                gx0, gy0, gx1, gy1 = box.ltrb
                gx0, gy0 = max(gx0, 0.0), max(gy0, 0.0)
                gx1, gy1 = min(gx1, row["width"]), min(gy1, row["height"])
                worst_globox = max(worst_globox, abs(x - gx0), abs(y - gy0), abs(x + w - gx1), abs(y + h - gy1))
                n_boxes += 1
            ref = coco_rows[name]
            assert len(ref["bbox"]) == len(row["bbox"])
            assert [coco_names[c] for c in ref["category_id"]] == [class_name(c) for c in row["category_id"]]
            for a, b in zip(row["bbox"], ref["bbox"]):
                worst_coco = max(worst_coco, max(abs(u - v) for u, v in zip(a, b)))
    return {"boxes": n_boxes, "globox": worst_globox, "coco": worst_coco}
