"""Near-duplicate leaks between val and train (convert.leaks, convert.leak_distance; rule val_near_duplicate): real
COCO128 images, the copies made from them with PIL (saved again at JPEG quality 70 and resized, cropped)."""
from __future__ import annotations

import copy
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from detpipe.data import imageio
from detpipe.data.convert import convert
from detpipe.core.errors import StageError
from detpipe.params import Convert, load
from support.pipeline import read_rows

REPO = Path(__file__).resolve().parents[2]
COCO = REPO / "data" / "coco128"
ANN, VAL_ANN = "annotations/instances_train2017.json", "annotations/instances_val2017.json"
TRAIN_IDS = (9, 25, 30, 110)     # 9: 640x480, 8 annotations; 25: giraffes; 110: people at a table
VAL_IDS = (34, 144, 360)         # 34: zebra; 144: giraffes (as 25); 360: people snowboarding (110 and 360 are
                                 # COCO128's nearest distinct pair, 16 bits apart, both with "person")
LEAK = Convert.model_fields["leak_distance"].default
DETAIL = re.compile(r"^pHash Hamming distance (\d+) <= (\d+) \(convert\.leak_distance\) to train image id (\d+) "
                    r"\((.+)\); (.+)$")


@pytest.fixture(scope="module")
def coco() -> dict:
    return json.loads((COCO / ANN).read_text())


def subset(coco: dict, ids) -> dict:
    ids = set(ids)
    return {"categories": copy.deepcopy(coco["categories"]),
            "images": [copy.deepcopy(i) for i in coco["images"] if i["id"] in ids],
            "annotations": [copy.deepcopy(a) for a in coco["annotations"] if a["image_id"] in ids]}


