"""COCO instances files: reading them in bounded memory (`read_coco`: records parsed one at a time into numpy
columns, `index`), the schema checks (hard errors), the validation rules (counted findings) and the per-annotation
checks that apply them.

`RULES` is the one table of counted rules (report.json, README "convert"); `ERRORS` the rules whose breach
always stops the convert stage with a one-line error. A record is counted under the first rule it breaks.
"""
from __future__ import annotations

import array
import contextlib
import dataclasses
import gc
import json
import math
import os
import struct
import tempfile
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
    "val_image_in_train": ("dropped", "val image whose file bytes equal a train image's (the same file under "
                                      "another id or name; checked by SHA-1, confirmed byte by byte, against the "
                                      "train images that were kept): dropped from val with its annotations, so "
                                      "that evaluation never scores an image the model was trained on"),
    "duplicate_image_bytes": ("kept", "image file bytes equal those of an image with a lower id in the same split "
                                      "(an exact copy under another id or name; confirmed byte by byte); kept"),
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
    cycles: automatic collections would walk them again and again (measured on the whole-file parse, 2,048
    images, load + check + index + split: 0.16-0.27 s -> 0.12-0.18 s). `read_coco` keeps only a few objects
    per file (numpy columns), but a file parsed whole (`load_json`) is alive until `read_coco` returns.
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


def _fail(path: Path, where: str, msg: str, rule: str = "coco_schema") -> None:
    raise StageError(f"{path}: {where}{msg} (rule '{rule}')")


def _need_int(path: Path, rec: dict, key: str, where: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> None:
    if key not in rec:
        _fail(path, where, f"missing key '{key}'")
    v = rec[key]
    if type(v) is not int:
        _fail(path, where, f"key '{key}' must be an integer (got {_jtype(v)} {v!r:.40})")
    if not lo <= v <= hi:
        _fail(path, where, f"key '{key}' must be in [{lo}, {hi}] (got {v!r:.60})")


def _record(path: Path, key: str, i: int, rec: Any) -> str:
    """Check that ``rec`` (``data[key][i]``) is an object with an int64 ``id``; return its name for messages."""
    if not isinstance(rec, dict):
        _fail(path, f"{key}[{i}]: ", f"must be an object (got {_jtype(rec)})")
    _need_int(path, rec, "id", f"{key}[{i}]: ")
    return f"{key}[{i}] (id {rec['id']}): "


def check_top(data: Any, path: Path) -> None:
    """The top level of a COCO instances file: an object whose ``images``, ``annotations`` and ``categories`` are
    arrays (rule ``coco_schema``; only their type is looked at).

    Raises:
        StageError: one line naming the file, the key and the rule.
    """
    if not isinstance(data, dict):
        _fail(path, "", f"top level must be a JSON object (got {_jtype(data)})")
    for key in ("images", "annotations", "categories"):
        if key not in data:
            _fail(path, "", f"missing key '{key}'")
        if not isinstance(data[key], list):
            _fail(path, "", f"key '{key}' must be an array (got {_jtype(data[key])})")


def check_categories(categories: list, path: Path) -> None:
    """Each category is an object with an int64 ``id`` (unique) and a string ``name`` (rule ``coco_schema``).

    Raises:
        StageError: one line naming the file, the record (``categories[3] (id 7)``), the key and the rule.
    """
    seen = set()
    for i, cat in enumerate(categories):
        where = _record(path, "categories", i, cat)
        if not isinstance(cat.get("name"), str):
            _fail(path, where, f"key 'name' must be a string (got {_jtype(cat.get('name'))})")
        if cat["id"] in seen:
            _fail(path, where, "duplicate category id")
        seen.add(cat["id"])


def check_image(im: Any, i: int, path: Path) -> None:
    """``images[i]``: an object with an int64 ``id``, a usable relative ``file_name`` (rule ``file_name_invalid``)
    and ``width``/``height`` in [1, 2^31 - 1] pixels (rule ``coco_schema``).

    Raises:
        StageError: one line naming the file, the record (``images[3] (id 7)``), the key and the rule.
    """
    where = _record(path, "images", i, im)
    problem = _file_name_problem(im.get("file_name"))
    if problem:
        _fail(path, where, f"key 'file_name' {problem}", "file_name_invalid")
    _need_int(path, im, "width", where, 1, INT32_MAX)
    _need_int(path, im, "height", where, 1, INT32_MAX)


def check_annotation(ann: Any, i: int, path: Path) -> None:
    """``annotations[i]``: an object with int64 ``id``, ``image_id`` and ``category_id``, ``bbox`` an array of 4
    numbers, ``iscrowd`` 0/1 or absent/null, ``area`` a number or absent/null (rule ``coco_schema``).

    Raises:
        StageError: one line naming the file, the record (``annotations[3] (id 7)``), the key and the rule.
    """
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
            return
    if not isinstance(ann, dict):
        _fail(path, f"annotations[{i}]: ", f"must be an object (got {_jtype(ann)})")
    _need_int(path, ann, "id", f"annotations[{i}]: ")
    where = f"annotations[{i}] (id {ann['id']}): "
    _need_int(path, ann, "image_id", where)
    _need_int(path, ann, "category_id", where)
    box = ann.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(type(v) in (int, float) for v in box)):
        _fail(path, where, f"key 'bbox' must be an array of 4 numbers [x, y, w, h] (got {_jtype(box)} {box!r:.60})")
    crowd = ann.get("iscrowd")
    if crowd is not None and (type(crowd) is not int or crowd not in (0, 1)):
        _fail(path, where, f"key 'iscrowd' must be 0 or 1 (got {_jtype(crowd)} {crowd!r:.40})")
    area = ann.get("area")
    if area is not None and type(area) not in (int, float):
        _fail(path, where, f"key 'area' must be a number (got {_jtype(area)} {area!r:.40})")


