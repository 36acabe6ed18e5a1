"""The convert stage's reader of Pascal VOC datasets (``convert.format: voc``).

A VOC dataset is translated, streamed, into COCO instances files in the output's scratch folder, which the COCO path
then reads: the validation rules, ``report.json``, the split's Arrow rows and ``meta.json`` are the COCO path's,
shared (`detpipe.data.translate`: the reader interface, `detect` and `read`).

Layout (``data/raw``; the VOC devkit's, e.g. ``VOCdevkit/VOC2012/`` moved to the top)::

    Annotations/<id>.xml       one annotation file per image (the image's <filename>, <size> and <object>s)
    JPEGImages/<filename>      the images
    ImageSets/Main/train.txt   optional: image ids (= annotation file stems), one per line
    ImageSets/Main/val.txt     optional
    ImageSets/Main/trainval.txt  optional

Split (the lists are read only from ``ImageSets/Main``; the first whitespace-separated word of a line is the id, so
the per-class lists' ``<id> 1`` lines would parse too, but only these three names are read):

- ``train.txt`` present: its ids -> train, ``val.txt``'s (if present) -> val; ``trainval.txt`` is not read.
- no ``train.txt``, ``trainval.txt`` present: with ``val.txt``, train = trainval's ids that are not in val.txt
  (the devkit defines trainval as train + val) and val = val.txt's; without it, all of trainval -> train, split by
  ``convert.val_fraction`` / ``seed`` by the COCO path.
- ``val.txt`` alone: an error (no train list).
- no lists: every ``Annotations/*.xml`` -> train, split by ``convert.val_fraction`` / ``seed``.

Image ids are 1..n per split in sorted id order (duplicate lines of a list are read once). A listed id without
``Annotations/<id>.xml`` is skipped and counted (``listed_without_annotation``; an error with ``convert.strict``);
with lists, an annotation file that no read list names (e.g. the devkit's test images) is skipped and counted
(``annotations_not_listed``; never an error: other tasks' and the test split's files live there too).

Mapping rules (sources: the devkit's annotation format as read by detectron2's
``detectron2/data/datasets/pascal_voc.py`` ``load_voc_instances`` and its VOC evaluator,
``detectron2/evaluation/pascal_voc_evaluation.py``, a port of py-faster-rcnn's ``voc_eval.py``):

- Parsing: each file alone (memory: one file's tree), with ``defusedxml`` through `detpipe.data.safe_xml` (the one
  safe-XML reader of VOC and CVAT; ``forbid_dtd``, ``forbid_entities``,
  ``forbid_external``): a file with a DTD (``<!DOCTYPE ...>``, which is where entity declarations, billion-laughs
  expansion and external entities live; VOC files have none) is refused, a malformed one is an error naming the
  parser's line and column (rule ``voc_xml``). The root element must be ``<annotation>``.
- Image: ``JPEGImages/<filename>``; an empty or missing ``<filename>`` -> ``JPEGImages/<annotation stem>.jpg``
  (counted: ``filename_from_stem``; the devkit's images are all ``<id>.jpg``). A ``<filename>`` that leaves
  ``JPEGImages`` (absolute, ``..``) is an error (rule ``voc_filename``). ``<folder>``, ``<path>``, ``<source>``,
  ``<segmented>`` are not read.
- Image size: ``<size><width>/<height>`` (positive integers, pixels; ``<depth>`` not read) is the COCO record's
  width/height, so the COCO path checks it against the decoded image exactly as it checks a COCO JSON's: equal to
  the stored raster (boxes mapped through the EXIF orientation to the displayed frame) or to the displayed size after
  EXIF orientation (boxes kept), else the image is dropped with its objects (rule ``image_size_mismatch``; an error
  with ``convert.strict``). A missing ``<size>`` or a 0 in it (some tools write 0 when unknown) -> the size read
  from the image header, stored raster (the frame the COCO convention assumes: for images without EXIF orientation
  the only one; counted: ``size_from_image``). A size that is not a non-negative integer is an error (``voc_size``).
- Class: ``<object><name>`` (surrounding whitespace stripped, case kept) -> category. VOC has no class list file:
  the categories are the sorted (Python string order) set of names found in all read annotation files, ids 1..K
  in that order, so the Arrow ``label`` equals the id. An object without a name is an error (``voc_object``).
- Box: ``<bndbox>`` ``xmin ymin xmax ymax`` are 1-based, inclusive pixel indices (the devkit's; ``xmin=1,
  xmax=W`` covers the whole image) -> COCO ``[x, y, w, h]`` in pixels = ``[xmin - 1, ymin - 1, xmax - xmin + 1,
  ymax - ymin + 1]`` (detectron2's ``bbox[0] -= 1.0; bbox[1] -= 1.0`` in continuous corner coordinates; the
  evaluator's inclusive ``xmax - xmin + 1.0`` widths); area ``w * h`` px^2. Non-integer values are accepted and
  mapped by the same rule. Tools that write 0-based or continuous corners (e.g. globox's ``save_pascal_voc``:
  ``x, y, x + w, y + h``) come out shifted left/up by 1 px and 1 px wider/taller. A missing ``<bndbox>``, a
  missing corner or one that is not a finite number is an error naming the file and object (``voc_bndbox``); a box
  with ``xmax < xmin`` is the COCO rule ``bbox_nonpositive``; boxes outside the image follow the COCO rules
  (``bbox_clipped``, ``bbox_outside``) with the annotation file and object named in report.json's examples.
- ``<difficult>1</difficult>`` -> ``iscrowd: 1``: the VOC evaluator ignores difficult objects (not counted as
  positives, a detection matching one is neither a true nor a false positive), as COCO's evaluation ignores crowd
  regions (`detpipe.evaluation.coco_metrics`), and the augment stage leaves ``iscrowd`` objects out of the
  training targets (`detpipe.data.augmentation`, counted ``crowd_excluded``); mmdetection's VOC reader also turns
  them into ignored boxes (``ignore_flag``). ``0``/``1``/``true``/``false`` (any case) or empty/missing (0);
  anything else is an error (``voc_object``).
- Not kept: ``<truncated>``, ``<occluded>``, ``<pose>``, ``<part>`` (person layout), ``<actions>``, ``<point>``,
  ``<attributes>``.
- An annotation file naming an image that does not exist: kept in the COCO file so that the COCO path counts it
  (rule ``image_missing``, dropped), its report.json example naming the annotation file (findings about an image
  name its annotation file, the image in the detail); with ``convert.strict`` an error naming both.
- Negatives: a file without ``<object>`` is a negative image (counted: ``files_without_objects``, and the COCO
  rule ``image_no_annotations``).

Cost: every annotation file is parsed twice (first the class names, then the records), one at a time; images are
read only when ``<size>`` is missing; the stage process holds each annotation file's path (a Python string) and the
`detpipe.data.translate.Translated` arrays (12 bytes per object, 8 per image).
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
from xml.etree.ElementTree import Element

from PIL import Image, UnidentifiedImageError

from detpipe.data.safe_xml import parse
from detpipe.data.translate import CocoWriter, Dataset, Translated, count_finding, image_size
from detpipe.core.errors import StageError

log = logging.getLogger(__name__)

ANNOTATIONS, IMAGES, IMAGE_SETS = "Annotations", "JPEGImages", "ImageSets/Main"

MARKER = "Annotations/*.xml beside JPEGImages/"
"""What ``convert.format: auto`` looks for (`detect`)."""

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_FLAG = {"": 0, "0": 0, "false": 0, "1": 1, "true": 1}


def detect(raw_root: Path) -> Path | None:
    """``raw_root/Annotations`` if it holds at least one ``.xml`` file and ``raw_root/JPEGImages`` is a folder,
    else None."""
    folder = raw_root / ANNOTATIONS
    if not (folder.is_dir() and (raw_root / IMAGES).is_dir()):
        return None
    with os.scandir(folder) as it:
        if any(e.name.endswith(".xml") and e.is_file() for e in it):
            return folder
    return None


@dataclasses.dataclass
class VocObject:
    """One ``<object>``: its class ``name``, ``bndbox`` as written (``xmin, ymin, xmax, ymax``: 1-based inclusive
    pixel indices) and ``difficult`` (0/1)."""
    name: str
    bndbox: tuple[float, float, float, float]
    difficult: int

    def coco_bbox(self) -> list[float]:
        """COCO ``[x, y, w, h]`` in pixels: ``[xmin - 1, ymin - 1, xmax - xmin + 1, ymax - ymin + 1]``."""
        x0, y0, x1, y1 = self.bndbox
        return [x0 - 1, y0 - 1, x1 - x0 + 1, y1 - y0 + 1]


@dataclasses.dataclass
class VocAnnotation:
    """One parsed annotation file: ``filename`` (None when missing or empty), ``size`` (``(width, height)``
    pixels, None when missing or 0) and its objects in file order."""
    filename: str | None
    size: tuple[int, int] | None
    objects: list[VocObject]


def parse_annotation(path: Path) -> VocAnnotation:
    """Parse one VOC annotation file, safely (see the module docstring).

    Raises:
        StageError: naming ``path`` (and the object, 1-based, in file order) with the rule: ``voc_xml`` (unreadable,
            not well-formed with the parser's line and column, a DTD / entity declaration / external reference,
            root not ``<annotation>``), ``voc_size``, ``voc_object`` (no ``<name>``, bad ``<difficult>``),
            ``voc_bndbox`` (no ``<bndbox>``, a corner missing or not a finite number).
    """
    root = parse(path, "voc_xml")
    if root.tag != "annotation":
        raise StageError(f"{path}: root element <{root.tag:.40}>, not <annotation> (rule 'voc_xml')")
    filename = (root.findtext("filename") or "").strip() or None
    return VocAnnotation(filename, _size(root, path), [_object(o, path, k) for k, o in
                                                       enumerate(root.findall("object"), 1)])


def _size(root: Element, path: Path) -> tuple[int, int] | None:
    node = root.find("size")
    if node is None:
        return None
    out = []
    for tag in ("width", "height"):
        text = (node.findtext(tag) or "").strip()
        if not text:
            return None
        v = float(text) if _NUMBER.match(text) else math.nan
        if not math.isfinite(v) or v != int(v) or v < 0 or v >= 2 ** 31:
            raise StageError(f"{path}: <size><{tag}> {text!r:.40} is not a non-negative integer (rule 'voc_size')")
        out.append(int(v))
    return None if 0 in out else (out[0], out[1])


def _object(node: Element, path: Path, k: int) -> VocObject:
    name = (node.findtext("name") or "").strip()
    if not name:
        raise StageError(f"{path}, object {k}: no <name> (rule 'voc_object')")
    box = node.find("bndbox")
    if box is None:
        raise StageError(f"{path}, object {k} ({name!r:.60}): no <bndbox> (rule 'voc_bndbox')")
    corners = []
    for tag in ("xmin", "ymin", "xmax", "ymax"):
        text = box.findtext(tag)
        if text is None:
            raise StageError(f"{path}, object {k} ({name!r:.60}): <bndbox> has no <{tag}> (rule 'voc_bndbox')")
        text = text.strip()
        v = float(text) if _NUMBER.match(text) else math.nan
        if not math.isfinite(v):
            raise StageError(f"{path}, object {k} ({name!r:.60}): <{tag}> {text!r:.40} is not a finite number "
                             f"(rule 'voc_bndbox')")
        corners.append(v)
    flag = (node.findtext("difficult") or "").strip().lower()
    if flag not in _FLAG:
        raise StageError(f"{path}, object {k} ({name!r:.60}): <difficult> {flag!r:.40} is not 0 or 1 "
                         f"(rule 'voc_object')")
    return VocObject(name, (corners[0], corners[1], corners[2], corners[3]), _FLAG[flag])


def _read_list(path: Path) -> list[tuple[str, int]]:
    """``(id, line number)`` of an image-set list, in file order, each id once."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not UTF-8 text (byte {e.start}) (rule 'voc_image_set')") from None
    out, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0] in seen:
            continue
        iid = words[0]
        norm = posixpath.normpath(iid)
        if os.path.isabs(iid) or norm.startswith("..") or "\\" in iid:
            raise StageError(f"{path}:{n}: image id {iid!r:.60} is not a name inside {ANNOTATIONS}/ "
                             f"(rule 'voc_image_set')")
        seen.add(iid)
        out.append((iid, n))
    return out


