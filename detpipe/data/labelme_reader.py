"""The convert stage's reader of LabelMe datasets (``convert.format: labelme``; the JSON files of
wkentaro/labelme, one per image).

A LabelMe dataset is translated, streamed (one JSON file at a time), into COCO instances files in the output's
scratch folder, which the COCO path then reads: the validation rules, ``report.json``, the split's Arrow rows and
``meta.json`` are the COCO path's, shared (`detpipe.data.translate`: the reader interface, `detect` and `read`).

Layout (``data/raw``)::

    train/a.json  train/a.jpg   with both ``train/`` and ``val/`` folders: the JSON files under each (any depth)
    val/b.json    val/b.jpg     are that split; other files are not read
    x.json  x.jpg  sub/y.json   otherwise: every JSON file under data/raw (any depth) is train, split by
                                ``convert.val_fraction`` / ``seed``
    labels.txt                  optional: the class list (labelme's own examples' convention, below)

A LabelMe file: ``{"imagePath": str, "imageHeight": int, "imageWidth": int, "imageData": str | null,
"shapes": [{"label": str, "points": [[x, y], ...], "shape_type": str, "group_id": int | null, "flags": {}}]}``.
A ``.json`` file is taken as LabelMe when its first and last 64 KiB hold the keys ``"shapes"`` and ``"imagePath"``
(`is_labelme`; others are counted as ``json_not_labelme`` and skipped without being parsed, so a large COCO file
beside the data costs no memory).

Mapping rules (sources: labelme's ``LabelFile`` and ``examples/instance_segmentation/labelme2coco.py``, globox's
``BoundingBox.from_labelme``):

- Coordinates: LabelMe points are continuous pixel coordinates of the image as labelme shows it, that is after
  EXIF orientation (labelme's ``utils.apply_exif_orientation`` on load), with (0, 0) the top-left corner of the
  top-left pixel.
- ``rectangle`` (exactly 2 points, any two opposite corners in any order) -> COCO box ``[min x, min y,
  max x - min x, max y - min y]`` (as labelme2coco sorts the corners and globox takes min / max); area w * h.
- ``polygon`` (>= 3 points; a shape without ``shape_type`` is a polygon, as in labelme's ``LabelFile``) -> COCO
  segmentation ``[[x1, y1, x2, y2, ...]]``; box = the polygon's bounds; area = the polygon's (shoelace) area.
- ``group_id``: shapes of one file with the same label and the same non-null group_id are one object (labelme2coco's
  ``instance = (label, group_id)``): box = the union of their bounds, segmentation = their polygons (a rectangle
  part as its 4 corners, as labelme2coco writes it; no segmentation when every part is a rectangle), area = the
  sum of the parts' areas (overlaps counted twice; labelme2coco rasterizes the union instead); counted
  (``grouped_objects``). A shape with group_id null is an object of its own.
- Other shape types (``circle``, ``line``, ``point``, ``linestrip``, ``points``, ``mask``, any other) are not
  boxes: counted by type (``skipped_shapes``) and skipped.
- Image: ``imagePath`` relative to the JSON file's folder (``\\`` read as ``/``); absolute or outside data/raw is
  an error. Its size is the JSON's ``imageWidth`` x ``imageHeight``, which the COCO path checks against the file
  (stored or EXIF-displayed size; anything else is rule ``image_size_mismatch``: dropped with its objects). For
  EXIF orientations whose displayed size equals the stored one (2, 3, 4, and 5..8 on square images) the COCO
  path cannot tell the frames apart and maps from the stored raster, so the boxes are given to it in the stored
  frame (mapped back exactly). ``imageData`` (the image embedded as base64) is never decoded: the image is read
  from ``imagePath`` only (an image only embedded is ``image_missing``); files with imageData are counted.
- Categories: ``data/raw/labels.txt`` when present (one name a line, ``__ignore__`` and ``_background_`` lines
  left out, as in labelme's examples; ids 1..K in file order; a shape label not in it is counted
  ``labels_not_in_list`` and skipped, as labelme2coco skips it); else the sorted set of the rectangle and polygon
  labels over all files (ids 1..K; labelme itself keeps no class list). Names are compared exactly
  (case-sensitive).
- Split: ``train/`` and ``val/`` folders when both exist (each its own image-id space), else all files are train
  and the COCO path splits them by ``convert.val_fraction`` / ``seed``. Image ids are 1..n in sorted JSON path
  order per split.
- Negatives: a file whose shapes are empty (or all skipped) is a negative image (``images_without_objects``, and
  the COCO rule ``image_no_annotations``).
- Boxes outside the image: the COCO rules (``bbox_clipped``, ``bbox_outside``, ``bbox_nonpositive``), with the
  JSON file and shape named in ``report.json``'s examples (``record: "shape 3 (image id 2)"``, shapes counted from
  1 in the file's ``shapes`` list).
- Errors (`StageError`, exit 2, naming the file and shape): a file that is not JSON or not UTF-8 (rule
  ``labelme_json``), ``imagePath`` / ``imageWidth`` / ``imageHeight`` / ``shapes`` missing or of the wrong type
  (``labelme_json``); a shape that is not an object, a label that is not a string, points that are not ``[x, y]``
  pairs of finite numbers, a rectangle with a point count other than 2, a polygon with fewer than 3 points, a
  group_id that is not an integer (rule ``labelme_shape``). With ``convert.strict`` every count of the
  ``labelme`` section that drops data (``json_not_labelme``, ``skipped_shapes``, ``labels_not_in_list``) is an
  error too.

Memory: one JSON file at a time (parsed with orjson; an ``imageData`` string is held while its file is parsed,
never decoded); the stage keeps each JSON path (a Python string per image, as the YOLO reader) and the
`detpipe.data.translate.Translated` arrays. Without labels.txt the files are parsed twice (labels first, so that
the category ids are known before any annotation is written).
"""
from __future__ import annotations