def check_coco(data: Any, path: Path) -> None:
    """Type checks of a parsed COCO instances file, in this order: `check_top`, `check_categories`, each image
    (`check_image`), each annotation (`check_annotation`); the first problem stops.

    Raises:
        StageError: one line naming the file, the record (``images[3] (id 7)``), the key and the rule.
    """
    check_top(data, path)
    check_categories(data["categories"], path)
    for i, im in enumerate(data["images"]):
        check_image(im, i, path)
    for i, ann in enumerate(data["annotations"]):
        check_annotation(ann, i, path)


@dataclasses.dataclass
class Entry:
    """One image record with the annotations that point to it (in file order)."""
    image_id: int
    file_name: str
    width: int
    height: int
    anns: list


# ---------------------------------------------------------------------------------- streaming reader

JSON_WS = b" \t\n\r"
CHUNK_BYTES = 2 << 20
"""Bytes read at a time by `read_coco` (more while one record is larger); its numpy scan needs ~5 times that."""
STREAM_MAX_DEPTH = 512
"""Nesting depth above which `read_coco` leaves the file to `load_json` (orjson's limit is 1024)."""
FALLBACK_MAX_BYTES = 512 << 20
"""Invalid JSON up to this size is parsed whole by `load_json`, whose message (Python's json) is today's; larger
files get the streaming reader's message (orjson's, with the byte offset of the record)."""
_BRACKET = np.zeros(256, np.int8)
_BRACKET[[ord("{"), ord("[")]] = 1
_BRACKET[[ord("}"), ord("]")]] = -1
_IS_BRACKET = _BRACKET != 0


class _WholeFile(Exception):
    """`read_coco` cannot take this file record by record: it is parsed whole (`load_json`). ``syntax``: some
    record does not parse at all (an invalid file)."""

    def __init__(self, why: str, syntax: bool = False):
        super().__init__(why)
        self.syntax = syntax


class _NotOrjson(Exception):
    """A record that orjson refuses and Python's json takes: the file is read again with Python's json."""


def _brackets(a: np.ndarray, depth: int) -> tuple[np.ndarray, ...]:
    """The brackets of ``a`` (uint8 bytes of JSON text that starts outside any string, at nesting ``depth``) that
    are outside strings: ``(quote positions, bracket positions, bracket chars, depth before, depth after)`` of
    those at depth <= 2 (top-level object, its values, their elements), and the maximum and minimum depth.
    Strings are found from their unescaped quotes (a quote after an odd run of backslashes is escaped)."""
    n = len(a)
    quote = a == 34
    slashes = np.flatnonzero(a == 92)
    if len(slashes):                                    # runs of backslashes: [run_start, run_end)
        cut = np.flatnonzero(np.diff(slashes) != 1)
        run_start = slashes[np.concatenate(([0], cut + 1))]
        run_end = slashes[np.concatenate((cut, [len(slashes) - 1]))] + 1
        escaped = run_end[(run_end - run_start) % 2 == 1]
        quote[escaped[escaped < n]] = False
    q = np.flatnonzero(quote)
    b = np.flatnonzero(_IS_BRACKET[a])
    if len(q):
        b = b[np.searchsorted(q, b) % 2 == 0]
    if not len(b):
        return q, b, b, b, b, depth, depth
    delta = _BRACKET[a[b]].astype(np.int64)
    after = depth + np.cumsum(delta)
    before = after - delta
    keep = np.flatnonzero(np.minimum(before, after) <= 2)
    return q, b[keep], a[b[keep]], before[keep], after[keep], int(after.max()), int(after.min())


