"""Building the augmentation cache: decode every image once, resize it to the training size and store it in Arrow
(re-encoded as JPEG by default, or raw uint8 pixels): the augment stage's work (`build_cache`).

``python -m stages.augment`` calls it with params section ``augment``: it reads the shards ``data/arrow/meta.json``
lists (`detpipe.data.meta.arrow_shards`; see `detpipe.data.convert` for their schema) and writes, per split,
``data/cache/<split>/part-NNNNN.arrow`` (pixels) and ``data/cache/<split>/index.arrow`` (everything but the pixels
and masks), plus ``data/cache/meta.json``. The expensive, deterministic work (decode, EXIF orientation, RGB
conversion, resize) is done here once; cheap random augmentation (horizontal flip) is applied at load time by
`detpipe.data.dataset.CachedDetectionDataset`.

Cache layout (Arrow IPC *file* format, uncompressed, so shards can be memory-mapped or read by byte range):

* ``part-NNNNN.arrow``: `CACHE_SCHEMA`, **one record batch per row** (so a single image can be read from
  object storage with one ranged read), about ``augment.shard_mb`` MB of stored pixel bytes per shard (default 32:
  tens of MB, so training can stream whole shards from object storage); an image's variants never straddle two
  shards.
* ``index.arrow``: `INDEX_SCHEMA` = `CACHE_SCHEMA` without ``pixels`` and ``masks``, plus ``has_masks``, ``shard``
  (file name) and ``batch`` (record batch number inside that shard). The loader reads only this file at start-up.

============== ================================= ==========================================================
column         type                              meaning
============== ================================= ==========================================================
image_id       int64                             COCO image id
variant        int32                             0 without copies; 0..K-1 with ``augment.copies: K``
height, width  int32                             cached pixel size (after resize)
orig_height    int32                             decoded size in pixels before resize (after EXIF
orig_width     int32                             orientation) — the frame of the COCO annotations
scale_y        float64                           cached pixels per original pixel, per axis
scale_x        float64
offset_y       float64                           original-pixel coordinate of cached pixel 0 (0 unless
offset_x       float64                           a crop / zoom-out variant): ``orig = cached / scale + offset``
boxes          list<fixed_size_list<float32,4>>  non-crowd boxes, XYXY, cached pixels
labels         list<int64>                       contiguous labels (1..K; 0 is background)
masks          list<binary> (nullable)           per object of ``boxes`` (same order), its instance mask at the
                                                 cached size as the ``counts`` of a pycocotools compressed
                                                 RLE (``{"size": [height, width], "counts": ...}``, column-
                                                 major); null when an object of the row has no segmentation
pixels         binary                            ``encoding: raw``: ``3 * height * width`` bytes, uint8, CHW
                                                 (planar), RGB; ``encoding: jpeg``: a baseline JPEG of that
                                                 image (``torchvision.io.encode_jpeg``, ``augment.jpeg_quality``)
============== ================================= ==========================================================

Both files carry the Arrow schema metadata ``encoding`` (``raw`` or ``jpeg``), which the loader follows.

Encoding (``augment.encoding``): ``jpeg`` (default) re-encodes each resized image at ``jpeg_quality`` (90): on
COCO128 the cache is 0.20x the source JPEG bytes at ``fixed 320`` (raw: 1.79x) and decoding it at load time
(``torchvision.io.decode_jpeg``, batched) still runs many times faster than training consumes images
(``benchmarks/cache_size.py``). Pixels then differ from the raw cache by JPEG's loss (a few levels on
average); boxes, labels, masks, variants and scales are identical. The original file bytes are never reused
as they are: a re-encode at quality 90 of the same pixels is ~0.56x the COCO source bytes, smaller, and it
keeps one decoder path and EXIF orientation already applied.

``augment.upscale: false`` (keep_ratio): an image the rule would enlarge is stored at its original size
(scale 1); the model's own transform enlarges it per step. At ``keep_ratio 800/1333`` with ``jpeg`` this keeps
the cache at 0.56x the source bytes instead of 1.15x (COCO images are ~640x480, all enlarged).

``index.arrow`` also has ``has_masks`` (bool): the row's ``masks`` is not null (every object has a mask; true for
an image without objects). ``meta.json`` says ``"masks": true`` when every row of every split has masks and there
is at least one; per split it counts ``masks`` (stored) and ``rows_without_masks``.

Rows are image-major: an image's K variants are consecutive rows, variant 0 first.

Resize modes (``augment.resize``), chosen to match what the model's own transform does so it does not
resize a second time:

* ``fixed``: ``size x size`` pixels, aspect ratio not kept — what torchvision's SSD/SSDlite transform does
  (``GeneralizedRCNNTransform(fixed_size=(320, 320))`` for ``ssdlite320_mobilenet_v3_large``).
* ``keep_ratio``: scale ``s = min(min_size / short_side, max_size / long_side)`` — the rule of
  ``torchvision.models.detection.transform._resize_image_and_masks`` (Faster R-CNN, RetinaNet, FCOS) — with the
  limiting side set to exactly ``min_size`` (or ``max_size``) and the other side ``floor(side * s)``. That makes the
  cached size a fixed point of the model's rule (it computes ``s = 1`` on it); torchvision's own
  ``floor(side * s)`` of the limiting side can land one pixel short in floating point (e.g. 640x638 at
  320/512 gives 321x319), and the model would then resize again.

Boxes: ``iscrowd`` objects are not training targets, boxes are clamped to the image and those whose width or
height is not positive are dropped — the rules of torchvision's ``references/detection/coco_utils.py``
(``ConvertCocoPolysToMask``); the same positivity rule is applied again after resizing. All are counted in
``meta.json``.

Masks: each kept object's ``segmentation`` (`detpipe.data.convert`'s JSON text, in original pixels of the decoded,
EXIF-oriented image) is rasterized at the cached size with ``pycocotools.mask``. Polygons are mapped to the cached
frame (``cached = (orig - offset) * scale``) and rasterized there with ``frPyObjects`` + ``merge`` (exact for
polygons, and cheap); polygons with fewer than 3 points (< 6 numbers) enclose nothing and are skipped
(``frPyObjects`` would read a 4-number one as a box). RLE masks (compressed or uncompressed, ``size`` must be the
original ``[height, width]``) are decoded, translated by the variant's offset, resized with bilinear interpolation
and antialias as float and kept where ``>= 0.5`` (the pixel is at least half covered). An object without a
segmentation (``""``, ``[]``) makes the row's ``masks`` null; box-only models never read the column.

Copies (``augment.copies: K > 0``, train split only; val is never augmented): each image is stored K times,
variant ``k`` drawn deterministically from ``(augment.seed, image_id, k)`` by the SSD augmentation of
torchvision's ``references/detection/presets.py`` (``data_augmentation="ssd"``), applied to the decoded original
before the final resize: ``RandomPhotometricDistort()``, ``RandomZoomOut(fill=(123, 117, 104))``,
``RandomIoUCrop()``, ``SanitizeBoundingBoxes()`` (torchvision.transforms.v2; an image without boxes gets no IoU
crop, which needs boxes to aim at). Boxes removed by the crop are counted as ``crop_dropped``. Zoom-out and
IoU crop only translate the image (by whole pixels) and change its canvas, so masks follow them exactly through the
recorded offset (see Masks above), and an object removed by ``SanitizeBoundingBoxes`` loses its mask too. The
loader picks variant ``(epoch + seed) mod K`` and flips at load time.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from detpipe.core.pool import bounded_map, process_pool
from detpipe.core.files import atomic_dir, atomic_write_json
from detpipe.data.augmentation import process_batch
from detpipe.data.cache_format import CACHE_FORMAT, INDEX_FILE, SPLITS, ZOOM_OUT_FILL, ShardWriter
from detpipe.data.meta import arrow_shards, read_meta
from detpipe.core.progress import Progress

log = logging.getLogger(__name__)


def iter_source_batches(shards: list[Path], rows_per_task: int = 8) -> Iterator[list[dict]]:
    """Yield lists of at most ``rows_per_task`` converted rows (dicts of only the columns augment reads), from the
    Arrow shards ``shards`` (`detpipe.data.meta.arrow_shards`) in order, each in file order.
    Raises `StageError` naming the shard when it is not a readable Arrow IPC file or lacks a column."""
    cols = ["image_id", "file_name", "image", "bbox", "label", "iscrowd"]
    optional = ["ann_id", "segmentation"]  # masks (and annotation ids for error messages) when present
    for shard in shards:
        with pa.memory_map(str(shard)) as src:
            try:
                reader = ipc.open_file(src)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    missing = [c for c in cols if c not in batch.schema.names]
                    if missing:
                        raise StageError(f"{shard}: missing column(s) {missing} (re-run the convert stage)")
                    batch = batch.select(cols + [c for c in optional if c in batch.schema.names])
                    for start in range(0, batch.num_rows, rows_per_task):
                        yield batch.slice(start, rows_per_task).to_pylist()
            except pa.ArrowInvalid as e:
                raise StageError(f"{shard}: not a readable Arrow IPC file ({e})") from None


def build_cache(arrow_dir: Path | str, cache_dir: Path | str, cfg: params_mod.Augment) -> dict:
    """Build the cache for every split in ``arrow_dir`` (`detpipe.data.convert`'s output) into ``cache_dir``
    (atomically replaced: on any error it is left as it was), with params section ``augment`` ``cfg``.

    The output depends only on the converted data and ``cfg`` minus ``workers`` (each variant has its own
    seed), so any number of workers gives the same bytes.
    Returns the ``meta.json`` dict: per split the image and row counts, boxes kept, crowd boxes excluded,
    degenerate boxes dropped, boxes dropped by crops, masks stored, rows without masks, and shard names; plus the
    resize and copy settings and ``masks`` (true when every row has its objects' masks and there is one at least).
    Progress (images per split) goes to `detpipe.core.progress.Progress`: a bar on a terminal, a log line every 30 s
    elsewhere.
    Raises:
        StageError: missing converted data, an image that cannot be decoded, a malformed segmentation.
    """
    arrow_meta = read_meta(Path(arrow_dir) / "meta.json", "convert")
    meta = {"format": CACHE_FORMAT, "resize": cfg.resize, "size": cfg.size, "min_size": cfg.min_size,
            "max_size": cfg.max_size, "upscale": cfg.upscale, "copies": cfg.copies, "seed": cfg.seed,
            "encoding": cfg.encoding, "jpeg_quality": cfg.jpeg_quality if cfg.encoding == "jpeg" else None,
            "shard_mb": cfg.shard_mb,
            "augmentation": ("torchvision.transforms.v2 RandomPhotometricDistort, RandomZoomOut(fill="
                             f"{list(ZOOM_OUT_FILL)}), RandomIoUCrop, SanitizeBoundingBoxes (train split)"
                             if cfg.copies else "none"),
            "pixel_format": "uint8 CHW RGB" if cfg.encoding == "raw" else "JPEG (decodes to uint8 RGB)",
            "box_format": "XYXY pixels",
            "mask_format": "pycocotools compressed RLE counts at the cached size, one per box", "masks": False,
            "index": INDEX_FILE, "splits": {}}
    workers = max(0, cfg.workers)
    with atomic_dir(cache_dir) as tmp:
        with process_pool(workers) as pool:
            for split in SPLITS:
                split_dir = Path(arrow_dir) / split
                if not split_dir.is_dir():
                    raise StageError(f"{split_dir}: not found (run the convert stage first)")
                copies = cfg.copies if split == "train" else 0
                (tmp / split).mkdir()
                writer = ShardWriter(tmp / split, int(cfg.shard_mb * 10**6), cfg.encoding)
                counts = {"images": 0, "rows": 0, "boxes": 0, "crowd_excluded": 0, "degenerate_dropped": 0,
                          "crop_dropped": 0, "masks": 0, "rows_without_masks": 0}
                shards = arrow_shards(split_dir, arrow_meta)
                tasks = ((rows, cfg, copies) for rows in iter_source_batches(shards))
                results = bounded_map(pool, process_batch, tasks, window=2 * workers)
                with Progress(arrow_meta["splits"][split].get("images"), f"augment {split}", unit="image") as bar:
                    for out in results:
                        for rows, c in out:
                            writer.write_image(rows)
                            for r in rows:
                                counts["boxes"] += len(r["labels"])
                                counts["masks"] += len(r["masks"] or ())
                                counts["rows_without_masks"] += r["masks"] is None
                            counts["images"] += 1
                            counts["rows"] += len(rows)
                            for k, v in c.items():
                                counts[k] += v
                        bar.update(len(out), images=len(out))
                writer.close()
                writer.write_index(tmp / split / INDEX_FILE)
                meta["splits"][split] = {**counts, "copies": copies, "shards": writer.shards}
                log.info("%s: %s", split, counts)
        splits = meta["splits"].values()
        meta["masks"] = all(c["rows_without_masks"] == 0 for c in splits) and sum(c["masks"] for c in splits) > 0
        atomic_write_json(tmp / "meta.json", meta)
    return meta