import array
import dataclasses
import logging
import math
import os
import posixpath
import re
from pathlib import Path

import orjson

from detpipe.core.boxes import xyxy_to_xywh
from detpipe.data.coco_schema import polygon_area
from detpipe.data.translate import CocoWriter, Dataset, Translated, count_finding, displayed_fix, to_stored
from detpipe.core.errors import StageError

log = logging.getLogger(__name__)

MARKER = "LabelMe JSON files (shapes, imagePath)"
"""What ``convert.format: auto`` looks for (`detect`)."""
LABELS_TXT = "labels.txt"
SPLIT_DIRS = ("train", "val")
BOX_SHAPES = ("rectangle", "polygon")
"""LabelMe shape types that become COCO objects; every other type is counted and skipped."""
LIST_SKIPPED = ("__ignore__", "_background_")
"""labels.txt lines that are not classes (labelme's examples: ``__ignore__`` first, ``_background_`` id 0)."""
_PEEK = 1 << 16
_INT32_MAX = (1 << 31) - 1


def is_labelme(path: Path) -> bool:
    """Whether ``path`` looks like a LabelMe file: its first and last 64 KiB (all of a small file) hold the keys
    ``"shapes"`` and ``"imagePath"``. Reads at most 128 KiB, never parses; labelme writes ``shapes`` and
    ``imagePath`` before ``imageData``, globox ``imagePath`` first and ``shapes`` last, so both keys are in those
    bytes whatever the size of an embedded image."""
    try:
        with open(path, "rb") as f:
            head = f.read(_PEEK)
            size = os.fstat(f.fileno()).st_size
            if size > 2 * _PEEK:
                f.seek(size - _PEEK)
            tail = f.read()
    except OSError:
        return False
    text = head + tail
    return b'"shapes"' in text and b'"imagePath"' in text


def json_files(raw_root: Path, folder: str = "") -> list[str]:
    """The ``.json`` files under ``raw_root / folder`` (any depth, hidden folders left out), relative to
    ``raw_root`` with ``/``, sorted."""
    out = []
    for dirpath, dirnames, files in os.walk(raw_root / folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in files if f.lower().endswith(".json"))
    return sorted(os.path.relpath(f, raw_root).replace(os.sep, "/") for f in out)


