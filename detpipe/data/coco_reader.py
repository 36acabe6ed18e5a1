"""The convert stage's COCO records -> rows: `index` (ids deduplicated and sorted, annotations attached to their
image, over `detpipe.data.coco_json.read_coco`'s columns) and the annotation rules (`clean_annotations`, applied by
each worker to one image's annotations). The file's streaming reader is `detpipe.data.coco_json`, the train/val
split `detpipe.data.split`.

The schema, the rules tables and `Report` are `detpipe.data.coco_schema`'s, which evaluation shares: nothing
outside the convert stage imports this module.
"""
from __future__ import annotations

import array
import dataclasses
import math
import struct
from typing import Any, Callable

import numpy as np

from detpipe.data.coco_json import Columns
from detpipe.data.coco_schema import Report, is_finite_number, segmentation_area, segmentation_problem


@dataclasses.dataclass
class Entry:
    """One image record with the annotations that point to it (in file order)."""
    image_id: int
    file_name: str
    width: int
    height: int
    anns: list


# ------------------------------------------------------------------------------------------- index, split


@dataclasses.dataclass
class ImageTable:
    """The images of one annotation file after `index`: row k is the k-th smallest unique image id. Each row's
    record is at file position ``pos[k]`` of the `Columns` ``cols``; its annotations (file order) are entries
    ``ann_first[k]:ann_first[k + 1]`` of ``ann_starts``/``ann_lengths`` (bytes in ``cols.source``)."""
    cols: Columns
    ids: np.ndarray             # (n,) int64, ascending
    pos: np.ndarray             # (n,) int64
    ann_first: np.ndarray       # (n + 1,) int64
    ann_starts: np.ndarray      # (m,) int64
    ann_lengths: np.ndarray     # (m,) int64

    def name(self, k: int) -> str:
        """File name of row ``k``."""
        return self.cols.name(int(self.pos[k]))


def index(cols: Columns, split: str, report: Report) -> ImageTable:
    """Index one checked file (its own id space: another file's ids do not matter), with numpy sorts.

    Counts, in file order, duplicate_image_id (first record kept; annotations with that id attach to it), then
    duplicate_annotation_id (first kept) and annotation_unknown_image.
    Raises:
        StageError: in strict mode, at the first finding.
    """
    path = str(cols.path)
    ids = np.frombuffer(cols.image_ids, np.int64)
    order = np.argsort(ids, kind="stable")
    first = np.ones(len(ids), bool)
    first[1:] = ids[order[1:]] != ids[order[:-1]]
    kept = order[first]
    kept_ids = ids[kept]
    repeats = np.sort(order[~first])
    for d, k in zip(repeats.tolist(), kept[np.searchsorted(kept_ids, ids[repeats])].tolist()):
        report.add("duplicate_image_id", split, path, f"image id {ids[d]}",
                   f"file_name {cols.name(d)!r}; the first record in this file ({cols.name(k)!r}) is kept")
    del order, first, repeats

    aids = np.frombuffer(cols.ann_ids, np.int64)
    image_ids = np.frombuffer(cols.ann_image_ids, np.int64)
    order = np.argsort(aids, kind="stable")
    ordered = aids[order]
    repeat = np.zeros(len(aids), bool)
    repeat[order[1:][ordered[1:] == ordered[:-1]]] = True
    del order, ordered
    rank = np.searchsorted(kept_ids, image_ids)
    known = kept_ids[np.minimum(rank, len(kept_ids) - 1)] == image_ids if len(kept_ids) else \
        np.zeros(len(aids), bool)
    for j in np.flatnonzero(repeat | ~known).tolist():
        aid, iid = aids[j], image_ids[j]
        if repeat[j]:
            report.add("duplicate_annotation_id", split, path, f"annotation id {aid} (image id {iid})",
                       "id already used by an earlier annotation")
        else:
            report.add("annotation_unknown_image", split, path, f"annotation id {aid} (image id {iid})",
                       f"image_id {iid} matches no image record")
    good = np.flatnonzero(known & ~repeat)
    del known, repeat
    rank = rank[good]
    good = good[np.argsort(rank, kind="stable")]
    ann_first = np.zeros(len(kept) + 1, np.int64)
    np.cumsum(np.bincount(rank, minlength=len(kept)), out=ann_first[1:])
    del rank
    starts = np.frombuffer(cols.ann_starts, np.int64)[good]
    lengths = np.frombuffer(cols.ann_lengths, np.int64)[good]
    del aids, image_ids
    for name in ("ann_ids", "ann_image_ids", "ann_starts", "ann_lengths"):   # only the sorted copies stay
        setattr(cols, name, array.array("q"))
    return ImageTable(cols, kept_ids, kept, ann_first, starts, lengths)


