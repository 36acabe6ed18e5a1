"""Augment stage: decode every image once, resize it to the training size, cache uint8 pixels in Arrow.

``python -m stages.augment`` reads ``data/arrow/{train,val}/*.arrow`` (see `stages.convert` for that schema)
and writes ``data/cache/{train,val}/part-NNNNN.arrow`` plus ``data/cache/meta.json``. The expensive,
deterministic work (decode, EXIF orientation, RGB conversion, resize) is done here once; cheap random
augmentation (horizontal flip) is applied at load time by `stages.data.CachedDetectionDataset`.

Cache schema (Arrow IPC file format, memory-mapped at load time), one row per image:

============== ================================ ==========================================================
column         type                             meaning
============== ================================ ==========================================================
image_id       int64                            COCO image id
height, width  int32                            cached pixel size (after resize)
orig_height    int32                            decoded size in pixels before resize (after EXIF
orig_width     int32                            orientation) — the frame of the COCO annotations
scale_y        float64                          height / orig_height (divide predictions by it to map
scale_x        float64                          back to original coordinates)
pixels         binary                           ``height * width * 3`` bytes, uint8, HWC, RGB
boxes          list<fixed_size_list<float32,4>>  non-crowd boxes, XYXY, cached pixels
labels         list<int64>                      contiguous labels (1..K; 0 is background)
============== ================================ ==========================================================

Resize modes (``augment.resize``), chosen to match what the model's own transform does so it does not
resize a second time:

* ``fixed``: ``size x size`` pixels, aspect ratio not kept — what torchvision's SSD/SSDlite transform does
  (``GeneralizedRCNNTransform(fixed_size=(320, 320))`` for ``ssdlite320_mobilenet_v3_large``).
* ``keep_ratio``: scale ``min(min_size / short_side, max_size / long_side)``, output size floored — the rule
  of ``torchvision.models.detection.transform._resize_image_and_masks`` (Faster R-CNN, RetinaNet, FCOS).

Boxes: ``iscrowd`` objects are not training targets (as in torchvision's
``references/detection/coco_utils.py``, ``ConvertCocoPolysToMask``); boxes whose width or height is not
positive after resizing are dropped (the same rule as that reference). Both are counted in ``meta.json``.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
from torchvision.transforms.v2 import functional as TF
from tqdm import tqdm

from stages import params as params_mod
from stages.common import StageError, atomic_dir, atomic_write_json, run_stage
from stages.imageio import decode_rgb

log = logging.getLogger("stages.augment")

ARROW_DIR = Path("data/arrow")
CACHE_DIR = Path("data/cache")
SPLITS = ("train", "val")
SHARD_BYTES = 256 << 20  # pixel bytes per output shard

CACHE_SCHEMA = pa.schema([
    ("image_id", pa.int64()),
    ("height", pa.int32()),
    ("width", pa.int32()),
    ("orig_height", pa.int32()),
    ("orig_width", pa.int32()),
    ("scale_y", pa.float64()),
    ("scale_x", pa.float64()),
    ("pixels", pa.binary()),
    ("boxes", pa.list_(pa.list_(pa.float32(), 4))),
    ("labels", pa.list_(pa.int64())),
])


def target_size(orig_h: int, orig_w: int, cfg: params_mod.Augment) -> tuple[int, int]:
    """Output ``(height, width)`` in pixels for an image of ``orig_h x orig_w`` pixels.

    ``fixed``: ``(size, size)``. ``keep_ratio``: ``floor(orig * s)`` with
    ``s = min(min_size / min(orig_h, orig_w), max_size / max(orig_h, orig_w))``, the rule of torchvision's
    ``GeneralizedRCNNTransform`` (``_resize_image_and_masks`` with ``recompute_scale_factor=True``).
    """
    if cfg.resize == "fixed":
        return cfg.size, cfg.size
    s = min(cfg.min_size / min(orig_h, orig_w), cfg.max_size / max(orig_h, orig_w))
    return max(1, math.floor(orig_h * s)), max(1, math.floor(orig_w * s))


def resize_pixels(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Resize ``(H, W, 3)`` uint8 RGB pixels to ``size = (h, w)`` with bilinear + antialias
    (``torchvision.transforms.v2.functional.resize``). Returns ``(h, w, 3)`` uint8, C-contiguous."""
    if pixels.shape[:2] == tuple(size):
        return np.ascontiguousarray(pixels)
    chw = torch.from_numpy(pixels).permute(2, 0, 1)
    out = TF.resize(chw, list(size), interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
    return out.permute(1, 2, 0).contiguous().numpy()


def transform_boxes(bbox_xywh: np.ndarray, scale_y: float, scale_x: float) -> np.ndarray:
    """COCO ``[x, y, w, h]`` boxes ``(N, 4)`` in original pixels → XYXY ``(N, 4)`` float32 in resized pixels."""
    b = np.asarray(bbox_xywh, dtype=np.float64).reshape(-1, 4)
    xyxy = np.stack([b[:, 0] * scale_x, b[:, 1] * scale_y,
                     (b[:, 0] + b[:, 2]) * scale_x, (b[:, 1] + b[:, 3]) * scale_y], axis=1)
    return xyxy.astype(np.float32)


def process_row(row: dict, cfg: params_mod.Augment) -> tuple[dict, int, int]:
    """Decode, resize and transform one converted row (a dict of `stages.convert` columns).

    Returns ``(cache_row, crowd_excluded, degenerate_dropped)``.
    Raises:
        StageError: the image bytes cannot be decoded (names the file and image id).
    """
    pixels = decode_rgb(row["image"], f"{row['file_name']} (image_id {row['image_id']})")
    oh, ow = pixels.shape[:2]
    h, w = target_size(oh, ow, cfg)
    out = resize_pixels(pixels, (h, w))
    sy, sx = h / oh, w / ow
    bbox = np.asarray(row["bbox"], dtype=np.float32).reshape(-1, 4)
    labels = np.asarray(row["label"], dtype=np.int64)
    crowd = np.asarray(row["iscrowd"], dtype=np.int64).astype(bool)
    xyxy = transform_boxes(bbox[~crowd], sy, sx)
    labels = labels[~crowd]
    keep = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
    cache_row = {
        "image_id": int(row["image_id"]), "height": h, "width": w, "orig_height": oh, "orig_width": ow,
        "scale_y": sy, "scale_x": sx, "pixels": out.tobytes(),
        "boxes": xyxy[keep].tolist(), "labels": labels[keep].tolist(),
    }
    return cache_row, int(crowd.sum()), int((~keep).sum())


def _process_batch(args: tuple[list[dict], params_mod.Augment]) -> list[tuple[dict, int, int]]:
    rows, cfg = args
    torch.set_num_threads(1)
    return [process_row(r, cfg) for r in rows]


def bounded_map(pool: Executor | None, fn: Callable, items: Iterable, window: int) -> Iterator:
    """Like ``map(fn, items)`` in order, on ``pool`` if given, with at most ``window`` tasks in flight, so
    memory stays bounded however long ``items`` is (``Executor.map`` submits every item at once)."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= max(1, window):
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _iter_source_batches(split_dir: Path, rows_per_task: int = 16) -> Iterator[list[dict]]:
    """Yield lists of converted rows (only the columns augment reads), shard by shard, in file order."""
    cols = ["image_id", "file_name", "image", "bbox", "label", "iscrowd"]
    for shard in sorted(split_dir.glob("*.arrow")):
        with pa.memory_map(str(shard)) as src:
            reader = ipc.open_file(src)
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i).select(cols)
                for start in range(0, batch.num_rows, rows_per_task):
                    yield batch.slice(start, rows_per_task).to_pylist()


class _ShardWriter:
    """Writes cache rows into ``part-NNNNN.arrow`` files of at most ~`SHARD_BYTES` pixel bytes."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.index, self.bytes, self.writer, self.shards = out_dir, 0, 0, None, []

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        if self.writer is None or self.bytes >= SHARD_BYTES:
            self.close()
            name = f"part-{self.index:05d}.arrow"
            self.writer = ipc.new_file(str(self.out_dir / name), CACHE_SCHEMA)
            self.shards.append(name)
            self.index += 1
        self.writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=CACHE_SCHEMA))
        self.bytes += sum(len(r["pixels"]) for r in rows)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer, self.bytes = None, 0


