"""Files: atomic outputs (temporary path, fsync, rename) under one temporary-name rule, content hashes, URLs
(filesystems, redaction)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from detpipe.core.errors import StageError

log = logging.getLogger("detpipe.core.files")


# The one temporary-name rule: whatever is written on its way to output ``<name>`` lives beside it as
# ``.<name>.<kind>-<suffix>`` (kind ``tmp``: being written; ``old``: a replaced output being removed; ``fetch``: a
# download being staged). `detpipe.orchestration.repair` removes what a killed stage left by this pattern.
TEMP_KINDS = ("tmp", "old", "fetch")
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old|fetch)-[A-Za-z0-9_]+$")


def temp_prefix(target: Path | str, kind: str = "tmp") -> str:
    """The temporary-name prefix ``.<name>.<kind>-`` for output ``target`` (`TEMP_NAME` matches it plus any
    suffix of letters, digits and ``_``, as `tempfile` makes). Raises ValueError for a kind not in `TEMP_KINDS`."""
    if kind not in TEMP_KINDS:
        raise ValueError(f"temporary kind {kind!r} is not one of {TEMP_KINDS}")
    return f".{Path(target).name}.{kind}-"


def temp_of(name: str) -> str | None:
    """The output name a temporary file or folder name belongs to (`TEMP_NAME`), or None if it is not one."""
    m = TEMP_NAME.match(name)
    return m.group("name") if m else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_dir(target: Path | str) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; on success it replaces ``target`` by rename.

    On any exception the temporary directory is removed and ``target`` is left as it was, so a failed or
    interrupted stage never leaves half-written outputs.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target), dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; outputs get the usual permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.is_dir() and not target.is_symlink():
        old = target.with_name(f"{temp_prefix(target, 'old')}{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if target.exists() or target.is_symlink():
            target.unlink()
        tmp.rename(target)


@contextlib.contextmanager
def atomic_open(path: Path | str) -> Iterator[Any]:
    """Yield a binary file opened on a temporary path beside ``path``; on success it is fsynced and renamed over
    ``path`` (then the directory is fsynced), on any exception removed: never a half-written ``path``.
    The temporary name is ``.<name>.tmp-*``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename (never a half-written file)."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_json(path: Path | str, obj) -> None:
    """`atomic_write_bytes` of ``obj`` as indented JSON (UTF-8, trailing newline)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def sha256_file(path: Path | str, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def iter_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(POSIX relative path, path) of every regular file under ``root`` (symlinks to files are followed,
    symlinked folders are not entered), in no particular order. Other entries are counted and logged."""
    skipped = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = Path(dirpath, name)
            if full.is_file():
                yield full.relative_to(root).as_posix(), full
            else:
                skipped += 1
                log.warning("%s: skipped (not a regular file)", full)
    if skipped:
        log.warning("%s: skipped %d entries that are not regular files", root, skipped)


def folder_sha256(path: Path | str) -> str:
    """sha256 of a folder's manifest, used to pin a folder source in ``download.sha256``.

    The manifest is the UTF-8 text with one line per regular file under ``path`` (recursively; symlinks to
    files count as files, symlinked folders and empty folders are ignored), sorted by the file's POSIX
    relative path (Python string order, i.e. by Unicode code point)::

        <relpath>\\t<hex sha256 of the file's bytes>\\n

    e.g. ``annotations/instances_train2017.json\\t9f2c...\\n``. An empty folder hashes to the sha256 of the
    empty string. The same value results from any copy of the folder, whatever the file times or modes.

    Returns:
        the hex digest (64 lower-case characters).
    Raises:
        StageError: ``path`` is not a folder, or a file name contains a tab or newline (ambiguous manifest).
    """
    root = Path(path)
    if not root.is_dir():
        raise StageError(f"{root}: not a folder")
    lines = []
    for rel, full in iter_files(root):
        if "\t" in rel or "\n" in rel:
            raise StageError(f"{full}: file name contains a tab or newline; cannot be listed in a manifest")
        lines.append((rel, sha256_file(full)))
    h = hashlib.sha256()
    for rel, digest in sorted(lines):
        h.update(f"{rel}\t{digest}\n".encode("utf-8"))
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- URLs
# The one place paths and URLs become filesystems: `is_url` and `url_protocol` classify a location, `local_path`
# turns a local one (plain path or ``file://`` URL) into a `Path`, `fsspec_filesystem` and `filesystem` open
# the filesystem behind it (fsspec, or pyarrow for the loader), `join_url` and `read_url_bytes` build on them.

def is_url(location: str | Path) -> bool:
    """Whether ``location`` is a URL (``scheme://...``, including ``file://`` and fsspec chains such as
    ``simplecache::s3://...``) rather than a plain local path."""
    return "://" in str(location)


def url_protocol(location: str | Path) -> str:
    """fsspec protocol of ``location``: ``"file"`` for a plain path or a ``file://``/``local://`` URL, else the
    URL scheme in lower case (``"s3"``, ``"https"``, ...)."""
    import fsspec.utils

    proto = fsspec.utils.get_protocol(str(location))
    return "file" if proto in ("file", "local") else proto.lower()


