"""Converting COCO instances JSON + image files to Apache Arrow IPC shards, with a validation report: the convert
stage's work (`convert`, explicit paths, no dependence on the working directory; ``python -m stages.convert``
calls it with params section ``convert``, reading ``data/raw`` and writing ``data/arrow``).

Formats (``convert.format``): ``coco`` (below); the formats of `READERS` (``yolo``:
`detpipe.data.yolo_reader`; ``voc``: `detpipe.data.voc_reader`; ``labelme``: `detpipe.data.labelme_reader`;
``cvat``: `detpipe.data.cvat_reader`), each translated into COCO files in the output's scratch folder, which the
COCO path below then reads: same rules, report and rows; ``meta.json``/``report.json`` gain ``"format": "<name>"``
and report.json a ``<name>`` section; ``auto`` (`detect_format`, logged).

Output (written into a temporary folder beside ``data/arrow`` and renamed at the end, so a failed or
interrupted run leaves the previous output untouched and no half-written shard)::

    data/arrow/train/part-00000.arrow ...   Arrow IPC *file* format (memory-mappable: pa.memory_map +
    data/arrow/val/part-00000.arrow ...     pa.ipc.open_file), uncompressed, record batches of ~16 MiB
    data/arrow/meta.json                    categories, label map, split sizes and shard lists
    data/arrow/report.json                  validation counts per rule with the first 5 examples each
    plots/labels/*.json                     (``label_plots``) the train split's label statistics as DVC plots:
                                            `detpipe.data.label_stats`, counted by the workers as they write

Schema (one row per image; later stages read columns by name):

=================  ==================================  ==================================================
column             Arrow type                          meaning
=================  ==================================  ==================================================
``image_id``       int64                               COCO image id (full int64 range survives)
``file_name``      string                              as in the JSON (relative to the image folder)
``width``          int32                               pixels, of the image as `detpipe.data.imageio.decode_rgb`
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
                                                       ("" if absent or invalid: segmentation_invalid)
``occluded``       list<int8>                          1 if the record has ``"attributes": {"occluded": true}``
                                                       (CVAT's COCO export, the CVAT reader), else 0
=================  ==================================  ==================================================

The per-object lists have the same length within a row; images without objects have empty lists (negatives).
Rows within a split are in ascending ``image_id`` order.

``meta.json``: ``{"categories": [...as given...], "category_id_to_label": {"<id>": label}, "label_names":
["__background__", name_1, ...], "num_classes": K + 1, "splits": {"train": {"images": n, "annotations": m,
"shards": ["train/part-00000.arrow", ...]}, "val": {...}}, "annotations_file": ..., "val_annotations_file":
..., "val_fraction": ..., "seed": ...}`` (shard paths relative to ``data/arrow``).

Split: without ``val_annotations`` the unique image ids of the one file are sorted, permuted with
``numpy.random.default_rng(seed).permutation`` and the first ``round(n * val_fraction)`` go to val
(`detpipe.data.split.val_positions`; `split_ids` gives the same split of a list of ids).
With ``val_annotations`` (images in ``val_images``, default ``images``) that file is the val split,
``val_fraction`` is ignored, and its categories must equal the train file's (same ids and names) or the stage
fails.

EXIF orientation: ``decode_rgb`` applies the EXIF orientation, so ``width``/``height`` and the boxes are stored
in that displayed frame. COCO's JSON describes the stored raster (its annotation tool showed images without
applying EXIF orientation), so when the JSON width/height equal the stored raster's size, boxes, polygons and
RLE masks are mapped to the displayed frame (``fixed``); when they instead equal the displayed size of a
90-degree-rotated image, the annotations are taken as already displayed-frame (``kept``). The encoded bytes are
never modified.

Validation: the rules are the table `detpipe.data.coco_schema.RULES` (rule -> action, description; ``report.json`` lists
each with its count and first 5 examples: split, file, record, detail). Each dropped record is counted under the
first rule it breaks; ``convert.strict: true`` turns every rule into a ``StageError`` naming the file, the record
and the rule. Inputs that always stop the stage (``error: ... (rule '<name>')``, exit 2) are the table
`detpipe.data.coco_schema.ERRORS`: malformed JSON or records, file names no filesystem takes, JSON nested too deeply,
disagreeing val categories, and any split that the rules empty. Each file (train, val) has its own image-id
space: a val file may reuse train's ids; reports name the split with every id.

Image check (`detpipe.data.imageio.inspect_image`): JPEG files (all of COCO) are decoded with ``Image.draft`` at 1/8 scale: libjpeg
still entropy-decodes every block, skipping only the full-size IDCT and colour conversion, so it rejects the same
files as ``decode_rgb`` at about 40 % of its cost (tests/stages/test_convert.py checks the agreement on truncated and
garbled COCO images). Other formats are decoded in full with ``decode_rgb``.

Streaming and parallel: the annotation file is never held whole (`detpipe.data.coco_json.read_coco`): it is
read in chunks of 2 MiB, each image and annotation record is parsed alone (orjson) and checked, and only compact
columns stay (per image id, width, height and file name; per annotation id, image id and where its JSON text lies
in the file); ids are deduplicated and sorted with numpy (`detpipe.data.coco_reader.index`). Shards are planned from
the file sizes (at most ``shard_mb`` x 10^6 bytes of image bytes each, unless one image alone is larger); each shard
is one task that a worker process reads (each image's annotations parsed again from the file, one image at a time),
validates and writes itself (``workers``; 0 = in this process), with at most 2 x ``workers`` tasks in flight. Memory:
this process ~40 bytes per image record (+ its file name) and ~32 bytes per annotation record (~100 at the
peak of sorting them), whatever their JSON size; each worker one image's annotations and one record batch.

Leaks between splits: every image file is hashed (SHA-1) as it is read. The train shards are written first; a val
image whose bytes equal a kept train image's (confirmed byte by byte) is then dropped from val (rule
``val_image_in_train``; with ``strict`` an error naming both files); exact copies within a split are counted
(``duplicate_image_bytes``) and kept. Near-duplicates (``convert.leaks``, default ``report``): the workers also
hash every kept image perceptually (`detpipe.data.imageio.phash_pair`: ImageHash's 64-bit pHash of the whole
frame and of its central 90 %, on the 1/8-scale decode the image check makes anyway; 16 bytes per train image in
this process and in the leak check's memory-mapped arrays), and each val image that is not a byte copy is compared
with every kept train image (`detpipe.data.leaks.nearest_train`): at most ``convert.leak_distance`` bits away
it is reported (rule ``val_near_duplicate``, kept), dropped (``drop``) or an error naming both files (``error``);
report.json's ``leaks`` section counts the val images per nearest distance.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from detpipe.data.coco_json import gc_paused, read_coco
from detpipe.data.coco_reader import ImageTable, index
from detpipe.data.split import split_ids, val_positions
from detpipe.data.coco_schema import LEAK_ACTIONS, Report
from detpipe.data.cocoarrow import SCHEMA, ShardResult, convert_shard, plan_shards
from detpipe.data.leaks import PHASH_BITS, write_leak_check
from detpipe.data.imageio import inspect_image, preload_phash
from detpipe.data.label_stats import LabelStats, write_label_plots
from detpipe.data import cvat_reader, labelme_reader, translate, voc_reader, yolo_reader
from detpipe.core.errors import StageError
from detpipe.core.files import atomic_dir
from detpipe.params import Convert
from detpipe.core.pool import bounded_map, process_pool
from detpipe.core.progress import Progress

log = logging.getLogger(__name__)

__all__ = ["convert", "split_ids", "inspect_image", "SCHEMA", "READERS", "detect_format"]

READERS = {"yolo": yolo_reader, "voc": voc_reader, "labelme": labelme_reader, "cvat": cvat_reader}
"""``convert.format`` -> the module that reads it (`detpipe.data.translate`'s reader interface)."""


def detect_format(raw_root: Path, annotations: str | None) -> tuple[str, Path]:
    """``(format, the file that shows it)`` from the files in ``raw_root``: each reader's ``detect``, and the
    ``convert.annotations`` JSON file for coco.

    Raises:
        StageError: more than one format found (ambiguous) or none.
    """
    found = []
    for name in READERS:
        marker = READERS[name].detect(raw_root)
        if marker is not None:
            found.append((name, marker))
    coco = raw_root / annotations if annotations else None
    if coco is not None and coco.is_file() and coco.suffix.lower() == ".json":
        found.append(("coco", coco))
    if len(found) > 1:
        raise StageError(f"{raw_root}: convert.format auto is ambiguous: "
                         + " and ".join(f"{m} ({n})" for n, m in found) + " found; set convert.format")
    if not found:
        raise StageError(f"{raw_root}: convert.format auto found no dataset ("
                         + ", ".join(f"{n}: {READERS[n].MARKER}" for n in READERS)
                         + f", coco: {annotations}); set convert.format")
    return found[0]


def _sources(raw_root: Path, params: Convert, report: Report, tmp: Path) -> tuple[dict, list, Path, Path | None]:
    """Read, check and index the annotation file(s): ``({split: (table, rows, image dir)}, categories, train file,
    val file or None)`` (``rows``: the split's rows of its `ImageTable`, ascending id). Each file is indexed in its
    own image-id space; spill files (see `read_coco`) go to ``tmp``."""
    train_file = raw_root / params.annotations
    cols = read_coco(train_file, tmp)
    categories = cols.categories
    images_dir = raw_root / params.images
    if not images_dir.is_dir():
        raise StageError(f"{images_dir}: image folder not found (convert.images)")
    if params.val_images is not None and params.val_annotations is None:
        raise StageError("convert.val_images is set but convert.val_annotations is null (set both, or "
                         "neither to split the one file by val_fraction)")
    table = index(cols, "train", report)
    if params.val_annotations is None:
        val = val_positions(len(table.ids), params.val_fraction, params.seed)
        train = np.ones(len(table.ids), bool)
        train[val] = False
        return ({"train": (table, np.flatnonzero(train), images_dir), "val": (table, val, images_dir)},
                categories, train_file, None)
    val_file = raw_root / params.val_annotations
    vcols = read_coco(val_file, tmp)
    names = {c["id"]: c["name"] for c in categories}
    vnames = {c["id"]: c["name"] for c in vcols.categories}
    if vnames != names:
        diff = sorted(set(vnames.items()) ^ set(names.items()))[0]
        raise StageError(f"{val_file}: categories differ from {train_file} (first difference: id {diff[0]} "
                         f"{diff[1]!r}); both files must list the same categories (rule 'categories_differ')")
    val_dir = raw_root / (params.val_images or params.images)
    if not val_dir.is_dir():
        raise StageError(f"{val_dir}: image folder not found (convert.val_images)")
    vtable = index(vcols, "val", report)
    return ({"train": (table, np.arange(len(table.ids)), images_dir),
             "val": (vtable, np.arange(len(vtable.ids)), val_dir)}, categories, train_file, val_file)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _count_copies(split: str, table: ImageTable, results: list[ShardResult], images_dir: Path,
                  report: Report) -> None:
    """Count rule ``duplicate_image_bytes`` for each written row of ``split`` whose file bytes equal those of a
    row with a lower image id (same SHA-1 key, then compared byte by byte), in image id order."""
    if not results:
        return
    keys = np.concatenate([r.keys for r in results])
    rows = np.concatenate([r.rows_out for r in results])
    order = np.argsort(keys, kind="stable")
    same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    copies = []
    for run in np.split(same, np.flatnonzero(np.diff(same) != 1) + 1) if len(same) else []:
        firsts: list[tuple[int, bytes | None]] = []
        for row in sorted(rows[order[run[0]:run[-1] + 2]].tolist()):
            data = _read(images_dir / table.name(row))
            match = next((first for first, blob in firsts if data is not None and blob == data), None)
            if match is None:
                firsts.append((row, data))
            else:
                copies.append((row, match))
    for row, first in sorted(copies):
        report.add("duplicate_image_bytes", split, str(images_dir / table.name(row)), f"image id {table.ids[row]}",
                   f"same bytes as image id {table.ids[first]} ({images_dir / table.name(first)}) of the {split} "
                   f"split; kept")


def _collect(results: list[ShardResult], sources: dict, tmp: Path, report: Report, num_labels: int) \
        -> dict[str, dict]:
    """Merge the shard results per split: rename shards to consecutive ``part-NNNNN.arrow`` names, merge
    their findings into ``report`` and their `LabelStats` (of ``num_labels`` labels, background included) into
    the split's ``labels``, count copies within the split. Raises `StageError` (rule ``split_emptied``)
    when the rules dropped every image of a split that listed some."""
    results.sort(key=lambda r: (list(sources).index(r.split), r.index))
    splits: dict[str, dict] = {}
    for split, (table, rows, images_dir) in sources.items():
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
        _count_copies(split, table, mine, images_dir, report)
        stats = LabelStats(num_labels)
        for r in mine:
            stats.merge(r.labels)
        splits[split] = {"images": sum(r.rows for r in mine), "annotations": sum(r.annotations for r in mine),
                         "labels": stats,
                         "shards": shards, "images_in": len(rows),
                         "annotations_in": int((table.ann_first[rows + 1] - table.ann_first[rows]).sum()),
                         "image_bytes": sum(r.image_bytes for r in mine)}
    for split, (table, rows, _) in sources.items():
        if splits[split]["images"] == 0 and (len(rows) or split == "train"):
            raise StageError(f"{table.cols.path}: no usable images in the {split} split ({len(rows)} listed; "
                             f"findings: {report.summary()}) (rule 'split_emptied')")
    return splits


def _leaks_section(params: Convert, leaks: str, results: list[ShardResult]) -> dict:
    """report.json's ``leaks``: the near-duplicate check's params, how many val images were compared with the
    train images and how many had their nearest train image at each pHash Hamming distance (``nearest_distance``,
    ``{"<bits>": images}``, non-zero only; val images dropped by an earlier rule are not compared)."""
    nearest = sum((r.nearest for r in results if r.split == "val"), np.zeros(PHASH_BITS + 1, np.int64))
    return {"mode": params.leaks, "leak_distance": params.leak_distance,
            "hash": "imagehash.phash (64 bit) of the whole frame and of its central 90 %, 1/8-scale JPEG decode",
            "checked": leaks != "off", "val_images_compared": int(nearest.sum()),
            "nearest_distance": {str(d): int(n) for d, n in enumerate(nearest.tolist()) if n}}


def convert(raw_root: Path | str, out_dir: Path | str, params: Convert, *, progress: bool = True,
            label_plots: Path | str | None = None) -> dict:
    """Convert a COCO instances dataset to Arrow IPC shards (see the module docstring for layout and schema).

    Args:
        raw_root: folder that ``params.annotations``/``images``/``val_annotations``/``val_images`` are relative to
            (``params.format`` yolo: the folder holding ``data.yaml``, see `detpipe.data.yolo_reader`; voc: the
            folder holding ``Annotations/`` and ``JPEGImages/``, see `detpipe.data.voc_reader`).
        out_dir: output folder (replaced atomically: on any error it is left as it was).
        params: the ``convert`` params section.
        progress: show the progress in images (`detpipe.core.progress.Progress`: a bar on a terminal, a log line every
            30 s elsewhere).
        label_plots: folder that receives the train split's label statistics as DVC plots
            (`detpipe.data.label_stats`: instances per class, box width, height and aspect-ratio histograms),
            replaced atomically once ``out_dir`` is written; None: not written.
    Returns:
        ``{"meta": <meta.json>, "report": <report.json>}``.
    Raises:
        StageError: an input of `detpipe.data.coco_schema.ERRORS` (malformed annotation file, a split emptied by the
            rules, ...), a missing image folder, or (``params.strict``) any rule of `detpipe.data.coco_schema.RULES`;
            ``leaks: error`` and a val image within ``leak_distance`` of a train image (naming both files);
            other formats: malformed input, naming the file and record (each reader's ``read``);
            ``format: auto`` finding both formats or neither.
    """
    raw_root, out_dir = Path(raw_root), Path(out_dir)
    fmt = params.format
    if fmt == "auto":
        fmt, marker = detect_format(raw_root, params.annotations)
        log.info("convert: format auto: found %s (%s)", fmt, marker)
    if fmt == "coco":
        return _convert(raw_root, out_dir, params, progress, label_plots, None)
    translated: dict = {}
    try:
        return _convert(raw_root, out_dir, params, progress, label_plots, (fmt, translated))
    except StageError as e:
        raise StageError(translate.rename_error(str(e), translated, raw_root)) from None


def _translated_sources(fmt: str, raw_root: Path, params: Convert, report: Report, tmp: Path, translated: dict) \
        -> tuple[dict, list, Path, Path | None, translate.Dataset]:
    """`_sources` of a dataset in format ``fmt``: translated into COCO files in ``tmp`` by its reader
    (`detpipe.data.translate`, filling ``translated`` with the `Translated` per split), those read as the COCO path
    reads its files. Also returns the `Dataset`."""
    ds = READERS[fmt].read(raw_root, params, tmp.absolute())   # the COCO files' paths are taken
    translated.update(ds.translated)                                    # relative to raw_root below
    coco = params.model_copy(update={"annotations": str(ds.translated["train"].json_path), "images": ".",
                                     "val_annotations": str(ds.translated["val"].json_path)
                                     if "val" in ds.translated else None, "val_images": None})
    sources, categories, _, _ = _sources(raw_root, coco, report, tmp)
    return sources, categories, ds.source, ds.source if "val" in ds.translated else None, ds


def _convert(raw_root: Path, out_dir: Path, params: Convert, progress: bool, label_plots: Path | str | None,
             other: tuple[str, dict] | None) -> dict:
    """`convert` of one format: COCO (``other`` None) or ``(format, translated)`` (``translated``: filled with the
    `detpipe.data.translate.Translated` per split, for naming the source files in findings and errors)."""
    t0 = time.perf_counter()
    report = Report(params.strict, {"val_near_duplicate": LEAK_ACTIONS[params.leaks]})
    ds = None
    with process_pool(params.workers) as pool, gc_paused() as parsed, atomic_dir(out_dir) as tmp:
        for _ in range(params.workers if params.leaks != "off" else 0):
            pool.submit(preload_phash)  # the workers import ImageHash (~0.4 s) while this process reads the JSON
        if other is None:
            sources, categories, train_file, val_file = _sources(raw_root, params, report, tmp)  # after the fork
        else:
            sources, categories, train_file, val_file, ds = _translated_sources(other[0], raw_root, params, report,
                                                                                tmp, other[1])
        parsed()                        # the columns live until the end: frozen out of later collections
        cat_ids = sorted(c["id"] for c in categories)
        labels = {cid: k + 1 for k, cid in enumerate(cat_ids)}
        names = {c["id"]: c["name"] for c in categories}
        total = sum(len(s[1]) for s in sources.values())
        results: list[ShardResult] = []
        leaks = params.leaks if len(sources["val"][1]) else "off"      # no val: nothing to compare, nothing hashed
        with Progress(total, "convert", unit="image", enabled=progress) as bar:
            leak = None
            for split, (table, rows, images_dir) in sources.items():   # train first: val is checked against it
                if split == "val" and len(rows):
                    train_table, _, train_dir = sources["train"]
                    phashes = [np.zeros((0, 2), np.uint64)] + [r.phashes for r in results]
                    leak = write_leak_check(tmp / ".train-images", train_table,
                                            np.concatenate([np.zeros(0, np.int64)] + [r.rows_out for r in results]),
                                            np.concatenate([np.zeros(0, np.int64)] + [r.keys for r in results]),
                                            train_dir, None if leaks == "off" else np.concatenate(phashes))
                (tmp / split).mkdir()
                tasks = plan_shards(split, table, rows, images_dir, tmp, labels, params.shard_mb, params.strict,
                                    leak, leaks, params.leak_distance)
                for r in bounded_map(pool, convert_shard, tasks, 2 * max(1, params.workers), ordered=False):
                    results.append(r)
                    bar.update(r.images, images=r.images)
        for scratch in tmp.glob(".*"):                  # the leak check's arrays, spill files
            shutil.rmtree(scratch) if scratch.is_dir() else scratch.unlink()
        splits = _collect(results, sources, tmp, report, len(cat_ids) + 1)
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
            "leaks": _leaks_section(params, leaks, results),
        }
        if ds is not None:
            _translated_report(ds, raw_root, params, meta, rep)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "report.json").write_text(json.dumps(rep, indent=2) + "\n")

    if label_plots is not None:
        write_label_plots(label_plots, splits["train"]["labels"], meta["label_names"])
    tr, va = splits["train"], splits["val"]
    log.info("convert: train %d images / %d annotations in %d shard(s), val %d / %d in %d; dropped %d of %d "
             "images; findings: %s (%s/report.json) [%.1f s]",
             tr["images"], tr["annotations"], len(tr["shards"]), va["images"], va["annotations"],
             len(va["shards"]), total - tr["images"] - va["images"], total, report.summary(), out_dir,
             time.perf_counter() - t0)
    return {"meta": meta, "report": rep}


