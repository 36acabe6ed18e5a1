"""Downloading the raw dataset: the download stage's work (`download`; ``python -m stages.download`` calls it
with params ``download`` and writes ``data/raw/``), and `source_sha256` for ``--print-sha256``.

The source (params ``download.source``) is an fsspec URL or a local path:

* a **folder** (local path, ``file://`` URL, ``s3://bucket/prefix``) is copied file by file;
* an **archive** (``.zip``, ``.tar``, ``.tar.gz``/``.tgz``, also ``.tar.bz2``/``.tar.xz``) is fetched, checked
  and extracted safely;
* any **other single file** is copied into ``data/raw/<its name>``.

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

The output is written with `detpipe.files.atomic_dir`: on any failure (bad hash, unsafe archive entry,
HTTP error, interrupt) ``data/raw`` keeps its previous content, or stays absent.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from detpipe.data.fetch import (BACKOFF_S, CHUNK_BYTES, MAX_COMPRESSION_RATIO, MAX_EXTRACT_BYTES, archive_kind,
                                check_relpath, extract, fetch, redact, source_name)
from detpipe.errors import StageError
from detpipe.files import atomic_dir, folder_sha256, local_path, sha256_file, temp_prefix, url_protocol
from detpipe.params import Download
from detpipe.paths import RAW_DIR

log = logging.getLogger(__name__)

__all__ = ["download", "download_raw", "print_sha256", "source_sha256", "verify"]


def verify(actual: str, expected: Optional[str], source: str, what: str) -> None:
    """Log ``actual`` and compare it with ``expected`` (hex sha256, or None to skip the check).

    Args:
        actual: computed hex sha256.
        expected: hex sha256 from params, or None.
        source: the source as given (redacted before use in messages).
        what: what was hashed, e.g. ``"file"`` or ``"folder manifest"``.
    Raises:
        StageError: mismatch; the message names the source, the expected and the actual hash.
    """
    log.info("sha256 of %s %s: %s", what, redact(source), actual)
    if expected is None:
        log.info("download.sha256 is null: not checked (set it to %s to pin this source)", actual)
        return
    if actual.lower() != expected.lower():
        raise StageError(f"{redact(source)}: sha256 mismatch for the {what}: expected {expected.lower()}, "
                         f"got {actual}")
    log.info("sha256 matches download.sha256")


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


def download(source: str, out: Path | str = RAW_DIR, *, sha256: Optional[str] = None, retries: int = 3,
             timeout_s: float = 60, endpoint_url: Optional[str] = None, backoff_s: float = BACKOFF_S,
             max_extract_bytes: int = MAX_EXTRACT_BYTES,
             max_compression_ratio: float = MAX_COMPRESSION_RATIO) -> str:
    """Fetch ``source``, check its sha256 and write the folder ``out`` atomically (the stage's work).

    A folder is copied to ``out``; an archive is fetched to a temporary file beside ``out``, checked and
    extracted into ``out``; another file is copied to ``out/<its name>``. All of it happens in a temporary
    folder that replaces ``out`` only at the end (`detpipe.files.atomic_dir`), so on any error ``out`` keeps
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
    out = Path(out)
    log.info("download %s -> %s", redact(source), out)
    kwargs = dict(retries=retries, timeout_s=timeout_s, endpoint_url=endpoint_url, backoff_s=backoff_s)
    local: Optional[Path] = None
    if url_protocol(source) == "file":
        local = local_path(source)
        if not local.exists():
            raise StageError(f"{source}: not found")
        if local.is_dir():
            src, dst = local.resolve(), out.resolve()
            if dst == src or src in dst.parents:
                raise StageError(f"{source}: the source folder contains the output folder {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        if local is not None and local.is_dir():
            fetch(str(local), tmp, **kwargs)
            digest = folder_sha256(tmp)
            verify(digest, sha256, source, "folder manifest")
            return digest
        name = source_name(source)
        kind = archive_kind(name)
        with tempfile.TemporaryDirectory(prefix=temp_prefix(out, "fetch"), dir=out.parent) as staging:
            if local is not None:
                fetched = local                              # read local archives/files in place
            else:
                fetched = fetch(source, Path(staging, "fetched"), **kwargs)
            if fetched.is_dir():                             # remote folder (e.g. s3 prefix)
                shutil.rmtree(tmp)
                shutil.move(str(fetched), tmp)
                digest = folder_sha256(tmp)
                verify(digest, sha256, source, "folder manifest")
                return digest
            digest = sha256_file(fetched, CHUNK_BYTES)
            verify(digest, sha256, source, "archive" if kind else "file")
            if kind:
                n = extract(fetched, tmp, label=redact(source), max_bytes=max_extract_bytes,
                            max_ratio=max_compression_ratio)
                log.info("extracted %d entries from %s", n, redact(source))
            else:
                check_relpath(name, redact(source), name)
                shutil.copyfile(fetched, tmp / name)
    return digest


def download_raw(cfg: Download, out: Path | str = RAW_DIR) -> str:
    """The download stage: `download` of ``cfg.source`` (params section ``download``) into ``out``
    (``data/raw``), with the section's hash, network settings and extraction limits.

    Returns:
        the computed hex sha256 (as `download`).
    Raises:
        StageError: as `download`.
    """
    digest = download(cfg.source, out, sha256=cfg.sha256, retries=cfg.retries, timeout_s=cfg.timeout_s,
                      endpoint_url=cfg.endpoint_url, max_extract_bytes=cfg.max_extract_bytes,
                      max_compression_ratio=cfg.max_compression_ratio)
    log.info("wrote %s", out)
    return digest


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