def image_sets(raw_root: Path) -> tuple[dict[str, tuple[str, list[tuple[str, int]]]] | None, str]:
    """The split from ``ImageSets/Main`` (see the module docstring): ``({"train": (list file, [(id, line)]),
    "val": ...}, how)``, ``"val"`` absent when the COCO path is to split train by ``val_fraction``; ``(None,
    how)`` when there are no lists (every annotation file is train). ``how`` says which lists were used.

    Raises:
        StageError: ``val.txt`` without ``train.txt`` or ``trainval.txt``; a list that is not UTF-8 or names an id
            outside ``Annotations/`` (rule ``voc_image_set``).
    """
    main = raw_root / IMAGE_SETS
    lists = {n: main / f"{n}.txt" for n in ("train", "val", "trainval") if (main / f"{n}.txt").is_file()}
    rel = {n: str(p.relative_to(raw_root)) for n, p in lists.items()}
    if "train" in lists:
        out = {"train": (rel["train"], _read_list(lists["train"]))}
        if "val" in lists:
            out["val"] = (rel["val"], _read_list(lists["val"]))
            return out, f"{rel['train']} -> train, {rel['val']} -> val"
        return out, f"{rel['train']} -> train, split by val_fraction"
    if "trainval" in lists:
        tv = _read_list(lists["trainval"])
        if "val" in lists:
            val = _read_list(lists["val"])
            ids = {i for i, _ in val}
            return ({"train": (rel["trainval"], [(i, n) for i, n in tv if i not in ids]), "val": (rel["val"], val)},
                    f"{rel['trainval']} minus {rel['val']} -> train, {rel['val']} -> val")
        return {"train": (rel["trainval"], tv)}, f"{rel['trainval']} -> train, split by val_fraction"
    if "val" in lists:
        raise StageError(f"{lists['val']}: a val list without {IMAGE_SETS}/train.txt or trainval.txt; add the train "
                         f"list, or remove val.txt to split every annotation file by val_fraction "
                         f"(rule 'voc_image_set')")
    return None, f"no lists in {IMAGE_SETS}: every {ANNOTATIONS}/*.xml -> train, split by val_fraction"


