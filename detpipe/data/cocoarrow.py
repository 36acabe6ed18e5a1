"""COCO image records -> validated rows -> Arrow IPC shard files (the convert stage's worker side).

One `ShardTask` is a run of consecutive images of one split (`plan_shards`, from the split's
`detpipe.data.coco_reader.ImageTable`); `convert_shard` reads each image's annotations (their JSON text, from the
annotation file) and its file, hashes the file (SHA-1: a val image equal to a kept train image is dropped,
`train_copy`), checks it (`detpipe.data.imageio.inspect`; with ``convert.leaks`` not off also its perceptual
hashes, `detpipe.data.imageio.phash_pair`: a val image within ``leak_distance`` of a kept train image is reported,
dropped or an error, `nearest_train`), applies the annotation rules
(`detpipe.data.coco_reader.clean_annotations`), maps annotations to the displayed frame where EXIF orientation asks
for it (`detpipe.data.geometry`) and writes the rows as record batches of at most `BATCH_BYTES` image bytes (and as
much segmentation text). It runs in a
worker process (or in-process) and holds one image's annotations and one record batch at a time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson
import pyarrow as pa

from detpipe.data.coco_reader import Entry, Frame, ImageTable, clean_annotations
from detpipe.data.coco_schema import LEAK_ACTIONS, Report, to_rle
from detpipe.data.geometry import orient_box, orient_segmentation
from detpipe.data.imageio import Unreadable, inspect
from detpipe.data.label_stats import LabelStats
from detpipe.data.leaks import PHASH_BITS, LeakCheck, image_key, load_leak_check, nearest_train, train_copy
from detpipe.core.errors import StageError

SCHEMA = pa.schema(
    [
        ("image_id", pa.int64()),
        ("file_name", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("image", pa.binary()),
        ("ann_id", pa.list_(pa.int64())),
        ("bbox", pa.list_(pa.list_(pa.float32(), 4))),
        ("category_id", pa.list_(pa.int64())),
        ("label", pa.list_(pa.int64())),
        ("iscrowd", pa.list_(pa.int8())),
        ("area", pa.list_(pa.float64())),
        ("segmentation", pa.list_(pa.string())),
        ("occluded", pa.list_(pa.int8())),
    ],
    metadata={"detpipe.convert.schema_version": "2"},
)
"""Arrow schema of the converted data, one row per image (see the convert stage's docstring)."""

SHARD_MB_BYTES = 1_000_000          # convert.shard_mb unit: 1 MB = 10^6 bytes of image bytes
BATCH_BYTES = 16 << 20              # image bytes, or segmentation text, per Arrow record batch (bounds a worker)
BATCH_ROWS = 1024
SPREAD_SHARDS = 16                  # shards per split at least, while each keeps MIN_SHARD_BYTES (balance)
MIN_SHARD_BYTES = 8_000_000
_OBJECT_COLUMNS = ("ann_id", "bbox", "category_id", "label", "iscrowd", "area", "segmentation", "occluded")


@dataclasses.dataclass
class ShardTask:
    """One shard to write: the images ``rows`` (rows of the split's `detpipe.data.coco_reader.ImageTable`, ascending
    id) of ``split`` into ``out_path``. Per image: ``image_ids`` (int64), ``file_names``, ``widths``/``heights`` (int32,
    pixels, as in the JSON) and ``ann_counts``; its annotations are the next ``ann_counts[k]`` JSON texts at
    (``ann_starts``, ``ann_lengths``) bytes of ``ann_source``, parsed with orjson if ``fast_json`` (the file parsed
    with orjson: orjson.dumps then also reproduces its values exactly), else Python's json. ``leak``: val only.
    ``leaks`` / ``leak_distance``: ``convert.leaks`` and ``convert.leak_distance`` (``off``: nothing hashed)."""
    split: str
    index: int
    out_path: str
    images_dir: str
    ann_file: str
    labels: dict          # category id -> label
    strict: bool
    fast_json: bool
    rows: np.ndarray
    image_ids: np.ndarray
    file_names: list
    widths: np.ndarray
    heights: np.ndarray
    ann_counts: np.ndarray
    ann_source: str
    ann_starts: np.ndarray
    ann_lengths: np.ndarray
    leak: LeakCheck | None = None
    leaks: str = "off"
    leak_distance: int = 0


@dataclasses.dataclass
class ShardResult:
    """What `convert_shard` wrote: counts of images in / rows out, annotations, image bytes, findings, per row
    written its table row and the first 8 bytes of its file's SHA-1 as int64 (``keys``), the `LabelStats` of
    the rows written (``labels``), per row written its `detpipe.data.imageio.phash_pair` (``phashes``: (rows, 2)
    uint64; (0, 2) when ``convert.leaks`` is off) and, val only, how many images had their nearest train image
    at each pHash distance (``nearest``: (65,) int64, index = Hamming distance 0..64; zeros when not checked)."""
    split: str
    index: int
    out_path: str | None  # None: every image of the shard was dropped, no file written
    images: int
    rows: int
    annotations: int
    image_bytes: int
    report: Report
    rows_out: np.ndarray
    keys: np.ndarray
    labels: LabelStats
    phashes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 2), np.uint64))
    nearest: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(PHASH_BITS + 1, np.int64))


