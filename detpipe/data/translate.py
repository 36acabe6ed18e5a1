"""What the convert stage's readers of non-COCO formats share: each translates its dataset, streamed, into COCO
instances files in the output's scratch folder, which the COCO path then reads (one set of validation rules, one
``report.json``, one Arrow writer), and keeps, per annotation, where it came from so that findings and errors name
the user's own file and record instead of the generated COCO file.

A reader is a module registered in `detpipe.data.convert.READERS` (``convert.format`` name -> module, imported
there so that dvc.yaml lists it as a dep of convert) with ``MARKER`` (what ``format: auto`` looks for, in words)
and:

- ``detect(raw_root: Path) -> Path | None``: the file that marks the format in ``raw_root`` (for ``format: auto``),
  or None;
- ``read(raw_root: Path, params: Convert, tmp: Path) -> Dataset``: the translation (COCO files written under
  ``tmp`` with `CocoWriter`), raising `detpipe.core.errors.StageError` naming the file and record for malformed input.
"""
from __future__ import annotations

import array
import dataclasses
import re
from pathlib import Path
from typing import Callable

import orjson
from PIL import Image, UnidentifiedImageError

from detpipe.data.coco_schema import MAX_EXAMPLES


_INVERSE = {2: 2, 3: 3, 4: 4, 5: 5, 6: 8, 7: 7, 8: 6}     # EXIF orientation -> its inverse


def count_finding(section: dict, key: str, example: dict, by: str | None = None) -> None:
    """Count one finding of a format reader in its ``report.json`` section: ``section[key]`` becomes
    ``{"count", "examples"}`` (the first `detpipe.data.coco_schema.MAX_EXAMPLES` examples, as the COCO path's rules
    keep them) and, with ``by``, ``"by_type"``: counts per kind (e.g. a skipped shape's type). The one counter of
    the YOLO, VOC, LabelMe and CVAT readers (the COCO path's rules go through `coco_schema.Report`)."""
    entry = section.setdefault(key, {"count": 0, "examples": []})
    entry["count"] += 1
    if by is not None:
        by_type = entry.setdefault("by_type", {})
        by_type[by] = by_type.get(by, 0) + 1
    if len(entry["examples"]) < MAX_EXAMPLES:
        entry["examples"].append(example)


def image_size(path: Path) -> tuple[int, int, int]:
    """``(width, height, orientation)``: the image's displayed size in pixels (after EXIF orientation, from the
    header only) and its EXIF orientation (1 when none or unknown). Raises OSError / PIL errors for unreadable
    files (the caller counts them through the COCO path)."""
    with Image.open(path) as im:
        w, h = im.size
        o = im.getexif().get(0x0112, 1)
    if o not in _INVERSE:
        o = 1
    return (h, w, o) if o in (5, 6, 7, 8) else (w, h, o)


def needs_stored_frame(width: int, height: int, orientation: int) -> bool:
    """Whether annotations given in the displayed frame of an image whose displayed size is ``width`` x ``height``
    must be handed to the COCO path in the stored frame (`to_stored`): EXIF orientation 2..8 and a displayed size
    equal to the stored one (2, 3, 4; 5..8 on square images), which the COCO path takes as stored-raster
    coordinates."""
    return orientation != 1 and (orientation in (2, 3, 4) or width == height)


def displayed_fix(path: Path, width: int, height: int) -> tuple[int, int, int] | None:
    """``(width, height, orientation)`` of the image file ``path`` (displayed size in pixels, from the header) when
    its annotations, given in the displayed frame with the size ``width`` x ``height``, must be handed to the COCO
    path in the stored frame (`needs_stored_frame`). Else None (also for an unreadable file, which the COCO path
    counts)."""
    try:
        w, h, orient = image_size(path)
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError):
        return None
    return (w, h, orient) if (w, h) == (width, height) and needs_stored_frame(w, h, orient) else None


