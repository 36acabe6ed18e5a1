"""Convert in bounded memory (issue 26): an ~80 MB annotation file (1,500 small images from a COCO128 photo,
15,000 polygons of 450 points) converts, its label statistics included, in a process whose data segment is limited
(``RLIMIT_DATA``, which counts the heap and private mappings), while parsing the same file whole, as convert did
before, fails under that limit."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image

from support.procs import REPO, run

LIMIT_MB = 450
"""The data-segment limit: ~2x what the streaming convert needs on such a file (190-220 MiB, imports ~130 MiB
included); a whole parse of it needs ~1 GiB (peak RSS of the old convert on a 57 MB file of this kind: 715 MiB)."""
IMAGES, ANNS, POINTS = 1500, 10, 450

_LIMITED = ("import resource, sys; limit = int(sys.argv[1]) << 20; "
            "resource.setrlimit(resource.RLIMIT_DATA, (limit, limit)); sys.argv = sys.argv[1:]; ")
_CONVERT = ("import json; from detpipe.data.convert import convert; from detpipe.params import Convert; "
            "convert(sys.argv[1], sys.argv[2], Convert(annotations='annotations/instances_train2017.json', "
            "images='train2017', val_fraction=0.2, seed=0, workers=1), progress=False, label_plots=sys.argv[3])")
_WHOLE = "from pathlib import Path; from detpipe.data.coco_json import load_json; load_json(Path(sys.argv[1]))"


def _dataset(root: Path) -> tuple[Path, list]:
    """``(root/raw, the polygon)``: ``root/raw`` holds `IMAGES` 64x48 JPEGs (one COCO128 photo, each file with its own JPEG comment: distinct bytes)
    and an annotation file giving each `ANNS` annotations whose polygon has `POINTS` points (the same one)."""
    raw = root / "raw"
    (raw / "train2017").mkdir(parents=True)
    (raw / "annotations").mkdir()
    with Image.open(REPO / "data/coco128/train2017/000000000009.jpg") as im:
        buf = io.BytesIO()
        im.convert("RGB").resize((64, 48)).save(buf, "JPEG", quality=80)
    jpeg = buf.getvalue()
    for k in range(IMAGES):
        note = b"image %d" % k
        (raw / "train2017" / f"{k:06d}.jpg").write_bytes(
            jpeg[:2] + b"\xff\xfe" + (len(note) + 2).to_bytes(2, "big") + note + jpeg[2:])
    poly = ",".join(f"{v:.2f}" for v in np.random.default_rng(0).uniform(1, 47, 2 * POINTS))
    images = ",".join(f'{{"id":{k + 1},"file_name":"{k:06d}.jpg","width":64,"height":48}}' for k in range(IMAGES))
    anns = ",".join(f'{{"id":{k * ANNS + j + 1},"image_id":{k + 1},"category_id":1,"bbox":[1.5,2.5,40,30],'
                    f'"area":1200.0,"iscrowd":0,"segmentation":[[{poly}]]}}'
                    for k in range(IMAGES) for j in range(ANNS))
    (raw / "annotations/instances_train2017.json").write_text(
        f'{{"images":[{images}],"annotations":[{anns}],"categories":[{{"id":1,"name":"thing"}}]}}')
    return raw, json.loads(f"[{poly}]")


def test_large_json_converts_under_a_memory_limit(tmp_path):
    raw, poly = _dataset(tmp_path)
    ann = raw / "annotations/instances_train2017.json"
    assert ann.stat().st_size > 75e6
    out = tmp_path / "arrow"
    labels = tmp_path / "plots/labels"
    done = run([sys.executable, "-c", _LIMITED + _CONVERT, str(LIMIT_MB), str(raw), str(out), str(labels)], tmp_path,
               check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert sum(s["images"] for s in meta["splits"].values()) == IMAGES
    assert sum(s["annotations"] for s in meta["splits"].values()) == IMAGES * ANNS
    report = json.loads((out / "report.json").read_text())
    # one photo in every file: each val image is a near-duplicate of the train images (pHash distance 0), listed
    # and kept (convert.leaks: report, the default), its hashes computed under the same limit
    assert {rule: v["count"] for rule, v in report["rules"].items() if v["count"]} == {
        "val_near_duplicate": meta["splits"]["val"]["images"]}
    assert report["leaks"]["nearest_distance"] == {"0": meta["splits"]["val"]["images"]}
    # the label statistics, counted under the same limit, cover every train box
    classes = json.loads((labels / "instances.json").read_text())["instances"]
    assert sum(c["instances"] for c in classes) == meta["splits"]["train"]["annotations"]
    with pa.memory_map(str(out / meta["splits"]["val"]["shards"][0])) as src:
        row = pa.ipc.open_file(src).get_batch(0).slice(0, 1).to_pylist()[0]
    assert row["ann_id"] == [(row["image_id"] - 1) * ANNS + j + 1 for j in range(ANNS)]
    assert [json.loads(s) for s in row["segmentation"]] == [[poly]] * ANNS
    # the limit binds: the same file parsed whole (the design before) runs out of memory under it
    whole = run([sys.executable, "-c", _LIMITED + _WHOLE, str(LIMIT_MB), str(ann)], tmp_path, check=False,
                timeout=300)
    assert whole.returncode != 0 and "MemoryError" in whole.stderr, whole.stderr[-2000:]
