"""Convert stage: COCO instances JSON + image files -> Apache Arrow IPC shards, with a validation report.

Run from the repository root: ``python -m stages.convert`` (params section ``convert``; reads ``data/raw``,
writes ``data/arrow``). The core is `convert` (explicit paths, no dependence on the working directory).

Output (written into a temporary folder beside ``data/arrow`` and renamed at the end, so a failed or
interrupted run leaves the previous output untouched and no half-written shard)::

    data/arrow/train/part-00000.arrow ...   Arrow IPC *file* format (memory-mappable: pa.memory_map +
    data/arrow/val/part-00000.arrow ...     pa.ipc.open_file), uncompressed, record batches of ~16 MiB
    data/arrow/meta.json                    categories, label map, split sizes and shard lists
    data/arrow/report.json                  validation counts per rule with the first 5 examples each

Schema (one row per image; later stages read columns by name):

=================  ==================================  ==================================================
column             Arrow type                          meaning
=================  ==================================  ==================================================
``image_id``       int64                               COCO image id (full int64 range survives)
``file_name``      string                              as in the JSON (relative to the image folder)
``width``          int32                               pixels, of the image as `detpipe.imageio.decode_rgb`
``height``         int32                               returns it (i.e. after EXIF orientation)
``image``          binary                              the original encoded file bytes, unmodified
``ann_id``         list<int64>                         COCO annotation ids
``bbox``           list<fixed_size_list<float32, 4>>   COCO [x, y, w, h], pixels, in the decode_rgb frame,
                                                       clipped to the image
``category_id``    list<int64>                         COCO category id, as given
``label``          list<int64>                         1..K by ascending category id (0 = background, as
                                                       torchvision detection models expect)
``iscrowd``        list<int8>                          0/1 (0 if missing)
``area``           list<float64>                       as given (COCO: segment area, pixels^2); computed if
                                                       missing
``segmentation``   list<string>                        JSON text of the polygons / RLE as given
                                                       ("" if absent)
=================  ==================================  ==================================================

The per-object lists have the same length within a row; images without objects have empty lists (negatives).
Rows within a split are in ascending ``image_id`` order.

``meta.json``: ``{"categories": [...as given...], "category_id_to_label": {"<id>": label}, "label_names":
["__background__", name_1, ...], "num_classes": K + 1, "splits": {"train": {"images": n, "annotations": m,
"shards": ["train/part-00000.arrow", ...]}, "val": {...}}, "annotations_file": ..., "val_annotations_file":
..., "val_fraction": ..., "seed": ...}`` (shard paths relative to ``data/arrow``).

Split: without ``val_annotations`` the unique image ids of the one file are sorted, permuted with
``numpy.random.default_rng(seed).permutation`` and the first ``round(n * val_fraction)`` go to val (`split_ids`).
With ``val_annotations`` (images in ``val_images``, default ``images``) that file is the val split,
``val_fraction`` is ignored, and its categories must equal the train file's (same ids and names) or the stage
fails.

EXIF orientation: ``decode_rgb`` applies the EXIF orientation, so ``width``/``height`` and the boxes are stored
in that displayed frame. COCO's JSON describes the stored raster (its annotation tool showed images without
applying EXIF orientation), so when the JSON width/height equal the stored raster's size, boxes, polygons and
RLE masks are mapped to the displayed frame (``fixed``); when they instead equal the displayed size of a
90-degree-rotated image, the annotations are taken as already displayed-frame (``kept``). The encoded bytes are
never modified.

Validation rules (``report.json`` counts each with the first 5 examples: split, file, record, detail; each
dropped record is counted under the first rule it breaks; ``convert.strict: true`` turns every rule below into a
``StageError`` naming the file, the record and the rule):

==========================  =======  ===============================================================
rule                        action   what
==========================  =======  ===============================================================
duplicate_image_id          dropped  image id already seen (in this file; for a val file, also train's);
                                     the first record is kept
duplicate_annotation_id     dropped  annotation id already seen in the same file; the first is kept
annotation_unknown_image    dropped  annotation whose image_id matches no image record
image_missing               dropped  image file not found; dropped with its annotations
image_unreadable            dropped  file does not decode (not an image, truncated, corrupt); dropped with
                                     its annotations
image_size_mismatch         dropped  decoded size differs from JSON width/height (neither the stored nor the
                                     EXIF-oriented size); dropped with its annotations
exif_orientation            fixed    EXIF orientation 2..8: annotations mapped to the displayed frame, or
                                     kept if the JSON is already in it (see above)
grayscale                   kept     1/L/LA/I;16/I/F mode; decode_rgb converts to RGB
cmyk                        kept     CMYK (or YCCK) JPEG; decode_rgb converts to RGB
palette                     kept     P/PA mode; decode_rgb converts to RGB
high_bit_depth              kept     16/32-bit samples (also 16-bit RGB PNG); decode_rgb scales to 8 bit
alpha                       kept     alpha channel or transparency; decode_rgb drops it
image_no_annotations        kept     no annotations (in the JSON, or all dropped): kept as a negative
category_unknown            dropped  category_id not in categories
bbox_not_finite             dropped  bbox holds NaN or +-Infinity
bbox_nonpositive            dropped  bbox width or height <= 0
bbox_outside                dropped  bbox does not overlap the image
bbox_clipped                fixed    bbox partly outside the image: clipped to [0, width] x [0, height]
iscrowd_missing             fixed    iscrowd missing or null: set to 0
area_missing                fixed    area missing, null, NaN or negative: computed as the segmentation mask
                                     area (pycocotools.mask.area, as COCO.loadRes does), else bbox w * h
==========================  =======  ===============================================================

Hard errors (always, one-line ``StageError`` naming the file and the key/record): annotation file missing, not
JSON, not an object, missing or non-list ``images``/``annotations``/``categories``, records of the wrong type
(ids not int64 integers, ``file_name`` not a relative path, ``width``/``height`` not positive integers, ``bbox``
not 4 numbers, ``iscrowd`` not 0/1, ``area`` not a number, ``segmentation`` not an array/object, RLE without
``size``/``counts``), duplicate category ids, image folder missing, disagreeing val categories, an empty train
split.

Image check (`inspect_image`): JPEG files (all of COCO) are decoded with ``Image.draft`` at 1/8 scale: libjpeg
still entropy-decodes every block, skipping only the full-size IDCT and colour conversion, so it rejects the same
files as ``decode_rgb`` at about 40 % of its cost (tests/test_convert.py checks the agreement on truncated and
garbled COCO images). Other formats are decoded in full with ``decode_rgb``.

Streaming and parallel: the JSON is the only thing held whole. Shards are planned from the file sizes (at most
``shard_mb`` x 10^6 bytes of image bytes each, unless one image alone is larger); each shard is one task that a
worker process reads, validates and writes itself (``workers``; 0 = in this process), with at most
2 x ``workers`` tasks in flight, so memory is bounded by the JSON plus a few record batches per worker.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import time
import warnings
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Sequence

import numpy as np
import orjson
import pyarrow as pa
from PIL import Image

from detpipe.errors import StageError, log, run_stage
from detpipe.io import atomic_dir
from detpipe.imageio import decode_rgb
from detpipe.pool import bounded_map, process_pool
from detpipe.paths import ARROW_DIR as OUT_DIR, RAW_DIR
from detpipe.params import Convert, load


SCHEMA = pa.schema(
    [
        ("image_id", pa.int64()),
        ("file_name", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("image", pa.binary()),
        ("ann_id", pa.list_(pa.int64())),
        ("bbox", pa.list_(pa.list_(pa.float32(), 4))),
        ("category_id", pa.list_(pa.int64())),
        ("label", pa.list_(pa.int64())),
        ("iscrowd", pa.list_(pa.int8())),
        ("area", pa.list_(pa.float64())),
        ("segmentation", pa.list_(pa.string())),
    ],
    metadata={"detpipe.convert.schema_version": "1"},
)

MAX_EXAMPLES = 5
SHARD_MB_BYTES = 1_000_000          # convert.shard_mb unit: 1 MB = 10^6 bytes of image bytes
BATCH_BYTES = 16 << 20              # image bytes per Arrow record batch (bounds a worker's memory)
BATCH_ROWS = 1024
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: rule -> (action, description); the order is the order of report.json.
RULES: dict[str, tuple[str, str]] = {
    "duplicate_image_id": ("dropped", "image id already seen (in this file; for a val file also in train); "
                                      "the first record is kept"),
    "duplicate_annotation_id": ("dropped", "annotation id already seen in the same file; the first is kept"),
    "annotation_unknown_image": ("dropped", "annotation image_id matches no image record"),
    "image_missing": ("dropped", "image file not found; dropped with its annotations"),
    "image_unreadable": ("dropped", "image file does not decode (not an image, truncated, corrupt); dropped "
                                    "with its annotations"),
    "image_size_mismatch": ("dropped", "decoded size differs from the JSON width/height (neither the stored nor "
                                       "the EXIF-oriented size); dropped with its annotations"),
    "exif_orientation": ("fixed", "EXIF orientation 2..8: width/height and annotations stored in the displayed "
                                  "frame decode_rgb returns (mapped from the stored raster unless the JSON size "
                                  "already is the displayed size)"),
    "grayscale": ("kept", "grayscale image (mode 1/L/LA/I;16/I/F); converted to RGB by decode_rgb"),
    "cmyk": ("kept", "CMYK image; converted to RGB by decode_rgb"),
    "palette": ("kept", "palette image (mode P/PA); converted to RGB by decode_rgb"),
    "high_bit_depth": ("kept", "16/32-bit samples; scaled to 8 bit by decode_rgb"),
    "alpha": ("kept", "alpha channel or transparency; dropped by decode_rgb"),
    "image_no_annotations": ("kept", "image without annotations (in the JSON, or all dropped); kept as a "
                                     "negative example"),
    "category_unknown": ("dropped", "category_id not in categories"),
    "bbox_not_finite": ("dropped", "bbox holds NaN or infinite values"),
    "bbox_nonpositive": ("dropped", "bbox width or height <= 0"),
    "bbox_outside": ("dropped", "bbox does not overlap the image"),
    "bbox_clipped": ("fixed", "bbox partly outside the image; clipped to [0, width] x [0, height]"),
    "iscrowd_missing": ("fixed", "iscrowd missing or null; set to 0"),
    "area_missing": ("fixed", "area missing, null, NaN or negative; computed (segmentation mask area with "
                              "pycocotools, else bbox w*h)"),
}

# PIL transposes that ImageOps.exif_transpose applies per EXIF orientation value (Pillow source).
_EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_GRAY_MODES = {"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
_HIGH_BIT_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}


# ----------------------------------------------------------------------------------------------- report


class Report:
    """Counts per validation rule (`RULES`) with the first `MAX_EXAMPLES` examples of each.

    With ``strict`` every `add` raises `StageError` instead of counting.
    """

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.counts: dict[str, int] = {rule: 0 for rule in RULES}
        self.examples: dict[str, list[dict]] = {rule: [] for rule in RULES}

    def add(self, rule: str, split: str, file: str, record: str, detail: str) -> None:
        """Count one occurrence of ``rule`` for ``record`` (e.g. ``"annotation id 5 (image id 9)"``) of ``file``.

        Raises:
            StageError: in strict mode, naming the file, the record and the rule.
        """
        if self.strict:
            raise StageError(f"{file}: {record}: rule '{rule}' ({RULES[rule][0]} unless strict): {detail} "
                             f"(convert.strict is true)")
        self.counts[rule] += 1
        if len(self.examples[rule]) < MAX_EXAMPLES:
            self.examples[rule].append({"split": split, "file": file, "record": record, "detail": detail})

    def merge(self, other: "Report") -> None:
        """Add ``other``'s counts; append its examples after ours (up to `MAX_EXAMPLES`)."""
        for rule in RULES:
            self.counts[rule] += other.counts[rule]
            room = MAX_EXAMPLES - len(self.examples[rule])
            if room > 0:
                self.examples[rule].extend(other.examples[rule][:room])

    def to_json(self) -> dict:
        """``{rule: {"action", "description", "count", "examples"}}`` in `RULES` order."""
        return {rule: {"action": action, "description": desc, "count": self.counts[rule],
                       "examples": self.examples[rule]}
                for rule, (action, desc) in RULES.items()}

    def summary(self) -> str:
        """``"rule=count ..."`` of the non-zero rules, or ``"no findings"``."""
        found = [f"{rule}={n}" for rule, n in self.counts.items() if n]
        return " ".join(found) if found else "no findings"