def _image_path(ann: VocAnnotation, xml: str, xml_path: Path) -> tuple[str, bool]:
    """``(JPEGImages/<filename>, whether the file name came from the annotation's stem)``."""
    if ann.filename is None:
        return f"{IMAGES}/{Path(xml).stem}.jpg", True
    rel = posixpath.normpath(f"{IMAGES}/{ann.filename}")
    if os.path.isabs(ann.filename) or not rel.startswith(IMAGES + "/") or "\\" in ann.filename:
        raise StageError(f"{xml_path}: <filename> {ann.filename!r:.80} is not a file inside {IMAGES}/ "
                         f"(rule 'voc_filename')")
    return rel, False


def to_coco(raw_root: Path, files: list[str], cat_ids: dict[str, int], out: Path, split: str, source: str,
            section: dict, strict: bool) -> Translated:
    """Translate one split's annotation files (``files``: relative to ``raw_root``, in image-id order) into the COCO
    instances file ``out`` (streamed: one file at a time, through `detpipe.data.translate.CocoWriter`); ``cat_ids``:
    class name -> category id.

    ``section`` (report.json's ``voc``) gets the counts ``objects``, ``difficult_as_iscrowd``,
    ``files_without_objects``, ``filename_from_stem``, ``size_from_image``. Images that cannot be read when
    their size is needed are written as 1x1, so that the COCO path counts them (``image_missing``,
    ``image_unreadable``).
    Raises:
        StageError: see `parse_annotation`; with ``strict``, an annotation file naming a missing image.
    """
    t = Translated(out, source, files, str, "object", image_file=array.array("q"))
    writer = CocoWriter(t)
    for k, xml in enumerate(files):
        path = raw_root / xml
        ann = parse_annotation(path)
        image, from_stem = _image_path(ann, xml, path)
        if from_stem:
            count_finding(section, "filename_from_stem", {"split": split, "file": str(path),
                                                   "detail": f"no <filename>: image {image}"})
        exists = (raw_root / image).is_file()
        if not exists and strict:
            raise StageError(f"{path}: names image {raw_root / image}, which does not exist (rule 'image_missing'; "
                             f"dropped unless strict) (convert.strict is true)")
        size = ann.size
        if size is None:
            try:
                w, h, orient = image_size(raw_root / image)
                size = (h, w) if orient in (5, 6, 7, 8) else (w, h)     # the stored raster
            except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError):
                size = (1, 1)       # the COCO path reads the file again and counts it as missing or unreadable
            if exists:
                count_finding(section, "size_from_image", {"split": split, "file": str(path),
                                                    "detail": f"no <size>: {size[0]}x{size[1]} from {image}"})
        image_id = writer.image(image, size[0], size[1])
        t.image_file.append(k)
        if not ann.objects:
            count_finding(section, "files_without_objects", {"split": split, "file": str(path),
                                                      "detail": "no <object>: a negative image"})
        for n, obj in enumerate(ann.objects, 1):
            box = obj.coco_bbox()
            writer.annotation(image_id, cat_ids[obj.name], box, box[2] * box[3], obj.difficult, k, n)
            section["objects"] += 1
            section["difficult_as_iscrowd"] += obj.difficult
    section["images"][split] = writer.images
    return writer.close(categories(cat_ids))