def _gap_values(gap: bytes, first: bool, last: bool, parse: Callable[[bytes], Any]) -> list:
    """The values between two bracketed elements of a top-level array (or its ends): ``gap`` must be the JSON
    separators, with any scalar elements (numbers, strings, literals) between them."""
    g = gap.strip(JSON_WS)
    if not first and not last:
        if g == b",":
            return []
        if len(g) < 2 or g[:1] != b"," or g[-1:] != b",":
            raise _WholeFile("elements not separated by commas", syntax=True)
        inner = g[1:-1]
    elif not g:
        return []
    elif not first:
        if g[:1] != b",":
            raise _WholeFile("elements not separated by commas", syntax=True)
        inner = g[1:]
    elif not last:
        if g[-1:] != b",":
            raise _WholeFile("elements not separated by commas", syntax=True)
        inner = g[:-1]
    else:
        inner = g
    if not inner.strip(JSON_WS):
        raise _WholeFile("empty array element", syntax=True)
    return parse(b"[" + inner + b"]")


def _scan(f, emit: Callable, parse: Callable[[bytes], Any]) -> bytes:
    """Read the JSON object in file ``f`` in chunks and call ``emit(key, index, offset, data, value)`` for each
    element of each of its top-level arrays, in file order: ``data`` is the element's bytes (an object or array;
    ``offset`` is where they start in the file) or None for a scalar element, which comes parsed as ``value``.
    Returns the *skeleton*: the file with each top-level array's elements replaced by the array's ordinal
    (``{"images": [0], "info": {...}, "annotations": [1], ...}``), for ``parse`` to check the rest of the file.

    Memory: one chunk (`CHUNK_BYTES`) or the largest element, and the skeleton.
    Raises:
        _WholeFile: not an object, nested deeper than `STREAM_MAX_DEPTH`, an images/annotations/categories array twice,
            or bytes that are not JSON around the elements.
    """
    skeleton: list[bytes] = []
    buf, base, depth, want, eof = b"", 0, 0, CHUNK_BYTES, False
    started = done = False
    open_array: list | None = None           # [key, ordinal, next index, gap start (file offset)] of the open array
    ordinal, arrays_seen = 0, set()
    skel_from = 0                       # file offset of the first byte not yet in the skeleton
    rec_start = 0
    while not done:
        more = f.read(want)
        eof = not more
        buf = buf + more if buf else more
        if not started:
            head = buf.lstrip(JSON_WS)
            if head[:1] != b"{":
                if head or eof:
                    raise _WholeFile("top level is not an object")
                continue
        a = np.frombuffer(buf, np.uint8)
        q, pos, chars, before, after, deepest, lowest = _brackets(a, depth)
        if deepest > STREAM_MAX_DEPTH:
            raise _WholeFile(f"nested deeper than {STREAM_MAX_DEPTH}")
        if lowest < 0:
            raise _WholeFile("more closing than opening brackets", syntax=True)
        commit, commit_depth = 0, depth  # buffer offset up to which all is taken, and the depth there
        for p, ch, b, af in zip(pos.tolist(), chars.tolist(), before.tolist(), after.tolist()):
            if open_array is None:
                if b == 1 and af == 2 and ch == 91:             # a top-level array value opens
                    k = int(np.searchsorted(q, p))
                    if k < 2 or q[k - 2] < commit or buf[q[k - 1] + 1:p].strip(JSON_WS) != b":":
                        raise _WholeFile("array value without a key", syntax=True)
                    key = parse(buf[q[k - 2]:q[k - 1] + 1])
                    if key in ("images", "annotations", "categories"):
                        if key in arrays_seen:
                            raise _WholeFile(f"key {key!r} twice")
                        arrays_seen.add(key)
                    skeleton.append(buf[skel_from - base:p + 1] + str(ordinal).encode())
                    open_array = [key, ordinal, 0, base + p + 1]
                    ordinal += 1
                    commit, commit_depth = p + 1, 2
                    continue
                started = True
                if b == 1 and af == 0:
                    done = True
                skeleton.append(buf[skel_from - base:p + 1])
                skel_from = base + p + 1
                commit, commit_depth = p + 1, af
                if done:
                    break
                continue
            if b == 2 and af == 3:                              # an element opens
                rec_start = p
            elif b == 3 and af == 2:                            # ... and closes
                key, _, index, gap = open_array
                for value in _gap_values(buf[gap - base:rec_start], index == 0, False, parse):
                    emit(key, index, None, None, value)
                    index += 1
                emit(key, index, base + rec_start, memoryview(buf)[rec_start:p + 1], None)
                open_array[2:] = [index + 1, base + p + 1]
                commit, commit_depth = p + 1, 2
            elif b == 2 and af == 1:                            # the array closes
                key, _, index, gap = open_array
                for value in _gap_values(buf[gap - base:p], index == 0, True, parse):
                    emit(key, index, None, None, value)
                    index += 1
                open_array = None
                skeleton.append(b"]")
                skel_from = base + p + 1
                commit, commit_depth = p + 1, 1
        if done:
            skeleton.append(buf[commit:] + f.read())
            break
        if eof:
            raise _WholeFile("the file ends inside the top-level object", syntax=True)
        want = CHUNK_BYTES if commit else 2 * want
        buf, base, depth = buf[commit:], base + commit, commit_depth
    return b"".join(skeleton)