class _Batch:
    """The rows of one record batch. Image files are read straight into one buffer (`read_image`), which becomes
    the ``image`` column's data without another copy and is reused by the next batch of the shard (no new
    allocation, and page faults, per file)."""

    _spare: bytearray | None = None         # this process's buffer, kept for its next shard

    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in SCHEMA.names if name != "image"}
        self.buf, _Batch._spare = _Batch._spare or bytearray(2 * BATCH_BYTES), None
        self.ends: list[int] = [0]          # end offset of each row's image bytes in buf
        self.rows = 0
        self.text_bytes = 0                 # characters of segmentation text

    @property
    def nbytes(self) -> int:
        return self.ends[-1]

    def read_image(self, path: str) -> memoryview:
        """The bytes of the file at ``path``, read into the buffer after the last added row (they belong to the
        batch once `add` is called with them; otherwise the next read overwrites them).

        Raises:
            OSError: the file cannot be opened or read.
        """
        start = self.ends[-1]
        with open(path, "rb", buffering=0) as f:
            room = os.fstat(f.fileno()).st_size + 1         # one byte more: a file that grew is read on
            n = 0
            while True:
                if start + n + room > len(self.buf):        # grow into a new buffer: older views stay valid
                    bigger = bytearray(max(2 * len(self.buf), start + n + room))
                    with memoryview(self.buf) as old:
                        bigger[:start + n] = old[:start + n]
                    self.buf = bigger
                with memoryview(self.buf) as mv:
                    got = f.readinto(mv[start + n:start + n + room])
                if not got:
                    break
                n += got
                room = max(room, 1 << 16)
        return memoryview(self.buf)[start:start + n]

    def add(self, row: dict, nbytes: int) -> None:
        """Append ``row`` (`SCHEMA` columns but ``image``), whose image bytes are the last ``nbytes`` read."""
        for name, col in self.cols.items():
            col.append(row[name])
        self.ends.append(self.ends[-1] + nbytes)
        self.rows += 1
        self.text_bytes += sum(map(len, row["segmentation"]))

    def record_batch(self) -> pa.RecordBatch:
        """The rows as one record batch; its ``image`` column points into the buffer (write it before the next
        `read_image`, then `clear`)."""
        arrays = [_binary(self.buf, self.ends) if f.name == "image" else pa.array(self.cols[f.name], type=f.type)
                  for f in SCHEMA]
        return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)

    def clear(self) -> None:
        """Drop the rows; keep the buffer."""
        for col in self.cols.values():
            col.clear()
        self.ends = [0]
        self.rows = 0
        self.text_bytes = 0

    def release(self) -> None:
        """Hand the buffer to this process's next batch (call when done with this one)."""
        _Batch._spare, self.buf = self.buf, bytearray()


