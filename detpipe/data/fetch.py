"""Fetching a dataset: HTTP(S) with Range resume, S3/local through fsspec, retries (extraction: `detpipe.data.archives`).

Retries use `tenacity` (exponential backoff ``backoff_s * 2**k`` seconds, capped at `MAX_BACKOFF_S`, on transient
errors only); an interrupted HTTP transfer resumes with ``Range: bytes=N-``. URLs become filesystems in
`detpipe.core.files` (`url_protocol`, `fsspec_filesystem`). Credentials in URLs are redacted from every message
(`detpipe.core.files.redact_url`). Transfers show their bytes with `detpipe.core.progress.Progress` (a bar on a terminal, a
log line every 30 s elsewhere).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar
from urllib.parse import urlsplit

import tenacity

from detpipe.data.archives import check_relpath, source_name
from detpipe.core.errors import StageError
from detpipe.core.files import fsspec_filesystem, is_url, iter_files, redact_url, url_protocol
from detpipe.core.progress import Progress

log = logging.getLogger("detpipe.data.fetch")

CHUNK_BYTES = 1 << 20
"""Read/write block size for downloads and hashing, in bytes."""
BACKOFF_S = 1.0
"""First retry delay in seconds; attempt k (0-based) waits ``BACKOFF_S * 2**k`` seconds, capped at
`MAX_BACKOFF_S` (plain exponential backoff, as in e.g. the AWS Architecture Blog, "Exponential Backoff
and Jitter", 2015, without the jitter)."""
MAX_BACKOFF_S = 60.0

T = TypeVar("T")


def _exc_text(exc: BaseException, url: str) -> str:
    """One-line description of ``exc`` with any copy of the (secret-bearing) URL parts removed."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    if is_url(url):
        parts = urlsplit(url)
        userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        for secret in (url, userinfo, parts.query, parts.password or ""):
            if len(secret) >= 4:                         # too short to replace without mangling the text
                text = text.replace(secret, "***")
    return text[:500]


# --------------------------------------------------------------------------------------------- retries

class _Transient(Exception):
    """A retryable HTTP condition (5xx, truncated body, bad range answer); ``retry_after`` in seconds."""

    def __init__(self, msg: str, retry_after: float = 0.0):
        super().__init__(msg)
        self.retry_after = retry_after


def _is_transient(exc: BaseException) -> bool:
    """Whether an error is worth retrying: network trouble, timeouts, server errors (HTTP 408/425/429/5xx,
    S3 5xx/408/429), truncated bodies. Not: missing files, access denied, bad credentials, TLS errors."""
    if isinstance(exc, StageError):
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                        FileExistsError)):
        return False
    import requests
    import urllib3.exceptions

    if isinstance(exc, (requests.exceptions.SSLError, requests.exceptions.InvalidURL,
                        requests.exceptions.InvalidSchema, requests.exceptions.MissingSchema,
                        requests.exceptions.TooManyRedirects)):
        return False
    if isinstance(exc, (_Transient, requests.exceptions.RequestException, urllib3.exceptions.HTTPError)):
        return True
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


def _permanent_error(exc: BaseException, source: str) -> StageError:
    """A one-line `StageError` for a failed fetch of ``source`` that retrying cannot fix."""
    url = redact_url(source)
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


def with_retries(fn: Callable[[], T], source: str, retries: int, backoff_s: float) -> T:
    """Call ``fn`` up to ``retries + 1`` times (`tenacity.Retrying`) while it raises a transient error
    (`_is_transient`), waiting ``backoff_s * 2**k`` seconds (capped at `MAX_BACKOFF_S`; an HTTP
    ``Retry-After`` is honoured up to the same cap) between attempts.

    Raises:
        StageError: a permanent error (at once), or the attempts are used up (names the redacted source and
            the last error).
    """
    base = tenacity.wait_exponential(multiplier=backoff_s, exp_base=2, max=MAX_BACKOFF_S)

    def wait(state: tenacity.RetryCallState) -> float:
        after = getattr(state.outcome.exception(), "retry_after", 0.0)
        return max(base(state), min(after, MAX_BACKOFF_S))

    def before_sleep(state: tenacity.RetryCallState) -> None:
        log.warning("%s: %s; retry %d/%d in %.1f s", redact_url(source), _exc_text(state.outcome.exception(), source),
                    state.attempt_number, retries, state.next_action.sleep)

    retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(retries + 1), wait=wait,
                                 retry=tenacity.retry_if_exception(_is_transient), before_sleep=before_sleep,
                                 reraise=True)
    try:
        return retrying(fn)
    except StageError:
        raise
    except Exception as e:                               # noqa: BLE001 - classified right below
        if _is_transient(e):
            raise StageError(f"{redact_url(source)}: failed after {retries + 1} attempts: "
                             f"{_exc_text(e, source)}") from None
        raise _permanent_error(e, source) from None


# --------------------------------------------------------------------------------------------- fetching

class _HttpDownload:
    """One resumable HTTP download; each call is one attempt (see `http_fetch`)."""

    def __init__(self, url: str, dest: Path, timeout_s: float, session, progress: Progress):
        self.url, self.dest, self.timeout_s, self.session, self.progress = url, dest, timeout_s, session, progress
        self.label = redact_url(url)
        self.validator: Optional[str] = None             # ETag / Last-Modified of the first answer

    def __call__(self) -> int:
        dest, label = self.dest, self.label
        have = dest.stat().st_size if dest.exists() else 0
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
            if self.validator:
                headers["If-Range"] = self.validator
        with self.session.get(self.url, headers=headers, stream=True, timeout=(self.timeout_s, self.timeout_s)) as r:
            status = r.status_code
            if status == 416 and have:
                if _content_range_total(r.headers.get("Content-Range", "")) == have:
                    log.info("%s: already complete (%d bytes)", label, have)
                    return have
                log.warning("%s: server refused range %d- (HTTP 416); restarting", label, have)
                dest.unlink()
                raise _Transient("HTTP 416 on resume")
            if status >= 500 or status in (408, 425, 429):
                raise _Transient(f"HTTP {status} {r.reason}", _retry_after_s(r.headers.get("Retry-After")))
            if status not in (200, 206):
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
                self.validator = (etag if etag and not etag.startswith("W/") else None) \
                    or r.headers.get("Last-Modified")
            self.progress.reset(total, have)
            with open(dest, mode) as f:
                for chunk in _body_chunks(r.raw):
                    f.write(chunk)
                    self.progress.update(len(chunk))
            size = dest.stat().st_size
            if total is not None and size != total:
                raise _Transient(f"truncated body: {size} of {total} bytes")
            return size


def http_fetch(url: str, dest: Path | str, *, retries: int = 3, timeout_s: float = 60,
               backoff_s: float = BACKOFF_S, session=None) -> int:
    """Download ``url`` (http/https) to the file ``dest``, resuming partial transfers.

    After a transient failure (connection error or reset, timeout, truncated body, HTTP 408/425/429/5xx) the
    next attempt sends ``Range: bytes=N-`` with N = bytes already in ``dest`` (and ``If-Range`` with the
    first answer's ETag / Last-Modified, so a changed file is not spliced). A ``206`` answer whose
    ``Content-Range`` starts at N is appended; a ``200`` answer (server ignores ranges or the file changed)
    restarts the file from byte 0. Attempts are spaced as in `with_retries` (``Retry-After`` honoured up to
    `MAX_BACKOFF_S`). Other 4xx answers (403, 404, ...) fail at once.

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

    with Progress(None, source_name(url), unit="B") as progress:
        attempt = _HttpDownload(url, Path(dest), timeout_s, session or requests.Session(), progress)
        return with_retries(attempt, url, retries, backoff_s)


def _body_chunks(raw) -> Iterator[bytes]:
    """The raw (not content-decoded) body of a urllib3 response, each piece as soon as it arrives (``read1``),
    so that a timeout or a cut connection loses no byte already received: the resume offset is exact."""
    if raw.chunked and raw.supports_chunked_reads():
        yield from raw.read_chunked(CHUNK_BYTES, decode_content=False)
        return
    while data := raw.read1(CHUNK_BYTES, decode_content=False):
        yield data


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
    are read through fsspec (`detpipe.core.files.fsspec_filesystem`), each file with `with_retries` (transient errors
    only; local reads are not retried). A folder source is copied file by file (file contents only, not modes
    or times); keys whose relative path is absolute or has ``..`` are refused.

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
    proto = url_protocol(source)
    if proto in ("http", "https"):
        if urlsplit(source).path.endswith("/"):
            raise StageError(f"{redact_url(source)}: an HTTP source must be a single file or archive, not a folder")
        http_fetch(source, dest, retries=retries, timeout_s=timeout_s, backoff_s=backoff_s)
        return dest
    if endpoint_url and proto not in ("s3", "s3a"):
        log.warning("download.endpoint_url is set but %s is not an s3:// source: ignored", redact_url(source))
    fs, path = fsspec_filesystem(source, endpoint_url=endpoint_url, timeout_s=timeout_s, label=redact_url(source))
    n_retries = 0 if proto == "file" else retries
    if with_retries(lambda: fs.isdir(path), source, n_retries, backoff_s):
        _fetch_folder(fs, path, source, dest, n_retries, backoff_s)
    else:
        info = with_retries(lambda: fs.info(path), source, n_retries, backoff_s)
        with Progress(info.get("size"), source_name(source), unit="B") as progress:
            def get() -> None:
                progress.reset(progress.total)
                with fs.open(path, "rb", block_size=CHUNK_BYTES) as src, open(dest, "wb") as out:
                    while chunk := src.read(CHUNK_BYTES):
                        out.write(chunk)
                        progress.update(len(chunk))

            with_retries(get, source, n_retries, backoff_s)
    return dest


def _fetch_folder(fs, path: str, source: str, dest: Path, retries: int, backoff_s: float) -> None:
    """Copy every file under the folder/prefix ``path`` of ``fs`` into ``dest`` (see `fetch`)."""
    root = path.rstrip("/")
    if url_protocol(source) == "file":
        files = {rel: full.stat().st_size for rel, full in iter_files(Path(root))}
        remote = {rel: str(Path(root, rel)) for rel in files}
    else:
        found = with_retries(lambda: fs.find(root, detail=True), source, retries, backoff_s)
        files, remote = {}, {}
        for key, info in found.items():
            if info.get("type") == "directory" or key.endswith("/"):
                continue
            rel = key[len(root):].lstrip("/") if key.startswith(root) else key
            check_relpath(rel, redact_url(source), rel)
            files[rel], remote[rel] = int(info.get("size") or 0), key
    dest.mkdir(parents=True, exist_ok=True)
    log.info("%s: copying %d files (%d bytes)", redact_url(source), len(files), sum(files.values()))
    with Progress(sum(files.values()), source_name(source), unit="B") as progress:
        for rel in sorted(files):
            out = dest.joinpath(*rel.split("/"))
            out.parent.mkdir(parents=True, exist_ok=True)

            def one(rel=rel, out=out):
                with fs.open(remote[rel], "rb", block_size=CHUNK_BYTES) as src, open(out, "wb") as f:
                    shutil.copyfileobj(src, f, CHUNK_BYTES)

            with_retries(one, f"{source.rstrip('/')}/{rel}", retries, backoff_s)
            progress.update(files[rel])
