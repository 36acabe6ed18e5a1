"""Download stage: fetch the raw dataset into ``data/raw/`` (``python -m stages.download``).

The source (params ``download.source``) is an fsspec URL or a local path:

* a **folder** (local path, ``file://`` URL, ``s3://bucket/prefix``) is copied file by file;
* an **archive** (``.zip``, ``.tar``, ``.tar.gz``/``.tgz``, also ``.tar.bz2``/``.tar.xz``) is fetched, checked
  and extracted safely;
* any **other single file** is copied into ``data/raw/<its name>``.

``http(s)://`` sources are single files, fetched with `requests`: transient failures (connection errors,
timeouts, HTTP 408/425/429/5xx) are retried with exponential backoff and a partial file is resumed with a
``Range: bytes=N-`` request; 4xx answers such as 403/404 fail at once. ``s3://`` sources use `s3fs`;
``download.endpoint_url`` points it at an S3-compatible store (SeaweedFS, MinIO). Credentials come only from
the environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``) or the standard AWS config
files; they are never read from params and never logged (user:password and query strings of URLs are
redacted from every message).

Integrity: ``download.sha256`` is the hex sha256 of the fetched file (for an archive: of the archive, before
extraction), or for a folder of its manifest, see `folder_sha256`. The computed hash is always logged;
``python -m stages.download --print-sha256 <path-or-url>`` prints it so it can be pasted into params.yaml.

The output is written with `detpipe.io.atomic_dir`: on any failure (bad hash, unsafe archive entry,
HTTP error, interrupt) ``data/raw`` keeps its previous content, or stays absent.
"""
from __future__ import annotations

import argparse
import logging
import os
import posixpath
import shutil
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

from detpipe.errors import StageError, run_stage
from detpipe.paths import RAW_DIR
from detpipe.io import atomic_dir, folder_sha256, iter_files, sha256_file

log = logging.getLogger("stages.download")

"""Output folder of the stage, relative to the repository root (the current working directory)."""

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)
CHUNK_BYTES = 1 << 20
"""Read/write block size for downloads and hashing, in bytes."""
BACKOFF_S = 1.0
"""First retry delay in seconds; attempt k (0-based) waits ``BACKOFF_S * 2**k`` seconds, capped at
`MAX_BACKOFF_S` (plain exponential backoff, as in e.g. the AWS Architecture Blog, "Exponential Backoff
and Jitter", 2015, without the jitter)."""
MAX_BACKOFF_S = 60.0

T = TypeVar("T")


# --------------------------------------------------------------------------------------------- helpers

def redact(url: str) -> str:
    """``url`` fit for logs and error messages: a ``user:password@`` part becomes ``***@`` and a query
    string (which may hold a signature or token) becomes ``?***``. Local paths are returned unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if not parts.scheme or len(parts.scheme) == 1:   # a plain path (or a Windows drive letter)
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "***" if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _protocol(source: str) -> str:
    """fsspec protocol of ``source``: ``"file"`` for plain paths, else the URL scheme (lower case)."""
    import fsspec.utils

    proto = fsspec.utils.get_protocol(source)
    return "file" if proto in ("file", "local") else proto.lower()


def _archive_kind(name: str) -> Optional[str]:
    """``"tar"``, ``"zip"`` or None from a file name's suffix (case-insensitive)."""
    low = name.lower()
    if low.endswith(TAR_SUFFIXES):
        return "tar"
    if low.endswith(ZIP_SUFFIXES):
        return "zip"
    return None


def _source_name(source: str) -> str:
    """Last path component of a path or URL (query and fragment ignored), used to name the fetched file."""
    path = urlsplit(source).path if "://" in source else source
    name = posixpath.basename(unquote(path).rstrip("/"))
    return name or "download"


def _backoff(attempt: int, backoff_s: float) -> float:
    """Delay in seconds before retry number ``attempt + 1`` (``attempt`` 0-based)."""
    return min(backoff_s * (2 ** attempt), MAX_BACKOFF_S)


