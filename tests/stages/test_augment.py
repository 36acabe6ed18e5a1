"""Augment stage on real COCO128 images: cached pixels/boxes vs a direct decode+resize, the model transforms'
own resize, SSD-style copies, bad input, and the DVC stage definition."""
from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
import yaml
from PIL import Image, ImageOps
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn, ssdlite320_mobilenet_v3_large
from torchvision.models.detection.transform import _resize_image_and_masks
from torchvision.transforms.v2 import functional as TF

from support.pipeline import COCO128, stage_cli, write_params
from support.procs import REPO
from detpipe import params as params_mod
from detpipe.data.augmentation import process_image, target_size
from detpipe.data.cache_format import INDEX_FILE, ZOOM_OUT_FILL
from detpipe.data.augment import build_cache
from detpipe.core.errors import StageError
from detpipe.data.dataset import CachedDetectionDataset


def _coco(work: Path) -> dict:
    return json.loads((work / "data/raw/annotations/instances_train2017.json").read_text())


def _direct(work: Path, image: dict, size: tuple[int, int] | None, cfg=None) -> torch.Tensor:
    """Reference: PIL decode, EXIF transpose, RGB, v2 bilinear antialiased resize -> (3, h, w) uint8."""
    with Image.open(work / "data/raw/train2017" / image["file_name"]) as im:
        chw = TF.pil_to_tensor(ImageOps.exif_transpose(im).convert("RGB"))
    if size is None:
        size = target_size(chw.shape[1], chw.shape[2], cfg)
    return TF.resize(chw, list(size), interpolation=TF.InterpolationMode.BILINEAR, antialias=True)


def _expected_boxes(coco: dict, image_id: int, h: int, w: int, label_of: dict) -> tuple[np.ndarray, list[int]]:
    """Non-crowd COCO boxes of an image as XYXY clamped to it, positive size only (original pixels)."""
    boxes, labels = [], []
    for a in coco["annotations"]:
        if a["image_id"] != image_id or a.get("iscrowd", 0):
            continue
        x, y, bw, bh = a["bbox"]
        b = [min(max(x, 0), w), min(max(y, 0), h), min(max(x + bw, 0), w), min(max(y + bh, 0), h)]
        if b[2] > b[0] and b[3] > b[1]:
            boxes.append(b)
            labels.append(label_of[str(a["category_id"])])
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4), labels