def categories(cat_ids: dict[str, int]) -> list[dict]:
    """The COCO categories: ``[{"id", "name"}]`` in id order."""
    return [{"id": i, "name": n} for n, i in sorted(cat_ids.items(), key=lambda kv: kv[1])]


def _splits(raw_root: Path, section: dict, strict: bool) -> dict[str, tuple[str, list[str]]]:
    """``{split: (how messages name it, [annotation file relative to raw_root, sorted by id])}``."""
    folder = raw_root / ANNOTATIONS
    if not folder.is_dir():
        raise StageError(f"{folder}: no {ANNOTATIONS} folder (convert.format voc)")
    with os.scandir(folder) as it:
        present = sorted(e.name[:-4] for e in it if e.name.endswith(".xml") and e.is_file())
    lists, how = image_sets(raw_root)
    section["image_sets"] = how
    if lists is None:
        if not present:
            raise StageError(f"{folder}: no .xml annotation files (convert.format voc)")
        return {"train": (f"{folder} (all annotation files)", [f"{ANNOTATIONS}/{i}.xml" for i in present])}
    have = set(present)
    out = {}
    for split, (list_file, ids) in lists.items():
        files = []
        for iid, line in ids:
            if iid in have:
                files.append(iid)
                continue
            count_finding(section, "listed_without_annotation",
                   {"split": split, "file": str(raw_root / list_file), "record": f"line {line}",
                    "detail": f"no {ANNOTATIONS}/{iid}.xml; skipped"})
            if strict:
                raise StageError(f"{raw_root / list_file}:{line}: image id {iid!r:.60} has no {ANNOTATIONS}/"
                                 f"{iid}.xml (rule 'listed_without_annotation'; skipped unless strict) "
                                 f"(convert.strict is true)")
        if not files:
            raise StageError(f"{raw_root / list_file}: lists no image with an annotation file ({len(ids)} id(s)) "
                             f"(rule 'voc_image_set')")
        out[split] = (f"{raw_root / list_file} ('{split}' images)",
                      [f"{ANNOTATIONS}/{i}.xml" for i in sorted(files)])
    listed = {i for _, ids in lists.values() for i, _ in ids}
    for iid in present:
        if iid not in listed:
            count_finding(section, "annotations_not_listed", {"file": str(folder / f"{iid}.xml"),
                                                       "detail": "in no read list of ImageSets/Main; skipped"})
    return out


