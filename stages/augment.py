"""Augment stage: decode every image once, resize it to the training size, cache uint8 pixels in Arrow.

``python -m stages.augment`` reads ``data/arrow/{train,val}/*.arrow`` (see `stages.convert` for that schema)
and writes, per split, ``data/cache/<split>/part-NNNNN.arrow`` (pixels) and ``data/cache/<split>/index.arrow``
(everything but the pixels and masks), plus ``data/cache/meta.json``. The expensive, deterministic work (decode, EXIF
orientation, RGB conversion, resize) is done here once; cheap random augmentation (horizontal flip) is applied
at load time by `detpipe.data.CachedDetectionDataset`.

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

Masks: each kept object's ``segmentation`` (`stages.convert`'s JSON text, in original pixels of the decoded,
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

import json
import logging
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
from pycocotools import mask as mask_utils
from torchvision import tv_tensors
from torchvision.io import encode_jpeg
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF
from tqdm import tqdm

from detpipe import params as params_mod
from detpipe.errors import StageError, run_stage
from detpipe.paths import ARROW_DIR, CACHE_DIR
from detpipe.pool import bounded_map, process_pool
from detpipe.io import atomic_dir, atomic_write_json
from detpipe.imageio import decode_rgb

log = logging.getLogger("stages.augment")

SPLITS = ("train", "val")
INDEX_FILE = "index.arrow"
CACHE_FORMAT = 4  # 3: masks column; 4: encoding (schema metadata), shard_mb
# Fill of the zoom-out canvas: the ImageNet mean in 0..255, as in torchvision's references/detection/presets.py.
ZOOM_OUT_FILL = (123, 117, 104)

CACHE_SCHEMA = pa.schema([
    ("image_id", pa.int64()),
    ("variant", pa.int32()),
    ("height", pa.int32()),
    ("width", pa.int32()),
    ("orig_height", pa.int32()),
    ("orig_width", pa.int32()),
    ("scale_y", pa.float64()),
    ("scale_x", pa.float64()),
    ("offset_y", pa.float64()),
    ("offset_x", pa.float64()),
    ("boxes", pa.list_(pa.list_(pa.float32(), 4))),
    ("labels", pa.list_(pa.int64())),
    ("masks", pa.list_(pa.binary())),
    ("pixels", pa.binary()),
])
INDEX_SCHEMA = pa.schema([f for f in CACHE_SCHEMA if f.name not in ("pixels", "masks")]
                         + [pa.field("has_masks", pa.bool_()), pa.field("shard", pa.string()),
                            pa.field("batch", pa.int32())])


def target_size(orig_h: int, orig_w: int, cfg: params_mod.Augment) -> tuple[int, int]:
    """Output ``(height, width)`` in pixels for an image of ``orig_h x orig_w`` pixels.

    ``fixed``: ``(size, size)``. ``keep_ratio``: with ``s = min(min_size / short, max_size / long)`` (torchvision's
    ``GeneralizedRCNNTransform`` rule), the limiting side becomes exactly ``min_size`` (or ``max_size``) and the
    other ``floor(side * s)`` (at least 1), so the model's transform computes ``s = 1`` on the result and does not
    resize again (see the module docstring). With ``cfg.upscale`` false and ``s > 1``: ``(orig_h, orig_w)``.
    """
    if cfg.resize == "fixed":
        return cfg.size, cfg.size
    short, long_ = min(orig_h, orig_w), max(orig_h, orig_w)
    s_short, s_long = cfg.min_size / short, cfg.max_size / long_
    s = min(s_short, s_long)
    if s > 1 and not getattr(cfg, "upscale", True):
        return orig_h, orig_w
    out = [max(1, math.floor(orig_h * s)), max(1, math.floor(orig_w * s))]
    short_i, long_i = (0, 1) if orig_h <= orig_w else (1, 0)
    if s_short <= s_long:
        out[short_i] = cfg.min_size
        out[long_i] = min(out[long_i], cfg.max_size)
    if s_long <= s_short:
        out[long_i] = cfg.max_size
        out[short_i] = min(out[short_i], cfg.min_size)
    return out[0], out[1]


def resize_pixels(pixels: np.ndarray | torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """Resize uint8 RGB pixels, an ``(H, W, 3)`` array or a ``(3, H, W)`` tensor, to ``size = (h, w)`` with bilinear
    interpolation and antialias (``torchvision.transforms.v2.functional.resize``).

    Returns ``(3, h, w)`` uint8, C-contiguous (planar CHW, the cache's pixel layout).
    """
    chw = pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(np.asarray(pixels)).permute(2, 0, 1)
    chw = chw.as_subclass(torch.Tensor)
    if tuple(chw.shape[-2:]) != tuple(size):
        chw = TF.resize(chw, list(size), interpolation=T.InterpolationMode.BILINEAR, antialias=True)
    return chw.contiguous().numpy()


def encode_pixels(chw: np.ndarray, cfg: params_mod.Augment) -> bytes:
    """The ``pixels`` cell for a ``(3, h, w)`` uint8 image: its raw bytes, or with ``cfg.encoding == "jpeg"`` a
    JPEG at ``cfg.jpeg_quality`` (``torchvision.io.encode_jpeg``: libjpeg-turbo, 4:2:0, deterministic)."""
    if getattr(cfg, "encoding", "raw") == "raw":
        return chw.tobytes()
    return encode_jpeg(torch.from_numpy(np.ascontiguousarray(chw)), quality=cfg.jpeg_quality).numpy().tobytes()


def coco_to_xyxy(bbox_xywh: np.ndarray, height: int, width: int) -> np.ndarray:
    """COCO ``[x, y, w, h]`` boxes ``(N, 4)`` in pixels → XYXY ``(N, 4)`` float64, clamped to the
    ``height x width`` image (as torchvision's ``ConvertCocoPolysToMask``)."""
    b = np.asarray(bbox_xywh, dtype=np.float64).reshape(-1, 4)
    xyxy = np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], axis=1)
    xyxy[:, 0::2] = xyxy[:, 0::2].clip(0, width)
    xyxy[:, 1::2] = xyxy[:, 1::2].clip(0, height)
    return xyxy


