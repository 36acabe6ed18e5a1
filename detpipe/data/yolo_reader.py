"""The convert stage's reader of YOLO datasets (Ultralytics layout; ``convert.format: yolo``).

A YOLO dataset is translated, streamed, into COCO instances files in the output's scratch folder (`to_coco`), which
the COCO path then reads: the validation rules, ``report.json``, the split's Arrow rows and ``meta.json`` are the
COCO path's, shared (`detpipe.data.translate`: the reader interface, `detect` and `read`).

Layout (``data/raw``)::

    data.yaml             names: [a, b, ...] or {0: a, 1: b, ...}; train: / val: a folder of images, a .txt file
                          listing image paths, or a list of those; optional path: (the dataset root)
    images/train/x.jpg    each image's label file is its path with the last ``images`` folder replaced by
    labels/train/x.txt    ``labels`` and the suffix by ``.txt`` (Ultralytics' ``img2label_paths``)

Mapping rules:

- Image size: read from the image file's header (PIL ``Image.open(...).size``) and taken after EXIF orientation
  (the displayed frame, as `detpipe.data.imageio.decode_rgb` and Ultralytics' loader show the image); labels are
  normalized to that frame. Never assumed.
- Box line ``class cx cy w h`` (normalized to [0, 1]) -> COCO ``[x, y, w, h]`` pixels:
  ``x = (cx - w / 2) * W``, ``y = (cy - h / 2) * H``, ``w * W``, ``h * H`` (float64, then float32 as stored);
  ``area = w * h`` in pixels^2.
- Polygon line ``class x1 y1 x2 y2 ...`` (>= 3 points, normalized) -> the polygon in pixels as COCO segmentation
  ``[[x1 * W, y1 * H, ...]]``; box = the polygon's bounds; area = the polygon's (shoelace) area.
- Class ids: category id = the YOLO class index (0-based, as written in the label files; COCO allows any int64 id,
  so the ids that ``predict`` and the model card show are the dataset's own), name = ``names[index]``; the Arrow
  ``label`` is then index + 1 (0 = background). A class index outside ``names`` is an error.
- Split: ``train`` images -> train, ``val`` images -> val (their own image-id space); without ``val`` the train
  images are split by ``convert.val_fraction`` / ``seed``. Image ids are 1..n in sorted path order per split.
- Negatives: an image without a label file (or with an empty one) is a negative (counted: ``images_without_labels``
  in ``report.json``'s ``yolo`` section, and the COCO rule ``image_no_annotations``).
- Boxes outside the image: the COCO rules (``bbox_clipped``, ``bbox_outside``, ``bbox_nonpositive``) with the label
  file and line named in ``report.json``'s examples.
- A label file without an image: counted (``labels_without_image``) and skipped.
- Errors (`StageError`, exit 2, naming the file and line): a line with a count of values other than 5 or an odd
  number >= 7, a value that is not a finite number, a class id that is not an integer or outside ``names``; a
  missing or malformed ``data.yaml``; a listed image folder or list file that does not exist.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from pathlib import Path
import yaml
from PIL import Image, UnidentifiedImageError

from detpipe.core.boxes import cxcywh_to_xywh
from detpipe.data.coco_schema import polygon_area
from detpipe.data.translate import (CocoWriter, Dataset, Translated, count_finding, image_size, needs_stored_frame,
                                    to_stored)
from detpipe.core.errors import StageError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".bmp", ".dng", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp"}
"""Image file suffixes (lower case) a YOLO image folder is searched for (Ultralytics' ``IMG_FORMATS``)."""
DATA_YAML = ("data.yaml", "data.yml")


MARKER = "data.yaml with names"
"""What ``convert.format: auto`` looks for (`detect`)."""


def detect(raw_root: Path) -> Path | None:
    """``data.yaml`` (or ``data.yml``) at the top of ``raw_root`` that has a ``names`` key (or is malformed: still
    YOLO's file; `read` names the error), else None."""
    for name in DATA_YAML:
        p = raw_root / name
        if p.is_file():
            try:
                data = yaml.safe_load(p.read_text())
            except (yaml.YAMLError, UnicodeDecodeError):
                return p
            if isinstance(data, dict) and "names" in data:
                return p
    return None


@dataclasses.dataclass
class YoloData:
    """A parsed ``data.yaml``: its path, ``names`` (index -> name, 0..K-1) and the image paths per split
    (relative to raw_root, sorted; ``val`` None when data.yaml has none)."""
    path: Path
    names: list[str]
    train: list[str]
    val: list[str] | None


def _names(data: dict, path: Path) -> list[str]:
    names = data.get("names")
    if isinstance(names, dict):
        keys = sorted(names)
        if not all(isinstance(k, int) and not isinstance(k, bool) for k in keys) or keys != list(range(len(keys))):
            raise StageError(f"{path}: 'names' as a mapping must have the keys 0..K-1 (got {keys[:10]!r})")
        names = [names[k] for k in keys]
    if not isinstance(names, list) or not names or not all(isinstance(n, (str, int)) for n in names):
        raise StageError(f"{path}: 'names' must be a non-empty list of class names or a {{index: name}} mapping")
    names = [str(n) for n in names]
    if len(set(names)) != len(names):
        raise StageError(f"{path}: 'names' lists a class name twice")
    return names


def _images(entry, base: Path, raw_root: Path, path: Path, key: str) -> list[str]:
    """Image paths (relative to ``raw_root``, sorted) of one ``train``/``val`` entry of data.yaml."""
    out: list[str] = []
    for item in entry if isinstance(entry, list) else [entry]:
        if not isinstance(item, str):
            raise StageError(f"{path}: '{key}' must be a path or a list of paths (got {item!r:.60})")
        p = base / item
        if not p.exists() and item.startswith("../"):    # Ultralytics' fallback for Roboflow's '../train/images'
            p = base / item[3:]
        if p.is_dir():
            for dirpath, dirnames, files in os.walk(p):
                dirnames.sort()
                out.extend(os.path.join(dirpath, f) for f in files if Path(f).suffix.lower() in IMAGE_SUFFIXES)
        elif p.is_file() and p.suffix == ".txt":
            for line in p.read_text().splitlines():
                line = line.strip()
                if line:
                    out.append(line if os.path.isabs(line) else str(p.parent / line))
        else:
            raise StageError(f"{path}: '{key}' entry {item!r}: no such folder or .txt list ({p})")
    root = os.path.abspath(raw_root)
    rel = []
    for f in out:
        r = os.path.relpath(os.path.abspath(f), root)
        if r.startswith(".."):
            raise StageError(f"{path}: '{key}' lists {f}, outside {raw_root} (images must be inside data/raw)")
        rel.append(r.replace(os.sep, "/"))
    return sorted(set(rel))


def read_data_yaml(raw_root: Path) -> YoloData:
    """Parse ``raw_root/data.yaml``: ``names`` and the ``train``/``val`` image lists.

    Paths in it are relative to its ``path`` key (itself relative to the yaml's folder), else to the yaml's folder.
    Raises:
        StageError: no data.yaml, malformed YAML, bad ``names``, missing ``train``, a listed folder not found.
    """
    path = next((raw_root / n for n in DATA_YAML if (raw_root / n).is_file()), raw_root / DATA_YAML[0])
    if not path.is_file():
        raise StageError(f"{path}: YOLO data.yaml not found (convert.format yolo)")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise StageError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise StageError(f"{path}: must be a mapping with 'names', 'train' and optionally 'val'")
    names = _names(data, path)
    base = path.parent      # a .txt list's relative lines are relative to the list's folder (Ultralytics: './x')
    if isinstance(data.get("path"), str):
        cand = base / data["path"]
        if cand.is_dir():
            base = cand
    if "train" not in data:
        raise StageError(f"{path}: missing key 'train'")
    train = _images(data["train"], base, raw_root, path, "train")
    val = _images(data["val"], base, raw_root, path, "val") if data.get("val") else None
    return YoloData(path, names, train, val)


def label_path(image: str) -> str:
    """The label file of image path ``image`` (relative, '/'-separated): the last ``images`` folder replaced by
    ``labels``, the suffix by ``.txt``; an image without an ``images`` folder has its label beside it."""
    parts = image.split("/")
    for k in range(len(parts) - 2, -1, -1):
        if parts[k] == "images":
            parts[k] = "labels"
            break
    stem = parts[-1].rsplit(".", 1)[0]
    return "/".join(parts[:-1] + [stem + ".txt"])


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_label_line(line: str, file: str, lineno: int, num_classes: int) -> tuple[int, list[float]]:
    """One label line -> ``(class index, values)``: 4 normalized box values ``cx cy w h`` or 2n >= 6 polygon
    coordinates ``x1 y1 ...``.

    Raises:
        StageError: ``<file>:<line>: ...`` for a wrong count of values, a non-number, a class id that is not an
            integer in [0, len(names)).
    """
    vals = line.split()
    if len(vals) != 5 and (len(vals) < 7 or len(vals) % 2 == 0):
        raise StageError(f"{file}:{lineno}: {len(vals)} values; a YOLO label line is 'class cx cy w h' (5) or "
                         f"'class x1 y1 x2 y2 x3 y3 ...' (odd, >= 7) (rule 'yolo_label_line')")
    cls = vals[0]
    try:
        c = float(cls) if _NUMBER.match(cls) else math.nan
    except ValueError:
        c = math.nan
    if not math.isfinite(c) or c != int(c):
        raise StageError(f"{file}:{lineno}: class id {cls!r:.40} is not an integer (rule 'yolo_class_id')")
    c = int(c)
    if not 0 <= c < num_classes:
        raise StageError(f"{file}:{lineno}: class id {c} is outside data.yaml's names (0..{num_classes - 1}) "
                         f"(rule 'yolo_class_id')")
    out = []
    for k, v in enumerate(vals[1:], 1):
        if not _NUMBER.match(v):
            raise StageError(f"{file}:{lineno}: value {k + 1} ({v!r:.40}) is not a finite number "
                             f"(rule 'yolo_label_line')")
        out.append(float(v))
    return c, out


def to_coco(data: YoloData, images: list[str], raw_root: Path, out: Path, split: str, report: dict) -> Translated:
    """Translate one split's images and their label files into the COCO instances file ``out`` (streamed: one
    image's labels at a time, through `detpipe.data.translate.CocoWriter`).

    ``report`` (the ``yolo`` section of report.json) gets ``images_without_labels`` counted with examples.
    Unreadable images are written with size 1x1 so that the COCO path counts them (rule ``image_unreadable``).
    Raises:
        StageError: a malformed label line (see `parse_label_line`), naming the file and line.
    """
    t = Translated(out, f"{data.path} ('{split}' images)", images, label_path, "line")
    writer = CocoWriter(t)
    report.setdefault("images_without_labels", {"count": 0, "examples": []})
    for k, rel in enumerate(images):
        try:
            w, h, orient = image_size(raw_root / rel)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError):
            w, h, orient = 1, 1, 1      # the COCO path reads the file again and counts it as unreadable
        image_id = writer.image(rel, w, h)
        lab = label_path(rel)
        try:
            f = open(raw_root / lab, encoding="utf-8", errors="strict")
        except FileNotFoundError:
            count_finding(report, "images_without_labels", {"split": split, "file": str(raw_root / rel),
                                                            "detail": f"no label file {lab}; kept as a negative"})
            continue
        with f:
            try:
                lines = list(enumerate(f, 1))
            except UnicodeDecodeError as e:
                raise StageError(f"{raw_root / lab}: not UTF-8 text (byte {e.start}) "
                                 f"(rule 'yolo_label_line')") from None
        for lineno, line in lines:
            if not line.strip():
                continue
            cls, v = parse_label_line(line, str(raw_root / lab), lineno, len(data.names))
            seg = None
            if len(v) == 4:
                cx, cy, bw, bh = v
                box = [c * s for c, s in zip(cxcywh_to_xywh(cx, cy, bw, bh), (w, h, w, h))]
                area = box[2] * box[3]
            else:
                xy = [c * (w if i % 2 == 0 else h) for i, c in enumerate(v)]
                xs, ys = xy[0::2], xy[1::2]
                box = [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]
                seg = [xy]
                area = polygon_area(xy)
            if needs_stored_frame(w, h, orient):
                # the COCO path maps boxes from the stored raster when the size does not tell the frames
                # apart: give it the stored-raster box, which it maps back to the displayed frame
                box, seg = to_stored(box, seg, (w, h, orient))
            writer.annotation(image_id, cls, box, area, 0, k, lineno, seg)
    return writer.close(categories(data))