def build_cache(arrow_dir: Path, cache_dir: Path, cfg: params_mod.Augment) -> dict:
    """Build the cache for every split in ``arrow_dir`` into ``cache_dir`` (atomically replaced).

    Returns the ``meta.json`` dict: per split the image count, crowd boxes excluded, degenerate boxes dropped
    and shard names; plus the resize settings.
    Raises:
        StageError: missing converted data, or an image that cannot be decoded.
    """
    meta_in = arrow_dir / "meta.json"
    if not meta_in.is_file():
        raise StageError(f"{meta_in}: not found (run the convert stage first)")
    meta = {"resize": cfg.resize, "size": cfg.size, "min_size": cfg.min_size, "max_size": cfg.max_size,
            "pixel_format": "uint8 HWC RGB", "box_format": "XYXY pixels", "splits": {}}
    workers = cfg.workers if cfg.workers > 0 else 0
    with atomic_dir(cache_dir) as tmp:
        pool = ProcessPoolExecutor(workers) if workers else None
        try:
            for split in SPLITS:
                split_dir = arrow_dir / split
                if not split_dir.is_dir():
                    raise StageError(f"{split_dir}: not found (run the convert stage first)")
                (tmp / split).mkdir()
                writer = _ShardWriter(tmp / split)
                counts = {"images": 0, "boxes": 0, "crowd_excluded": 0, "degenerate_dropped": 0}
                tasks = ((rows, cfg) for rows in _iter_source_batches(split_dir))
                results = bounded_map(pool, _process_batch, tasks, window=2 * workers)
                with tqdm(desc=f"augment {split}", unit="img", disable=None) as bar:
                    for out in results:
                        writer.write([r for r, _, _ in out])
                        for r, crowd, degenerate in out:
                            counts["images"] += 1
                            counts["boxes"] += len(r["labels"])
                            counts["crowd_excluded"] += crowd
                            counts["degenerate_dropped"] += degenerate
                        bar.update(len(out))
                writer.close()
                meta["splits"][split] = {**counts, "shards": writer.shards}
                log.info("%s: %s", split, counts)
        finally:
            if pool:
                pool.shutdown(cancel_futures=True)
        atomic_write_json(tmp / "meta.json", meta)
    return meta


def main() -> None:
    cfg = params_mod.load("augment")
    build_cache(ARROW_DIR, CACHE_DIR, cfg)


if __name__ == "__main__":
    run_stage(main)