def _binary(buf: bytearray, ends: list[int]) -> pa.Array:
    """A ``binary`` array of ``len(ends) - 1`` values: value k is ``buf[ends[k]:ends[k + 1]]`` (no copy of
    ``buf``; offsets int32, or int64 ``large_binary`` cast back to ``binary`` beyond 2 GiB, which pyarrow
    refuses with its own error)."""
    offsets = np.asarray(ends, dtype=np.int64)
    data = pa.py_buffer(buf).slice(0, ends[-1])
    if offsets[-1] >= 1 << 31:
        return pa.Array.from_buffers(pa.large_binary(), len(ends) - 1, [None, pa.py_buffer(offsets), data]) \
            .cast(pa.binary())
    return pa.Array.from_buffers(pa.binary(), len(ends) - 1, [None, pa.py_buffer(offsets.astype(np.int32)), data])


def _dumps(obj: Any, fast: bool) -> str:
    """Compact JSON text. orjson is used only for files it parsed: it would write NaN/Infinity as null."""
    if fast:
        try:
            return orjson.dumps(obj).decode()
        except TypeError:       # e.g. an int beyond 64 bits
            pass
    return json.dumps(obj, separators=(",", ":"))


def _orienter(width: int, height: int, orientation: int):
    """``(box, seg) -> (box, seg)`` mapping a stored-raster annotation to the displayed frame."""
    def orient(box: list, seg: Any) -> tuple[list, Any]:
        if isinstance(seg, dict):
            seg = to_rle(seg, height, width)
        if seg:
            seg = orient_segmentation(seg, width, height, orientation)
        return orient_box(box, width, height, orientation), seg
    return orient


def _near_duplicate(entry: Entry, task: ShardTask, report: Report, train: tuple, hashes: tuple[int, int],
                    path: str, nearest: np.ndarray | None) -> bool:
    """Check one val image (decoded and valid) against the kept train images (rule ``val_near_duplicate``): count
    its nearest distance in ``nearest``; at most ``task.leak_distance`` away, report it (``leaks: report``),
    report and drop it (``drop``: True) or raise (``error``). Returns True when the image is dropped.

    Raises:
        StageError: ``leaks: error`` and a near-duplicate, naming the val file, its image id, the train file, the
            distance and the rule; or ``strict`` (`Report.add`).
    """
    near = nearest_train(task.leak, train, hashes)
    if near is None:
        return False
    dist, train_id, train_path = near
    if nearest is not None:
        nearest[dist] += 1
    if dist > task.leak_distance:
        return False
    what = (f"pHash Hamming distance {dist} <= {task.leak_distance} (convert.leak_distance) to train image id "
            f"{train_id} ({train_path})")
    if task.leaks == "error":
        raise StageError(f"{path}: image id {entry.image_id}: near-duplicate of a train image: {what} "
                         f"(rule 'val_near_duplicate'; convert.leaks is error)")
    drop = task.leaks == "drop"
    tail = f"; dropped with its {len(entry.anns)} annotation(s)" if drop else "; kept (convert.leaks: report)"
    report.add("val_near_duplicate", task.split, path, f"image id {entry.image_id}", what + tail)
    return drop