def to_stored(box: list[float], seg: list | None, fix: tuple[int, int, int]) -> tuple[list[float], list | None]:
    """``box`` / ``seg`` (pixels, displayed frame) in the stored raster of the image ``fix`` = ``(width, height,
    orientation)`` describes (displayed size), so that the COCO path's mapping from the stored raster gives them
    back."""
    from detpipe.data.geometry import orient_box, orient_segmentation

    w, h, orient = fix
    box = orient_box(box, w, h, _INVERSE[orient])
    if seg is not None:
        seg = orient_segmentation(seg, w, h, _INVERSE[orient])
    return box, seg


@dataclasses.dataclass
class Translated:
    """What `CocoWriter` wrote for one split: the COCO file, and per annotation id (1..m, index id - 1) the source
    file (``files[ann_file[id - 1]]``, relative to raw_root, passed through ``file_of``) and record number
    (``ann_record``: a line for YOLO, the object's 1-based position in its file for the XML/JSON formats, named by
    ``record_word``), for naming findings; ``class_counts``: category id -> annotations written; ``image_file``
    (formats with one annotation file per image, filled by the reader): per image id (index id - 1) the index into
    ``files`` of the file that named the image, so that findings about the image name that file."""
    json_path: Path
    source: str = ""            # how messages name the split: "<data.yaml> ('val' images)"
    files: list[str] = dataclasses.field(default_factory=list)
    file_of: Callable[[str], str] = str
    record_word: str = "line"
    ann_file: array.array = dataclasses.field(default_factory=lambda: array.array("q"))
    ann_record: array.array = dataclasses.field(default_factory=lambda: array.array("i"))
    class_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    image_file: array.array | None = None   # None: findings about an image keep naming the image file

    def where(self, ann_id: int) -> tuple[str, str] | None:
        """``(source file relative to raw_root, "line 3")`` of annotation ``ann_id``, or None."""
        if not 1 <= ann_id <= len(self.ann_record):
            return None
        return (self.file_of(self.files[self.ann_file[ann_id - 1]]),
                f"{self.record_word} {self.ann_record[ann_id - 1]}")


@dataclasses.dataclass
class Dataset:
    """A translated dataset: its ``format``, the file that describes it (``source``: data.yaml, the annotation
    folder, annotations.xml), its categories (``[{"id", "name"}]``, the dataset's own ids), the `Translated` per split
    (``"train"``, and ``"val"`` when the dataset has its own val split; else the COCO path splits train by
    ``convert.val_fraction``) and report.json's section for the format (counts with examples)."""
    format: str
    source: Path
    categories: list[dict]
    translated: dict[str, Translated]
    section: dict