@dataclasses.dataclass
class Columns:
    """One annotation file's records as compact columns in file order (what `read_coco` returns): its categories
    as given; per image record id (int64), width and height (int32, pixels) and UTF-8 file name (``names`` with
    end offsets ``name_ends``, which start with 0); per annotation record id, image_id (int64), and the offset and
    length in bytes of its JSON text in ``source`` (the annotation file itself, or a spill file written by
    `read_coco`), which parses with orjson when ``fast`` (the file parsed with orjson) and Python's json if not."""
    path: Path
    source: str
    fast: bool
    categories: list = dataclasses.field(default_factory=list)
    image_ids: array.array = dataclasses.field(default_factory=lambda: array.array("q"))
    widths: array.array = dataclasses.field(default_factory=lambda: array.array("i"))
    heights: array.array = dataclasses.field(default_factory=lambda: array.array("i"))
    names: bytearray = dataclasses.field(default_factory=bytearray)
    name_ends: array.array = dataclasses.field(default_factory=lambda: array.array("q", [0]))
    ann_ids: array.array = dataclasses.field(default_factory=lambda: array.array("q"))
    ann_image_ids: array.array = dataclasses.field(default_factory=lambda: array.array("q"))
    ann_starts: array.array = dataclasses.field(default_factory=lambda: array.array("q"))
    ann_lengths: array.array = dataclasses.field(default_factory=lambda: array.array("q"))

    def add_image(self, im: dict) -> None:
        """Append a `check_image`'d record."""
        self.image_ids.append(im["id"])
        self.widths.append(im["width"])
        self.heights.append(im["height"])
        self.names += im["file_name"].encode()
        self.name_ends.append(len(self.names))

    def add_annotation(self, ann: dict, start: int, length: int) -> None:
        """Append a `check_annotation`'d record whose JSON text is ``source[start:start + length]``."""
        self.ann_ids.append(ann["id"])
        self.ann_image_ids.append(ann["image_id"])
        self.ann_starts.append(start)
        self.ann_lengths.append(length)

    def name(self, k: int) -> str:
        """File name of the image record at file position ``k``."""
        return self.names[self.name_ends[k]:self.name_ends[k + 1]].decode()


def _parser(fast: bool) -> Callable[..., Any]:
    """``parse(data, where="")``: orjson (``fast``) or Python's json, as `load_json` would have parsed the text
    inside the whole file. Raises `_NotOrjson` where orjson refuses what Python's json takes, `_WholeFile`
    (syntax) where neither takes it."""
    def parse(data, where: str = "") -> Any:
        if fast:
            try:
                return orjson.loads(data)
            except orjson.JSONDecodeError as e:
                err = e
        try:
            value = json.loads(bytes(data))
        except (ValueError, RecursionError) as e:
            raise _WholeFile(f"{err if fast else e}{where}", syntax=True) from None
        if fast:
            raise _NotOrjson()
        return value
    return parse