def jpeg(im: Image.Image, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def reencoded_resized(coco: dict, source: int, new_id: int) -> tuple[dict, list[dict], bytes]:
    """COCO128 image ``source`` saved again at JPEG quality 70 and resized by 0.9: its record (id ``new_id``,
    'copy.jpg', the new size), its annotations scaled by 0.9 (ids + 10^6), the file's bytes."""
    rec = next(i for i in coco["images"] if i["id"] == source)
    with Image.open(COCO / "train2017" / rec["file_name"]) as im:
        small = im.convert("RGB").resize((round(im.width * 0.9), round(im.height * 0.9)), Image.Resampling.BILINEAR)
    anns = []
    for a in coco["annotations"]:
        if a["image_id"] == source:
            seg = a["segmentation"]
            anns.append(dict(a, id=a["id"] + 10**6, image_id=new_id, bbox=[v * 0.9 for v in a["bbox"]],
                             area=a["area"] * 0.81,
                             segmentation=[[v * 0.9 for v in poly] for poly in seg] if isinstance(seg, list) else []))
    return dict(rec, id=new_id, file_name="copy.jpg", width=small.width, height=small.height), anns, jpeg(small, 70)


def cropped(coco: dict, source: int, new_id: int, margin: float = 0.05) -> tuple[dict, list[dict], bytes]:
    """COCO128 image ``source`` cropped by ``margin`` of its width and height on each side ('crop.jpg', id
    ``new_id``, no annotations)."""
    rec = next(i for i in coco["images"] if i["id"] == source)
    with Image.open(COCO / "train2017" / rec["file_name"]) as im:
        w, h = im.size
        part = im.convert("RGB").crop((round(w * margin), round(h * margin), round(w * (1 - margin)),
                                       round(h * (1 - margin))))
    return dict(rec, id=new_id, file_name="crop.jpg", width=part.width, height=part.height), [], jpeg(part)


def layout(tmp_path: Path, coco: dict, extra: list[tuple[dict, list[dict], bytes]] = (), *, val_ids=VAL_IDS) -> Path:
    """``tmp_path/raw``: train = COCO128 `TRAIN_IDS` (annotations/instances_train2017.json, train2017/), val =
    ``val_ids`` plus the ``extra`` (record, annotations, bytes) copies (annotations/instances_val2017.json,
    val2017/)."""
    raw = tmp_path / "raw"
    for name, ids, folder in ((ANN, TRAIN_IDS, "train2017"), (VAL_ANN, val_ids, "val2017")):
        data = subset(coco, ids)
        (raw / folder).mkdir(parents=True)
        for im in data["images"]:
            shutil.copyfile(COCO / "train2017" / im["file_name"], raw / folder / im["file_name"])
        if folder == "val2017":
            for rec, anns, blob in extra:
                data["images"].append(rec)
                data["annotations"] += anns
                (raw / folder / rec["file_name"]).write_bytes(blob)
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_text(json.dumps(data))
    return raw


def run(raw: Path, **kw) -> dict:
    base = dict(annotations=ANN, images="train2017", val_annotations=VAL_ANN, val_images="val2017", workers=0)
    return convert(raw, raw.parent / "arrow", Convert(**{**base, **kw}), progress=False)


def findings(res: dict) -> dict[str, int]:
    return {rule: v["count"] for rule, v in res["report"]["rules"].items() if v["count"]}


def val_ids(tmp_path: Path) -> list[int]:
    return [r["image_id"] for r in read_rows(tmp_path / "arrow", "val")]


def the_example(res: dict) -> tuple[dict, re.Match]:
    (example,) = res["report"]["rules"]["val_near_duplicate"]["examples"]
    m = DETAIL.match(example["detail"])
    assert m, example["detail"]
    return example, m


# --------------------------------------------------------------------------------------------- the modes


def test_report_lists_a_reencoded_resized_copy_and_keeps_it(tmp_path, coco):
    """leaks: report (the default): a val image that is train image 9 saved again at quality 70 and resized by 0.9
    is counted with train image 9's file and its distance (<= leak_distance), and kept; the distinct val images
    (a giraffe picture beside train's giraffe picture, COCO128's nearest distinct pair) are not flagged."""
    raw = layout(tmp_path, coco, [reencoded_resized(coco, 9, 901)])
    res = run(raw)
    assert findings(res) == {"val_near_duplicate": 1}
    example, m = the_example(res)
    assert example["split"] == "val" and example["record"] == "image id 901"
    assert example["file"] == str(raw / "val2017" / "copy.jpg")
    dist, limit, train_id, train_file, tail = m.groups()
    assert int(dist) <= LEAK == int(limit) and int(train_id) == 9
    assert train_file == str(raw / "train2017" / "000000000009.jpg") and tail == "kept (convert.leaks: report)"
    assert res["report"]["rules"]["val_near_duplicate"]["action"] == "kept"
    assert val_ids(tmp_path) == sorted(VAL_IDS + (901,))
    leaks = res["report"]["leaks"]
    assert leaks["mode"] == "report" and leaks["checked"] and leaks["val_images_compared"] == 4
    near = {int(d): n for d, n in leaks["nearest_distance"].items()}
    assert near.get(int(dist)) and sum(n for d, n in near.items() if d <= LEAK) == 1
    assert min(d for d in near if d > LEAK) >= 16          # the three distinct val images: 16 bits or more


def test_drop_removes_the_copy_and_its_annotations_from_val(tmp_path, coco):
    copy_ = reencoded_resized(coco, 9, 901)
    raw = layout(tmp_path, coco, [copy_])
    res = run(raw, leaks="drop")
    assert findings(res) == {"val_near_duplicate": 1}
    example, m = the_example(res)
    assert example["record"] == "image id 901" and int(m[3]) == 9
    assert m[5] == f"dropped with its {len(copy_[1])} annotation(s)" and len(copy_[1]) == 8
    assert res["report"]["rules"]["val_near_duplicate"]["action"] == "dropped"
    assert val_ids(tmp_path) == sorted(VAL_IDS)
    split = res["report"]["splits"]["val"]
    assert (split["images_in"], split["images_out"]) == (4, 3)
    assert split["annotations_in"] - split["annotations_out"] == 8
    assert res["meta"]["splits"]["val"]["images"] == 3
    assert len(read_rows(tmp_path / "arrow", "train")) == len(TRAIN_IDS)


@pytest.mark.parametrize("workers", [0, 1])
def test_error_names_both_files_the_distance_and_the_rule(tmp_path, coco, workers):
    raw = layout(tmp_path, coco, [reencoded_resized(coco, 9, 901)])
    with pytest.raises(StageError) as e:
        run(raw, leaks="error", workers=workers)
    msg = str(e.value)
    assert "\n" not in msg and "rule 'val_near_duplicate'" in msg and "convert.leaks is error" in msg
    assert msg.startswith(f"{raw / 'val2017' / 'copy.jpg'}: image id 901: ")
    assert f"train image id 9 ({raw / 'train2017' / '000000000009.jpg'})" in msg
    assert re.search(rf"pHash Hamming distance \d+ <= {LEAK} \(convert.leak_distance\)", msg), msg
    assert not (tmp_path / "arrow").exists()


def test_error_without_a_near_duplicate_converts(tmp_path, coco):
    """leaks: error stops only on a near-duplicate: the distinct val images convert, report.json says the mode."""
    res = run(layout(tmp_path, coco), leaks="error")
    assert findings(res) == {} and val_ids(tmp_path) == sorted(VAL_IDS)
    assert res["report"]["rules"]["val_near_duplicate"]["action"] == "error"
    assert res["report"]["leaks"]["val_images_compared"] == 3


@pytest.mark.parametrize("pair", [(25, 144), (110, 360)], ids=["giraffes", "nearest_distinct_pair"])
def test_a_different_image_of_the_same_scene_class_is_not_flagged(tmp_path, coco, pair):
    """Train image 25 and val image 144 both show giraffes; 110 (people at a table) and 360 (people
    snowboarding) both hold "person" and are COCO128's nearest distinct pair. Even with drop, val keeps the
    image, and its nearest train image is further than leak_distance."""
    train_id, val_id = pair
    cats = {c["id"]: c["name"] for c in coco["categories"]}
    shared = ({cats[a["category_id"]] for a in coco["annotations"] if a["image_id"] == train_id}
              & {cats[a["category_id"]] for a in coco["annotations"] if a["image_id"] == val_id})
    assert shared & {"giraffe", "person"}
    res = run(layout(tmp_path, coco, val_ids=(val_id,)), leaks="drop")
    assert "val_near_duplicate" not in findings(res)
    assert val_ids(tmp_path) == [val_id]
    (dist,) = res["report"]["leaks"]["nearest_distance"]
    assert int(dist) > LEAK and int(dist) >= 16


def test_a_lightly_cropped_copy_is_found(tmp_path, coco):
    """Train image 110 cropped by 5 % of its width and height on each side: found, though its whole-frame pHash
    alone lies further than leak_distance from the original's (the central part's hash finds it)."""
    crop = cropped(coco, 110, 902)
    original = (COCO / "train2017" / "000000000110.jpg").read_bytes()
    whole = [imageio.inspect(data, phash=True).phash[0] for data in (original, crop[2])]
    assert bin(whole[0] ^ whole[1]).count("1") > LEAK
    raw = layout(tmp_path, coco, [crop])
    res = run(raw)
    assert findings(res) == {"val_near_duplicate": 1, "image_no_annotations": 1}
    example, m = the_example(res)
    assert example["record"] == "image id 902" and example["file"] == str(raw / "val2017" / "crop.jpg")
    assert int(m[1]) <= LEAK and int(m[3]) == 110 and m[4] == str(raw / "train2017" / "000000000110.jpg")


def test_off_hashes_nothing_and_flags_nothing(tmp_path, coco, monkeypatch):
    """leaks: off: the copy converts unflagged and no perceptual hash is computed (in-process, workers 0)."""
    def no_hash(image):
        raise AssertionError("phash_pair called with convert.leaks off")
    monkeypatch.setattr(imageio, "phash_pair", no_hash)
    raw = layout(tmp_path, coco, [reencoded_resized(coco, 9, 901), cropped(coco, 30, 902)])
    res = run(raw, leaks="off")
    assert findings(res) == {"image_no_annotations": 1}
    assert val_ids(tmp_path) == sorted(VAL_IDS + (901, 902))
    assert res["report"]["leaks"] == {**res["report"]["leaks"], "mode": "off", "checked": False,
                                      "val_images_compared": 0, "nearest_distance": {}}
    assert res["report"]["rules"]["val_near_duplicate"]["action"] == "off"
    with pytest.raises(AssertionError, match="leaks off"):   # the patch is live: report mode calls it
        run(raw, leaks="report")


def test_strict_makes_the_rule_an_error(tmp_path, coco):
    raw = layout(tmp_path, coco, [reencoded_resized(coco, 9, 901)])
    with pytest.raises(StageError) as e:
        run(raw, strict=True, workers=1)
    msg = str(e.value)
    assert "\n" not in msg and "rule 'val_near_duplicate' (kept unless strict)" in msg
    assert msg.startswith(f"{raw / 'val2017' / 'copy.jpg'}: image id 901: ")
    assert str(raw / "train2017" / "000000000009.jpg") in msg and "(convert.strict is true)" in msg
    assert not (tmp_path / "arrow").exists()


def test_a_byte_copy_keeps_its_own_rule(tmp_path, coco):
    """A val file with the bytes of train image 9 is dropped as val_image_in_train (checked first), never counted
    as a near-duplicate as well."""
    rec = dict(next(i for i in coco["images"] if i["id"] == 9), id=903, file_name="same.jpg")
    raw = layout(tmp_path, coco, [(rec, [], (COCO / "train2017" / "000000000009.jpg").read_bytes())])
    res = run(raw, leaks="drop")
    assert findings(res) == {"val_image_in_train": 1}
    assert res["report"]["leaks"]["val_images_compared"] == 3


# ------------------------------------------------------------------------------------- the default run


def test_default_coco128_run_rows_unchanged_and_nothing_flagged(tmp_path):
    """params.yaml's convert section on data/coco128 (val_fraction 0.2): the 26 val images are all further than
    leak_distance from every train image, and the Arrow shards and meta.json are byte-identical to a run with
    leaks: off (only report.json differs: the rule's action and the leaks section)."""
    params = load("convert", REPO / "params.yaml")
    assert params.leaks == "report" and params.leak_distance == LEAK
    on = convert(COCO, tmp_path / "on", params, progress=False)
    off = convert(COCO, tmp_path / "off", params.model_copy(update={"leaks": "off"}), progress=False)
    assert on["report"]["rules"]["val_near_duplicate"]["count"] == 0
    near = on["report"]["leaks"]
    assert near["val_images_compared"] == on["meta"]["splits"]["val"]["images"] == 26
    assert min(int(d) for d in near["nearest_distance"]) > LEAK
    files = sorted(p.relative_to(tmp_path / "on") for p in (tmp_path / "on").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "off") for p in (tmp_path / "off").rglob("*") if p.is_file())
    for rel in files:
        if rel.name != "report.json":
            assert (tmp_path / "on" / rel).read_bytes() == (tmp_path / "off" / rel).read_bytes(), rel
