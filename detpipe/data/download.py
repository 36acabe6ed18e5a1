"""Downloading the raw dataset: the download stage's work (`download`; ``python -m stages.download`` calls it
with params ``download`` and writes ``data/raw/``), and `source_sha256` for ``--print-sha256``.

The source (params ``download.source``) is an fsspec URL or a local path:

* a **folder** (local path, ``file://`` URL, ``s3://bucket/prefix``) is copied file by file;
* an **archive** (``.zip``, ``.tar``, ``.tar.gz``/``.tgz``, also ``.tar.bz2``/``.tar.xz``) is fetched, checked
  and extracted safely;
* any **other single file** is copied into ``data/raw/<its name>``;
* a **list of parts** (each any of the above with its own sha256: COCO 2017's ``train2017.zip``, ``val2017.zip``
  and ``annotations_trainval2017.zip``) is fetched part by part and merged into the one ``data/raw``
  (`download_parts`): a path two parts hold must have the same bytes, else the download fails naming both.

``http(s)://`` sources are single files, fetched with `requests`: transient failures (connection errors,
timeouts, HTTP 408/425/429/5xx) are retried with exponential backoff (`tenacity`) and a partial file is resumed
with a ``Range: bytes=N-`` request; 4xx answers such as 403/404 fail at once (`detpipe.data.fetch`). ``s3://``
sources use `s3fs`; ``download.endpoint_url`` points it at an S3-compatible store (SeaweedFS, MinIO).
Credentials come only from the environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``) or
the standard AWS config files; they are never read from params and never logged (user:password and query strings
of URLs are redacted from every message).

Integrity: ``download.sha256`` is the hex sha256 of the fetched file (for an archive: of the archive, before
extraction), or for a folder of its manifest, see `folder_sha256`. The computed hash is always logged;
``python -m stages.download --print-sha256 <path-or-url>`` prints it so it can be pasted into params.yaml.

Archives are extracted only if their declared size is at most ``download.max_extract_bytes``, at most the
free disk space and at most ``download.max_compression_ratio`` times the archive's size (zip bombs); the
archive's own top-level folder, if any, is kept (``data/raw/<folder>/...``).

The output is written with `detpipe.core.files.atomic_dir`: on any failure (bad hash, unsafe archive entry,
HTTP error, clashing parts, interrupt) ``data/raw`` keeps its previous content, or stays absent. The reference for
users: docs/download.md.
"""
from __future__ import annotations

import filecmp
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from detpipe.data.archives import (MAX_COMPRESSION_RATIO, MAX_EXTRACT_BYTES, archive_kind, check_relpath, extract,
                                   source_name)
from detpipe.data.fetch import BACKOFF_S, CHUNK_BYTES, fetch
from detpipe.core.errors import StageError
from detpipe.core.files import atomic_dir, folder_sha256, local_path, redact_url, sha256_file, temp_prefix, url_protocol
from detpipe.params import Download
from detpipe.core.paths import RAW_DIR

log = logging.getLogger(__name__)

__all__ = ["download", "download_parts", "download_raw", "print_sha256", "source_sha256", "verify"]


def verify(actual: str, expected: Optional[str], source: str, what: str, label: Optional[str] = None) -> None:
    """Log ``actual`` and compare it with ``expected`` (hex sha256, or None to skip the check).

    Args:
        actual: computed hex sha256.
        expected: hex sha256 from params, or None.
        source: the source as given (redacted before use in messages).
        what: what was hashed, e.g. ``"file"`` or ``"folder manifest"``.
        label: how messages name the source (default: the redacted source; e.g. ``download.source[1] URL``).
    Raises:
        StageError: mismatch; the message names the source, the expected and the actual hash.
    """
    label = label or redact_url(source)
    log.info("sha256 of %s %s: %s", what, label, actual)
    if expected is None:
        log.info("sha256 is null: not checked (set it to %s to pin %s)", actual, label)
        return
    if actual.lower() != expected.lower():
        raise StageError(f"{label}: sha256 mismatch for the {what}: expected {expected.lower()}, got {actual}")
    log.info("sha256 of %s matches params", label)