# ------------------------------------------------------------------------------------------ image check


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """What `inspect_image` learnt about one encoded image.

    ``width``/``height`` are the stored raster's pixels; ``orientation`` is the EXIF orientation that
    ``decode_rgb`` applies (1 = none); ``flags`` are report rules that apply (``grayscale``, ``cmyk``,
    ``palette``, ``high_bit_depth``, ``alpha``).
    """

    format: str | None
    mode: str
    width: int
    height: int
    orientation: int
    flags: tuple[str, ...]

    @property
    def display_size(self) -> tuple[int, int]:
        """(width, height) in pixels after EXIF orientation, i.e. of ``decode_rgb``'s output."""
        return (self.height, self.width) if self.orientation in (5, 6, 7, 8) else (self.width, self.height)


class _Unreadable(Exception):
    pass


def _inspect(data: bytes) -> ImageInfo:
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, mode, (width, height) = im.format, im.mode, im.size
            transparency = "transparency" in im.info
            if fmt == "JPEG":
                # Decode at 1/8 scale in the DCT domain: every entropy-coded block is still decoded (so
                # truncated and garbled streams fail as in decode_rgb); only full-size IDCT/colour work is
                # skipped. Modes a JPEG can have (L, RGB, CMYK) all convert to RGB.
                im.draft(None, (1, 1))
                im.load()
                orientation = im.getexif().get(0x0112, 1)
        if fmt != "JPEG":
            decode_rgb(data)          # the exact decoder later stages use (rare formats: cost is fine)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                orientation = im.getexif().get(0x0112, 1)
    except StageError as e:           # decode_rgb's "<bytes>: unreadable or corrupt image (<reason>)"
        msg = str(e)
        raise _Unreadable(_reason(msg[msg.find("(") + 1:-1] if msg.endswith(")") else msg)) from None
    except Exception as e:  # noqa: BLE001 - any failure of a third-party parser on untrusted bytes
        raise _Unreadable(_reason(f"{type(e).__name__}: {e}")) from None
    if orientation not in _EXIF_TRANSPOSE:
        orientation = 1                 # exif_transpose ignores other values
    bits = data[24] if data[:8] == _PNG_SIGNATURE and data[12:16] == b"IHDR" else 8
    flags = []
    if mode in _GRAY_MODES:
        flags.append("grayscale")
    if mode == "CMYK":
        flags.append("cmyk")
    if mode in ("P", "PA"):
        flags.append("palette")
    if mode in _HIGH_BIT_MODES or bits > 8:
        flags.append("high_bit_depth")
    if mode in _ALPHA_MODES or transparency:
        flags.append("alpha")
    return ImageInfo(fmt, mode, width, height, orientation, tuple(flags))