def detect(raw_root: Path) -> Path | None:
    """The first (sorted walk) ``.json`` file under ``raw_root`` that `is_labelme`, else None."""
    for dirpath, dirnames, files in os.walk(raw_root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(files):
            if f.lower().endswith(".json") and is_labelme(Path(dirpath) / f):
                return Path(dirpath) / f
    return None


def split_files(raw_root: Path) -> dict[str, list[str]]:
    """The JSON files per split: ``{"train": [...], "val": [...]}`` from the ``train/`` and ``val/`` folders when
    both exist, else ``{"train": every JSON file under raw_root}`` (paths relative to raw_root, sorted)."""
    if all((raw_root / d).is_dir() for d in SPLIT_DIRS):
        return {d: json_files(raw_root, d) for d in SPLIT_DIRS}
    return {"train": json_files(raw_root)}


@dataclasses.dataclass
class LabelMeObject:
    """One COCO object of a LabelMe file: ``record`` (1-based index of its first shape in ``shapes``), label,
    box ``[x, y, w, h]`` and area in pixels (displayed frame), segmentation polygons or None, ``parts`` (shapes
    merged by group_id, 1 for a lone shape)."""
    record: int
    label: str
    box: list[float]
    area: float
    segmentation: list[list[float]] | None
    parts: int = 1


@dataclasses.dataclass
class LabelMeFile:
    """A parsed LabelMe file: ``image_path`` (as written), size in pixels, objects, skipped shapes
    (``[(index, shape_type)]``) and whether it embeds ``imageData``."""
    image_path: str
    width: int
    height: int
    objects: list[LabelMeObject]
    skipped: list[tuple[int, str]]
    image_data: bool


def _number(v) -> float | None:
    if type(v) is bool or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _merge(parts: list[tuple]) -> LabelMeObject:
    """One object from its shapes ``(index, label, (x0, y0, x1, y1), area, polygon or None)``: box = the union of
    the bounds, area = the sum, segmentation = the polygons (rectangles as their 4 corners) if any part is one."""
    x0 = min(p[2][0] for p in parts)
    y0 = min(p[2][1] for p in parts)
    x1 = max(p[2][2] for p in parts)
    y1 = max(p[2][3] for p in parts)
    seg = None
    if any(p[4] is not None for p in parts):
        seg = [p[4] if p[4] is not None else [p[2][0], p[2][1], p[2][2], p[2][1], p[2][2], p[2][3], p[2][0], p[2][3]]
               for p in parts]
    return LabelMeObject(parts[0][0], parts[0][1], xyxy_to_xywh(x0, y0, x1, y1), sum(p[3] for p in parts), seg,
                         len(parts))


def _points(pts, where: str) -> list[float]:
    if not isinstance(pts, list):
        raise StageError(f"{where}: 'points' must be a list of [x, y] (got {type(pts).__name__}) "
                         f"(rule 'labelme_shape')")
    out = []
    for j, p in enumerate(pts, 1):
        xy = [_number(v) for v in p] if isinstance(p, list) and len(p) == 2 else [None]
        if None in xy:
            raise StageError(f"{where}: point {j} ({str(p)[:60]}) is not [x, y] with two finite numbers "
                             f"(rule 'labelme_shape')")
        out.extend(xy)
    return out


def parse_file(path: Path) -> LabelMeFile | None:
    """Read and check one LabelMe file (``path`` names it in errors); None if it is JSON but not a LabelMe file
    (no ``shapes`` or no ``imagePath`` key at the top).

    Coordinates are pixels, as written (the displayed frame). Shapes with the same label and non-null group_id are
    merged into one object (see the module docstring); objects are in the order of their first shape.
    Raises:
        StageError: rule ``labelme_json`` (not JSON, not UTF-8, bad top-level keys) or ``labelme_shape`` (a shape
            that is not an object, a non-string label, points that are not [x, y] pairs of finite numbers, a
            rectangle without exactly 2 points, a polygon with fewer than 3, a non-integer group_id), naming the
            file and the shape (1-based index in ``shapes``).
    """
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise StageError(f"{path}: not a valid JSON file ({e}) (rule 'labelme_json')") from None
    except OSError as e:
        raise StageError(f"{path}: cannot read ({e.strerror or e}) (rule 'labelme_json')") from None
    if not isinstance(data, dict) or "shapes" not in data or "imagePath" not in data:
        return None
    image_path, shapes = data["imagePath"], data["shapes"]
    if not isinstance(image_path, str) or not image_path:
        raise StageError(f"{path}: 'imagePath' must be a non-empty string (rule 'labelme_json')")
    if not isinstance(shapes, list):
        raise StageError(f"{path}: 'shapes' must be a list (rule 'labelme_json')")
    size = []
    for key in ("imageWidth", "imageHeight"):
        v = data.get(key)
        if type(v) is not int or not 1 <= v <= _INT32_MAX:
            raise StageError(f"{path}: '{key}' must be a positive integer (got {str(v)[:40]}) (rule 'labelme_json')")
        size.append(v)
    parts: dict[object, list[tuple]] = {}      # object key -> its shapes, in order of first shape
    skipped = []
    for k, s in enumerate(shapes, 1):
        where = f"{path}, shape {k}"
        if not isinstance(s, dict):
            raise StageError(f"{where}: must be an object (rule 'labelme_shape')")
        kind = s.get("shape_type") or "polygon"
        if not isinstance(kind, str):
            raise StageError(f"{where}: 'shape_type' must be a string (rule 'labelme_shape')")
        if kind not in BOX_SHAPES:
            skipped.append((k, kind))
            continue
        label, group = s.get("label"), s.get("group_id")
        if not isinstance(label, str):
            raise StageError(f"{where}: 'label' must be a string (got {str(label)[:40]}) (rule 'labelme_shape')")
        if group is not None and type(group) is not int:
            raise StageError(f"{where}: 'group_id' must be an integer or null (got {str(group)[:40]}) "
                             f"(rule 'labelme_shape')")
        xy = _points(s.get("points"), where)
        n = len(xy) // 2
        xs, ys = xy[0::2], xy[1::2]
        bounds = (min(xs), min(ys), max(xs), max(ys))
        if kind == "rectangle":
            if n != 2:
                raise StageError(f"{where}: a rectangle has {n} points; LabelMe writes a rectangle as 2 opposite "
                                 f"corners (rule 'labelme_shape')")
            poly, area = None, (bounds[2] - bounds[0]) * (bounds[3] - bounds[1])
        else:
            if n < 3:
                raise StageError(f"{where}: a polygon has {n} points, at least 3 are needed (rule 'labelme_shape')")
            poly, area = xy, polygon_area(xy)
        key = (label, group) if group is not None else k
        parts.setdefault(key, []).append((k, label, bounds, area, poly))
    objects = [_merge(p) for p in parts.values()]
    return LabelMeFile(image_path, size[0], size[1], objects, skipped, bool(data.get("imageData")))


_WINDOWS_ABS = re.compile(r"^[A-Za-z]:/")


def image_rel(json_rel: str, image_path: str, where: str) -> str:
    """The image of the JSON file ``json_rel`` (relative to raw_root): ``imagePath`` resolved against the JSON's
    folder, relative to raw_root with ``/``.

    Raises:
        StageError: ``imagePath`` absolute or outside raw_root (rule ``labelme_json``).
    """
    p = image_path.replace("\\", "/")
    if p.startswith("/") or _WINDOWS_ABS.match(p):
        raise StageError(f"{where}: imagePath {image_path!r} is absolute; it must be relative to the JSON file's "
                         f"folder (rule 'labelme_json')")
    rel = posixpath.normpath(posixpath.join(posixpath.dirname(json_rel), p))
    if rel == ".." or rel.startswith("../"):
        raise StageError(f"{where}: imagePath {image_path!r} points outside data/raw (rule 'labelme_json')")
    return rel


def read_labels_txt(path: Path) -> list[str]:
    """Class names of labelme's ``labels.txt``: one a line, blank lines and ``__ignore__`` / ``_background_`` left
    out, in file order.

    Raises:
        StageError: not UTF-8, a name twice, or no name (rule ``labelme_labels``).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not UTF-8 text (byte {e.start}) (rule 'labelme_labels')") from None
    names = [n.strip() for n in lines if n.strip() and n.strip() not in LIST_SKIPPED]
    seen = set()
    for n in names:
        if n in seen:
            raise StageError(f"{path}: class {n!r} is listed twice (rule 'labelme_labels')")
        seen.add(n)
    if not names:
        raise StageError(f"{path}: lists no class (rule 'labelme_labels')")
    return names


def to_coco(raw_root: Path, files: list[str], split: str, cat: dict[str, int], out: Path, section: dict) \
        -> Translated:
    """Translate one split's LabelMe files (relative to ``raw_root``) into the COCO instances file ``out``
    (streamed: one file at a time, through `detpipe.data.translate.CocoWriter`), category ids from ``cat``
    (label -> id). ``section`` (report.json's ``labelme``) gets the counts with examples.

    Raises:
        StageError: see `parse_file` and `image_rel`.
    """
    t = Translated(out, f"{raw_root} (LabelMe '{split}' files)", files, str, "shape", image_file=array.array("q"))
    writer = CocoWriter(t)
    for k, rel in enumerate(files):
        path = raw_root / rel
        doc = parse_file(path)
        if doc is None:
            count_finding(section, "json_not_labelme", {"split": split, "file": str(path),
                                                 "detail": "no 'shapes' or 'imagePath' key at the top; skipped"})
            continue
        image = image_rel(rel, doc.image_path, str(path))
        image_id = writer.image(image, doc.width, doc.height)
        t.image_file.append(k)          # findings about the image name its LabelMe file
        fix = displayed_fix(raw_root / image, doc.width, doc.height)
        if doc.image_data:
            section["image_data_not_decoded"] = section.get("image_data_not_decoded", 0) + 1
        for index, kind in doc.skipped:
            count_finding(section, "skipped_shapes", {"split": split, "file": str(path), "record": f"shape {index}",
                                               "detail": f"shape_type {kind!r} is not a box; skipped"}, by=kind)
        written = 0
        for obj in doc.objects:
            if obj.label not in cat:
                count_finding(section, "labels_not_in_list", {"split": split, "file": str(path),
                                                       "record": f"shape {obj.record}",
                                                       "detail": f"label {obj.label!r} is not in {LABELS_TXT}; "
                                                                 f"skipped"})
                continue
            box, seg = obj.box, obj.segmentation
            if fix is not None:
                box, seg = to_stored(box, seg, fix)
            if obj.parts > 1:
                count_finding(section, "grouped_objects", {"split": split, "file": str(path), "record": f"shape {obj.record}",
                                                    "detail": f"{obj.parts} shapes of label {obj.label!r} with one "
                                                              f"group_id merged into one object"})
            writer.annotation(image_id, cat[obj.label], box, obj.area, 0, k, obj.record, seg)
            written += 1
        if not written:
            count_finding(section, "images_without_objects", {"split": split, "file": str(path),
                                                       "detail": "no rectangle or polygon; kept as a negative"})
    return writer.close([{"id": i, "name": n} for n, i in cat.items()])


_DROPS = ("json_not_labelme", "skipped_shapes", "labels_not_in_list")


def read(raw_root: Path, params, tmp: Path) -> Dataset:
    """The LabelMe dataset in ``raw_root`` translated into COCO files under ``tmp`` (`detpipe.data.translate`
    reader interface; ``params``: the ``convert`` section, for ``strict``).

    Raises:
        StageError: no LabelMe file (in train, or in a val folder), a bad labels.txt, a malformed file (see
            `parse_file`); with ``params.strict``, any data the ``labelme`` section counts as dropped.
    """
    splits = split_files(raw_root)
    section: dict = {"split": "train/ and val/ folders" if "val" in splits else "convert.val_fraction",
                     "label_list": None}
    for key in _DROPS + ("images_without_objects", "grouped_objects"):
        section[key] = {"count": 0, "examples": []}
    section["skipped_shapes"]["by_type"] = {}
    section["image_data_not_decoded"] = 0
    files: dict[str, list[str]] = {}
    for split, rels in splits.items():
        files[split] = []
        for rel in rels:
            if is_labelme(raw_root / rel):
                files[split].append(rel)
            else:
                count_finding(section, "json_not_labelme", {"split": split, "file": str(raw_root / rel),
                                                     "detail": "no 'shapes' and 'imagePath' keys; skipped"})
        if not files[split]:
            where = raw_root / split if "val" in splits else raw_root
            raise StageError(f"{where}: no LabelMe JSON file (with 'shapes' and 'imagePath') for the {split} split "
                             f"(convert.format labelme)")
    section["json_files"] = {s: len(f) for s, f in files.items()}
    labels_txt = raw_root / LABELS_TXT
    if labels_txt.is_file():
        names = read_labels_txt(labels_txt)
        section["label_list"] = str(labels_txt)
    else:
        used: set[str] = set()
        for rels in files.values():
            for rel in rels:
                doc = parse_file(raw_root / rel)
                if doc is not None:
                    used.update(o.label for o in doc.objects)
        names = sorted(used)
        if not names:
            raise StageError(f"{raw_root}: the LabelMe files hold no rectangle or polygon, so no class "
                             f"(convert.format labelme)")
    section["names"] = names
    cat = {n: i for i, n in enumerate(names, 1)}
    translated = {split: to_coco(raw_root, rels, split, cat, tmp / f".labelme-{split}.json", section)
                  for split, rels in files.items()}
    if params.strict:
        for key in _DROPS:
            if section[key]["count"]:
                ex = section[key]["examples"][0]
                rec = f", {ex['record']}" if "record" in ex else ""
                raise StageError(f"{ex['file']}{rec}: {ex['detail']} (rule '{key}'; counted unless strict) "
                                 f"(convert.strict is true)")
    return Dataset("labelme", raw_root, [{"id": i, "name": n} for n, i in cat.items()], translated, section)
