"""What the model is fed (issue 33.2), on the session fixtures' real COCO128 runs: the convert stage's label
statistics (``plots/labels/``) against pycocotools' and numpy's count of the same JSON, and the train stage's
first batch drawn (``plots/train_batch.png``) against the batch the loader yields at iteration 0, a flipped
sample's boxes on its object (from the Arrow annotations, not from the loader)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
import yaml
from PIL import ImageColor

from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.loader import micro_batches
from detpipe.data.sampler import ResumableDistributedSampler
from detpipe.vis.batch_plot import class_color, grid_layout


def _arrow_rows(split_dir: Path) -> list[dict]:
    rows = []
    for shard in sorted(split_dir.glob("part-*.arrow")):
        with pa.memory_map(str(shard)) as src:
            table = ipc.open_file(src).read_all().drop_columns(["image"])
        rows += table.to_pylist()
    return rows


# ------------------------------------------------------------------------------------------ label statistics

def test_label_statistics_match_pycocotools(cached_workdir):
    from pycocotools.coco import COCO

    work = cached_workdir
    coco = COCO(str(work / "data/raw/annotations/instances_train2017.json"))
    train_ids = [r["image_id"] for r in _arrow_rows(work / "data/arrow/train")]
    report = json.loads((work / "data/arrow/report.json").read_text())
    assert not any(v["count"] for v in report["rules"].values()), "boxes changed by convert: not the JSON's"
    plots = work / "plots/labels"
    # instances per class: every category in id order, crowd regions included (pycocotools' default)
    rows = json.loads((plots / "instances.json").read_text())["instances"]
    expected = []
    for cat in coco.loadCats(sorted(coco.getCatIds())):
        anns = coco.loadAnns(coco.getAnnIds(imgIds=train_ids, catIds=[cat["id"]]))
        expected.append({"class": cat["name"], "instances": len(anns),
                         "crowd": sum(a["iscrowd"] for a in anns), "images": len({a["image_id"] for a in anns})})
    assert rows == expected
    assert sum(r["instances"] for r in rows) > 20
    # width, height and w/h histograms of the JSON's boxes (float32 as stored), by numpy, with the documented bins
    boxes = np.array([a["bbox"] for a in coco.loadAnns(coco.getAnnIds(imgIds=train_ids))], np.float32)
    w, h = boxes[:, 2].astype(np.float64), boxes[:, 3].astype(np.float64)
    for name, values, edges in (("box_width", w, 2 ** (np.arange(1, 29) / 2)),
                                ("box_height", h, 2 ** (np.arange(1, 29) / 2)),
                                ("aspect_ratio", w / h, 2 ** (np.arange(-16, 17) / 4))):
        bins = json.loads((plots / f"{name}.json").read_text())[name]
        assert [b["from_exact"] for b in bins] == [0.0, *edges.tolist()], name
        assert [b["to_exact"] for b in bins] == [*edges.tolist(), None], name
        counts, _ = np.histogram(values, np.r_[0.0, edges, max(values.max(), edges[-1]) * 2])
        assert [b["boxes"] for b in bins] == counts.tolist(), name
        assert sum(b["boxes"] for b in bins) == len(boxes)


def test_label_statistics_memory_is_bounded():
    """The counts of any number of boxes are a fixed number of integers (no per-box list)."""
    from detpipe.data.label_stats import LabelStats

    rng = np.random.default_rng(0)
    small, large = LabelStats(81), LabelStats(81)
    for stats, n in ((small, 10), (large, 100_000)):
        for _ in range(10):
            wh = rng.uniform(0.5, 5000, (n // 10, 2))
            stats.add_image(np.c_[np.zeros_like(wh), wh].tolist(), rng.integers(1, 81, n // 10).tolist(),
                            [0] * (n // 10))
    assert int(large.instances.sum()) == 100_000 and int(large.width.sum()) == 100_000
    size = lambda s: sum(v.nbytes for v in vars(s).values())  # noqa: E731
    assert size(small) == size(large) < 4096


# ------------------------------------------------------------------------------------------ the first batch

def _first_batch(work: Path, train: dict) -> tuple[CachedDetectionDataset, list]:
    """The loader's first step of epoch 0, as the trainer builds its sampler (one process)."""
    ds = CachedDetectionDataset(work / "data/cache", "train", hflip=train["hflip"], seed=train["seed"])
    sampler = ResumableDistributedSampler(len(ds), 1, 0, seed=train["seed"], shards=ds.sample_shards())
    data = micro_batches(ds, sampler, (0, 0, 0), train["batch_size"], train["accumulate"])
    try:
        micro = next(data)
    finally:
        data.close()
    return ds, [(im, t) for images, targets in micro for im, t in zip(images, targets)]