def read(raw_root: Path, params, tmp: Path) -> Dataset:
    """The VOC dataset in ``raw_root`` translated into COCO files under ``tmp`` (`detpipe.data.translate` reader
    interface; ``params``: the ``convert`` section, for ``strict``).

    Raises:
        StageError: see the module docstring and `parse_annotation`: malformed or hostile XML, a bad box, size or
            file name (each naming the file and object); no annotation files; a val list without a train list;
            with ``params.strict``, an annotation file naming a missing image or a listed id without one.
    """
    section: dict = {"annotations_folder": str(raw_root / ANNOTATIONS), "image_sets": None, "names": [],
                     "images": {}, "objects": 0, "difficult_as_iscrowd": 0}
    for key in ("files_without_objects", "filename_from_stem", "size_from_image", "listed_without_annotation",
                "annotations_not_listed"):
        section[key] = {"count": 0, "examples": []}
    splits = _splits(raw_root, section, params.strict)
    names: set[str] = set()
    for _, files in splits.values():          # pass 1: the class names (VOC has no class list)
        for xml in files:
            names.update(o.name for o in parse_annotation(raw_root / xml).objects)
    if not names:
        raise StageError(f"{raw_root / ANNOTATIONS}: no <object> in any read annotation file: no classes to train "
                         f"(convert.format voc)")
    cat_ids = {n: i for i, n in enumerate(sorted(names), 1)}
    section["names"] = sorted(names)
    translated = {split: to_coco(raw_root, files, cat_ids, tmp / f".voc-{split}.json", split, source, section,
                                 params.strict)
                  for split, (source, files) in splits.items()}
    return Dataset("voc", raw_root / ANNOTATIONS, categories(cat_ids), translated, section)