def _reason(msg: str) -> str:
    """Exception text without the object address PIL puts in it (keeps report.json reproducible)."""
    return re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", msg)


def inspect_image(data: bytes, source: str = "<bytes>") -> ImageInfo:
    """Check that encoded image bytes decode, and read their size, EXIF orientation and colour mode.

    JPEG is decoded at 1/8 scale (``PIL.Image.draft``; entropy decoding of all blocks unchanged), other
    formats in full with `detpipe.imageio.decode_rgb`.

    Args:
        data: the file's bytes.
        source: file name for the error message.
    Returns:
        `ImageInfo` (sizes in pixels of the stored raster; ``display_size`` after EXIF orientation).
    Raises:
        StageError: the bytes are not a readable image (names ``source``).
    """
    try:
        return _inspect(data)
    except _Unreadable as e:
        raise StageError(f"{source}: unreadable or corrupt image ({e})") from None


# -------------------------------------------------------------------------------------------- geometry


def orient_points(xy: np.ndarray, width: int, height: int, orientation: int) -> np.ndarray:
    """Map points from a stored raster to the frame that EXIF ``orientation`` displays (as ``exif_transpose``).

    Args:
        xy: float array ``(N, 2)`` of continuous pixel coordinates (x, y) in the stored raster.
        width, height: stored raster size in pixels.
        orientation: EXIF orientation 1..8 (TIFF/EXIF 2.3 tag 0x0112; transposes as in Pillow's
            ``ImageOps.exif_transpose``).
    Returns:
        float64 array ``(N, 2)`` in the displayed frame (size ``(height, width)`` for orientations 5..8).
    """
    xy = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
    x, y = xy[:, 0], xy[:, 1]
    w, h = float(width), float(height)
    out = {
        1: (x, y), 2: (w - x, y), 3: (w - x, h - y), 4: (x, h - y),
        5: (y, x), 6: (h - y, x), 7: (h - y, w - x), 8: (y, w - x),
    }[orientation]
    return np.stack(out, axis=1)