def _rgb(label: int) -> list[int]:
    return list(ImageColor.getrgb(class_color(label)))


def _undrawn(h: int, w: int, boxes: list, names: list[str]) -> np.ndarray:
    """Pixels of an (h, w) tile outside every box (and its outline's reach) and its class name (written from the
    box's top-left corner: at most 8 x 16 pixels a character)."""
    free = np.ones((h, w), bool)
    for (x0, y0, x1, y1), name in zip(boxes, names):
        x1, y1 = max(x1, x0 + 8 * len(name) + 8), max(y1, y0 + 20)
        free[max(0, int(y0) - 1):int(y1) + 2, max(0, int(x0) - 1):int(x1) + 2] = False
    return free


def _lines(h: int, w: int, boxes: list, names: list[str]) -> np.ndarray:
    """Pixels of an (h, w) tile that a box outline (3 pixels wide either side of each edge) or a class name may
    cover."""
    drawn = np.zeros((h, w), bool)
    for (x0, y0, x1, y1), name in zip(boxes, names):
        x0, y0, x1, y1 = int(x0), int(y0), int(x1), int(y1)
        for ya, yb, xa, xb in ((y0 - 3, y0 + 4, x0 - 3, x1 + 4), (y1 - 3, y1 + 4, x0 - 3, x1 + 4),
                               (y0 - 3, y1 + 4, x0 - 3, x0 + 4), (y0 - 3, y1 + 4, x1 - 3, x1 + 4),
                               (y0, y0 + 20, x0, x0 + 8 * len(name) + 8)):
            drawn[max(0, ya):max(0, yb), max(0, xa):max(0, xb)] = True
    return drawn