class CocoWriter:
    """Streams one split into a COCO instances file: image records and annotations go to two scratch files, joined
    with the categories by `close` (memory: the `Translated` arrays, 12 bytes per annotation).

    Images get ids 1..n in call order; annotations 1..m."""

    def __init__(self, t: Translated):
        self.t = t
        self._ims = open(t.json_path.with_suffix(".images"), "wb")
        self._anns = open(t.json_path.with_suffix(".anns"), "wb")
        self.images = 0
        self.annotations = 0

    def image(self, file_name: str, width: int, height: int) -> int:
        """Add an image record (``file_name`` relative to raw_root, size in pixels as displayed); its id."""
        self.images += 1
        self._ims.write((b"," if self.images > 1 else b"") + orjson.dumps(
            {"id": self.images, "file_name": file_name, "width": width, "height": height}))
        return self.images

    def annotation(self, image_id: int, category_id: int, bbox: list[float], area: float, iscrowd: int,
                   file_index: int, record: int, segmentation: list | None = None, **extra) -> None:
        """Add an annotation (COCO ``bbox`` ``[x, y, w, h]`` and ``segmentation`` polygons in pixels, ``area`` in
        pixels^2) read from ``files[file_index]``'s record ``record``; ``extra`` keys go into the record as they are
        (e.g. ``attributes``)."""
        self.annotations += 1
        rec = {"id": self.annotations, "image_id": image_id, "category_id": category_id, "bbox": bbox,
               "area": area, "iscrowd": iscrowd, **extra}
        if segmentation is not None:
            rec["segmentation"] = segmentation
        self._anns.write((b"," if self.annotations > 1 else b"") + orjson.dumps(rec))
        self.t.ann_file.append(file_index)
        self.t.ann_record.append(record)
        self.t.class_counts[category_id] = self.t.class_counts.get(category_id, 0) + 1

    def close(self, categories: list[dict]) -> Translated:
        """Write the COCO file (``categories``: ``[{"id", "name"}]``) and remove the scratch files."""
        self._ims.close()
        self._anns.close()
        cats = orjson.dumps([{"id": c["id"], "name": c["name"], "supercategory": c.get("supercategory", "")}
                             for c in categories])
        with open(self.t.json_path, "wb") as f:
            f.write(b'{"categories":' + cats + b',"images":[')
            for part in (self._ims.name, self._anns.name):
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 20):
                        f.write(chunk)
                if part == self._ims.name:
                    f.write(b'],"annotations":[')
            f.write(b"]}")
        for part in (self._ims.name, self._anns.name):
            Path(part).unlink()
        return self.t


_ANN = re.compile(r"^annotation id (\d+) \(image id (\d+)\)$")
_IMAGE = re.compile(r"^image id (\d+)$")


def rename_findings(rules: dict, translated: dict[str, Translated], raw_root: Path) -> None:
    """In ``rules`` (report.json's), replace each example's generated-COCO file with the source file and record it
    came from (``file``: ``.../labels/x.txt``, ``record``: ``line 3 (image id 2)``). Findings about an image
    (``record``: ``image id 2``) of a split whose `Translated` has ``image_file`` name that annotation file instead
    of the image, the image going into the detail (``image <path>: file not found; ...``)."""
    by_path = {str(t.json_path): t for t in translated.values()}
    for rule in rules.values():
        for ex in rule["examples"]:
            t = by_path.get(ex.get("file"))
            m = _ANN.match(ex.get("record", ""))
            if t is None or m is None:
                _rename_image_finding(ex, translated, raw_root)
                continue
            where = t.where(int(m.group(1)))
            if where is not None:
                ex["file"] = str(raw_root / where[0])
                ex["record"] = f"{where[1]} (image id {m.group(2)})"


def _rename_image_finding(ex: dict, translated: dict[str, Translated], raw_root: Path) -> None:
    m = _IMAGE.match(ex.get("record", ""))
    t = translated.get(ex.get("split")) if "val" in translated else translated.get("train")  # val_fraction: train's
    if m is None or t is None or t.image_file is None or not 1 <= int(m.group(1)) <= len(t.image_file):
        return
    source = raw_root / t.file_of(t.files[t.image_file[int(m.group(1)) - 1]])
    ex["detail"] = f"image {ex['file']}: " + ex["detail"].replace("JSON says", "the annotation file says")
    ex["file"] = str(source)


def rename_error(msg: str, translated: dict[str, Translated], raw_root: Path) -> str:
    """A `StageError` message about a generated COCO file (strict mode), with the source file and record
    instead."""
    for t in translated.values():
        prefix = f"{t.json_path}: "
        if msg.startswith(prefix):
            m = re.match(r"annotation id (\d+) \(image id (\d+)\)", msg[len(prefix):])
            if m:
                where = t.where(int(m.group(1)))
                if where:
                    sep = ":" if t.record_word == "line" else ", "
                    rec = where[1].split(" ", 1)[1] if sep == ":" else where[1]
                    return f"{raw_root / where[0]}{sep}{rec} (image id {m.group(2)})" + msg[len(prefix) + m.end():]
            return msg.replace(str(t.json_path), t.source)
    return msg