def orient_box(box: Sequence[float], width: int, height: int, orientation: int) -> list[float]:
    """COCO box ``[x, y, w, h]`` (pixels, stored raster of ``width`` x ``height``) -> same box in the
    displayed frame of EXIF ``orientation`` (see `orient_points`)."""
    x, y, w, h = box
    p = orient_points([[x, y], [x + w, y + h]], width, height, orientation)
    x0, y0 = p.min(axis=0)
    x1, y1 = p.max(axis=0)
    return [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]


def _orient_segmentation(seg: Any, width: int, height: int, orientation: int) -> Any:
    """Polygons: each point mapped (`orient_points`, rounded to 1e-6 px). RLE: mask decoded, transposed with
    the same PIL transpose as ``exif_transpose``, re-encoded as compressed RLE (counts string)."""
    from pycocotools import mask as mask_utils

    if isinstance(seg, list):
        out = []
        for poly in seg:
            p = orient_points(np.asarray(poly, dtype=np.float64), width, height, orientation)
            out.append([round(v, 6) for v in p.reshape(-1).tolist()])
        return out
    if isinstance(seg, dict):
        with warnings.catch_warnings():   # pycocotools 2.0.11 + numpy 2: harmless copy=False DeprecationWarning
            warnings.simplefilter("ignore", DeprecationWarning)
            m = mask_utils.decode(_rle(seg))
        m = np.asarray(Image.fromarray(m).transpose(_EXIF_TRANSPOSE[orientation]))
        rle = mask_utils.encode(np.asfortranarray(m))
        return {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")}
    return seg


def _rle(seg: dict) -> dict:
    """COCO RLE dict (uncompressed list counts or compressed string counts) -> pycocotools compressed RLE."""
    from pycocotools import mask as mask_utils

    h, w = seg["size"]
    if isinstance(seg["counts"], list):
        return mask_utils.frPyObjects(seg, h, w)
    counts = seg["counts"]
    return {"size": [h, w], "counts": counts.encode("ascii") if isinstance(counts, str) else counts}


def _computed_area(seg: Any, box: Sequence[float], width: int, height: int) -> tuple[float, str]:
    """Area in pixels^2 as COCO defines it: the segmentation mask area (pycocotools.mask.area on the
    rasterised polygons / RLE, as pycocotools COCO.loadRes does for segm results), else bbox w * h (as
    COCO.loadRes does for bbox results). Returns (area, source)."""
    from pycocotools import mask as mask_utils

    if isinstance(seg, dict):
        return float(mask_utils.area(_rle(seg))), "segmentation RLE"
    polys = [p for p in seg if isinstance(p, list) and len(p) >= 6] if isinstance(seg, list) else []
    if polys:
        rles = mask_utils.frPyObjects(polys, height, width)
        return float(mask_utils.area(mask_utils.merge(rles))), "segmentation polygons"
    return float(box[2]) * float(box[3]), "bbox w*h"


# ------------------------------------------------------------------------------------------------- JSON


def _jtype(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


def _load_json(path: Path) -> tuple[Any, bool]:
    """Parse an annotation file: orjson (fast), or the standard library where orjson refuses the text (it
    rejects the NaN/Infinity literals that Python's json accepts). Returns (data, parsed_by_orjson)."""
    if not path.is_file():
        raise StageError(f"{path}: annotation file not found")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise StageError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return orjson.loads(text), True
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text), False
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not valid JSON (not UTF-8 at byte {e.start})") from None


def _check_coco(data: Any, path: Path) -> None:
    """Type checks of a COCO instances file. Raises StageError naming the file, record and key."""
    def fail(where: str, msg: str) -> None:
        raise StageError(f"{path}: {where}{msg}")

    def need_int(rec: dict, key: str, where: str, lo: int = _INT64_MIN, hi: int = _INT64_MAX) -> None:
        if key not in rec:
            fail(where, f"missing key '{key}'")
        v = rec[key]
        if type(v) is not int:
            fail(where, f"key '{key}' must be an integer (got {_jtype(v)} {v!r:.40})")
        if not lo <= v <= hi:
            fail(where, f"key '{key}' must be in [{lo}, {hi}] (got {v})")

    if not isinstance(data, dict):
        fail("", f"top level must be a JSON object (got {_jtype(data)})")
    for key in ("images", "annotations", "categories"):
        if key not in data:
            fail("", f"missing key '{key}'")
        if not isinstance(data[key], list):
            fail("", f"key '{key}' must be an array (got {_jtype(data[key])})")

    seen_cats = set()
    for i, cat in enumerate(data["categories"]):
        where = f"categories[{i}]: "
        if not isinstance(cat, dict):
            fail(where, f"must be an object (got {_jtype(cat)})")
        need_int(cat, "id", where)
        if not isinstance(cat.get("name"), str):
            fail(f"categories[{i}] (id {cat['id']}): ", f"key 'name' must be a string (got {_jtype(cat.get('name'))})")
        if cat["id"] in seen_cats:
            fail(f"categories[{i}] (id {cat['id']}): ", "duplicate category id")
        seen_cats.add(cat["id"])

    for i, im in enumerate(data["images"]):
        where = f"images[{i}]: "
        if not isinstance(im, dict):
            fail(where, f"must be an object (got {_jtype(im)})")
        need_int(im, "id", where)
        where = f"images[{i}] (id {im['id']}): "
        fn = im.get("file_name")
        if not isinstance(fn, str) or not fn:
            fail(where, f"key 'file_name' must be a non-empty string (got {_jtype(fn)} {fn!r:.40})")
        p = PurePosixPath(fn)
        if p.is_absolute() or ".." in p.parts or "\\" in fn:
            fail(where, f"key 'file_name' must be a relative path inside the image folder (got {fn!r:.80})")
        need_int(im, "width", where, 1, _INT32_MAX)
        need_int(im, "height", where, 1, _INT32_MAX)

    for i, ann in enumerate(data["annotations"]):
        where = f"annotations[{i}]: "
        if not isinstance(ann, dict):
            fail(where, f"must be an object (got {_jtype(ann)})")
        need_int(ann, "id", where)
        where = f"annotations[{i}] (id {ann['id']}): "
        need_int(ann, "image_id", where)
        need_int(ann, "category_id", where)
        box = ann.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(type(v) in (int, float) for v in box)):
            fail(where, f"key 'bbox' must be an array of 4 numbers [x, y, w, h] (got {_jtype(box)} {box!r:.60})")
        crowd = ann.get("iscrowd")
        if crowd is not None and (type(crowd) is not int or crowd not in (0, 1)):
            fail(where, f"key 'iscrowd' must be 0 or 1 (got {_jtype(crowd)} {crowd!r:.40})")
        area = ann.get("area")
        if area is not None and type(area) not in (int, float):
            fail(where, f"key 'area' must be a number (got {_jtype(area)} {area!r:.40})")
        seg = ann.get("segmentation")
        if seg is not None and not isinstance(seg, (list, dict)):
            fail(where, f"key 'segmentation' must be an array (polygons) or an object (RLE) (got {_jtype(seg)})")
        if isinstance(seg, dict):
            size, counts = seg.get("size"), seg.get("counts")
            if not (isinstance(size, list) and len(size) == 2 and all(type(v) is int and v > 0 for v in size)):
                fail(where, f"key 'segmentation.size' must be [height, width] (got {size!r:.40})")
            if not isinstance(counts, (list, str)):
                fail(where, f"key 'segmentation.counts' must be an array or a string (got {_jtype(counts)})")