def local_path(location: str | Path) -> Path:
    """The local path of a plain path or a ``file://`` URL (protocol stripped). Only meaningful when
    ``url_protocol(location) == "file"``."""
    if not is_url(location):
        return Path(location)
    import fsspec.core

    return Path(fsspec.core.strip_protocol(str(location)))


def fsspec_filesystem(url: str, *, endpoint_url: str | None = None, timeout_s: float | None = None,
                      label: str | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a path or URL (``fsspec.core.url_to_fs``), for callers that
    stream through fsspec (the download stage, schemes pyarrow does not know).

    Args:
        url: local path or fsspec URL.
        endpoint_url: S3-compatible endpoint (SeaweedFS, MinIO) for ``s3://`` URLs; None = AWS.
        timeout_s: S3 connect and read timeout in seconds (botocore's own retries are turned off: callers
            retry, see `detpipe.data.fetch`); None = botocore's defaults.
        label: the URL as shown in errors (e.g. with credentials redacted); default ``url``.
    Raises:
        StageError: no filesystem for this URL (names ``label`` and the reason).
    """
    import fsspec.core

    options: dict = {}
    if is_url(url) and url_protocol(url) in ("s3", "s3a"):
        options["skip_instance_cache"] = True        # credentials may change between calls (environment)
        if timeout_s is not None:
            options["config_kwargs"] = {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                                        "retries": {"total_max_attempts": 1}}
        if endpoint_url:
            options["client_kwargs"] = {"endpoint_url": endpoint_url}
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as e:
        raise StageError(f"{label or url}: no filesystem for this URL ({type(e).__name__}: {e})") from None


def filesystem(root: str | Path, filesystem: Any = None) -> tuple[pafs.FileSystem | None, str]:
    """The pyarrow filesystem behind a path or URL, for readers that memory-map or range-read Arrow files:
    ``(None, path)`` for a local path (callers memory-map or open it directly), else ``(pyarrow filesystem,
    path inside it)``.

    Args:
        root: a local path or a URL. URLs go to ``pyarrow.fs.FileSystem.from_uri`` (``s3://``, ``gs://``,
            ``hdfs://``, ``file://``; S3 options as query parameters, e.g. ``?endpoint_override=host:port&scheme=http``,
            credentials from the usual AWS environment/config), and schemes pyarrow does not know to
            `fsspec_filesystem` (wrapped in ``pyarrow.fs.PyFileSystem``).
        filesystem: an explicit ``pyarrow.fs.FileSystem`` or fsspec filesystem; ``root`` is then a path in it
            (a URL scheme, if any, is stripped).
    Raises:
        StageError: the URL's filesystem cannot be created (names the URL and the reason).
    """
    root = str(root)
    if filesystem is not None:
        if not isinstance(filesystem, pafs.FileSystem):
            filesystem = pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
        return filesystem, root.split("://", 1)[-1].rstrip("/")
    if not is_url(root):
        return None, root
    try:
        fs, path = pafs.FileSystem.from_uri(root)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        ffs, path = fsspec_filesystem(root)
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(ffs))
    except OSError as e:
        raise StageError(f"{root}: cannot open the filesystem ({e})") from None
    return fs, path.rstrip("/")


def join_url(base: str, *parts: str) -> str:
    """``base`` joined with path ``parts``, keeping a URL's query string (``?endpoint_override=...``) at the end:
    ``join_url("s3://b/cache?scheme=http", "meta.json") == "s3://b/cache/meta.json?scheme=http"``."""
    path, sep, query = str(base).partition("?")
    joined = "/".join([path.rstrip("/"), *(p.strip("/") for p in parts)])
    return joined + (f"?{query}" if sep else "")


def read_url_bytes(url: str | Path, what: str) -> bytes:
    """All bytes of a local file or of a URL (any scheme `filesystem` knows: ``s3://``, ``http(s)://``, ...).

    Args:
        url: local path or URL.
        what: the setting or role named in errors (e.g. ``"train.weights"``).
    Raises:
        StageError: the file does not exist or cannot be read (names ``what``, the location and the reason).
    """
    try:
        if not is_url(url):
            return Path(url).read_bytes()
        if url_protocol(url) in ("http", "https"):
            import fsspec  # whole-file read: works with servers that refuse Range requests

            with fsspec.open(str(url), "rb", block_size=0) as f:
                return f.read()
        fs, path = filesystem(url)
        with fs.open_input_stream(path) as f:
            return f.read()
    except StageError:
        raise
    except FileNotFoundError:
        raise StageError(f"{what}: '{url}' not found") from None
    except Exception as e:  # pyarrow / fsspec raise OSError and backend-specific errors
        raise StageError(f"{what}: cannot read '{url}': {type(e).__name__}: {e}") from None


def redact_url(url: str | Path, mark_query: bool = True) -> str:
    """``url`` fit for logs and error messages: a ``user:password@`` part becomes ``***@`` and a query string
    (which may hold a signature, a token or an endpoint) becomes ``?***`` (dropped with ``mark_query=False``,
    for a base URL that more path parts are appended to). Local paths are returned unchanged; an unparsable
    URL becomes ``<unparsable URL>``."""
    from urllib.parse import urlsplit, urlunsplit

    url = str(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if not parts.scheme or len(parts.scheme) == 1:   # a plain path (or a Windows drive letter)
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "***" if parts.query and mark_query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