def _stream(path: Path, fast: bool) -> Columns:
    """`read_coco` record by record (see there)."""
    cols = Columns(path, str(path), fast)
    errors: dict[str, StageError] = {}
    parse = _parser(fast)

    def emit(key: str, index: int, offset: int | None, data: memoryview | None, value: Any) -> None:
        if key not in ("images", "annotations", "categories"):
            if data is not None:
                parse(data, f" (the element at byte {offset})")     # checked, not kept
            return
        rec = value if data is None else parse(data, f" (the element at byte {offset})")
        if key == "categories":
            cols.categories.append(rec)
        elif key not in errors:                     # after a record's error only parsed: a later syntax error
            try:                                    # or non-orjson value still decides the message
                if key == "images":
                    check_image(rec, index, path)
                    cols.add_image(rec)
                else:
                    check_annotation(rec, index, path)
                    cols.add_annotation(rec, offset, len(data))
            except StageError as e:
                errors[key] = e

    try:
        with open(path, "rb") as f:
            skeleton = _scan(f, emit, parse)
    except OSError as e:
        raise StageError(f"{path}: cannot read ({e.strerror or e}) (rule 'json_invalid')") from None
    check_top(parse(skeleton, " (outside the top-level arrays)"), path)
    check_categories(cols.categories, path)
    for key in ("images", "annotations"):
        if key in errors:
            raise errors[key]
    return cols


def _whole(path: Path, spill_dir: Path) -> Columns:
    """`read_coco` by `load_json` + `check_coco`; the annotations are written to a spill file in ``spill_dir``."""
    data, fast = load_json(path)
    check_coco(data, path)
    fd, spill = tempfile.mkstemp(prefix=".annotations-", suffix=".json", dir=spill_dir)
    cols = Columns(path, spill, fast, data["categories"])
    for im in data["images"]:
        cols.add_image(im)
    offset = 0
    with os.fdopen(fd, "wb") as f:
        for ann in data["annotations"]:
            text = orjson.dumps(ann) if fast else json.dumps(ann, separators=(",", ":")).encode()
            f.write(text)
            cols.add_annotation(ann, offset, len(text))
            offset += len(text)
    return cols


def read_coco(path: Path, spill_dir: Path) -> Columns:
    """Read and check a COCO instances file into `Columns`, in bounded memory.

    The file is read in chunks of `CHUNK_BYTES`; the elements of its top-level arrays are found by their brackets
    (numpy, outside strings) and each is parsed alone with orjson, checked (`check_image`, `check_annotation`,
    `check_categories`, `check_top`) and reduced to columns; annotations are parsed again from the file by the
    worker that writes their shard. Memory: O(images) x ~30 bytes + file names, O(annotations) x 32 bytes, one
    chunk, the largest record, the categories and the top level without its arrays.

    The result, findings and errors are those of parsing the file whole (`load_json`) and `check_coco`: the
    elements are the same values (orjson parses the same text; a file with values only Python's json takes, such
    as NaN, is read again with Python's json, as `load_json` would); the first error of the order `check_coco`
    reports is raised after the whole file has been read (a later syntax error wins, as in a whole parse).
    Files the record reader cannot decide (not an object, nested deeper than `STREAM_MAX_DEPTH`, images,
    annotations or categories twice, invalid JSON up to `FALLBACK_MAX_BYTES`) are parsed whole by `load_json`,
    whose error message they then get; their annotations go to a spill file in ``spill_dir``.

    Raises:
        StageError: rules ``json_invalid``, ``json_too_deep``, ``coco_schema``, ``file_name_invalid`` (see
            `ERRORS`), naming the file (and the record).
    """
    if not path.is_file():
        raise StageError(f"{path}: annotation file not found (rule 'json_invalid')")
    try:
        try:
            return _stream(path, fast=True)
        except _NotOrjson:
            return _stream(path, fast=False)
    except _WholeFile as e:
        if e.syntax and path.stat().st_size > FALLBACK_MAX_BYTES:
            raise StageError(f"{path}: not valid JSON ({e}) (rule 'json_invalid')") from None
    return _whole(path, spill_dir)


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


def val_positions(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Positions (ascending, int64) among ``n`` sorted image ids that go to val: the first
    ``round(n * val_fraction)`` of ``numpy.random.default_rng(seed).permutation(n)``.

    Raises:
        StageError: ``seed`` is negative.
    """
    if seed < 0:
        raise StageError(f"convert.seed must be >= 0 (got {seed})")
    return np.sort(np.random.default_rng(seed).permutation(n)[:round(n * val_fraction)]).astype(np.int64)


def split_ids(ids: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/val split of image ids: sorted, then `val_positions` go to val.

    Returns:
        (train_ids, val_ids), each sorted ascending.
    Raises:
        StageError: ``seed`` is negative.
    """
    ids = sorted(ids)
    val = np.zeros(len(ids), bool)
    val[val_positions(len(ids), val_fraction, seed)] = True
    return ([i for i, v in zip(ids, val.tolist()) if not v], [i for i, v in zip(ids, val.tolist()) if v])


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