def _exc_text(exc: BaseException, url: str) -> str:
    """One-line description of ``exc`` with any copy of the (secret-bearing) URL parts removed."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    if "://" in url:
        parts = urlsplit(url)
        userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        for secret in (url, userinfo, parts.query, parts.password or ""):
            if len(secret) >= 4:                         # too short to replace without mangling the text
                text = text.replace(secret, "***")
    return text[:500]


def _check_relpath(relpath: str, label: str, entry: str) -> None:
    """Refuse a member/key path that is absolute or has a ``..`` component (it would land outside the
    destination). Raises `StageError` naming ``label`` (the archive or source) and ``entry``."""
    drive = len(relpath) >= 2 and relpath[0].isalpha() and relpath[1] == ":" and relpath[2:3] in ("", "/", "\\")
    if relpath.startswith(("/", "\\")) or os.path.isabs(relpath) or drive:
        raise StageError(f"{label}: unsafe entry {entry!r}: absolute path; nothing was extracted")
    if ".." in relpath.replace("\\", "/").split("/"):
        raise StageError(f"{label}: unsafe entry {entry!r}: '..' path component; nothing was extracted")


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


# --------------------------------------------------------------------------------------------- fetching

def _is_transient(exc: BaseException) -> bool:
    """Whether an fsspec/s3fs/botocore error is worth retrying (network trouble, timeouts, server errors)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                        FileExistsError)):
        return False
    try:
        import botocore.exceptions as bex
    except ImportError:                                  # pragma: no cover - s3fs pulls botocore in
        bex = None
    if bex is not None:
        if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError, bex.ParamValidationError)):
            return False
        if isinstance(exc, bex.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
            return status >= 500 or status in (408, 429)
        if isinstance(exc, bex.BotoCoreError):           # EndpointConnectionError, ReadTimeoutError, ...
            return True
    return isinstance(exc, (TimeoutError, ConnectionError, OSError))


def _fs_error(exc: BaseException, source: str) -> StageError:
    """A one-line `StageError` for a failed fsspec operation on ``source``."""
    url = redact(source)
    if isinstance(exc, FileNotFoundError):
        return StageError(f"{url}: not found")
    if isinstance(exc, PermissionError):
        return StageError(f"{url}: access denied ({_exc_text(exc, source)}); check the credentials in the "
                          "environment or AWS config")
    try:
        import botocore.exceptions as bex
        if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
            return StageError(f"{url}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                              "(or AWS_PROFILE) in the environment")
    except ImportError:                                  # pragma: no cover
        pass
    return StageError(f"{url}: {_exc_text(exc, source)}")


def _with_retries(fn: Callable[[], T], source: str, retries: int, backoff_s: float) -> T:
    """Call ``fn`` up to ``retries + 1`` times, sleeping `_backoff` seconds between attempts, while it
    raises a transient error (`_is_transient`). Raises `StageError` on a permanent error or when the
    attempts are used up."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except StageError:
            raise
        except Exception as e:                           # noqa: BLE001 - classified right below
            if not _is_transient(e):
                raise _fs_error(e, source) from None
            if attempt == retries:
                raise StageError(f"{redact(source)}: failed after {retries + 1} attempts: "
                                 f"{_exc_text(e, source)}") from None
            delay = _backoff(attempt, backoff_s)
            log.warning("%s: %s; retry %d/%d in %.1f s", redact(source), _exc_text(e, source),
                        attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _open_fs(source: str, endpoint_url: Optional[str], timeout_s: float):
    """(fsspec filesystem, path inside it) for a non-HTTP source. S3 gets ``endpoint_url`` (when set) and
    connect/read timeouts of ``timeout_s`` seconds; credentials are left to botocore's standard chain."""
    import fsspec.core

    proto = _protocol(source)
    options: dict = {}
    if proto in ("s3", "s3a"):
        options = {
            "skip_instance_cache": True,                 # credentials may change between calls (env)
            "config_kwargs": {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                              "retries": {"total_max_attempts": 1}},   # retries are ours (_with_retries)
        }
        if endpoint_url:
            options["client_kwargs"] = {"endpoint_url": endpoint_url}
    elif endpoint_url:
        log.warning("download.endpoint_url is set but %s is not an s3:// source: ignored", redact(source))
    try:
        fs, path = fsspec.core.url_to_fs(source, **options)
    except (ImportError, ValueError) as e:
        raise StageError(f"{redact(source)}: unsupported source ({_exc_text(e, source)})") from None
    return fs, path


def _progress(total: Optional[int], desc: str, initial: int = 0):
    """A tqdm byte progress bar on stderr (bytes, rate; shown when stderr is a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)


def http_fetch(url: str, dest: Path | str, *, retries: int = 3, timeout_s: float = 60,
               backoff_s: float = BACKOFF_S, session=None) -> int:
    """Download ``url`` (http/https) to the file ``dest``, resuming partial transfers.

    After a transient failure (connection error or reset, timeout, truncated body, HTTP 408/425/429/5xx) the
    next attempt sends ``Range: bytes=N-`` with N = bytes already in ``dest`` (and ``If-Range`` with the
    first answer's ETag / Last-Modified, so a changed file is not spliced). A ``206`` answer whose
    ``Content-Range`` starts at N is appended; a ``200`` answer (server ignores ranges or the file changed)
    restarts the file from byte 0. Attempts wait `_backoff` seconds between them (``Retry-After`` honoured
    up to `MAX_BACKOFF_S`). Other 4xx answers (403, 404, ...) fail at once.

    Args:
        url: the URL (may carry credentials; they are redacted in logs and errors).
        dest: file to write; an existing file is treated as a partial download to resume.
        retries: retries after the first attempt.
        timeout_s: connect timeout and read timeout (longest silence between bytes), in seconds.
        backoff_s: first retry delay, in seconds.
        session: a `requests.Session` to use (default: a new one).
    Returns:
        the size of the complete file, in bytes.
    Raises:
        StageError: permanent HTTP error (names the redacted URL and status) or attempts used up.
    """
    import requests
    import urllib3.exceptions

    dest = Path(dest)
    label = redact(url)
    session = session or requests.Session()
    validator: Optional[str] = None
    bar = None
    try:
        for attempt in range(retries + 1):
            have = dest.stat().st_size if dest.exists() else 0
            headers = {"Accept-Encoding": "identity"}
            if have:
                headers["Range"] = f"bytes={have}-"
                if validator:
                    headers["If-Range"] = validator
            retry_after = 0.0
            try:
                with session.get(url, headers=headers, stream=True, timeout=(timeout_s, timeout_s)) as r:
                    status = r.status_code
                    if status == 416 and have:
                        total = _content_range_total(r.headers.get("Content-Range", ""))
                        if total == have:
                            log.info("%s: already complete (%d bytes)", label, have)
                            return have
                        log.warning("%s: server refused range %d- (HTTP 416); restarting", label, have)
                        dest.unlink()
                        raise _Transient("HTTP 416 on resume")
                    if status >= 500 or status in (408, 425, 429):
                        retry_after = _retry_after_s(r.headers.get("Retry-After"))
                        raise _Transient(f"HTTP {status} {r.reason}")
                    if status >= 400 or status not in (200, 206):
                        raise StageError(f"{label}: HTTP {status} {r.reason}")
                    if have and status == 206:
                        start, total = _parse_content_range(r.headers.get("Content-Range", ""))
                        if start != have:
                            log.warning("%s: server answered range %s for bytes=%d-; restarting", label,
                                        r.headers.get("Content-Range"), have)
                            dest.unlink()
                            raise _Transient("unexpected Content-Range")
                        mode = "ab"
                        log.info("%s: resuming at byte %d (HTTP 206)", label, have)
                    else:
                        if have:
                            log.warning("%s: server answered HTTP %d to a range request; restarting from byte 0",
                                        label, status)
                        have, mode = 0, "wb"
                        length = r.headers.get("Content-Length")
                        total = int(length) if length and length.isdigit() else None
                        etag = r.headers.get("ETag")
                        validator = (etag if etag and not etag.startswith("W/") else None) \
                            or r.headers.get("Last-Modified")
                    if bar is None:
                        bar = _progress(total, _source_name(url), have)
                    else:
                        bar.reset(total=total)
                        bar.update(have)
                    with open(dest, mode) as f:
                        for chunk in _body_chunks(r.raw):
                            f.write(chunk)
                            bar.update(len(chunk))
                    size = dest.stat().st_size
                    if total is not None and size != total:
                        raise _Transient(f"truncated body: {size} of {total} bytes")
                    return size
            except (requests.exceptions.SSLError, requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema,
                    requests.exceptions.MissingSchema, requests.exceptions.TooManyRedirects) as e:
                raise StageError(f"{label}: {_exc_text(e, url)}") from None       # retrying cannot help
            except (_Transient, requests.exceptions.RequestException, urllib3.exceptions.HTTPError,
                    ConnectionError, TimeoutError) as e:
                if attempt == retries:
                    raise StageError(f"{label}: failed after {retries + 1} attempts: {_exc_text(e, url)}") \
                        from None
                delay = max(_backoff(attempt, backoff_s), min(retry_after, MAX_BACKOFF_S))
                log.warning("%s: %s; retry %d/%d in %.1f s", label, _exc_text(e, url), attempt + 1, retries,
                            delay)
                time.sleep(delay)
    finally:
        if bar is not None:
            bar.close()
    raise AssertionError("unreachable")


def _body_chunks(raw) -> Iterator[bytes]:
    """The raw (not content-decoded) body of a urllib3 response, each piece as soon as it arrives (``read1``),
    so that a timeout or a cut connection loses no byte already received: the resume offset is exact."""
    if raw.chunked and raw.supports_chunked_reads():
        yield from raw.read_chunked(CHUNK_BYTES, decode_content=False)
        return
    while data := raw.read1(CHUNK_BYTES, decode_content=False):
        yield data


class _Transient(Exception):
    """A retryable HTTP condition (5xx, truncated body, bad range answer)."""


def _parse_content_range(value: str) -> tuple[Optional[int], Optional[int]]:
    """(first byte, total bytes or None) of a ``Content-Range: bytes A-B/T`` header; (None, None) if bad."""
    try:
        unit, rest = value.strip().split(" ", 1)
        span, total = rest.split("/", 1)
        if unit.lower() != "bytes":
            return None, None
        start = int(span.split("-", 1)[0])
        return start, (None if total.strip() == "*" else int(total))
    except ValueError:
        return None, None


def _content_range_total(value: str) -> Optional[int]:
    """Total size from ``Content-Range: bytes */T`` (a 416 answer), or None."""
    try:
        return int(value.rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return None


def _retry_after_s(value: Optional[str]) -> float:
    """Seconds from a numeric ``Retry-After`` header (dates are ignored), else 0."""
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


def fetch(source: str, dest: Path | str, *, retries: int = 3, timeout_s: float = 60,
          endpoint_url: Optional[str] = None, backoff_s: float = BACKOFF_S) -> Path:
    """Fetch ``source`` (a file or a folder) to the local path ``dest`` (a file path that does not exist
    yet, or for a folder source a folder path that may exist).

    HTTP(S) goes through `http_fetch` (Range resume); other fsspec protocols (local, ``file://``, ``s3://``)
    are read through fsspec, each file with `_with_retries` (transient errors only; local reads are not
    retried). A folder source is copied file by file (file contents only, not modes or times); keys whose
    relative path is absolute or has ``..`` are refused.

    Args:
        source: local path or fsspec URL.
        dest: local destination path (a file, or a folder when the source is a folder).
        retries: retries after the first attempt of each file.
        timeout_s: network connect and read timeout, in seconds.
        endpoint_url: S3 endpoint for S3-compatible stores, or None for AWS.
        backoff_s: first retry delay, in seconds.
    Returns:
        ``dest``.
    Raises:
        StageError: not found, access denied, permanent HTTP error, attempts used up, unsafe key.
    """
    dest = Path(dest)
    proto = _protocol(source)
    if proto in ("http", "https"):
        if urlsplit(source).path.endswith("/"):
            raise StageError(f"{redact(source)}: an HTTP source must be a single file or archive, not a folder")
        http_fetch(source, dest, retries=retries, timeout_s=timeout_s, backoff_s=backoff_s)
        return dest
    fs, path = _open_fs(source, endpoint_url, timeout_s)
    n_retries = 0 if proto == "file" else retries
    if _with_retries(lambda: fs.isdir(path), source, n_retries, backoff_s):
        _fetch_folder(fs, path, source, dest, n_retries, backoff_s)
    else:
        info = _with_retries(lambda: fs.info(path), source, n_retries, backoff_s)
        if info.get("type") == "directory":         # pragma: no cover - isdir said no
            raise StageError(f"{redact(source)}: is a folder but could not be listed")
        size = info.get("size")
        with _progress(size, _source_name(source)) as bar:
            _with_retries(lambda: _get_file(fs, path, dest, bar), source, n_retries, backoff_s)
    return dest


def _get_file(fs, path: str, dest: Path, bar) -> None:
    """Copy one file from ``fs`` to ``dest`` (replacing a partial copy), updating the progress bar."""
    bar.reset(total=bar.total)
    with fs.open(path, "rb", block_size=CHUNK_BYTES) as src, open(dest, "wb") as out:
        while chunk := src.read(CHUNK_BYTES):
            out.write(chunk)
            bar.update(len(chunk))


def _fetch_folder(fs, path: str, source: str, dest: Path, retries: int, backoff_s: float) -> None:
    """Copy every file under the folder/prefix ``path`` of ``fs`` into ``dest`` (see `fetch`)."""
    root = path.rstrip("/")
    if _protocol(source) == "file":
        files = {rel: full.stat().st_size for rel, full in iter_files(Path(root))}
        remote = {rel: str(Path(root, rel)) for rel in files}
    else:
        found = _with_retries(lambda: fs.find(root, detail=True), source, retries, backoff_s)
        files, remote = {}, {}
        for key, info in found.items():
            if info.get("type") == "directory" or key.endswith("/"):
                continue
            rel = key[len(root):].lstrip("/") if key.startswith(root) else key
            _check_relpath(rel, redact(source), rel)
            files[rel], remote[rel] = int(info.get("size") or 0), key
    dest.mkdir(parents=True, exist_ok=True)
    log.info("%s: copying %d files (%d bytes)", redact(source), len(files), sum(files.values()))
    with _progress(sum(files.values()), _source_name(source)) as bar:
        for rel in sorted(files):
            out = dest.joinpath(*rel.split("/"))
            out.parent.mkdir(parents=True, exist_ok=True)

            def one(rel=rel, out=out):
                with fs.open(remote[rel], "rb", block_size=CHUNK_BYTES) as src, open(out, "wb") as f:
                    shutil.copyfileobj(src, f, CHUNK_BYTES)

            _with_retries(one, f"{source.rstrip('/')}/{rel}", retries, backoff_s)
            bar.update(files[rel])


# --------------------------------------------------------------------------------------------- extraction

def extract(archive: Path | str, dest: Path | str, label: Optional[str] = None) -> int:
    """Extract a ``.zip`` or tar (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``) archive into the
    existing folder ``dest``, refusing anything that could write outside it.

    Every entry is checked before anything is extracted: absolute names, ``..`` components, symlinks whose
    target is absolute or resolves outside ``dest``, hard links to paths outside ``dest``, and device/FIFO
    entries are refused. Tar archives are then extracted with Python's ``filter="data"`` (PEP 706), which
    re-checks links against the real filesystem and drops unsafe modes; zip members are extracted only
    after their names passed the check (zip "symlinks" become regular files).

    Args:
        archive: the archive file; its kind comes from ``label``'s (else its own) suffix.
        dest: existing destination folder.
        label: the source name used in messages (default: ``archive``).
    Returns:
        the number of entries extracted.
    Raises:
        StageError: unsafe entry (one line naming the archive and the entry), corrupt or unknown archive.
    """
    archive, dest = Path(archive), Path(dest)
    label = label or str(archive)
    kind = _archive_kind(_source_name(label)) or _archive_kind(archive.name)
    try:
        if kind == "zip":
            with zipfile.ZipFile(archive) as zf:
                infos = zf.infolist()
                for info in infos:
                    _check_relpath(info.filename, label, info.filename)
                zf.extractall(dest)
                return len(infos)
        if kind == "tar":
            with tarfile.open(archive, "r:*") as tf:
                members = tf.getmembers()
                for m in members:
                    _check_tar_member(m, label)
                tf.extractall(dest, filter="data")
                return len(members)
    except tarfile.FilterError as e:
        name = e.tarinfo.name if getattr(e, "tarinfo", None) is not None else "?"
        raise StageError(f"{label}: unsafe entry {name!r}: {e}".replace("\n", " ")) from None
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, KeyError, RuntimeError, OSError) as e:
        raise StageError(f"{label}: cannot extract: corrupt or unreadable archive ({type(e).__name__}: {e})"
                         .replace("\n", " ")) from None
    raise StageError(f"{label}: not a known archive type (expected one of {ZIP_SUFFIXES + TAR_SUFFIXES})")


def _check_tar_member(m: tarfile.TarInfo, label: str) -> None:
    """Refuse a tar entry that could write outside the destination (see `extract`)."""
    _check_relpath(m.name, label, m.name)
    if m.issym():
        target = m.linkname
        if target.startswith("/") or os.path.isabs(target):
            raise StageError(f"{label}: unsafe entry {m.name!r}: symlink to absolute path {target!r}; "
                             "nothing was extracted")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(m.name), target))
        if resolved == ".." or resolved.startswith("../"):
            raise StageError(f"{label}: unsafe entry {m.name!r}: symlink to {target!r} points outside the "
                             "destination; nothing was extracted")
    elif m.islnk():
        target = m.linkname
        resolved = posixpath.normpath(target)
        if target.startswith("/") or os.path.isabs(target) or resolved == ".." or resolved.startswith("../"):
            raise StageError(f"{label}: unsafe entry {m.name!r}: hard link to {target!r} outside the "
                             "destination; nothing was extracted")
    elif not (m.isfile() or m.isdir()):
        raise StageError(f"{label}: unsafe entry {m.name!r}: special file (device or FIFO); nothing was "
                         "extracted")


# --------------------------------------------------------------------------------------------- stage

def source_sha256(source: str, *, retries: int = 3, timeout_s: float = 60,
                  endpoint_url: Optional[str] = None, backoff_s: float = BACKOFF_S) -> str:
    """The value to put in ``download.sha256`` for ``source``: `folder_sha256` of a folder, the sha256 of a
    file's bytes otherwise (an archive is hashed as fetched, not extracted). Remote sources are fetched to a
    temporary folder first (removed afterwards).

    Raises:
        StageError: as `fetch`.
    """
    if _protocol(source) == "file":
        import fsspec.core
        local = Path(fsspec.core.strip_protocol(source)) if "://" in source else Path(source)
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
             timeout_s: float = 60, endpoint_url: Optional[str] = None, backoff_s: float = BACKOFF_S) -> str:
    """Fetch ``source``, check its sha256 and write the folder ``out`` atomically (the stage's work).

    A folder is copied to ``out``; an archive is fetched to a temporary file beside ``out``, checked and
    extracted into ``out``; another file is copied to ``out/<its name>``. All of it happens in a temporary
    folder that replaces ``out`` only at the end (`detpipe.io.atomic_dir`), so on any error ``out`` keeps
    its previous content or stays absent.

    Args:
        source: local path or fsspec URL (see the module docstring).
        out: output folder.
        sha256: expected hex sha256 (file, or folder manifest: `folder_sha256`); None skips the check.
        retries, timeout_s, endpoint_url, backoff_s: as in `fetch` (seconds for times).
    Returns:
        the computed hex sha256 (always logged).
    Raises:
        StageError: fetch failure, sha256 mismatch, unsafe archive entry, source containing ``out``.
    """
    out = Path(out)
    proto = _protocol(source)
    log.info("download %s -> %s", redact(source), out)
    kwargs = dict(retries=retries, timeout_s=timeout_s, endpoint_url=endpoint_url, backoff_s=backoff_s)
    local: Optional[Path] = None
    if proto == "file":
        import fsspec.core
        local = Path(fsspec.core.strip_protocol(source)) if "://" in source else Path(source)
        if not local.exists():
            raise StageError(f"{source}: not found")
        if local.is_dir():
            src, dst = local.resolve(), out.resolve()
            if dst == src or src in dst.parents:
                raise StageError(f"{source}: the source folder contains the output folder {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        _chmod_like_mkdir(tmp)
        if local is not None and local.is_dir():
            fetch(str(local), tmp, **kwargs)
            digest = folder_sha256(tmp)
            verify(digest, sha256, source, "folder manifest")
            return digest
        name = _source_name(source)
        kind = _archive_kind(name)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.fetch-", dir=out.parent) as staging:
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
                n = extract(fetched, tmp, label=redact(source))
                log.info("extracted %d entries from %s", n, redact(source))
            else:
                _check_relpath(name, redact(source), name)
                shutil.copyfile(fetched, tmp / name)
    return digest


def _chmod_like_mkdir(path: Path) -> None:
    """Give ``path`` the mode a plain ``mkdir`` would (0777 less the umask); temp folders are 0700."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m stages.download`` (params section ``download``), or ``--print-sha256 SOURCE`` to print
    the value for ``download.sha256`` (network settings from params.yaml when present, else defaults)."""
    ap = argparse.ArgumentParser(prog="python -m stages.download", description=__doc__.splitlines()[0])
    ap.add_argument("--print-sha256", metavar="SOURCE",
                    help="print the sha256 of a file, or the manifest sha256 of a folder, and exit")
    ap.add_argument("--endpoint-url", default=None, help="S3 endpoint for --print-sha256 (default: params)")
    args = ap.parse_args(argv)
    from detpipe.params import PARAMS_FILE, Download, load

    if args.print_sha256:
        p = load("download") if PARAMS_FILE.exists() else Download(source=args.print_sha256)
        print(source_sha256(args.print_sha256, retries=p.retries, timeout_s=p.timeout_s,
                            endpoint_url=args.endpoint_url or p.endpoint_url), flush=True)
        return
    p = load("download")
    download(p.source, RAW_DIR, sha256=p.sha256, retries=p.retries, timeout_s=p.timeout_s,
             endpoint_url=p.endpoint_url)
    log.info("wrote %s", RAW_DIR)


if __name__ == "__main__":
    run_stage(main)