@dataclasses.dataclass
class _Entry:
    """One image record with the annotations that point to it (in file order)."""
    image_id: int
    file_name: str
    width: int
    height: int
    anns: list


def _index(data: dict, path: Path, split: str, report: Report, taken: dict | None = None) -> dict[int, _Entry]:
    """image id -> `_Entry`; counts duplicate_image_id, duplicate_annotation_id, annotation_unknown_image.

    A repeated id within the file: the first record is kept and all annotations with that id attach to it.
    An id already in ``taken`` (the train file, for a val file): the record is dropped with this file's
    annotations of that id.
    """
    index: dict[int, _Entry] = {}
    taken = taken or {}
    dropped: set[int] = set()
    for im in data["images"]:
        iid = im["id"]
        if iid in index:
            report.add("duplicate_image_id", split, str(path), f"image id {iid}",
                       f"file_name {im['file_name']!r}; the first record in this file ({index[iid].file_name!r}) "
                       f"is kept")
            continue
        if iid in taken:
            report.add("duplicate_image_id", split, str(path), f"image id {iid}",
                       f"file_name {im['file_name']!r}; id already used in the train file (by "
                       f"{taken[iid].file_name!r}); dropped with its annotations in this file")
            dropped.add(iid)
            continue
        index[iid] = _Entry(iid, im["file_name"], im["width"], im["height"], [])
    seen_anns: set[int] = set()
    for ann in data["annotations"]:
        aid, iid = ann["id"], ann["image_id"]
        if aid in seen_anns:
            report.add("duplicate_annotation_id", split, str(path), f"annotation id {aid} (image id {iid})",
                       "id already used by an earlier annotation")
            continue
        seen_anns.add(aid)
        entry = index.get(iid)
        if entry is None and iid in dropped:
            continue                     # dropped with its image record (duplicate_image_id)
        if entry is None:
            report.add("annotation_unknown_image", split, str(path), f"annotation id {aid} (image id {iid})",
                       f"image_id {iid} matches no image record")
            continue
        entry.anns.append(ann)
    return index


