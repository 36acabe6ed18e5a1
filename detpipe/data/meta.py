"""The stages' ``meta.json`` files and the shard lists in them: the one reader of both.

``data/arrow/meta.json`` (the convert stage's, `detpipe.data.convert`) lists per split (``splits.<split>.shards``)
the split's Arrow shards in row order, as paths relative to ``data/arrow`` (``"train/part-00000.arrow"``, ...).
Every reader of the converted shards (the augment stage, evaluation's ground truth and plots) takes them from
there (`arrow_shards`), never by listing the folder. ``data/cache/meta.json`` (the augment stage's,
`detpipe.data.augment`) holds the cache's settings and per-split counts, read locally or from a URL
(`read_cache_meta_bytes`); the loader finds each cache row's shard in the split's ``index.arrow``
(`detpipe.data.dataset`).
"""
from __future__ import annotations

import json
from pathlib import Path

from detpipe.core.errors import StageError
from detpipe.core.files import is_url, join_url, read_url_bytes

META_FILE = "meta.json"

__all__ = ["META_FILE", "read_meta", "read_meta_bytes", "read_cache_meta_bytes", "arrow_shards"]

_LOADED: dict[str, tuple[tuple[int, int, int], bytes, dict]] = {}
"""The ``meta.json`` files this process has read: resolved path -> ((inode, size, mtime_ns), bytes, parsed)."""


def _load(path: Path, stage: str | None) -> tuple[bytes, dict]:
    """``path``'s bytes and parsed JSON, read once per process: again only when the file changed (another inode,
    size or modification time: a stage rerun in the same process, a test rewriting it)."""
    run = f"the {stage} stage" if stage else "the previous stages"
    try:
        st = path.stat()
        key, stamp = str(path.resolve()), (st.st_ino, st.st_size, st.st_mtime_ns)
        hit = _LOADED.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1], hit[2]
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StageError(f"{path}: not found (run {run} first)") from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StageError(f"{path}: not valid JSON ({e})") from None
    _LOADED[key] = (stamp, raw, data)
    return raw, data


def read_meta(path: str | Path, stage: str | None = None) -> dict:
    """A stage's ``meta.json`` (a local file) as a dict, read once per process (`_load`): every caller of one file
    gets the same object, which must not be modified.

    Args:
        path: the file.
        stage: the stage that writes it (``"convert"``, ``"augment"``), named in the not-found error.
    Raises:
        StageError: the file is missing (``<path>: not found (run the <stage> stage first)``, or "the previous
            stages" without ``stage``) or not JSON (``<path>: not valid JSON (...)``).
    """
    return _load(Path(path), stage)[1]


def read_meta_bytes(path: str | Path, stage: str | None = None) -> bytes:
    """The bytes of the ``meta.json`` `read_meta` parses (the same single read; what a checkpoint fingerprint
    hashes). Raises as `read_meta`."""
    return _load(Path(path), stage)[0]


def read_cache_meta_bytes(root: str) -> bytes:
    """Bytes of the augmentation cache's ``<root>/meta.json``; ``root`` a local folder or a URL (``s3://...``,
    `detpipe.core.files.read_url_bytes`).
    Raises `StageError` naming the location when it cannot be read."""
    if not is_url(root) and not (Path(root) / META_FILE).is_file():
        raise StageError(f"{Path(root) / META_FILE}: not found (run the augment stage first)")
    return read_url_bytes(join_url(root, META_FILE), "train.cache_url" if is_url(root) else "augment cache")


def arrow_shards(split_dir: str | Path, meta: dict | None = None) -> list[Path]:
    """The converted Arrow shards of one split, in row order (ascending ``image_id``).

    Args:
        split_dir: the split's folder, ``<arrow_dir>/<split>`` (e.g. ``data/arrow/val``).
        meta: ``<arrow_dir>/meta.json`` as `read_meta` returns it; default: read it.
    Returns:
        the paths ``<arrow_dir>/<shard>`` of the shards ``meta["splits"][<split>]["shards"]`` lists (an empty list
        for a split without images).
    Raises:
        StageError: ``meta.json`` is missing or not JSON, lists no shards for the split, or a listed shard is not
            a file (each: re-run the convert stage).
    """
    split_dir = Path(split_dir)
    arrow_dir, split = split_dir.parent, split_dir.name
    where = arrow_dir / META_FILE
    if meta is None:
        meta = read_meta(where, "convert")
    splits = meta.get("splits") if isinstance(meta, dict) else None
    entry = splits.get(split) if isinstance(splits, dict) else None
    shards = entry.get("shards") if isinstance(entry, dict) else None
    if not isinstance(shards, list):
        raise StageError(f"{where}: no shard list for the {split} split (re-run the convert stage)")
    paths = [arrow_dir / name for name in shards]
    for path in paths:
        if not path.is_file():
            raise StageError(f"{path}: listed in {where} but not found (re-run the convert stage)")
    return paths
