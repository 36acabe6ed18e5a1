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
