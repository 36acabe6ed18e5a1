"""What predict reads: the files of a SOURCE (`list_sources`), each a `SourceFile` that reads its own bytes."""
from __future__ import annotations

import dataclasses
import posixpath

from detpipe.core.errors import StageError
from detpipe.core.files import fsspec_filesystem, is_url, read_url_bytes, redact_url, url_protocol

_GLOB_CHARS = "*?["


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One listed input: ``file_name`` (POSIX path relative to the source's folder, as written to the outputs),
    ``location`` (what to read: a local path, a URL, or a path inside ``fs``), ``fs`` (fsspec filesystem, or None
    to read ``location`` with `detpipe.core.files.read_url_bytes`)."""

    file_name: str
    location: str
    fs: object = None

    def read(self) -> bytes:
        """The file's bytes (any exception of the filesystem propagates: the caller counts a skip)."""
        return read_url_bytes(self.location, "predict source") if self.fs is None else self.fs.cat_file(self.location)


def list_sources(source: str, endpoint_url: str | None = None) -> list[SourceFile]:
    """The files of ``source``, sorted by ``file_name``.

    Args:
        source: a local file, folder (its files, not its subfolders), or glob; an ``http(s)://`` URL (one file);
            an ``s3://`` or other fsspec URL of a file, prefix (folder) or glob.
        endpoint_url: S3-compatible endpoint for ``s3://`` sources (`detpipe.core.files.fsspec_filesystem`).
    Returns:
        the files (may include non-images: they are skipped, counted, when decoded).
    Raises:
        StageError: ``source`` does not exist, the folder is empty or the glob matches no file (names the
            source, credentials and query redacted).
    """
    shown = redact_url(source)
    if is_url(source) and url_protocol(source) in ("http", "https"):
        name = posixpath.basename(source.split("?", 1)[0].rstrip("/")) or "image"
        return [SourceFile(name, source)]
    fs, path = fsspec_filesystem(source, endpoint_url=endpoint_url, label=shown)
    try:
        if any(c in path for c in _GLOB_CHARS):
            parts = path.split("/")
            root = "/".join(parts[:next(i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS))])
            found = [p for p, info in fs.glob(path, detail=True).items() if info.get("type") == "file"]
            what = "the glob matches no file"
        elif fs.isdir(path):
            root = path
            found = [info["name"] for info in fs.ls(path, detail=True) if info.get("type") == "file"]
            what = "the folder has no files"
        elif fs.isfile(path):
            root, found, what = posixpath.dirname(path), [path], ""
        else:
            raise StageError(f"{shown}: not found (SOURCE must be an image file, a folder, a glob or a URL)")
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - listing a remote store: permission, network, bad bucket
        raise StageError(f"{shown}: cannot list ({type(e).__name__}: {e})") from None
    if not found:
        raise StageError(f"{shown}: {what}: nothing to predict on")
    files = [SourceFile(posixpath.relpath(p, root) if root else p, p, fs) for p in found]
    return sorted(files, key=lambda f: f.file_name)