def valid_boxes(xyxy: np.ndarray) -> np.ndarray:
    """``(N,)`` bool: boxes ``(N, 4)`` XYXY with positive width and height."""
    return (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])


def variant_seed(seed: int, image_id: int, k: int) -> int:
    """The torch seed (uint64) of variant ``k`` of image ``image_id`` under ``augment.seed = seed``
    (``numpy.random.SeedSequence`` of the three, so nearby inputs give unrelated streams)."""
    return int(np.random.SeedSequence([seed % 2**64, image_id % 2**64, k]).generate_state(1, np.uint64)[0])


class _RecordParams:
    """Mixin for a torchvision v2 transform: keeps the parameters of its last call in ``last_params``
    (None when a random-apply transform was skipped)."""

    last_params: dict | None = None

    def forward(self, *inputs):
        self.last_params = None
        return super().forward(*inputs)

    def make_params(self, flat_inputs):
        self.last_params = super().make_params(flat_inputs)
        return self.last_params


class _ZoomOut(_RecordParams, T.RandomZoomOut):
    pass


class _IoUCrop(_RecordParams, T.RandomIoUCrop):
    pass


def ssd_variant(chw: torch.Tensor, boxes: np.ndarray, labels: np.ndarray, seed: int):
    """One SSD-style random variant (torchvision ``references/detection/presets.py``, ``"ssd"``) of an image.

    Args:
        chw: ``(3, H, W)`` uint8 RGB image.
        boxes: ``(N, 4)`` XYXY boxes in its pixels (valid: positive width and height).
        labels: ``(N,)`` int64.
        seed: torch seed for this variant (`variant_seed`); the global torch RNG is left untouched.
    Returns:
        ``(image (3, h, w) uint8, boxes (M, 4) float32, labels (M,) int64, (offset_y, offset_x), kept (M,) int64)``
        where ``offset`` is the original-pixel coordinate of the variant's pixel (0, 0) (whole pixels) and
        ``kept`` the indices into ``boxes`` of the M objects that survive (in order); ``M <= N``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        image = tv_tensors.Image(chw)
        bb = tv_tensors.BoundingBoxes(torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4), format="XYXY",
                                      canvas_size=tuple(chw.shape[-2:]))
        image = T.RandomPhotometricDistort()(image)
        zoom, crop = _ZoomOut(fill=ZOOM_OUT_FILL), _IoUCrop()
        image, bb = zoom(image, bb)
        offset_y = offset_x = 0.0
        if zoom.last_params is not None:
            left, top = zoom.last_params["padding"][:2]
            offset_y, offset_x = -float(top), -float(left)
        if len(bb):  # RandomIoUCrop needs at least one box to aim at
            image, bb = crop(image, bb)
            if crop.last_params:
                offset_y += crop.last_params["top"]
                offset_x += crop.last_params["left"]
        sample = {"image": image, "boxes": bb, "labels": torch.as_tensor(labels, dtype=torch.int64),
                  "kept": torch.arange(len(labels), dtype=torch.int64)}
        out = T.SanitizeBoundingBoxes(labels_getter=lambda d: (d["labels"], d["kept"]))(sample)
    return (out["image"].as_subclass(torch.Tensor), out["boxes"].as_subclass(torch.Tensor).numpy(),
            out["labels"].numpy(), (offset_y, offset_x), out["kept"].numpy())


def parse_segmentation(text: str | None, source: str = "") -> list | dict | None:
    """A `stages.convert` ``segmentation`` cell (JSON text) as COCO polygons (list of lists) or an RLE dict;
    None when the object has no segmentation (``""``, ``null``, ``[]``, ``{}``).

    Raises:
        StageError: the text is not JSON, or neither polygons nor an RLE dict with ``size`` and ``counts``
        (names ``source``: file, image and annotation id).
    """
    if not text:
        return None
    try:
        seg = json.loads(text) if isinstance(text, (str, bytes)) else text
    except json.JSONDecodeError as e:
        raise StageError(f"{source}: segmentation is not valid JSON ({e})") from None
    if not seg:
        return None
    if isinstance(seg, list) and all(isinstance(p, list) for p in seg):
        return seg
    if isinstance(seg, dict) and "size" in seg and "counts" in seg:
        return seg
    raise StageError(f"{source}: segmentation is neither COCO polygons nor an RLE dict with 'size' and 'counts' "
                     f"(rule: COCO segmentation format)")


def rasterize_mask(seg: list | dict, orig_size: tuple[int, int], src_size: tuple[int, int],
                   offset: tuple[float, float], out_size: tuple[int, int], source: str = "") -> bytes:
    """One object's COCO segmentation (original pixels) as a mask of the cached image, compressed-RLE encoded.

    The cached image is the source canvas ``src_size = (sh, sw)`` (the decoded image, or an SSD variant of it whose
    pixel ``(0, 0)`` is original pixel ``offset = (oy, ox)``, whole pixels) resized to ``out_size = (h, w)``:
    ``cached = (orig - offset) * (h / sh, w / sw)``.

    * Polygons: every point is mapped by that formula and the polygons are rasterized at ``(h, w)`` with
      ``pycocotools.mask.frPyObjects`` + ``merge`` (which clips to the canvas); polygons with < 6 numbers are
      skipped (no area; ``frPyObjects`` would read 4 numbers as a box).
    * RLE (compressed or uncompressed; ``size`` must be ``orig_size``): decoded, translated onto the source
      canvas, resized as float32 with bilinear interpolation and antialias (``torchvision.transforms.v2``) and
      kept where ``>= 0.5``.

    Args:
        seg: `parse_segmentation`'s output (not None).
        orig_size, src_size, out_size: ``(height, width)`` in pixels.
        offset: ``(offset_y, offset_x)`` in original pixels.
        source: names the file/record in errors.
    Returns:
        ``counts`` (bytes) of the pycocotools compressed RLE of the ``(h, w)`` uint8 mask (column-major, as
        ``pycocotools.mask.encode``); decode with ``{"size": [h, w], "counts": counts}``.
    Raises:
        StageError: an RLE whose ``size`` is not ``orig_size``, or malformed polygons/RLE.
    """
    (oh, ow), (sh, sw), (h, w) = orig_size, src_size, out_size
    oy, ox = offset
    sy, sx = h / sh, w / sw
    try:
        if isinstance(seg, list):
            polys = []
            for p in seg:
                if len(p) < 6:
                    continue
                xy = np.asarray(p, dtype=np.float64)[: len(p) // 2 * 2].reshape(-1, 2)
                xy = (xy - [ox, oy]) * [sx, sy]
                polys.append(xy.reshape(-1).tolist())
            if not polys:
                return mask_utils.encode(np.zeros((h, w, 1), dtype=np.uint8, order="F"))[0]["counts"]
            return mask_utils.merge(mask_utils.frPyObjects(polys, h, w))["counts"]
        size = [int(v) for v in seg["size"]]
        if size != [oh, ow]:
            raise StageError(f"{source}: segmentation RLE size {size} != image [height, width] [{oh}, {ow}] "
                             f"(rule: an RLE covers its whole image)")
        rle = mask_utils.frPyObjects(seg, oh, ow) if isinstance(seg["counts"], list) else seg
        m = torch.from_numpy(mask_utils.decode(rle))
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - malformed polygons / RLE from the data
        raise StageError(f"{source}: segmentation is not valid COCO polygons/RLE ({type(e).__name__}: {e})") from None
    if (sh, sw) != (oh, ow) or oy or ox:
        canvas = torch.zeros((sh, sw), dtype=torch.uint8)
        y0, x0 = int(round(oy)), int(round(ox))  # canvas pixel (r, c) is original pixel (r + y0, c + x0)
        r0, r1 = max(0, -y0), min(sh, oh - y0)
        c0, c1 = max(0, -x0), min(sw, ow - x0)
        if r1 > r0 and c1 > c0:
            canvas[r0:r1, c0:c1] = m[r0 + y0:r1 + y0, c0 + x0:c1 + x0]
        m = canvas
    if (sh, sw) != (h, w):
        m = TF.resize(m[None].float(), [h, w], interpolation=T.InterpolationMode.BILINEAR, antialias=True)[0] >= 0.5
    return mask_utils.encode(np.asfortranarray(m.numpy().astype(np.uint8)))["counts"]


def process_image(row: dict, cfg: params_mod.Augment, copies: int) -> tuple[list[dict], dict]:
    """Decode one converted row (a dict of `stages.convert` columns) and make its cache rows.

    ``copies == 0``: one row, the plain resize. ``copies == K > 0``: K rows, variant ``k`` = `ssd_variant` with
    seed `variant_seed` ``(cfg.seed, image_id, k)``, then resized. Each row's ``masks`` (`rasterize_mask` per
    kept object) is None when the row has no ``segmentation`` column or one of its objects has none.
    Returns ``(rows, counts)``; rows are `CACHE_SCHEMA` dicts, counts has ``crowd_excluded``,
    ``degenerate_dropped``, ``crop_dropped`` (summed over the rows).
    Raises:
        StageError: the image bytes cannot be decoded, or a segmentation is malformed (names the file, image id
        and annotation id).
    """
    image_id = int(row["image_id"])
    where = f"{row['file_name']} (image_id {image_id})"
    pixels = decode_rgb(row["image"], where)
    oh, ow = pixels.shape[:2]
    labels = np.asarray(row["label"], dtype=np.int64)
    crowd = np.asarray(row["iscrowd"], dtype=np.int64).astype(bool)
    xyxy = coco_to_xyxy(np.asarray(row["bbox"], dtype=np.float64), oh, ow)[~crowd]
    labels = labels[~crowd]
    keep = valid_boxes(xyxy)
    counts = {"crowd_excluded": int(crowd.sum()), "degenerate_dropped": int((~keep).sum()), "crop_dropped": 0}
    xyxy, labels = xyxy[keep], labels[keep]
    segs = None
    if row.get("segmentation") is not None:
        ann_ids = row.get("ann_id") or [None] * len(crowd)
        objs = [(t, a) for t, a, c in zip(row["segmentation"], ann_ids, crowd) if not c]
        segs = [(parse_segmentation(t, f"{where}, annotation id {a}"), f"{where}, annotation id {a}")
                for (t, a), k in zip(objs, keep) if k]

    chw = torch.from_numpy(pixels).permute(2, 0, 1)
    if copies == 0:
        sources = [(0, chw, xyxy, labels, (0.0, 0.0), np.arange(len(labels)))]
    else:
        sources = []
        for k in range(copies):
            img, b, lab, offset, kept = ssd_variant(chw, xyxy, labels, variant_seed(cfg.seed, image_id, k))
            counts["crop_dropped"] += len(labels) - len(lab)
            sources.append((k, img, b, lab, offset, kept))

    rows = []
    for k, img, b, lab, (off_y, off_x), kept in sources:
        sh, sw = img.shape[-2:]
        h, w = target_size(sh, sw, cfg)
        sy, sx = h / sh, w / sw
        b = np.asarray(b, dtype=np.float64).reshape(-1, 4) * np.array([sx, sy, sx, sy])
        ok = valid_boxes(b)
        counts["degenerate_dropped"] += int((~ok).sum())
        masks = None
        if segs is not None:
            objs = [segs[j] for j, o in zip(kept, ok) if o]
            if all(seg is not None for seg, _ in objs):
                masks = [rasterize_mask(seg, (oh, ow), (sh, sw), (off_y, off_x), (h, w), src) for seg, src in objs]
        rows.append({
            "image_id": image_id, "variant": k, "height": h, "width": w, "orig_height": oh, "orig_width": ow,
            "scale_y": sy, "scale_x": sx, "offset_y": off_y, "offset_x": off_x,
            "boxes": b[ok].astype(np.float32).tolist(), "labels": np.asarray(lab, dtype=np.int64)[ok].tolist(),
            "masks": masks, "pixels": encode_pixels(resize_pixels(img, (h, w)), cfg),
        })
    return rows, counts


def _process_batch(args: tuple[list[dict], params_mod.Augment, int]) -> list[tuple[list[dict], dict]]:
    rows, cfg, copies = args
    torch.set_num_threads(1)
    return [process_image(r, cfg, copies) for r in rows]


def _iter_source_batches(split_dir: Path, rows_per_task: int = 8) -> Iterator[list[dict]]:
    """Yield lists of converted rows (only the columns augment reads), shard by shard, in file order."""
    cols = ["image_id", "file_name", "image", "bbox", "label", "iscrowd"]
    optional = ["ann_id", "segmentation"]  # masks (and annotation ids for error messages) when present
    for shard in sorted(split_dir.glob("*.arrow")):
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


class _ShardWriter:
    """Writes cache rows, one record batch each, into ``part-NNNNN.arrow`` files of about ``shard_bytes`` stored
    pixel bytes (a new shard starts only between images), and collects the index rows."""

    def __init__(self, out_dir: Path, shard_bytes: int = 32 * 10**6, encoding: str = "raw"):
        self.out_dir, self.index, self.bytes, self.writer, self.batch = out_dir, 0, 0, None, 0
        self.shard_bytes = shard_bytes
        self.schema = CACHE_SCHEMA.with_metadata({"encoding": encoding})
        self.shards: list[str] = []
        self.index_rows: list[dict] = []

    def write_image(self, rows: list[dict]) -> None:
        """Write one image's rows (its variants) into the current shard, starting a new one first if full."""
        if self.writer is None or self.bytes >= self.shard_bytes:
            self.close()
            name = f"part-{self.index:05d}.arrow"
            self.writer = ipc.new_file(str(self.out_dir / name), self.schema)
            self.shards.append(name)
            self.index += 1
        for row in rows:
            self._write(row)

    def _write(self, row: dict) -> None:
        arrays = [pa.array([row[f.name]], type=f.type) for f in CACHE_SCHEMA]
        self.writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.index_rows.append({**{k: v for k, v in row.items() if k not in ("pixels", "masks")},
                                "has_masks": row["masks"] is not None, "shard": self.shards[-1],
                                "batch": self.batch})
        self.batch += 1
        self.bytes += len(row["pixels"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer, self.bytes, self.batch = None, 0, 0

    def write_index(self, path: Path) -> None:
        """Write the collected index rows as one Arrow IPC file (`INDEX_SCHEMA`)."""
        cols = {f.name: [r[f.name] for r in self.index_rows] for f in INDEX_SCHEMA}
        arrays = [pa.array(cols[f.name], type=f.type) for f in INDEX_SCHEMA]
        schema = INDEX_SCHEMA.with_metadata(self.schema.metadata)
        with ipc.new_file(str(path), schema) as w:
            w.write_table(pa.Table.from_arrays(arrays, schema=schema))


def build_cache(arrow_dir: Path, cache_dir: Path, cfg: params_mod.Augment) -> dict:
    """Build the cache for every split in ``arrow_dir`` into ``cache_dir`` (atomically replaced).

    The output depends only on the converted data and ``cfg`` minus ``workers`` (each variant has its own
    seed), so any number of workers gives the same bytes.
    Returns the ``meta.json`` dict: per split the image and row counts, boxes kept, crowd boxes excluded,
    degenerate boxes dropped, boxes dropped by crops, masks stored, rows without masks, and shard names; plus the
    resize and copy settings and ``masks`` (true when every row has its objects' masks and there is one at least).
    Raises:
        StageError: missing converted data, an image that cannot be decoded, a malformed segmentation.
    """
    meta_in = Path(arrow_dir) / "meta.json"
    if not meta_in.is_file():
        raise StageError(f"{meta_in}: not found (run the convert stage first)")
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
                writer = _ShardWriter(tmp / split, int(cfg.shard_mb * 10**6), cfg.encoding)
                counts = {"images": 0, "rows": 0, "boxes": 0, "crowd_excluded": 0, "degenerate_dropped": 0,
                          "crop_dropped": 0, "masks": 0, "rows_without_masks": 0}
                tasks = ((rows, cfg, copies) for rows in _iter_source_batches(split_dir))
                results = bounded_map(pool, _process_batch, tasks, window=2 * workers)
                with tqdm(desc=f"augment {split}", unit="img", disable=None) as bar:
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
                        bar.update(len(out))
                writer.close()
                writer.write_index(tmp / split / INDEX_FILE)
                meta["splits"][split] = {**counts, "copies": copies, "shards": writer.shards}
                log.info("%s: %s", split, counts)
        splits = meta["splits"].values()
        meta["masks"] = all(c["rows_without_masks"] == 0 for c in splits) and sum(c["masks"] for c in splits) > 0
        atomic_write_json(tmp / "meta.json", meta)
    return meta


def main() -> None:
    cfg = params_mod.load("augment")
    build_cache(ARROW_DIR, CACHE_DIR, cfg)


if __name__ == "__main__":
    run_stage(main)