def categories(data: YoloData) -> list[dict]:
    """The COCO categories of ``data``: id = class index, name = ``names[index]``."""
    return [{"id": i, "name": n} for i, n in enumerate(data.names)]


def read(raw_root: Path, params, tmp: Path) -> Dataset:
    """The YOLO dataset in ``raw_root`` translated into COCO files under ``tmp`` (`detpipe.data.translate` reader
    interface; ``params``: the ``convert`` section, for ``strict``).

    Raises:
        StageError: see the module docstring; with ``params.strict``, a label file of no listed image.
    """
    data = read_data_yaml(raw_root)
    section: dict = {"data_yaml": str(data.path), "names": data.names}
    if not data.train:
        raise StageError(f"{data.path}: 'train' lists no images")
    translated = {"train": to_coco(data, data.train, raw_root, tmp / ".yolo-train.json", "train", section)}
    if data.val:
        translated["val"] = to_coco(data, data.val, raw_root, tmp / ".yolo-val.json", "val", section)
    labels_without_image(data, raw_root, section)
    if params.strict and section["labels_without_image"]["count"]:
        ex = section["labels_without_image"]["examples"][0]
        raise StageError(f"{ex['file']}: label file of no listed image (rule 'labels_without_image'; skipped unless "
                         f"strict) (convert.strict is true)")
    return Dataset("yolo", data.path, categories(data), translated, section)


def labels_without_image(data: YoloData, raw_root: Path, report: dict) -> None:
    """Count (``labels_without_image`` in ``report``, first 5 examples) the ``.txt`` files in the label folders of
    the listed images that belong to no listed image; they are skipped."""
    report.setdefault("labels_without_image", {"count": 0, "examples": []})
    wanted = {label_path(p) for p in data.train + (data.val or [])}
    folders = sorted({os.path.dirname(p) for p in wanted})
    for folder in folders:
        d = raw_root / folder
        if not d.is_dir():
            continue
        for name in sorted(os.listdir(d)):
            rel = f"{folder}/{name}" if folder else name
            if name.endswith(".txt") and rel not in wanted and name not in ("classes.txt",):
                count_finding(report, "labels_without_image", {"file": str(raw_root / rel),
                                                               "detail": "no image with this stem is listed; skipped"})