# ---------------------------------------------------------------------------------------------- annotations


_F32 = struct.Struct("<f")
_F32X2 = struct.Struct("<2f")
_F32X4 = struct.Struct("<4f")


def _f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (IEEE round-to-nearest, as numpy's cast), as a Python float; +-inf
    beyond float32 range. Exact: float32 sums/differences computed in float64 and rounded once are the float32
    results (float64 has more than 2 x 24 + 2 significand bits)."""
    try:
        return _F32.unpack(_F32.pack(v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


@dataclasses.dataclass
class Frame:
    """Where one image's annotations go: the JSON's ``width`` x ``height`` (pixels) and, when they must be
    mapped to the displayed frame, ``orient(box, seg) -> (box, seg)`` (else None)."""
    width: int
    height: int
    orient: Callable[[list, Any], tuple[list, Any]] | None = None


def clean_annotations(anns: list[dict], frame: Frame, labels: dict[int, int], report: Report, split: str,
                      ann_file: str, image_id: int) -> list[tuple]:
    """Apply the annotation rules of `RULES` to one image's annotations (each already `check_coco`'d).

    Box rules run on the float32 values that are stored (range checked first, without float conversion).
    Returns:
        ``(ann_id, bbox [x, y, w, h] float32 pixels, category_id, label, iscrowd, area float, segmentation or
        None, occluded)`` per kept annotation, in input order; ``occluded`` is 1 when the record has
        ``"attributes": {"occluded": true}`` (what CVAT's COCO export and the CVAT reader write), else 0.
    Raises:
        StageError: in strict mode, at the first counted finding.
    """
    out = []
    jw, jh = frame.width, frame.height
    fw, fh = float(jw), float(jh)
    for ann in anns:
        aid = ann["id"]

        def add(rule: str, detail: str) -> None:
            report.add(rule, split, ann_file, f"annotation id {aid} (image id {image_id})", detail)

        cat = ann["category_id"]
        label = labels.get(cat)
        if label is None:
            add("category_unknown", f"category_id {cat} is not in categories")
            continue
        given = ann["bbox"]
        try:                    # the common case in one C call: four numbers within float32 range
            x, y, w, h = _F32X4.unpack(_F32X4.pack(*given))
            exact = math.isfinite(x + y + w + h)
        except (OverflowError, struct.error):   # beyond float32 range; an int beyond float64
            exact = False
        if not exact:           # the rules' order: range checked without float conversion, then float32
            if not all(is_finite_number(v) for v in given):
                add("bbox_not_finite", f"bbox {given!r:.80}")
                continue
            x, y, w, h = (_f32(v) for v in given)
            if not all(math.isfinite(v) for v in (x, y, w, h)):
                add("bbox_not_finite", f"bbox {given!r:.80}: beyond float32 range")
                continue
        if w <= 0 or h <= 0:
            add("bbox_nonpositive", f"bbox {given!r:.80}: width or height <= 0 as float32")
            continue
        try:                    # float32 sums, as a reader of the stored box gets
            xe, ye = _F32X2.unpack(_F32X2.pack(x + w, y + h))
        except OverflowError:
            xe, ye = _f32(x + w), _f32(y + h)
        x0, y0, x1, y1 = max(x, 0.0), max(y, 0.0), min(xe, fw), min(ye, fh)
        if x1 <= x0 or y1 <= y0:
            add("bbox_outside", f"bbox {given!r:.80} does not overlap the {jw}x{jh} image")
            continue
        box = [x, y, w, h]
        if (x0, y0, x1, y1) != (x, y, xe, ye):
            box = [x0, y0, _f32(x1 - x0), _f32(y1 - y0)]
            add("bbox_clipped", f"bbox {given!r:.80} clipped to {box} ({jw}x{jh} image)")
        crowd = ann.get("iscrowd")
        if crowd is None:
            add("iscrowd_missing", "iscrowd set to 0")
            crowd = 0
        seg = ann.get("segmentation")
        problem = segmentation_problem(seg, jh, jw)
        if problem:
            add("segmentation_invalid", f"{problem}; segmentation removed, box kept")
            seg = None
        area = ann.get("area")
        if not is_finite_number(area) or area < 0:
            seg_area = segmentation_area(seg, jh, jw)
            new_area, source = ((seg_area, "segmentation") if seg_area is not None
                                else (box[2] * box[3], "bbox w*h"))
            add("area_missing", f"area {area!r:.40} -> {new_area} from {source}")
            area = new_area
        if frame.orient is not None:
            box, seg = frame.orient(box, seg)
        attributes = ann.get("attributes")
        occluded = int(isinstance(attributes, dict) and attributes.get("occluded") is True)
        out.append((aid, box, cat, label, crowd, float(area), seg, occluded))
    return out
