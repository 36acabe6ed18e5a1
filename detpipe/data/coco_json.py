"""The convert stage's streaming reader of COCO instances files: `read_coco` (the file streamed in chunks, each
record of its top-level arrays found by its brackets and parsed alone with orjson, checked and reduced to
numpy-ready `Columns`), `load_json` (the whole parse, for the files the stream cannot decide) and `gc_paused` (the
collector's policy while parsing). `detpipe.data.coco_reader` indexes the columns and applies the annotation
rules; the schema, the rules tables and `Report` are `detpipe.data.coco_schema`'s.

Why not a library's streaming parser: ijson 3.6.0 with its C backend (yajl2_c; one pass, ``items(f, "")`` with
the complete records taken out of the arrays after each read, annotations written to a spill file) was measured on
the 488 MB file of ``python -m benchmarks.convert_memory`` (128,000 images): read + check + index 20.5 s against
this reader's 10.2 s (yajl's parse alone 14.1 s; re-serializing the annotations for the spill ~5 s), convert
74-89 s against 70-74 s (+6 to +26 %, 3 runs each, interleaved), over the 10 % allowed. yajl also refuses NaN and
Infinity (which Python's ``json.dumps`` writes), numbers beyond int64 or float64, and writes '?' for a lone
surrogate escape, so such files would still need the whole parse; and its prefixes cost O(depth^2) memory.
"""
from __future__ import annotations

import array
import contextlib
import dataclasses
import gc
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import orjson

from detpipe.data.coco_schema import check_annotation, check_categories, check_coco, check_image, check_top
from detpipe.core.errors import StageError

# ---------------------------------------------------------------------------------------------- parsing


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


# ---------------------------------------------------------------------------------------------- reading

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