@pytest.fixture(scope="module")
def raw_cache(cached_workdir, tmp_path_factory) -> Path:
    """The plain cache of `cached_workdir` with ``encoding: raw`` (the pipeline's default is jpeg)."""
    cache = tmp_path_factory.mktemp("raw") / "cache"
    build_cache(cached_workdir / "data/arrow", cache, params_mod.Augment(encoding="raw", workers=0))
    return cache


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images (peak 255)."""
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255**2 / mse)


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_cache_equals_direct_decode_and_resize(cached_workdir, raw_cache, split, encoding):
    """raw: bit-identical pixels; jpeg (the pipeline's default cache): within JPEG quality-90 loss (PSNR); boxes,
    labels, scales identical in both."""
    work = cached_workdir
    coco = _coco(work)
    images = {im["id"]: im for im in coco["images"]}
    label_of = json.loads((work / "data/arrow/meta.json").read_text())["category_id_to_label"]
    cache = raw_cache if encoding == "raw" else work / "data/cache"
    cache_meta = json.loads((cache / "meta.json").read_text())
    assert cache_meta["encoding"] == encoding
    ds = CachedDetectionDataset(cache, split)
    assert len(ds) == cache_meta["splits"][split]["images"] > 0
    crowd = 0
    for i in range(len(ds)):
        image, target = ds[i]
        info = images[int(target["image_id"])]
        ref = _direct(work, info, (320, 320))
        assert image.shape == (3, 320, 320) and image.dtype == torch.float32 and image.is_contiguous()
        if encoding == "raw":
            assert torch.equal(ds.pixels(i), ref)  # bit-identical uint8 pixels
            torch.testing.assert_close(image, ref.to(torch.float32) / 255, rtol=0, atol=1e-6)
        else:
            assert _psnr(ds.pixels(i), ref) >= 28.0, (i, _psnr(ds.pixels(i), ref))  # quality 90: ~29-40 dB
            torch.testing.assert_close(image, ds.pixels(i).to(torch.float32) / 255, rtol=0, atol=1e-6)
        oh, ow = int(target["orig_size"][0]), int(target["orig_size"][1])
        assert (oh, ow) == (info["height"], info["width"])
        boxes, labels = _expected_boxes(coco, info["id"], oh, ow, label_of)
        sy, sx = (float(v) for v in target["scale"])
        assert (sy, sx) == (320 / oh, 320 / ow) and target["offset"].tolist() == [0.0, 0.0]
        np.testing.assert_allclose(target["boxes"].numpy(), boxes * [sx, sy, sx, sy], rtol=1e-6, atol=1e-4)
        assert target["labels"].tolist() == labels
        # the recorded scale maps the cached boxes back to original pixels (what evaluate does with predictions)
        back = target["boxes"].double() / torch.tensor([sx, sy, sx, sy], dtype=torch.float64)
        np.testing.assert_allclose(back.numpy(), boxes, atol=1e-3)
        crowd += sum(1 for a in coco["annotations"] if a["image_id"] == info["id"] and a.get("iscrowd", 0))
    assert cache_meta["splits"][split]["crowd_excluded"] == crowd
    assert cache_meta["splits"][split]["boxes"] == sum(len(ds[i][1]["labels"]) for i in range(len(ds)))


def _sizes() -> list[tuple[int, int]]:
    coco = json.loads((COCO128 / "annotations/instances_train2017.json").read_text())
    return sorted({(im["height"], im["width"]) for im in coco["images"]} | {(640, 638), (3, 900), (480, 640)})


@pytest.mark.parametrize("min_size,max_size", [(800, 1333), (320, 512), (320, 640)])
def test_keep_ratio_size_is_a_fixed_point_of_torchvision_resize(min_size, max_size):
    """For every COCO128 image size (and awkward ones), the cached size goes through torchvision's own
    GeneralizedRCNNTransform resize unchanged, and is within 1 pixel of what it makes of the original."""
    cfg = params_mod.Augment(resize="keep_ratio", min_size=min_size, max_size=max_size)
    for h, w in _sizes():
        ch, cw = target_size(h, w, cfg)
        same, _ = _resize_image_and_masks(torch.empty(3, ch, cw, device="meta"), float(min_size), float(max_size))
        assert tuple(same.shape[-2:]) == (ch, cw), (h, w)
        tv, _ = _resize_image_and_masks(torch.empty(3, h, w, device="meta"), float(min_size), float(max_size))
        assert abs(tv.shape[-2] - ch) <= 1 and abs(tv.shape[-1] - cw) <= 1, (h, w, tuple(tv.shape), (ch, cw))


def _model_input_unchanged(model: torch.nn.Module, image: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        batch, _ = model.transform([image])
    h, w = image.shape[-2:]
    assert batch.image_sizes[0] == (h, w)
    t = model.transform
    normalized = (image - torch.tensor(t.image_mean)[:, None, None]) / torch.tensor(t.image_std)[:, None, None]
    torch.testing.assert_close(batch.tensors[0, :, :h, :w], normalized, rtol=0, atol=1e-6)


def test_fixed_cache_is_not_resized_by_ssdlite(cached_workdir):
    model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=81)
    ds = CachedDetectionDataset(cached_workdir / "data/cache", "val")
    for i in range(len(ds)):
        _model_input_unchanged(model, ds[i][0])


@pytest.mark.parametrize("min_size,max_size", [(320, 512), (800, 1333)])
def test_keep_ratio_cache_is_not_resized_by_faster_rcnn(cached_workdir, tmp_path, min_size, max_size):
    work = cached_workdir
    cfg = params_mod.Augment(resize="keep_ratio", min_size=min_size, max_size=max_size, workers=0, encoding="raw")
    build_cache(work / "data/arrow", tmp_path / "cache", cfg)
    model = fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None, num_classes=81,
                                              min_size=min_size, max_size=max_size)
    images = {im["id"]: im for im in _coco(work)["images"]}
    ds = CachedDetectionDataset(tmp_path / "cache", "val")
    for i in range(len(ds)):
        image, target = ds[i]
        assert min(image.shape[-2:]) == min_size or max(image.shape[-2:]) == max_size
        assert torch.equal(ds.pixels(i), _direct(work, images[int(target["image_id"])], None, cfg))
        _model_input_unchanged(model, image)


def test_boxes_clamped_crowd_and_degenerate_counted():
    """Real image, hand-made annotations: crowd excluded, boxes clamped to the image, empty ones dropped."""
    name = "000000000009.jpg"
    data = (COCO128 / "train2017" / name).read_bytes()
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
    row = {"image_id": 9, "file_name": name, "image": data,
           "bbox": [[10, 20, 30, 40], [w - 10, 5, 50, 10], [15, 15, 0, 5], [w + 5, 0, 20, 20], [0, 0, 5, 5]],
           "label": [1, 2, 3, 4, 5], "iscrowd": [0, 0, 0, 0, 1]}
    cfg = params_mod.Augment(resize="fixed", size=100, encoding="raw")
    rows, counts = process_image(row, cfg, copies=0)
    (jrow,), jcounts = process_image(row, cfg.model_copy(update={"encoding": "jpeg"}), copies=0)
    assert jcounts == counts and jrow["boxes"] == rows[0]["boxes"] and jrow["pixels"][:2] == b"\xff\xd8"  # SOI
    assert counts == {"crowd_excluded": 1, "degenerate_dropped": 2, "crop_dropped": 0}
    (r,) = rows
    sx, sy = 100 / w, 100 / h
    np.testing.assert_allclose(r["boxes"], [[10 * sx, 20 * sy, 40 * sx, 60 * sy], [(w - 10) * sx, 5 * sy, 100, 15 * sy]],
                               rtol=1e-6)
    assert r["labels"] == [1, 2] and len(r["pixels"]) == 3 * 100 * 100


def _index(cache: Path, split: str) -> pa.Table:
    with pa.memory_map(str(cache / split / INDEX_FILE)) as f:
        return ipc.open_file(f).read_all()


@pytest.fixture(scope="module")
def copies_cache(cached_workdir, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("copies") / "cache"
    build_cache(cached_workdir / "data/arrow", cache, params_mod.Augment(copies=2, seed=5, workers=0, encoding="raw"))
    return cache


def test_copies_are_deterministic_and_independent_of_workers(cached_workdir, raw_cache, copies_cache, tmp_path):
    meta = json.loads((copies_cache / "meta.json").read_text())
    plain = json.loads((cached_workdir / "data/cache/meta.json").read_text())
    assert meta["splits"]["train"]["rows"] == 2 * meta["splits"]["train"]["images"] == 2 * plain["splits"]["train"]["images"]
    assert meta["splits"]["val"]["rows"] == meta["splits"]["val"]["images"]  # val is never augmented
    again = tmp_path / "cache"
    build_cache(cached_workdir / "data/arrow", again, params_mod.Augment(copies=2, seed=5, workers=2, encoding="raw"))
    for f in sorted(p.relative_to(copies_cache) for p in copies_cache.rglob("*") if p.is_file()):
        assert (again / f).read_bytes() == (copies_cache / f).read_bytes(), f
    other = tmp_path / "other"
    build_cache(cached_workdir / "data/arrow", other, params_mod.Augment(copies=2, seed=6, workers=0, encoding="raw"))
    assert (other / "train/part-00000.arrow").read_bytes() != (copies_cache / "train/part-00000.arrow").read_bytes()
    # val: exactly the plain cache
    assert _index(copies_cache, "val").equals(_index(raw_cache, "val"))
    for shard in meta["splits"]["val"]["shards"]:
        assert (copies_cache / "val" / shard).read_bytes() == (raw_cache / "val" / shard).read_bytes()


def test_copies_geometry_matches_offset_and_scale(cached_workdir, copies_cache):
    """Every variant box is an original box mapped by ``(orig - offset) * scale`` and clipped to the variant;
    pixels that map outside the original image are the zoom-out fill."""
    plain = CachedDetectionDataset(cached_workdir / "data/cache", "train")
    ds = CachedDetectionDataset(copies_cache, "train", seed=0)
    assert ds.copies == 2 and plain.image_ids == ds.image_ids
    fill_checked = 0
    distinct = 0
    for i in range(len(ds)):
        _, pt = plain[i]
        s0 = pt["scale"].numpy()
        orig = pt["boxes"].double().numpy() / [s0[1], s0[0], s0[1], s0[0]]
        variants = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            image, t = ds[i]
            variants.append(ds.pixels(i).clone())
            assert t["orig_size"].tolist() == pt["orig_size"].tolist()
            (sy, sx), (oy, ox) = t["scale"].numpy(), t["offset"].numpy()
            h, w = image.shape[-2:]
            mapped = (orig - [ox, oy, ox, oy]) * [sx, sy, sx, sy]
            mapped[:, 0::2] = mapped[:, 0::2].clip(0, w)
            mapped[:, 1::2] = mapped[:, 1::2].clip(0, h)
            j = 0  # variant boxes are a subsequence of the mapped originals (SanitizeBoundingBoxes keeps order)
            for box, label in zip(t["boxes"].double().numpy(), t["labels"].tolist()):
                while j < len(mapped) and not (np.abs(mapped[j] - box).max() < 1e-2 and pt["labels"][j] == label):
                    j += 1
                assert j < len(mapped), (i, epoch, box)
                j += 1
            # cached pixel centres mapping to original positions beyond the resize kernel's reach (max(1, 1/scale)
            # original pixels for bilinear + antialias) outside the image: only zoom-out fill contributes there
            oh, ow = t["orig_size"].tolist()
            ys = (np.arange(h) + 0.5) / sy + oy
            xs = (np.arange(w) + 0.5) / sx + ox
            my, mx = max(1.0, 1 / sy) + 1, max(1.0, 1 / sx) + 1
            out = ((ys < -my) | (ys > oh + my))[:, None] | ((xs < -mx) | (xs > ow + mx))[None, :]
            if out.any():
                px = variants[-1].permute(1, 2, 0).numpy()[out]
                assert (px == ZOOM_OUT_FILL).all(), (i, epoch)
                fill_checked += 1
        distinct += not torch.equal(variants[0], variants[1])
    assert fill_checked > 0 and distinct == len(ds)


def test_loader_picks_variant_epoch_plus_seed_mod_k(copies_cache):
    index = _index(copies_cache, "train").to_pydict()
    rows = {(i, v): k for k, (i, v) in enumerate(zip(index["image_id"], index["variant"]))}
    for seed in (0, 1):
        ds = CachedDetectionDataset(copies_cache, "train", seed=seed)
        for epoch in range(3):
            ds.set_epoch(epoch)
            for i in range(len(ds)):
                _, t = ds[i]
                r = rows[(int(t["image_id"]), (epoch + seed) % 2)]
                assert t["boxes"].numpy().tolist() == np.asarray(index["boxes"][r], dtype=np.float32).tolist()


def test_undecodable_image_is_a_one_line_error_and_nothing_is_written(cached_workdir, tmp_path):
    arrow = tmp_path / "arrow"
    shutil.copytree(cached_workdir / "data/arrow", arrow)
    shard = next((arrow / "train").glob("*.arrow"))
    table = ipc.open_file(pa.BufferReader(shard.read_bytes())).read_all()  # in memory: the file is rewritten
    images = table.column("image").to_pylist()
    images[2] = images[2][:200]  # truncated JPEG
    table = table.set_column(table.schema.get_field_index("image"), "image", pa.array(images, pa.binary()))
    with ipc.new_file(str(shard), table.schema) as w:
        w.write_table(table)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "keep.txt").write_text("previous output")
    with pytest.raises(StageError) as e:
        build_cache(arrow, cache, params_mod.Augment(workers=0))
    name, image_id = table.column("file_name")[2].as_py(), table.column("image_id")[2].as_py()
    assert name in str(e.value) and f"image_id {image_id}" in str(e.value) and "\n" not in str(e.value)
    assert [p.name for p in cache.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".cache")] == []


def test_reads_the_shards_meta_json_lists(cached_workdir, tmp_path):
    """augment reads the shards data/arrow/meta.json lists, not whatever lies in the folder: a stray file is not
    read; a listed shard that is missing, or no shard list, is a one-line error naming the file."""
    arrow = tmp_path / "arrow"
    shutil.copytree(cached_workdir / "data/arrow", arrow)
    (arrow / "val" / "part-99999.arrow").write_bytes(b"not arrow")  # would fail if it were read
    meta = build_cache(arrow, tmp_path / "cache", params_mod.Augment(workers=0))
    assert meta["splits"]["val"]["images"] == json.loads((arrow / "meta.json").read_text())["splits"]["val"]["images"]
    (arrow / "val" / "part-00000.arrow").unlink()
    with pytest.raises(StageError, match=r"^\S*/val/part-00000\.arrow: listed in \S*/meta\.json but not found "
                                         r"\(re-run the convert stage\)$"):
        build_cache(arrow, tmp_path / "cache2", params_mod.Augment(workers=0))
    arrow_meta = json.loads((arrow / "meta.json").read_text())
    del arrow_meta["splits"]["train"]["shards"]
    (arrow / "meta.json").write_text(json.dumps(arrow_meta))
    with pytest.raises(StageError, match=r"meta\.json: no shard list for the train split "
                                         r"\(re-run the convert stage\)$"):
        build_cache(arrow, tmp_path / "cache3", params_mod.Augment(workers=0))
    assert not (tmp_path / "cache2").exists() and not (tmp_path / "cache3").exists()


def test_stage_cli_logs_progress_without_a_terminal(cached_workdir, tmp_path):
    """Without a terminal (stderr a pipe, as under Prefect) the stage's progress is log lines, one per split at
    its end at least: images done of the split's total (data/arrow/meta.json), images/s."""
    shutil.copyfile(cached_workdir / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(cached_workdir / "data/arrow", tmp_path / "data/arrow")
    proc = stage_cli("augment", tmp_path)
    meta = json.loads((tmp_path / "data/arrow/meta.json").read_text())
    for split in ("train", "val"):
        n = meta["splits"][split]["images"]
        line = f"detpipe.core.progress INFO augment {split}: image {n}/{n}, "
        assert line in proc.stderr and "images/s" in proc.stderr.split(line, 1)[1].splitlines()[0], proc.stderr


def test_stage_cli_without_converted_data_fails_with_one_line(tmp_path):
    write_params(tmp_path)
    proc = stage_cli("augment", tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: data/arrow/meta.json: not found (run the convert stage first)"
    assert not (tmp_path / "data/cache").exists()


def test_dvc_stage_lists_all_code_and_params_it_reads():
    """DVC reruns augment exactly when its inputs change: every augment param that changes the output (all but
    ``workers``) is listed (code deps follow the imports: tests/unit/test_layout.py), and readers of the cache
    list the loader."""
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["augment"]
    assert "data/arrow" in stage["deps"] and stage["outs"] == ["data/cache"]
    listed = {p.removeprefix("augment.") for p in stage["params"]}
    assert listed == set(params_mod.Augment.model_fields) - {"workers"}
    for name in ("train", "evaluate", "export"):
        assert "detpipe/data/dataset.py" in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][name]["deps"]