def source_sha256(source: str, *, retries: int = 3, timeout_s: float = 60,
                  endpoint_url: Optional[str] = None, backoff_s: float = BACKOFF_S) -> str:
    """The value to put in ``download.sha256`` for ``source``: `folder_sha256` of a folder, the sha256 of a
    file's bytes otherwise (an archive is hashed as fetched, not extracted). Remote sources are fetched to a
    temporary folder first (removed afterwards).

    Raises:
        StageError: as `fetch`.
    """
    if url_protocol(source) == "file":
        local = local_path(source)
        if local.is_dir():
            return folder_sha256(local)
        if local.is_file():
            return sha256_file(local, CHUNK_BYTES)
        raise StageError(f"{source}: not found")
    with tempfile.TemporaryDirectory(prefix="download-sha256-") as tmp:
        got = fetch(source, Path(tmp, "fetched"), retries=retries, timeout_s=timeout_s,
                    endpoint_url=endpoint_url, backoff_s=backoff_s)
        return folder_sha256(got) if got.is_dir() else sha256_file(got, CHUNK_BYTES)


def _local_source(source: str, out: Path, label: str) -> Optional[Path]:
    """The local path of ``source`` (plain path or ``file://``), or None for a remote one.

    Raises:
        StageError: a local source that does not exist, or a local folder that contains ``out``.
    """
    if url_protocol(source) != "file":
        return None
    local = local_path(source)
    if not local.exists():
        raise StageError(f"{label}: not found")
    if local.is_dir():
        src, dst = local.resolve(), out.resolve()
        if dst == src or src in dst.parents:
            raise StageError(f"{label}: the source folder contains the output folder {out}")
    return local


def _materialize(source: str, dest: Path, staging: Path, local: Optional[Path], *, sha256: Optional[str],
                 label: str, fetch_kw: dict, max_extract_bytes: int, max_compression_ratio: float) -> str:
    """Put one source into the existing empty folder ``dest``: a folder copied, an archive fetched into
    ``staging`` (an existing folder on ``dest``'s filesystem), checked and extracted, another file copied to
    ``dest/<its name>``; the hash checked against ``sha256`` (see `download`). A fetched file is deleted once
    extracted, so that only one part's archive is on the disk at a time.

    Returns:
        the computed hex sha256.
    Raises:
        StageError: as `download`; messages name ``label``.
    """
    if local is not None and local.is_dir():
        fetch(str(local), dest, **fetch_kw)
        digest = folder_sha256(dest)
        verify(digest, sha256, source, "folder manifest", label=label)
        return digest
    name = source_name(source)
    kind = archive_kind(name)
    fetched = local if local is not None else fetch(source, staging / "fetched", **fetch_kw)
    if fetched.is_dir():                                  # remote folder (e.g. s3 prefix)
        shutil.rmtree(dest)
        shutil.move(str(fetched), dest)
        digest = folder_sha256(dest)
        verify(digest, sha256, source, "folder manifest", label=label)
        return digest
    digest = sha256_file(fetched, CHUNK_BYTES)
    verify(digest, sha256, source, "archive" if kind else "file", label=label)
    if kind:
        n = extract(fetched, dest, label=label, max_bytes=max_extract_bytes, max_ratio=max_compression_ratio)
        log.info("extracted %d entries from %s", n, label)
    else:
        check_relpath(name, label, name)
        shutil.copyfile(fetched, dest / name)
    if fetched != local:
        fetched.unlink()
    return digest