def _translated_report(ds: translate.Dataset, raw_root: Path, params: Convert, meta: dict, rep: dict) -> None:
    """meta.json and report.json of a translated dataset: ``format``, its source file, findings naming the source
    files and records, the reader's section (report.json's ``<format>`` key) and the classes that are in val but
    not in train (``val_classes_not_in_train``, also logged)."""
    rel = str(ds.source.relative_to(raw_root))
    has_val = "val" in ds.translated
    meta.update({"format": ds.format, "annotations_file": rel, "val_annotations_file": rel if has_val else None,
                 "val_fraction": None if has_val else params.val_fraction})
    rep.update({"format": ds.format, "annotations_file": str(ds.source),
                "val_annotations_file": str(ds.source) if has_val else None})
    translate.rename_findings(rep["rules"], ds.translated, raw_root)
    if has_val:
        names = {c["id"]: c["name"] for c in ds.categories}
        train, val = ds.translated["train"].class_counts, ds.translated["val"].class_counts
        only = sorted(set(val) - set(train))
        ds.section["val_classes_not_in_train"] = [{"id": c, "name": names[c], "val_annotations": val[c]}
                                                  for c in only]
        if only:
            log.warning("convert: %d class(es) in val but not in train: %s", len(only),
                        ", ".join(f"{c} {names[c]!r}" for c in only))
    rep[ds.format] = ds.section