def convert_image(entry: Entry, task: ShardTask, report: Report, batch: _Batch, train: tuple | None = None,
                  nearest: np.ndarray | None = None) -> tuple[dict, int, int, tuple[int, int] | None] | None:
    """Validate one image and its annotations (the file is read into ``batch``'s buffer); return its Arrow row
    (a dict of the `SCHEMA` columns but ``image``), its byte count for `_Batch.add`, its `image_key` and its
    `detpipe.data.imageio.phash_pair` (None when ``task.leaks`` is off), or None if the image is dropped (counted
    in ``report``). ``train``: `load_leak_check` of ``task.leak`` (val); ``nearest``: the shard's histogram of
    nearest-train distances (`ShardResult.nearest`), val only.

    Raises:
        StageError: in strict mode at the first finding; ``leaks: error`` at a near-duplicate (`_near_duplicate`).
    """
    split, iid = task.split, entry.image_id
    path = os.path.join(task.images_dir, entry.file_name)
    record = f"image id {iid}"
    tail = f"; dropped with its {len(entry.anns)} annotation(s)"
    try:
        data = batch.read_image(path)
    except FileNotFoundError:
        report.add("image_missing", split, path, record, "file not found" + tail)
        return None
    except OSError as e:
        report.add("image_unreadable", split, path, record, f"cannot read ({e.strerror or e})" + tail)
        return None
    key = image_key(data)
    if train is not None:
        copy = train_copy(task.leak, train, key, data)
        if copy is not None:
            report.add("val_image_in_train", split, path, record,
                       f"same bytes as train image id {copy[0]} ({copy[1]})" + tail)
            return None
    try:
        info = inspect(data, phash=task.leaks != "off")
    except Unreadable as e:
        report.add("image_unreadable", split, path, record, f"{e}" + tail)
        return None

    jw, jh = entry.width, entry.height
    raw, shown = (info.width, info.height), info.display_size
    if (jw, jh) == raw:
        remap = info.orientation != 1
    elif (jw, jh) == shown:
        remap = False
    else:
        extra = f" ({shown[0]}x{shown[1]} after EXIF orientation {info.orientation})" if shown != raw else ""
        report.add("image_size_mismatch", split, path, record,
                   f"JSON says {jw}x{jh}, file is {raw[0]}x{raw[1]}{extra}" + tail)
        return None
    if train is not None and info.phash is not None and \
            _near_duplicate(entry, task, report, train, info.phash, path, nearest):
        return None
    if info.orientation != 1:
        how = (f"annotations mapped from the stored {raw[0]}x{raw[1]} raster to the displayed "
               f"{shown[0]}x{shown[1]} frame" if remap else
               f"JSON size {jw}x{jh} is already the displayed size; annotations kept")
        report.add("exif_orientation", split, path, record, f"orientation {info.orientation}: {how}")
    for flag in info.flags:
        report.add(flag, split, path, record, f"{info.format} mode {info.mode}")

    frame = Frame(jw, jh, _orienter(info.width, info.height, info.orientation) if remap else None)
    kept = clean_annotations(entry.anns, frame, task.labels, report, split, task.ann_file, iid)
    objs = {name: list(col) for name, col in zip(_OBJECT_COLUMNS, zip(*kept))} if kept else \
        {name: [] for name in _OBJECT_COLUMNS}
    objs["segmentation"] = ["" if seg is None else _dumps(seg, task.fast_json) for seg in objs["segmentation"]]
    if not kept:
        why = "no annotations in the JSON" if not entry.anns else f"all {len(entry.anns)} annotation(s) dropped"
        report.add("image_no_annotations", split, path, record, f"{why}; kept as a negative")
    return ({"image_id": iid, "file_name": entry.file_name, "width": shown[0], "height": shown[1], **objs},
            len(data), key, info.phash)


def entries(task: ShardTask) -> Iterator[Entry]:
    """The task's images in order, each with its annotations read from ``task.ann_source`` (one at a time)."""
    parse = orjson.loads if task.fast_json else json.loads
    starts, lengths = task.ann_starts.tolist(), task.ann_lengths.tolist()
    with open(task.ann_source, "rb", buffering=0) as f:
        fd, j = f.fileno(), 0
        for k, count in enumerate(task.ann_counts.tolist()):
            anns = [parse(os.pread(fd, n, s)) for s, n in zip(starts[j:j + count], lengths[j:j + count])]
            j += count
            yield Entry(int(task.image_ids[k]), task.file_names[k], int(task.widths[k]), int(task.heights[k]), anns)