def split_ids(ids: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/val split of image ids.

    The ids are sorted; ``numpy.random.default_rng(seed).permutation(n)`` orders them and the first
    ``round(n * val_fraction)`` go to val.

    Returns:
        (train_ids, val_ids), each sorted ascending.
    Raises:
        StageError: ``seed`` is negative.
    """
    if seed < 0:
        raise StageError(f"convert.seed must be >= 0 (got {seed})")
    ids = sorted(ids)
    n_val = round(len(ids) * val_fraction)
    val_pos = set(np.random.default_rng(seed).permutation(len(ids))[:n_val].tolist())
    train = [i for k, i in enumerate(ids) if k not in val_pos]
    val = [i for k, i in enumerate(ids) if k in val_pos]
    return train, val


# --------------------------------------------------------------------------------------------- shards


@dataclasses.dataclass
class _Task:
    split: str
    index: int
    out_path: str
    images_dir: str
    ann_file: str
    labels: dict          # category id -> label
    strict: bool
    fast_json: bool       # the file parsed with orjson: orjson.dumps reproduces its values exactly
    items: list           # [_Entry]


@dataclasses.dataclass
class _Result:
    split: str
    index: int
    out_path: str | None  # None: every image of the shard was dropped, no file written
    images: int
    rows: int
    annotations: int
    image_bytes: int
    report: Report


class _Batch:
    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in SCHEMA.names}
        self.rows = 0
        self.nbytes = 0

    def add(self, row: dict) -> None:
        for name, col in self.cols.items():
            col.append(row[name])
        self.rows += 1
        self.nbytes += len(row["image"])

    def record_batch(self) -> pa.RecordBatch:
        arrays = [pa.array(self.cols[f.name], type=f.type) for f in SCHEMA]
        return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def _dumps(obj: Any, fast: bool) -> str:
    """Compact JSON text. orjson is used only for files it parsed: it would write NaN/Infinity as null."""
    if fast:
        try:
            return orjson.dumps(obj).decode()
        except TypeError:       # e.g. an int beyond 64 bits
            pass
    return json.dumps(obj, separators=(",", ":"))


def _convert_image(entry: _Entry, task: _Task, report: Report) -> dict | None:
    """Validate one image and its annotations; return the Arrow row, or None if the image is dropped."""
    split, iid = task.split, entry.image_id
    path = os.path.join(task.images_dir, entry.file_name)
    record = f"image id {iid}"
    n_anns = len(entry.anns)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        report.add("image_missing", split, path, record, f"file not found; dropped with its {n_anns} annotation(s)")
        return None
    except OSError as e:
        report.add("image_unreadable", split, path, record,
                   f"cannot read ({e.strerror or e}); dropped with its {n_anns} annotation(s)")
        return None
    try:
        info = _inspect(data)
    except _Unreadable as e:
        report.add("image_unreadable", split, path, record, f"{e}; dropped with its {n_anns} annotation(s)")
        return None

    jw, jh = entry.width, entry.height
    raw, shown = (info.width, info.height), info.display_size
    if (jw, jh) == raw:
        remap = info.orientation != 1
    elif (jw, jh) == shown:
        remap = False
    else:
        extra = f" ({shown[0]}x{shown[1]} after EXIF orientation {info.orientation})" if shown != raw else ""
        report.add("image_size_mismatch", split, path, record,
                   f"JSON says {jw}x{jh}, file is {raw[0]}x{raw[1]}{extra}; dropped with its {n_anns} annotation(s)")
        return None
    if info.orientation != 1:
        how = (f"annotations mapped from the stored {raw[0]}x{raw[1]} raster to the displayed "
               f"{shown[0]}x{shown[1]} frame" if remap else
               f"JSON size {jw}x{jh} is already the displayed size; annotations kept")
        report.add("exif_orientation", split, path, record, f"orientation {info.orientation}: {how}")
    for flag in info.flags:
        report.add(flag, split, path, record, f"{info.format} mode {info.mode}")

    ann_file = task.ann_file
    objs: dict[str, list] = {k: [] for k in ("ann_id", "bbox", "category_id", "label", "iscrowd", "area",
                                             "segmentation")}
    for ann in entry.anns:
        aid = ann["id"]
        arec = f"annotation id {aid} (image id {iid})"
        cat = ann["category_id"]
        label = task.labels.get(cat)
        if label is None:
            report.add("category_unknown", split, ann_file, arec, f"category_id {cat} is not in categories")
            continue
        given = ann["bbox"]
        x, y, w, h = (float(v) for v in given)
        if not all(math.isfinite(v) for v in (x, y, w, h)):
            report.add("bbox_not_finite", split, ann_file, arec, f"bbox {given}")
            continue
        if w <= 0 or h <= 0:
            report.add("bbox_nonpositive", split, ann_file, arec, f"bbox {given}: width or height <= 0")
            continue
        x0, y0, x1, y1 = max(x, 0.0), max(y, 0.0), min(x + w, float(jw)), min(y + h, float(jh))
        if x1 <= x0 or y1 <= y0:
            report.add("bbox_outside", split, ann_file, arec, f"bbox {given} does not overlap the {jw}x{jh} image")
            continue
        box = [x, y, w, h]
        if (x0, y0, x1, y1) != (x, y, x + w, y + h):
            box = [x0, y0, x1 - x0, y1 - y0]
            report.add("bbox_clipped", split, ann_file, arec, f"bbox {given} clipped to {box} ({jw}x{jh} image)")
        crowd = ann.get("iscrowd")
        if crowd is None:
            report.add("iscrowd_missing", split, ann_file, arec, "iscrowd set to 0")
            crowd = 0
        seg = ann.get("segmentation")
        area = ann.get("area")
        if area is None or not math.isfinite(area) or area < 0:
            try:
                new_area, source = _computed_area(seg, box, jw, jh)
            except Exception as e:  # noqa: BLE001 - malformed polygons / RLE from untrusted JSON
                raise StageError(f"{ann_file}: {arec}: key 'segmentation' is not valid COCO polygons/RLE "
                                 f"({type(e).__name__}: {e})") from None
            report.add("area_missing", split, ann_file, arec, f"area {area!r} -> {new_area} from {source}")
            area = new_area
        if remap:
            box = orient_box(box, info.width, info.height, info.orientation)
            try:
                seg = _orient_segmentation(seg, info.width, info.height, info.orientation)
            except Exception as e:  # noqa: BLE001
                raise StageError(f"{ann_file}: {arec}: key 'segmentation' is not valid COCO polygons/RLE "
                                 f"({type(e).__name__}: {e})") from None
        objs["ann_id"].append(aid)
        objs["bbox"].append(box)
        objs["category_id"].append(cat)
        objs["label"].append(label)
        objs["iscrowd"].append(crowd)
        objs["area"].append(float(area))
        objs["segmentation"].append("" if seg is None else _dumps(seg, task.fast_json))
    if not objs["ann_id"]:
        why = "no annotations in the JSON" if not n_anns else f"all {n_anns} annotation(s) dropped"
        report.add("image_no_annotations", split, path, record, f"{why}; kept as a negative")
    return {"image_id": iid, "file_name": entry.file_name, "width": shown[0], "height": shown[1],
            "image": data, **objs}


def _convert_shard(task: _Task) -> _Result:
    """Read, validate and write one shard (runs in a worker process, or in-process for workers=0)."""
    report = Report(task.strict)
    writer = None
    batch = _Batch()
    rows = anns = nbytes = 0

    def flush() -> None:
        nonlocal writer, batch
        if batch.rows:
            if writer is None:
                writer = pa.ipc.new_file(task.out_path, SCHEMA)
            writer.write_batch(batch.record_batch())
            batch = _Batch()

    try:
        for entry in task.items:
            row = _convert_image(entry, task, report)
            if row is None:
                continue
            batch.add(row)
            rows += 1
            anns += len(row["ann_id"])
            nbytes += len(row["image"])
            if batch.nbytes >= BATCH_BYTES or batch.rows >= BATCH_ROWS:
                flush()
        flush()
    finally:
        if writer is not None:
            writer.close()
    return _Result(task.split, task.index, task.out_path if writer is not None else None, len(task.items),
                   rows, anns, nbytes, report)


def _plan(split: str, entries: list[_Entry], images_dir: Path, out_dir: Path, ann_file: Path, fast_json: bool,
          labels: dict, params: Convert) -> Iterator[_Task]:
    """Yield shard tasks lazily: consecutive images while their file sizes sum to <= shard_mb."""
    limit = params.shard_mb * SHARD_MB_BYTES
    index, cur, cur_bytes = 0, [], 0

    def task() -> _Task:
        return _Task(split, index, str(out_dir / split / f"part-{index:05d}.arrow"), str(images_dir),
                     str(ann_file), labels, params.strict, fast_json, cur)

    for entry in entries:
        try:
            size = os.stat(images_dir / entry.file_name).st_size
        except OSError:
            size = 0                     # missing: counted by the worker
        if cur and cur_bytes + size > limit:
            yield task()
            index, cur, cur_bytes = index + 1, [], 0
        cur.append(entry)
        cur_bytes += size
    if cur:
        yield task()


# ----------------------------------------------------------------------------------------------- stage


def convert(raw_root: Path | str, out_dir: Path | str, params: Convert, *, progress: bool = True) -> dict:
    """Convert a COCO instances dataset to Arrow IPC shards (see the module docstring for layout and schema).

    Args:
        raw_root: folder that ``params.annotations``/``images``/``val_annotations``/``val_images`` are relative to.
        out_dir: output folder (replaced atomically: on any error it is left as it was).
        params: the ``convert`` params section.
        progress: show a tqdm progress bar (images) on stderr.
    Returns:
        ``{"meta": <meta.json>, "report": <report.json>}``.
    Raises:
        StageError: malformed/missing annotation file, missing image folder, disagreeing val categories, an
            empty train split, or (``params.strict``) any validation rule.
    """
    from tqdm import tqdm

    raw_root, out_dir = Path(raw_root), Path(out_dir)
    t0 = time.perf_counter()
    with process_pool(params.workers) as pool:
        train_file = raw_root / params.annotations
        data, fast = _load_json(train_file)
        _check_coco(data, train_file)
        categories = data["categories"]
        cat_ids = sorted(c["id"] for c in categories)
        labels = {cid: k + 1 for k, cid in enumerate(cat_ids)}
        names = {c["id"]: c["name"] for c in categories}
        images_dir = raw_root / params.images
        if not images_dir.is_dir():
            raise StageError(f"{images_dir}: image folder not found (convert.images)")
        if params.val_images is not None and params.val_annotations is None:
            raise StageError("convert.val_images is set but convert.val_annotations is null (set both, or "
                             "neither to split the one file by val_fraction)")
        report = Report(params.strict)
        index = _index(data, train_file, "train", report)
        del data

        val_file = None
        if params.val_annotations is None:
            train_ids, val_ids = split_ids(index, params.val_fraction, params.seed)
            sources = {"train": ([index[i] for i in train_ids], images_dir, train_file, fast),
                       "val": ([index[i] for i in val_ids], images_dir, train_file, fast)}
        else:
            val_file = raw_root / params.val_annotations
            vdata, vfast = _load_json(val_file)
            _check_coco(vdata, val_file)
            vnames = {c["id"]: c["name"] for c in vdata["categories"]}
            if vnames != names:
                diff = sorted(set(vnames.items()) ^ set(names.items()))[0]
                raise StageError(f"{val_file}: categories differ from {train_file} (first difference: id "
                                 f"{diff[0]} {diff[1]!r}); both files must list the same categories")
            val_dir = raw_root / (params.val_images or params.images)
            if not val_dir.is_dir():
                raise StageError(f"{val_dir}: image folder not found (convert.val_images)")
            vindex = _index(vdata, val_file, "val", report, taken=index)
            del vdata
            sources = {"train": ([index[i] for i in sorted(index)], images_dir, train_file, fast),
                       "val": ([vindex[i] for i in sorted(vindex)], val_dir, val_file, vfast)}

        total = sum(len(s[0]) for s in sources.values())
        results: list[_Result] = []
        with atomic_dir(out_dir) as tmp, tqdm(total=total, unit="img", desc="convert", disable=not progress,
                                              mininterval=0.5) as bar:
            for split in sources:
                (tmp / split).mkdir()

            def tasks() -> Iterator[_Task]:
                for split, (entries, img_dir, ann_file, fast_json) in sources.items():
                    yield from _plan(split, entries, img_dir, tmp, ann_file, fast_json, labels, params)

            for r in bounded_map(pool, _convert_shard, tasks(), 2 * max(1, params.workers), ordered=False):
                results.append(r)
                bar.update(r.images)

            results.sort(key=lambda r: (list(sources).index(r.split), r.index))
            splits: dict[str, dict] = {}
            for split, (entries, *_) in sources.items():
                mine = [r for r in results if r.split == split]
                shards = []
                for r in mine:
                    report.merge(r.report)
                    if r.out_path is None:
                        continue
                    name = f"{split}/part-{len(shards):05d}.arrow"
                    if Path(r.out_path) != tmp / name:
                        os.rename(r.out_path, tmp / name)
                    shards.append(name)
                splits[split] = {
                    "images": sum(r.rows for r in mine), "annotations": sum(r.annotations for r in mine),
                    "shards": shards, "images_in": len(entries),
                    "annotations_in": sum(len(e.anns) for e in entries),
                    "image_bytes": sum(r.image_bytes for r in mine)}
            if splits["train"]["images"] == 0:
                raise StageError(f"{train_file}: no usable images in the train split "
                                 f"({splits['train']['images_in']} listed; findings: {report.summary()})")
            meta = {
                "categories": categories,
                "category_id_to_label": {str(cid): labels[cid] for cid in cat_ids},
                "label_names": ["__background__"] + [names[cid] for cid in cat_ids],
                "num_classes": len(cat_ids) + 1,
                "splits": {s: {"images": v["images"], "annotations": v["annotations"], "shards": v["shards"]}
                           for s, v in splits.items()},
                "annotations_file": params.annotations,
                "val_annotations_file": params.val_annotations,
                "val_fraction": params.val_fraction if params.val_annotations is None else None,
                "seed": params.seed,
            }
            rep = {
                "strict": params.strict,
                "annotations_file": str(train_file),
                "val_annotations_file": None if val_file is None else str(val_file),
                "splits": {s: {"images_in": v["images_in"], "images_out": v["images"],
                               "annotations_in": v["annotations_in"], "annotations_out": v["annotations"],
                               "image_bytes": v["image_bytes"], "shards": len(v["shards"])}
                           for s, v in splits.items()},
                "rules": report.to_json(),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            (tmp / "report.json").write_text(json.dumps(rep, indent=2) + "\n")

    tr, va = splits["train"], splits["val"]
    log.info("convert: train %d images / %d annotations in %d shard(s), val %d / %d in %d; dropped %d of %d "
             "images; findings: %s (%s/report.json) [%.1f s]",
             tr["images"], tr["annotations"], len(tr["shards"]), va["images"], va["annotations"],
             len(va["shards"]), total - tr["images"] - va["images"], total, report.summary(), out_dir,
             time.perf_counter() - t0)
    return {"meta": meta, "report": rep}


def main() -> None:
    """``python -m stages.convert``: ``data/raw`` -> ``data/arrow`` with params section ``convert``."""
    convert(RAW_DIR, OUT_DIR, load("convert"))


if __name__ == "__main__":
    run_stage(main)
