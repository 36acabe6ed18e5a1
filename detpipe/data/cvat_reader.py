"""The convert stage's reader of CVAT datasets (``convert.format: cvat``; CVAT for images 1.1 XML).

The ``annotations.xml`` of a CVAT export is translated, streamed, into COCO instances files in the output's scratch
folder, which the COCO path then reads: the validation rules, ``report.json``, the split's Arrow rows and
``meta.json`` are the COCO path's, shared (`detpipe.data.translate`: the reader interface, `detect` and `read`).

Layout (``data/raw``; CVAT's "CVAT for images 1.1" export with images, unzipped)::

    annotations.xml             <annotations><version/><meta><task|project|job>...<labels><label><name>...
                                </meta><image id name width height [subset]> <box .../> <polygon .../> </image>
    images/<name>               a task's export (and where ``images/`` holds ``<name>``)
    images/<subset>/<name>      a project's export (CVAT writes each task's subset folder)

An image's file is the first of ``images/<name>``, ``images/<subset>/<name>`` and ``<name>`` that exists (the
order of datumaro's CVAT importer, which CVAT uses, plus ``<name>`` beside annotations.xml); if none does, the
COCO path counts ``images/<name>`` as ``image_missing``.

Parsing: ``defusedxml``'s ``iterparse`` (`detpipe.data.safe_xml.iter_events`, events start/end), one ``<image>`` element at a time; each image (and
``<meta>``) is cleared from the tree once read, so memory is one image's elements whatever the file's size.
Document type declarations are refused (``forbid_dtd``), and with them every entity declaration (billion laughs)
and external reference (XXE); CVAT never writes one.

Mapping rules (sources: the CVAT XML format description, docs.cvat.ai "XML annotation format"; datumaro's CVAT
importer, ``datumaro/plugins/data_formats/cvat/base.py``, which CVAT's own exporters build on):

- Coordinates: continuous pixel coordinates (0-based, (0, 0) the top-left corner of the top-left pixel; CVAT
  writes them with 2 decimals) of the image as CVAT shows it: after EXIF orientation (CVAT >= 2.1 applies it,
  cvat-ai/cvat#4529).
- ``<box xtl ytl xbr ybr>`` -> COCO box ``[xtl, ytl, xbr - xtl, ybr - ytl]`` (datumaro's ``Bbox(x, y, xbr - x,
  ybr - y)``, which CVAT's COCO export writes); area w * h. A box with ``rotation`` (degrees about its centre)
  becomes the axis-aligned bounds of the rotated rectangle, area still w * h (counted: ``rotated_boxes``).
- ``<polygon points="x1,y1;x2,y2;...">`` (>= 3 points) -> COCO segmentation ``[[x1, y1, ...]]``; box = the
  polygon's bounds; area = the polygon's (shoelace) area.
- Other elements of an image (``polyline``, ``points``, ``cuboid``, ``mask``, ``ellipse``, ``skeleton``, ``tag``,
  any other) are counted by element name (``skipped_shapes``) and skipped. ``z_order``, ``group_id``, ``source``
  and ``<attribute>`` children are not used.
- ``occluded="1"``: kept in the translated COCO annotation as ``"attributes": {"occluded": true}`` (what CVAT's
  COCO exporter writes) and counted with examples (``occluded_objects``); the Arrow rows have no per-object
  attribute column, so occlusion does not reach the shards (the object is kept as any other; see
  docs/convert.md).
- Categories: the ``<label><name>`` elements of the first ``<labels>`` in ``<meta>`` (``task``, ``project`` or
  ``job``), ids 1..K in that order; an object whose label is not in the list is an error naming the image and
  the element (``<image>``'s child, from 1). A file without ``<labels>`` (globox's ``save_cvat`` writes none) takes
  the sorted set of its box and polygon labels (ids 1..K; ``labels_from: "objects"``, logged), one more pass over
  the file.
- Split, by the ``subset`` attribute of ``<image>`` (CVAT's project export; case-insensitive): ``Train`` /
  ``Training`` -> train, ``Validation`` / ``Val`` / ``Valid`` -> val, absent / empty / ``default`` -> train; any
  other subset (``Test``, custom names) is counted (``images_other_subset``) and skipped, so that held-out images
  never reach training. Without val images, train is split by ``convert.val_fraction`` / ``seed``. Image ids are
  1..n per split in file order.
- Negatives: an image without a box or polygon is kept as a negative (``images_without_objects``, and the COCO
  rule ``image_no_annotations``).
- Image size: the ``<image>``'s ``width`` / ``height``, checked by the COCO path against the file as for COCO
  (``image_size_mismatch``: dropped with its objects); for EXIF orientations whose displayed size equals the
  stored one the boxes are handed over in the stored frame, as the LabelMe reader does
  (`detpipe.data.translate.displayed_fix`).
- Boxes outside the image: the COCO rules, with ``annotations.xml`` and ``image '<name>' element <k>`` named in
  ``report.json``'s examples.
- Errors (`StageError`, exit 2, naming the file, and the image and element where there is one): a DTD, entity or
  external reference, malformed XML (with line and column), a root other than ``<annotations>``, ``<track>``
  elements (CVAT for video) (rule ``cvat_xml``); ``<labels>`` empty or with a name twice (``cvat_labels``); an image
  without name or positive integer width / height, a name that is absolute or has ``..`` (``cvat_image``); a label
  not in the list (``cvat_label``); a missing or non-numeric coordinate, a polygon with fewer than 3 points
  (``cvat_shape``). With ``convert.strict`` the counts of dropped data (``skipped_shapes``,
  ``images_other_subset``) are errors too.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import posixpath
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

from detpipe.data.coco_schema import polygon_area
from detpipe.data.safe_xml import iter_events
from detpipe.data.translate import CocoWriter, Dataset, Translated, count_finding, displayed_fix, to_stored
from detpipe.core.errors import StageError

log = logging.getLogger(__name__)

XML_NAME = "annotations.xml"
MARKER = "annotations.xml with an <annotations> root (CVAT for images 1.1)"
"""What ``convert.format: auto`` looks for (`detect`)."""
IMAGES_DIR = "images"
SUBSETS = {"train": "train", "training": "train", "validation": "val", "val": "val", "valid": "val",
           "": "train", "default": "train"}
"""CVAT ``subset`` (lower case, stripped) -> split; any other subset is skipped (counted)."""
BOX_ELEMENTS = ("box", "polygon")
_NUMBER = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")


def detect(raw_root: Path) -> Path | None:
    """``raw_root/annotations.xml`` if its root element is ``<annotations>`` (or it is not well-formed XML: still
    CVAT's file name; `read` names the error), else None."""
    p = raw_root / XML_NAME
    if not p.is_file():
        return None
    try:
        for _, el in iter_events(p, "cvat_xml", ("start",)):
            return p if el.tag == "annotations" else None
    except StageError:
        return p
    return p


@dataclasses.dataclass
class CvatShape:
    """One child element of an ``<image>``: ``element`` (1-based position among the image's children), ``kind``
    (the element name), label, ``points`` (box: ``[xtl, ytl, xbr, ybr]``; polygon: ``[x1, y1, x2, y2, ...]``;
    pixels; empty for other kinds), ``occluded``, ``rotation`` (degrees)."""
    element: int
    kind: str
    label: str | None
    points: list[float]
    occluded: bool = False
    rotation: float = 0.0


@dataclasses.dataclass
class CvatImage:
    """One ``<image>``: its position in the file (1-based), ``name``, size in pixels, ``subset`` (None if absent)
    and its shapes."""
    index: int
    name: str
    width: int
    height: int
    subset: str | None
    shapes: list[CvatShape]


def _num(el: ET.Element, key: str, where: str) -> float:
    v = el.get(key)
    if v is None or not _NUMBER.match(v):
        what = "missing" if v is None else f"{v[:40]!r} is not a finite number"
        raise StageError(f"{where}: attribute {key!r} {what} (rule 'cvat_shape')")
    f = float(v)
    if not math.isfinite(f):
        raise StageError(f"{where}: attribute {key!r} {v[:40]!r} is not a finite number (rule 'cvat_shape')")
    return f


def _shape(el: ET.Element, k: int, where_image: str) -> CvatShape:
    kind = el.tag
    where = f"{where_image} element {k} (<{kind}>)"
    if kind not in BOX_ELEMENTS:
        return CvatShape(k, kind, el.get("label"), [])
    label = el.get("label")
    if label is None:
        raise StageError(f"{where}: no 'label' attribute (rule 'cvat_shape')")
    occluded = el.get("occluded", "0").strip().lower() in ("1", "true")
    if kind == "box":
        pts = [_num(el, a, where) for a in ("xtl", "ytl", "xbr", "ybr")]
        rotation = _num(el, "rotation", where) if el.get("rotation") is not None else 0.0
        return CvatShape(k, kind, label, pts, occluded, rotation)
    text = el.get("points")
    if text is None:
        raise StageError(f"{where}: no 'points' attribute (rule 'cvat_shape')")
    pts = []
    for j, pair in enumerate(text.strip().split(";"), 1):
        xy = pair.split(",")
        if len(xy) != 2 or not all(_NUMBER.match(v) for v in xy) or \
                not all(math.isfinite(float(v)) for v in xy):
            raise StageError(f"{where}: point {j} {pair[:40]!r} of 'points' is not 'x,y' with two finite numbers "
                             f"(rule 'cvat_shape')")
        pts.extend(float(v) for v in xy)
    if len(pts) < 6:
        raise StageError(f"{where}: a polygon has {len(pts) // 2} points, at least 3 are needed (rule 'cvat_shape')")
    return CvatShape(k, kind, label, pts, occluded)


def _image(el: ET.Element, index: int, path: Path) -> CvatImage:
    name = el.get("name")
    if not name:
        raise StageError(f"{path}: <image> {index} (id {el.get('id')}) has no 'name' (rule 'cvat_image')")
    where = f"{path}, image {name!r}"
    size = []
    for key in ("width", "height"):
        v = el.get(key, "")
        if not v.strip().isdigit() or not 1 <= int(v) <= (1 << 31) - 1:
            raise StageError(f"{where}: {key} {v[:40]!r} is not a positive integer (rule 'cvat_image')")
        size.append(int(v))
    norm = name.replace("\\", "/")
    if norm.startswith("/") or ".." in norm.split("/"):
        raise StageError(f"{where}: the name must be a relative path without '..' (rule 'cvat_image')")
    shapes = [_shape(child, k, where) for k, child in enumerate(el, 1)]
    return CvatImage(index, norm, size[0], size[1], el.get("subset"), shapes)


def _labels(meta: ET.Element, path: Path) -> list[str] | None:
    labels = next(meta.iter("labels"), None)
    if labels is None:
        return None
    names = []
    for k, lab in enumerate(labels.findall("label"), 1):
        name = (lab.findtext("name") or "").strip()
        if not name:
            raise StageError(f"{path}: <meta> <labels> label {k} has no <name> (rule 'cvat_labels')")
        if name in names:
            raise StageError(f"{path}: <meta> <labels> lists {name!r} twice (rule 'cvat_labels')")
        names.append(name)
    if not names:
        raise StageError(f"{path}: <meta> <labels> lists no label (rule 'cvat_labels')")
    return names


def iter_cvat(path: Path) -> Iterator[tuple[str, object]]:
    """Stream a CVAT for images 1.1 file: first ``("labels", names or None)`` (None: no ``<labels>`` in
    ``<meta>``, or no ``<meta>`` before the first image), then ``("image", CvatImage)`` per ``<image>`` in file
    order. Each ``<meta>`` and ``<image>`` is cleared from the tree once read (memory: one image's elements).

    Raises:
        StageError: see the module docstring (rules ``cvat_xml``, ``cvat_labels``, ``cvat_image``, ``cvat_shape``).
    """
    root = None
    depth = 0
    labels_sent = False
    index = 0
    for ev, el in iter_events(path, "cvat_xml"):
        if ev == "start":
            depth += 1
            if root is None:
                root = el
                if el.tag != "annotations":
                    raise StageError(f"{path}: root element <{el.tag}>; a CVAT for images 1.1 file has "
                                     f"<annotations> (rule 'cvat_xml')")
            elif depth == 2 and el.tag == "track":
                raise StageError(f"{path}: <track> elements: this is CVAT for video 1.1; export the task as "
                                 f"'CVAT for images 1.1' (rule 'cvat_xml')")
            elif depth == 2 and el.tag == "image" and not labels_sent:
                labels_sent = True
                yield "labels", None
            continue
        depth -= 1
        if depth != 1:
            continue
        if el.tag == "meta":
            names = _labels(el, path)
            root.clear()
            if not labels_sent:
                labels_sent = True
                yield "labels", names
        elif el.tag == "image":
            index += 1
            image = _image(el, index, path)
            root.clear()
            yield "image", image
    if not labels_sent:
        yield "labels", None


@dataclasses.dataclass
class XmlTranslated(Translated):
    """`Translated` of an XML file that holds every image: ``files`` are the image names (one per image),
    ``ann_record`` the element's position in its ``<image>``; `where` names the XML file and both."""
    xml: str = XML_NAME

    def where(self, ann_id: int) -> tuple[str, str] | None:
        """``("annotations.xml", "image 'x.jpg' element 2")`` of annotation ``ann_id``, or None."""
        if not 1 <= ann_id <= len(self.ann_record):
            return None
        return self.xml, f"image {self.files[self.ann_file[ann_id - 1]]!r} element {self.ann_record[ann_id - 1]}"


def image_file(raw_root: Path, name: str, subset: str | None) -> str:
    """The image file of ``<image name subset>``, relative to raw_root: the first of ``images/<name>``,
    ``images/<subset>/<name>``, ``<name>`` that exists, else ``images/<name>``."""
    cands = [posixpath.join(IMAGES_DIR, name)]
    if subset:
        cands.append(posixpath.join(IMAGES_DIR, subset, name))
    cands.append(name)
    return next((c for c in cands if (raw_root / c).is_file()), cands[0])


def rotated_bounds(box: list[float], degrees: float) -> list[float]:
    """COCO ``[x, y, w, h]`` (pixels) of the axis-aligned bounds of box ``[xtl, ytl, xbr, ybr]`` rotated by
    ``degrees`` about its centre (the bounds are the same for either direction of rotation)."""
    xtl, ytl, xbr, ybr = box
    w, h = xbr - xtl, ybr - ytl
    cx, cy = (xtl + xbr) / 2, (ytl + ybr) / 2
    a = math.radians(degrees)
    bw = abs(w * math.cos(a)) + abs(h * math.sin(a))
    bh = abs(w * math.sin(a)) + abs(h * math.cos(a))
    return [cx - bw / 2, cy - bh / 2, bw, bh]


def _used_labels(path: Path) -> list[str]:
    used: set[str] = set()
    for kind, im in iter_cvat(path):
        if kind == "image":
            used.update(s.label for s in im.shapes if s.kind in BOX_ELEMENTS)
    return sorted(used)


_DROPS = ("skipped_shapes", "images_other_subset")


def read(raw_root: Path, params, tmp: Path) -> Dataset:
    """The CVAT for images 1.1 dataset in ``raw_root`` (``annotations.xml``) translated into COCO files under
    ``tmp`` (`detpipe.data.translate` reader interface; ``params``: the ``convert`` section, for ``strict``).

    Boxes and polygons in pixels (see the module docstring for every rule and its source).
    Raises:
        StageError: no annotations.xml; unsafe or malformed XML; a label outside ``<labels>``; a bad image or
            shape (see the module docstring); no train image; with ``params.strict``, data the ``cvat`` section
            counts as dropped.
    """
    path = raw_root / XML_NAME
    if not path.is_file():
        raise StageError(f"{path}: CVAT annotations.xml not found (convert.format cvat)")
    stream = iter_cvat(path)
    _, names = next(stream)
    section: dict = {"annotations_xml": str(path), "labels_from": "meta"}
    if names is None:
        names = _used_labels(path)
        section["labels_from"] = "objects"
        log.warning("convert: %s has no <labels> in <meta>: classes are the %d labels its boxes and polygons use, "
                    "sorted", path, len(names))
        if not names:
            raise StageError(f"{path}: no <labels> in <meta> and no box or polygon (rule 'cvat_labels')")
    section["names"] = names
    section["subsets"] = {}
    for key in _DROPS + ("images_without_objects", "occluded_objects", "rotated_boxes"):
        section[key] = {"count": 0, "examples": []}
    section["skipped_shapes"]["by_type"] = {}
    cat = {n: i for i, n in enumerate(names, 1)}
    translated = {s: XmlTranslated(json_path=tmp / f".cvat-{s}.json", source=f"{path} ({s} images)",
                                   record_word="element") for s in ("train", "val")}
    writers = {s: CocoWriter(t) for s, t in translated.items()}
    for _, im in stream:
        sub = im.subset if im.subset is not None else ""
        section["subsets"][sub or "(none)"] = section["subsets"].get(sub or "(none)", 0) + 1
        split = SUBSETS.get(sub.strip().lower())
        where = f"image {im.name!r}"
        if split is None:
            count_finding(section, "images_other_subset", {"file": str(path), "record": where,
                                                    "detail": f"subset {sub!r} is neither train nor validation; "
                                                              f"skipped with its {len(im.shapes)} element(s)"})
            continue
        t, writer = translated[split], writers[split]
        rel = image_file(raw_root, im.name, im.subset)
        image_id = writer.image(rel, im.width, im.height)
        t.files.append(im.name)
        file_index = len(t.files) - 1
        fix = displayed_fix(raw_root / rel, im.width, im.height)
        written = 0
        for s in im.shapes:
            rec = f"{where} element {s.element}"
            if s.kind not in BOX_ELEMENTS:
                count_finding(section, "skipped_shapes", {"split": split, "file": str(path), "record": rec,
                                                   "detail": f"<{s.kind}> is not a box or polygon; skipped"},
                       by=s.kind)
                continue
            if s.label not in cat:
                raise StageError(f"{path}, {rec} (<{s.kind}>): label {s.label!r} is not in <meta> <labels> "
                                 f"({', '.join(names[:10])}{', ...' if len(names) > 10 else ''}) (rule 'cvat_label')")
            seg = None
            if s.kind == "box":
                xtl, ytl, xbr, ybr = s.points
                box, area = [xtl, ytl, xbr - xtl, ybr - ytl], (xbr - xtl) * (ybr - ytl)
                if s.rotation % 360:
                    box = rotated_bounds(s.points, s.rotation)
                    count_finding(section, "rotated_boxes", {"split": split, "file": str(path), "record": rec,
                                                      "detail": f"rotation {s.rotation} degrees: box = the rotated "
                                                                f"rectangle's axis-aligned bounds"})
            else:
                xs, ys = s.points[0::2], s.points[1::2]
                box = [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]
                seg, area = [s.points], polygon_area(s.points)
            if fix is not None:
                box, seg = to_stored(box, seg, fix)
            extra = {}
            if s.occluded:
                extra["attributes"] = {"occluded": True}
                count_finding(section, "occluded_objects", {"split": split, "file": str(path), "record": rec,
                                                     "detail": f"occluded {s.kind} of label {s.label!r}; kept "
                                                               f"(not in the Arrow rows)"})
            writer.annotation(image_id, cat[s.label], box, area, 0, file_index, s.element, seg, **extra)
            written += 1
        if not written:
            count_finding(section, "images_without_objects", {"split": split, "file": str(path), "record": where,
                                                       "detail": "no box or polygon; kept as a negative"})
    categories = [{"id": i, "name": n} for n, i in cat.items()]
    n_images = {s: w.images for s, w in writers.items()}
    for s in ("train", "val"):
        writers[s].close(categories)
    if not n_images["train"]:
        raise StageError(f"{path}: no train image (subsets: {section['subsets'] or 'no <image> at all'}; train is "
                         f"subset Train or none) (convert.format cvat)")
    if not n_images["val"]:
        os.unlink(translated.pop("val").json_path)
    if params.strict:
        for key in _DROPS:
            if section[key]["count"]:
                ex = section[key]["examples"][0]
                raise StageError(f"{ex['file']}, {ex['record']}: {ex['detail']} (rule '{key}'; counted unless "
                                 f"strict) (convert.strict is true)")
    section["split"] = "subset" if "val" in translated else "convert.val_fraction"
    return Dataset("cvat", path, categories, translated, section)