def download(source: str, out: Path | str = RAW_DIR, *, sha256: Optional[str] = None, retries: int = 3,
             timeout_s: float = 60, endpoint_url: Optional[str] = None, backoff_s: float = BACKOFF_S,
             max_extract_bytes: int = MAX_EXTRACT_BYTES,
             max_compression_ratio: float = MAX_COMPRESSION_RATIO) -> str:
    """Fetch ``source``, check its sha256 and write the folder ``out`` atomically (the stage's work).

    A folder is copied to ``out``; an archive is fetched to a temporary file beside ``out``, checked and
    extracted into ``out``; another file is copied to ``out/<its name>``. All of it happens in a temporary
    folder that replaces ``out`` only at the end (`detpipe.core.files.atomic_dir`), so on any error ``out`` keeps
    its previous content or stays absent.

    Args:
        source: local path or fsspec URL (see the module docstring).
        out: output folder.
        sha256: expected hex sha256 (file, or folder manifest: `folder_sha256`); None skips the check.
        retries, timeout_s, endpoint_url, backoff_s: as in `fetch` (seconds for times).
        max_extract_bytes, max_compression_ratio: an archive's limits, as in `extract` (bytes, ratio).
    Returns:
        the computed hex sha256 (always logged).
    Raises:
        StageError: fetch failure, sha256 mismatch, unsafe archive entry, archive beyond the size limits,
            source containing ``out``.
    """
    return download_parts([(source, sha256)], out, retries=retries, timeout_s=timeout_s,
                          endpoint_url=endpoint_url, backoff_s=backoff_s, max_extract_bytes=max_extract_bytes,
                          max_compression_ratio=max_compression_ratio)[0]


def download_parts(parts: Sequence[tuple[str, Optional[str]]], out: Path | str = RAW_DIR, *, retries: int = 3,
                   timeout_s: float = 60, endpoint_url: Optional[str] = None, backoff_s: float = BACKOFF_S,
                   max_extract_bytes: int = MAX_EXTRACT_BYTES,
                   max_compression_ratio: float = MAX_COMPRESSION_RATIO) -> list[str]:
    """Fetch every ``(source, sha256)`` of ``parts`` as `download` does one, and merge them into the one folder
    ``out``, written atomically (all parts or, on any error, ``out`` as it was).

    Parts are fetched one after the other, each into its own folder beside ``out`` (an archive extracted there,
    then deleted), then merged: an entry no earlier part has is moved in (a rename, no copy); a folder both have is
    merged entry by entry; a file both have must hold the same bytes (kept once), else the download fails naming
    the path and both parts. With one part the output is exactly `download`'s.

    Args:
        parts: ``(local path or fsspec URL, expected hex sha256 or None)`` per part, in order.
        out: output folder.
        retries, timeout_s, endpoint_url, backoff_s: as in `fetch` (seconds for times), for every part.
        max_extract_bytes, max_compression_ratio: each archive's limits, as in `extract` (bytes, ratio).
    Returns:
        the computed hex sha256 of each part (always logged).
    Raises:
        StageError: as `download` for any part (with several parts the message starts with
            ``download.source[i]``, the part's index in params), or a path two parts hold with different bytes.
    """
    out = Path(out)
    several = len(parts) > 1
    labels = [f"download.source[{i}] {redact_url(src)}" if several else redact_url(src)
              for i, (src, _) in enumerate(parts)]
    fetch_kw = dict(retries=retries, timeout_s=timeout_s, endpoint_url=endpoint_url, backoff_s=backoff_s)
    locals_ = [_local_source(src, out, label) for (src, _), label in zip(parts, labels)]
    out.parent.mkdir(parents=True, exist_ok=True)
    digests: list[str] = []
    owners: dict[str, str] = {}
    with atomic_dir(out) as tmp, \
            tempfile.TemporaryDirectory(prefix=temp_prefix(out, "fetch"), dir=out.parent) as staging:
        for i, ((src, sha256), label, local) in enumerate(zip(parts, labels, locals_)):
            log.info("download %s -> %s%s", redact_url(src), out, f" (part {i + 1} of {len(parts)})" if several else "")
            part_dir = Path(staging, f"part-{i}")
            part_dir.mkdir()
            dest = part_dir / "tree" if several else tmp
            dest.mkdir(exist_ok=True)
            try:
                digests.append(_materialize(src, dest, part_dir, local, sha256=sha256, label=label,
                                            fetch_kw=fetch_kw, max_extract_bytes=max_extract_bytes,
                                            max_compression_ratio=max_compression_ratio))
            except StageError as e:                      # fetch's own messages name the URL, not the part
                if several and not str(e).startswith(label):
                    raise StageError(f"download.source[{i}]: {e}") from None
                raise
            if several:
                _merge(dest, tmp, "", label, owners)
            shutil.rmtree(part_dir)
    return digests


