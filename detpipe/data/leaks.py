"""Train/val leak detection of the convert stage: the kept train images' SHA-1 keys, file names and pHash pairs
written once (`write_leak_check`) and memory-mapped by every val shard worker (`load_leak_check`), which looks up
an exact copy (`train_copy`) and the nearest train image by pHash (`nearest_train`); `detpipe.data.cocoarrow`
applies the rules (``val_exact_duplicate``-style copies, ``val_near_duplicate``) to each val image."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np

from detpipe.data.coco_reader import ImageTable

NEAR_CHUNK = 1 << 20                # train hashes compared per numpy call in nearest_train (bounds its temporaries)
PHASH_BITS = 64


@dataclasses.dataclass
class LeakCheck:
    """Where a val shard finds the train images that were kept (written by `write_leak_check`): ``folder`` holds
    ``keys.npy`` (int64, ascending: the first 8 bytes of each image's SHA-1), ``rows.npy`` ((n, 3) int64: image
    id, start and end of its file name in ``names.npy``, uint8 UTF-8) and, when ``convert.leaks`` is not off,
    ``phash.npy`` ((2, n) uint64: row 0 each image's whole-frame pHash, row 1 its central part's,
    `detpipe.data.imageio.phash_pair`; rows contiguous for the scan) in the same order; names are
    relative to ``images_dir``. Val shard workers memory-map them (`load_leak_check`)."""
    folder: str
    images_dir: str


def image_key(data: bytes | memoryview) -> int:
    """The first 8 bytes of the SHA-1 of ``data`` as a little-endian int64 (equal bytes give equal keys; equal keys
    are confirmed byte by byte before two files are called equal)."""
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "little", signed=True)


def load_leak_check(leak: LeakCheck) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The arrays of ``leak`` (memory-mapped): keys, rows, names, and phash (None when not written)."""
    arrays = [np.load(os.path.join(leak.folder, f"{name}.npy"), mmap_mode="r") for name in ("keys", "rows", "names")]
    phash = os.path.join(leak.folder, "phash.npy")
    return (*arrays, np.load(phash, mmap_mode="r") if os.path.exists(phash) else None)


def train_copy(leak: LeakCheck, tables: tuple, key: int, data: memoryview) -> tuple[int, str] | None:
    """``(image id, path)`` of a kept train image whose file holds exactly ``data`` (`image_key` ``key``), or None
    (also when that train file cannot be read any more: equality not confirmed). ``tables``: `load_leak_check`."""
    keys, rows, names, _ = tables
    k = int(np.searchsorted(keys, key))
    while k < len(keys) and keys[k] == key:
        image_id, start, end = rows[k].tolist()
        path = os.path.join(leak.images_dir, bytes(names[start:end]).decode())
        try:
            with open(path, "rb") as f:
                if f.read() == data:
                    return image_id, path
        except OSError:
            pass
        k += 1
    return None


def nearest_train(leak: LeakCheck, tables: tuple, hashes: tuple[int, int]) -> tuple[int, int, str] | None:
    """The kept train image nearest to a val image by pHash: ``(Hamming distance 0..64, train image id, path)``,
    or None when there are no train hashes. The distance is the smallest of whole frame vs whole frame, val's
    whole frame vs train's central part (val a crop of train) and val's central part vs train's whole frame
    (train a crop of val), each the popcount of the XOR of two `detpipe.data.imageio.phash64` (``np.bitwise_count``
    over all train hashes, `NEAR_CHUNK` at a time: ~11 bytes of temporaries per train image of a chunk, at most
    ~11 MB, and O(train images) time per val image: ~0.4 ms per 100,000 train images on one core, ``python -m
    benchmarks.convert_leaks``). Ties go to the lowest train image id.

    Args:
        leak: the `LeakCheck` ``tables`` were loaded from (for the train image's path).
        tables: `load_leak_check` of ``leak``.
        hashes: the val image's `detpipe.data.imageio.phash_pair` (two ints in [0, 2**64)).
    """
    _, rows, names, phash = tables
    if phash is None or not phash.shape[1]:
        return None
    whole, centre = np.uint64(hashes[0]), np.uint64(hashes[1])
    best, found = PHASH_BITS + 1, [np.zeros(0, np.int64)]
    n = phash.shape[1]
    xor = np.empty(min(n, NEAR_CHUNK), np.uint64)
    for start in range(0, n, NEAR_CHUNK):
        t_whole = np.asarray(phash[0, start:start + NEAR_CHUNK])
        t_centre = np.asarray(phash[1, start:start + NEAR_CHUNK])
        x = xor[:len(t_whole)]
        dist = np.bitwise_count(np.bitwise_xor(t_whole, whole, out=x))
        np.minimum(dist, np.bitwise_count(np.bitwise_xor(t_centre, whole, out=x)), out=dist)
        np.minimum(dist, np.bitwise_count(np.bitwise_xor(t_whole, centre, out=x)), out=dist)
        low = int(dist.min())
        if low < best:
            best, found = low, []
        if low == best:
            found.append(np.flatnonzero(dist == low) + start)
    at = np.concatenate(found)
    k = int(at[np.argmin(rows[at, 0])])
    image_id, start, end = rows[k].tolist()
    return best, image_id, os.path.join(leak.images_dir, bytes(names[start:end]).decode())


def write_leak_check(folder: Path, table: ImageTable, rows: np.ndarray, keys: np.ndarray, images_dir: Path,
                     phashes: np.ndarray | None = None) -> LeakCheck:
    """Write the `LeakCheck` of the kept train images (``rows`` of ``table`` with SHA-1 keys ``keys`` and, unless
    None, `detpipe.data.imageio.phash_pair` hashes ``phashes``, (len(rows), 2) uint64) into the new folder
    ``folder``."""
    folder.mkdir()
    order = np.argsort(keys, kind="stable")
    rows = rows[order]
    pos = table.pos[rows]
    ends = np.frombuffer(table.cols.name_ends, np.int64)
    np.save(folder / "keys.npy", keys[order])
    np.save(folder / "rows.npy", np.stack([table.ids[rows], ends[pos], ends[pos + 1]], axis=1))
    np.save(folder / "names.npy", np.frombuffer(table.cols.names, np.uint8))
    if phashes is not None:
        np.save(folder / "phash.npy", np.ascontiguousarray(phashes[order].T))
    return LeakCheck(str(folder), str(images_dir))
