"""COCO instances files: loading, the schema checks (hard errors), the validation rules (counted findings) and
the per-annotation checks that apply them.

`RULES` is the one table of counted rules (report.json, README "convert"); `ERRORS` the rules whose breach
always stops the convert stage with a one-line error. A record is counted under the first rule it breaks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import struct
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import orjson

from detpipe.errors import StageError

MAX_EXAMPLES = 5
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
FLOAT64_MAX = float(np.finfo(np.float64).max)
_NUMBER = (int, float)

#: rule -> (action, description); the order is the order of report.json.
RULES: dict[str, tuple[str, str]] = {
    "duplicate_image_id": ("dropped", "image id already seen in the same file (each file, train or val, has its "
                                      "own id space); the first record is kept"),
    "duplicate_annotation_id": ("dropped", "annotation id already seen in the same file; the first is kept"),
    "annotation_unknown_image": ("dropped", "annotation image_id matches no image record of its file"),
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
    "high_bit_depth": ("kept", "16/32-bit or float samples; scaled to 8 bit by decode_rgb"),
    "alpha": ("kept", "alpha channel or transparency; dropped by decode_rgb"),
    "image_no_annotations": ("kept", "image without annotations (in the JSON, or all dropped); kept as a "
                                     "negative example"),
    "category_unknown": ("dropped", "category_id not in categories"),
    "bbox_not_finite": ("dropped", "bbox holds NaN, +-Infinity, or a number beyond float32 range (checked "
                                   "before any conversion, e.g. a 400-digit integer)"),
    "bbox_nonpositive": ("dropped", "bbox width or height <= 0 once cast to float32 (the stored type; e.g. "
                                    "1e-50 becomes 0)"),
    "bbox_outside": ("dropped", "bbox does not overlap the image"),
    "bbox_clipped": ("fixed", "bbox partly outside the image; clipped to [0, width] x [0, height] in float32"),
    "segmentation_invalid": ("dropped", "segmentation malformed (not polygons or RLE; a polygon of odd length, "
                                        "under 3 points or with non-finite numbers; RLE counts that do not "
                                        "decode or do not cover exactly its size) or an RLE size that is not "
                                        "the image's [height, width]: the segmentation is removed (stored as "
                                        "\"\"), the box kept"),
    "iscrowd_missing": ("fixed", "iscrowd missing or null; set to 0"),
    "area_missing": ("fixed", "area missing, null, NaN, infinite, negative or beyond float64 range; computed "
                              "(segmentation mask area with pycocotools, else bbox w*h)"),
}

#: rule -> description of the inputs that always stop the convert stage (``error: ... (rule '<name>')``).
ERRORS: dict[str, str] = {
    "json_invalid": "annotation file missing, unreadable, not JSON or not UTF-8",
    "json_too_deep": "JSON nested deeper than 1024 levels (orjson's limit; Python's json stops near it too)",
    "coco_schema": "top level not an object; images/annotations/categories missing or not arrays; a record of "
                   "the wrong type (ids not int64, width/height not positive int32, bbox not 4 numbers, iscrowd "
                   "not 0/1, area not a number); a duplicate category id",
    "file_name_invalid": "file_name empty, absolute, with '..' or '\\', or with characters no filesystem takes "
                         "(NUL byte, a lone UTF-16 surrogate)",
    "categories_differ": "the val file's categories differ from the train file's",
    "split_emptied": "the rules dropped every image of a split that listed some (train or val)",
}


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


# ------------------------------------------------------------------------------------------------- JSON


def _jtype(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


@contextlib.contextmanager
def gc_paused() -> Iterator[Callable[[], None]]:
    """Cyclic garbage collector policy for parsing a big COCO JSON and then working on it.

    The collector is paused; the yielded ``parsed()`` (call it once the JSON is parsed and indexed) freezes every
    object that exists (``gc.freeze``: later collections skip them) and resumes collecting; on exit they are
    unfrozen and the collector's state restored. Parsing makes one container per record and polygon, without
    cycles: every automatic collection would walk them all again (2,048 images, load + check + index + split:
    0.16-0.27 s -> 0.12-0.18 s), and the first collection after resuming would walk the whole parsed file
    (~20 ms at 2,048 images, at every later full collection again) had it not been frozen.
    """
    enabled = gc.isenabled()
    gc.disable()

    def parsed() -> None:
        gc.freeze()
        if enabled:
            gc.enable()
    try:
        yield parsed
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def load_json(path: Path) -> tuple[Any, bool]:
    """Parse an annotation file: orjson (fast), or the standard library where orjson refuses the text (it
    rejects the NaN/Infinity literals that Python's json accepts).

    Returns:
        (data, parsed_by_orjson).
    Raises:
        StageError: rule ``json_invalid`` or ``json_too_deep`` (see `ERRORS`), naming the file.
    """
    if not path.is_file():
        raise StageError(f"{path}: annotation file not found (rule 'json_invalid')")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise StageError(f"{path}: cannot read ({e.strerror or e}) (rule 'json_invalid')") from None
    try:
        return orjson.loads(text), True
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e) or "recursion" in str(e).lower():
            raise StageError(f"{path}: JSON nested deeper than 1024 levels (rule 'json_too_deep')") from None
    try:
        return json.loads(text), False
    except RecursionError:
        raise StageError(f"{path}: JSON nested too deeply for Python's parser (rule 'json_too_deep')") from None
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e}) (rule 'json_invalid')") from None
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not valid JSON (not UTF-8 at byte {e.start}) (rule 'json_invalid')") from None


def _file_name_problem(fn: Any) -> str | None:
    """Why ``fn`` cannot be an image's relative file name, or None."""
    if not isinstance(fn, str) or not fn:
        return f"must be a non-empty string (got {_jtype(fn)} {fn!r:.40})"
    if "\x00" in fn:
        return f"holds a NUL byte ({fn!r:.80})"
    try:
        fn.encode("utf-8")
    except UnicodeEncodeError:
        return f"holds a lone UTF-16 surrogate, which no file system name can hold ({fn!r:.80})"
    p = PurePosixPath(fn)
    if p.is_absolute() or ".." in p.parts or "\\" in fn:
        return f"must be a relative path inside the image folder (got {fn!r:.80})"
    return None


def check_coco(data: Any, path: Path) -> None:
    """Type checks of a parsed COCO instances file (rules ``coco_schema`` and ``file_name_invalid``).

    Raises:
        StageError: one line naming the file, the record (``images[3] (id 7)``), the key and the rule.
    """
    def fail(where: str, msg: str, rule: str = "coco_schema") -> None:
        raise StageError(f"{path}: {where}{msg} (rule '{rule}')")

    def need_int(rec: dict, key: str, where: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> None:
        if key not in rec:
            fail(where, f"missing key '{key}'")
        v = rec[key]
        if type(v) is not int:
            fail(where, f"key '{key}' must be an integer (got {_jtype(v)} {v!r:.40})")
        if not lo <= v <= hi:
            fail(where, f"key '{key}' must be in [{lo}, {hi}] (got {v!r:.60})")

    if not isinstance(data, dict):
        fail("", f"top level must be a JSON object (got {_jtype(data)})")
    for key in ("images", "annotations", "categories"):
        if key not in data:
            fail("", f"missing key '{key}'")
        if not isinstance(data[key], list):
            fail("", f"key '{key}' must be an array (got {_jtype(data[key])})")

    def records(key: str) -> Iterator[tuple[dict, str]]:
        """Each record of ``data[key]`` (checked to be an object with an int64 ``id``) and its name."""
        for i, rec in enumerate(data[key]):
            if not isinstance(rec, dict):
                fail(f"{key}[{i}]: ", f"must be an object (got {_jtype(rec)})")
            need_int(rec, "id", f"{key}[{i}]: ")
            yield rec, f"{key}[{i}] (id {rec['id']}): "

    seen_cats = set()
    for cat, where in records("categories"):
        if not isinstance(cat.get("name"), str):
            fail(where, f"key 'name' must be a string (got {_jtype(cat.get('name'))})")
        if cat["id"] in seen_cats:
            fail(where, "duplicate category id")
        seen_cats.add(cat["id"])

    for im, where in records("images"):
        problem = _file_name_problem(im.get("file_name"))
        if problem:
            fail(where, f"key 'file_name' {problem}", "file_name_invalid")
        need_int(im, "width", where, 1, INT32_MAX)
        need_int(im, "height", where, 1, INT32_MAX)

    for i, ann in enumerate(data["annotations"]):
        # fast path (one expression per record) for what nearly every file holds; any doubt -> the checks below
        if type(ann) is dict:
            aid, iid, cid, box, crowd = ann.get("id"), ann.get("image_id"), ann.get("category_id"), \
                ann.get("bbox"), ann.get("iscrowd", 0)
            area = ann.get("area", 0)
            if type(aid) is int and type(iid) is int and type(cid) is int and type(box) is list and len(box) == 4 \
                    and type(box[0]) in _NUMBER and type(box[1]) in _NUMBER and type(box[2]) in _NUMBER \
                    and type(box[3]) in _NUMBER and (crowd is None or (type(crowd) is int and crowd in (0, 1))) \
                    and (area is None or type(area) in _NUMBER) \
                    and INT64_MIN <= aid <= INT64_MAX and INT64_MIN <= iid <= INT64_MAX \
                    and INT64_MIN <= cid <= INT64_MAX:
                continue
        if not isinstance(ann, dict):
            fail(f"annotations[{i}]: ", f"must be an object (got {_jtype(ann)})")
        need_int(ann, "id", f"annotations[{i}]: ")
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


@dataclasses.dataclass
class Entry:
    """One image record with the annotations that point to it (in file order)."""
    image_id: int
    file_name: str
    width: int
    height: int
    anns: list


def index(data: dict, path: Path, split: str, report: Report) -> dict[int, Entry]:
    """image id -> `Entry` for one checked file (its own id space: another file's ids do not matter).

    Counts duplicate_image_id (first record kept; later annotations with that id attach to it),
    duplicate_annotation_id and annotation_unknown_image.
    """
    idx: dict[int, Entry] = {}
    for im in data["images"]:
        iid = im["id"]
        if iid in idx:
            report.add("duplicate_image_id", split, str(path), f"image id {iid}",
                       f"file_name {im['file_name']!r}; the first record in this file ({idx[iid].file_name!r}) "
                       f"is kept")
            continue
        idx[iid] = Entry(iid, im["file_name"], im["width"], im["height"], [])
    seen_anns: set[int] = set()
    for ann in data["annotations"]:
        aid, iid = ann["id"], ann["image_id"]
        if aid in seen_anns:
            report.add("duplicate_annotation_id", split, str(path), f"annotation id {aid} (image id {iid})",
                       "id already used by an earlier annotation")
            continue
        seen_anns.add(aid)
        entry = idx.get(iid)
        if entry is None:
            report.add("annotation_unknown_image", split, str(path), f"annotation id {aid} (image id {iid})",
                       f"image_id {iid} matches no image record")
            continue
        entry.anns.append(ann)
    return idx


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


# ------------------------------------------------------------------------------------------ segmentation


def _is_real(v: Any, limit: float = FLOAT64_MAX) -> bool:
    """``v`` is a JSON number (not a bool) that is finite and within +-``limit``, checked without converting
    an int to float (a 400-digit integer compares exactly; ``float()`` of it would raise OverflowError)."""
    if type(v) is int:
        return -limit <= v <= limit
    return type(v) is float and math.isfinite(v) and -limit <= v <= limit


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


def rle_counts(counts: str) -> list[int]:
    """Run lengths of a COCO compressed RLE ``counts`` string (the LEB128-like code of pycocotools'
    ``rleFrString``, maskApi.c: 6-bit groups offset by 48, 0x20 = more, 0x10 = sign; from the third run on each
    value is a delta to the run two before).

    Raises:
        ValueError: a character outside '0'..'o', or the string ends inside a value.
    """
    out: list[int] = []
    p, n = 0, len(counts)
    while p < n:
        x, k, more = 0, 0, True
        while more:
            if p >= n:
                raise ValueError("counts string ends inside a value")
            c = ord(counts[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"character {counts[p]!r} at {p} is not an RLE digit")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(out) > 2:
            x += out[-2]
        out.append(x)
    return out


def segmentation_problem(seg: Any, height: int, width: int) -> str | None:
    """Why ``seg`` is not a usable COCO segmentation of a ``height`` x ``width`` image, or None (also for
    None and ``[]``: no segmentation). Each polygon and RLE is decoded here once: polygons must be flat lists
    of an even number (>= 6) of finite numbers; RLE must have ``size == [height, width]`` and ``counts`` (a list
    of ints, or a compressed string, see `rle_counts`) of non-negative runs summing to ``height * width``."""
    if seg is None or seg == []:
        return None
    if isinstance(seg, list):
        for k, poly in enumerate(seg):
            if not isinstance(poly, list) or len(poly) < 6 or len(poly) % 2:
                return f"polygon {k} must be [x1, y1, x2, y2, ...] with an even number >= 6 of values"
            # one C-level pass: strings and nested lists raise TypeError; NaN/inf propagate to the sum; an integer
            # beyond float64 raises OverflowError when added to a float or, in an all-integer sum, in isfinite
            try:
                finite = math.isfinite(sum(poly))
            except (TypeError, OverflowError):
                finite = False
            if not finite:
                return f"polygon {k} holds a value that is not a finite number"
        return None
    if not isinstance(seg, dict):
        return f"must be an array (polygons) or an object (RLE), got {_jtype(seg)}"
    size, counts = seg.get("size"), seg.get("counts")
    if not isinstance(size, (list, tuple)) or list(size) != [height, width] or \
            not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in size):
        return f"RLE size {size!r:.40} != image [height, width] [{height}, {width}]"
    if isinstance(counts, (str, bytes)):
        try:
            runs = rle_counts(counts.decode("ascii", "replace") if isinstance(counts, bytes) else counts)
        except ValueError as e:
            return f"RLE counts do not decode ({e})"
    elif isinstance(counts, list) and all(type(v) is int for v in counts):
        runs = counts
    else:
        return f"RLE counts must be a list of integers or a string (got {_jtype(counts)})"
    if any(r < 0 for r in runs) or sum(runs) != height * width:
        return f"RLE runs sum to {sum(runs)} (with any negative: {any(r < 0 for r in runs)}), not {height}x{width}"
    return None


def to_rle(seg: Any, height: int, width: int) -> dict | None:
    """A valid (see `segmentation_problem`) non-empty segmentation as one pycocotools compressed RLE
    (polygons merged, as ``COCO.annToRLE``); None for no segmentation."""
    from pycocotools import mask as mask_utils

    if not seg:
        return None
    if isinstance(seg, list):
        return mask_utils.merge(mask_utils.frPyObjects(seg, height, width))
    if isinstance(seg["counts"], list):
        return mask_utils.frPyObjects(seg, height, width)
    return {"size": seg["size"], "counts": seg["counts"].encode("ascii")}


# ----------------------------------------------------------------------------------------- annotations


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
        None)`` per kept annotation, in input order.
    Raises:
        StageError: in strict mode, at the first counted finding.
    """
    from pycocotools import mask as mask_utils

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
            if not all(_is_real(v) for v in given):
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
        if not _is_real(area) or area < 0:
            rle = to_rle(seg, jh, jw)
            new_area, source = ((float(mask_utils.area(rle)), "segmentation mask") if rle is not None
                                else (box[2] * box[3], "bbox w*h"))
            add("area_missing", f"area {area!r:.40} -> {new_area} from {source}")
            area = new_area
        if frame.orient is not None:
            box, seg = frame.orient(box, seg)
        out.append((aid, box, cat, label, crowd, float(area), seg))
    return out