def _merge(src: Path, dst: Path, rel: str, label: str, owners: dict[str, str]) -> None:
    """Move the entries of folder ``src`` into folder ``dst`` (``rel``: their path under the output, ``""`` or
    ending in ``/``), recording in ``owners`` which part (``label``) brought each moved entry.

    Raises:
        StageError: an entry of ``src`` clashes with one of ``dst`` (a file with different bytes, or a file
            where the other has a folder), naming the path and both parts.
    """
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        s, d, path = Path(entry.path), dst / entry.name, rel + entry.name
        if not os.path.lexists(d):
            os.replace(s, d)
            owners[path] = label
        elif s.is_dir() and not s.is_symlink() and d.is_dir() and not d.is_symlink():
            _merge(s, d, path + "/", label, owners)
        elif s.is_file() and d.is_file() and filecmp.cmp(s, d, shallow=False):
            log.info("%s: %s is also in %s, with the same bytes", label, path, _owner(path, owners))
        else:
            what = "different bytes" if s.is_file() and d.is_file() else "a file in one and a folder in the other"
            raise StageError(f"{label} and {_owner(path, owners)} both hold '{path}', with {what}; a dataset's "
                             "parts must not overwrite each other (drop or rename one)")


def _owner(path: str, owners: dict[str, str]) -> str:
    """The part that brought ``path`` or the nearest of its folders into the output (see `_merge`)."""
    parts = path.split("/")
    for i in range(len(parts), 0, -1):
        if "/".join(parts[:i]) in owners:
            return owners["/".join(parts[:i])]
    return "an earlier part"


def download_raw(cfg: Download, out: Path | str = RAW_DIR) -> list[str]:
    """The download stage: `download_parts` of ``cfg.source`` (params section ``download``: one source, or a list
    of parts each with its own sha256) into ``out`` (``data/raw``), with the section's network settings and
    extraction limits.

    Returns:
        the computed hex sha256 of each part (one for a single source).
    Raises:
        StageError: as `download_parts`.
    """
    digests = download_parts([(p.url, p.sha256) for p in cfg.parts], out, retries=cfg.retries,
                             timeout_s=cfg.timeout_s, endpoint_url=cfg.endpoint_url,
                             max_extract_bytes=cfg.max_extract_bytes,
                             max_compression_ratio=cfg.max_compression_ratio)
    log.info("wrote %s", out)
    return digests


def print_sha256(source: str, endpoint_url: Optional[str] = None) -> str:
    """``--print-sha256``: `source_sha256` of ``source`` with the network settings of params.yaml's ``download``
    section when the file exists (defaults otherwise), printed on stdout and returned.

    Args:
        source: local path or fsspec URL.
        endpoint_url: S3 endpoint; None = ``download.endpoint_url`` from params.
    Raises:
        StageError: as `source_sha256`; an invalid params.yaml.
    """
    from detpipe.params import PARAMS_FILE, load

    p = load("download") if PARAMS_FILE.exists() else Download(source=source)
    digest = source_sha256(source, retries=p.retries, timeout_s=p.timeout_s,
                           endpoint_url=endpoint_url or p.endpoint_url)
    print(digest, flush=True)
    return digest