def convert_shard(task: ShardTask) -> ShardResult:
    """Read, validate and write one shard (runs in a worker process, or in-process for workers=0).

    Raises:
        StageError: in strict mode, at the first finding (the partial file is left for the caller's
            temporary folder to remove).
    """
    report = Report(task.strict, {"val_near_duplicate": LEAK_ACTIONS[task.leaks]})
    writer = None
    batch = _Batch()
    rows = anns = nbytes = 0
    n = len(task.image_ids)
    rows_out, keys, phashes = [], [], []
    nearest = np.zeros(PHASH_BITS + 1, np.int64)
    stats = LabelStats(max(task.labels.values(), default=0) + 1)
    train = None if task.leak is None else load_leak_check(task.leak)
    try:
        for k, entry in enumerate(entries(task)):
            got = convert_image(entry, task, report, batch, train, nearest)
            if got is not None:
                row, size, key, hashes = got
                batch.add(row, size)
                rows, anns, nbytes = rows + 1, anns + len(row["ann_id"]), nbytes + size
                rows_out.append(int(task.rows[k]))
                keys.append(key)
                if hashes is not None:
                    phashes.append(hashes)
                stats.add_image(row["bbox"], row["label"], row["iscrowd"])
            if batch.rows and (k == n - 1 or batch.nbytes >= BATCH_BYTES or batch.rows >= BATCH_ROWS
                               or batch.text_bytes >= BATCH_BYTES):
                if writer is None:
                    writer = pa.ipc.new_file(task.out_path, SCHEMA)
                writer.write_batch(batch.record_batch())
                batch.clear()
    finally:
        batch.release()
        if writer is not None:
            writer.close()
    return ShardResult(task.split, task.index, task.out_path if writer is not None else None, n, rows, anns,
                       nbytes, report, np.array(rows_out, np.int64), np.array(keys, np.int64), stats,
                       np.array(phashes, np.uint64).reshape(-1, 2), nearest)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` (int64), without a Python loop."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(total, dtype=np.int64)


def plan_shards(split: str, table: ImageTable, rows: np.ndarray, images_dir: Path, out_dir: Path, labels: dict,
                shard_mb: float, strict: bool, leak: LeakCheck | None = None, leaks: str = "off",
                leak_distance: int = 0) -> Iterator[ShardTask]:
    """Yield the shard tasks of one split, the images ``rows`` of ``table`` (ascending): runs of consecutive images
    whose file sizes sum to at most ``shard_mb`` x 10^6 bytes (a larger image gets a shard of its own), the bytes
    spread evenly over the shards, and at least `SPREAD_SHARDS` shards where the split holds `MIN_SHARD_BYTES` per
    shard, so that a few workers get about the same work (3 shards on 2 workers would leave one idle half the
    time). The layout depends on the files only, not on the number of workers. Writes go to
    ``out_dir/<split>/part-NNNNN.arrow``. ``leak``, ``leaks``, ``leak_distance``: see `ShardTask`."""
    def size(row: int) -> int:
        try:
            return os.stat(images_dir / table.name(row)).st_size
        except OSError:
            return 0                     # missing or unreadable: counted by the worker

    sizes = np.fromiter((size(r) for r in rows.tolist()), np.int64, len(rows))
    total = int(sizes.sum())
    cap = shard_mb * SHARD_MB_BYTES
    n = max(1, math.ceil(total / cap), min(SPREAD_SHARDS, total // MIN_SHARD_BYTES))
    target = total / n                   # cut at the image boundary nearest to it, never above cap
    widths = np.frombuffer(table.cols.widths, np.int32)
    heights = np.frombuffer(table.cols.heights, np.int32)

    def task(index: int, a: int, b: int) -> ShardTask:
        r = rows[a:b]
        counts = table.ann_first[r + 1] - table.ann_first[r]
        anns = _ranges(table.ann_first[r], counts)
        pos = table.pos[r]
        return ShardTask(split, index, str(out_dir / split / f"part-{index:05d}.arrow"), str(images_dir),
                         str(table.cols.path), labels, strict, table.cols.fast, r, table.ids[r],
                         [table.name(k) for k in r.tolist()], widths[pos], heights[pos], counts, table.cols.source,
                         table.ann_starts[anns], table.ann_lengths[anns], leak, leaks, leak_distance)

    index, start, cur_bytes = 0, 0, 0
    for k, size in enumerate(sizes.tolist()):
        if k > start and (cur_bytes + size > cap or cur_bytes + size / 2 > target):
            yield task(index, start, k)
            index, start, cur_bytes = index + 1, k, 0
        cur_bytes += size
    if len(rows) > start:
        yield task(index, start, len(rows))