def test_first_batch_drawn_as_fed(trained_workdir):
    from torchvision.io import decode_png, read_file

    work = trained_workdir
    train = yaml.safe_load((work / "params.yaml").read_text())["train"]
    grid = decode_png(read_file(str(work / "plots/train_batch.png"))).numpy()
    ds, pairs = _first_batch(work, train)
    names = json.loads((work / "data/arrow/meta.json").read_text())["label_names"]
    assert len(pairs) == train["batch_size"] * train["accumulate"] > 1
    scales, corners, size = grid_layout([tuple(im.shape[1:]) for im, _ in pairs], 640)
    assert grid.shape == (3, *size) and scales == [1.0] * len(pairs)
    # the first image's first target: its outline in its class colour at its exact (truncated) coordinates
    (image, target), (cy, cx) = pairs[0], corners[0]
    x0, y0, x1, y1 = (int(v) for v in target["boxes"][0].tolist())
    for y, x in (((y0 + y1) // 2, x0), (y1, (x0 + x1) // 2)):
        assert grid[:, cy + y, cx + x].tolist() == _rgb(int(target["labels"][0])), (y, x)
    # every tile is its image exactly where nothing is drawn
    for (image, target), (cy, cx) in zip(pairs, corners):
        h, w = image.shape[1:]
        tile = grid[:, cy:cy + h, cx:cx + w]
        pixels = image.mul(255).round().to(torch.uint8).numpy()
        free = _undrawn(h, w, target["boxes"].tolist(), [names[k] for k in target["labels"].tolist()])
        assert free.sum() > 0.05 * h * w
        assert np.array_equal(tile[:, free], pixels[:, free])


def test_flipped_sample_box_follows_its_object(trained_workdir):
    """A flipped sample of the first batch, checked from the Arrow annotations (original pixels), the cache's
    scale and the unflipped cached image: its tile is that image mirrored, and each box's outline sits on the
    mirrored box; a box left unflipped while the image is flipped lies elsewhere."""
    from torchvision.io import decode_png, read_file

    work = trained_workdir
    train = yaml.safe_load((work / "params.yaml").read_text())["train"]
    grid = decode_png(read_file(str(work / "plots/train_batch.png"))).numpy()
    ds, pairs = _first_batch(work, train)
    plain = CachedDetectionDataset(work / "data/cache", "train")
    names = json.loads((work / "data/arrow/meta.json").read_text())["label_names"]
    arrow = {r["image_id"]: r for r in _arrow_rows(work / "data/arrow/train")}
    _, corners, _ = grid_layout([tuple(im.shape[1:]) for im, _ in pairs], 640)
    flipped = [k for k, (_, t) in enumerate(pairs) if ds.flipped(ds.image_ids.index(int(t["image_id"])), 0)]
    assert flipped, "no flipped sample in the first batch: choose another seed"
    checked = 0
    for k in flipped:
        image, target = pairs[k]
        cy, cx = corners[k]
        i = ds.image_ids.index(int(target["image_id"]))
        unflipped = plain[(0, i)][0].mul(255).round().to(torch.uint8).numpy()
        h, w = unflipped.shape[1:]
        sy, sx = target["scale"].tolist()
        row = arrow[int(target["image_id"])]
        boxes = [(w - (x + bw) * sx, y * sy, w - x * sx, (y + bh) * sy) for x, y, bw, bh in row["bbox"]]
        tile = grid[:, cy:cy + h, cx:cx + w]
        free = _undrawn(h, w, boxes, [names[k] for k in row["label"]]) & \
            _undrawn(h, w, target["boxes"].tolist(), [names[k] for k in target["labels"].tolist()])
        assert np.array_equal(tile[:, free], unflipped[:, :, ::-1][:, free]), "the image is not mirrored"
        for (fx0, fy0, fx1, fy1), label, (x, _, bw, _) in zip(boxes, row["label"], row["bbox"]):
            if abs(fx0 - x * sx) < 8 or fy1 - fy0 < 30:
                continue     # a box about as far from both sides (or too flat for its name) decides nothing
            ym = int((fy0 + fy1) / 2)
            near = [tile[:, ym, xx].tolist() for xx in range(max(0, int(fx0) - 1), int(fx0) + 2)]
            assert _rgb(label) in near, f"image {row['image_id']}: no outline at the mirrored box's left edge"
            checked += 1
    assert checked > 0


def test_masks_shaded_in_class_colour(cached_workdir):
    """Mask models: each instance mask is shaded in its class colour (opacity 0.4) under the boxes."""
    from detpipe.vis.batch_plot import draw_batch

    ds = CachedDetectionDataset(cached_workdir / "data/cache", "train", with_masks=True)
    image, target = ds[0]
    grid = draw_batch([([image], [target])]).numpy().astype(np.int64)
    pixels = image.mul(255).round().numpy()
    names = json.loads((cached_workdir / "data/arrow/meta.json").read_text())["label_names"]
    masks = target["masks"].numpy().astype(bool)
    assert masks.any()
    free = _undrawn(*masks.shape[1:], target["boxes"].tolist(), [names[k] for k in target["labels"].tolist()])
    outside = free & ~masks.any(0)
    assert np.array_equal(grid[:, outside], pixels[:, outside])
    alone = masks.sum(0) == 1             # under one mask only
    drawn = _lines(*masks.shape[1:], target["boxes"].tolist(), [names[k] for k in target["labels"].tolist()])
    checked = 0
    for k, label in enumerate(target["labels"].tolist()):
        inside = masks[k] & alone & ~drawn
        if inside.sum() < 20:
            continue
        want = 0.6 * pixels[:, inside] + 0.4 * np.array(_rgb(label))[:, None]
        assert np.abs(grid[:, inside] - want).max() <= 1.0, k
        checked += 1
    assert checked > 0


def test_checkpoint_carries_the_drawn_batch(trained_workdir, tmp_path):
    """A run that resumes never sees iteration 0: every checkpoint holds the PNG drawn then, which the hook writes
    again before training when the file is missing (dvc repro removes the stage's outputs before it runs) or
    differs, without drawing anything."""
    import types

    from detpipe.engine.checkpoints import list_checkpoints
    from detpipe.engine.hooks import TrainBatchPlotHook

    drawn = (trained_workdir / "plots/train_batch.png").read_bytes()
    ckpts = list_checkpoints(trained_workdir / "checkpoints")
    assert ckpts
    for ckpt in ckpts:
        state = torch.load(ckpt, weights_only=True)["hooks"]["TrainBatchPlotHook"]
        hook = TrainBatchPlotHook(tmp_path / "plots/train_batch.png")
        hook.trainer = types.SimpleNamespace(rank=0, iter=int(ckpt.stem.split("-")[1]))
        hook.load_state_dict(state)
        hook.before_train()
        assert (tmp_path / "plots/train_batch.png").read_bytes() == drawn
        hook.after_load([])            # past iteration 0: nothing drawn (an empty batch would fail to draw)
        (tmp_path / "plots/train_batch.png").write_bytes(b"stale")
        hook.before_train()
        assert (tmp_path / "plots/train_batch.png").read_bytes() == drawn
