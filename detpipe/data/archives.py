"""Archives of a fetched dataset: which files are archives (`archive_kind`), the names of entries that would land
outside the destination (`check_relpath`), and safe, bounded extraction (`extract`: every entry checked before
anything is written; size, compression-ratio and free-space caps; tar through Python's ``filter="data"``, PEP 706).
"""
from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import zipfile
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit

from detpipe.core.errors import StageError
from detpipe.core.files import is_url

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)


def archive_kind(name: str) -> Optional[str]:
    """``"tar"``, ``"zip"`` or None from a file name's suffix (case-insensitive)."""
    low = name.lower()
    if low.endswith(TAR_SUFFIXES):
        return "tar"
    if low.endswith(ZIP_SUFFIXES):
        return "zip"
    return None


def source_name(source: str) -> str:
    """Last path component of a path or URL (query and fragment ignored), used to name the fetched file."""
    path = urlsplit(source).path if is_url(source) else source
    name = posixpath.basename(unquote(path).rstrip("/"))
    return name or "download"


def check_relpath(relpath: str, label: str, entry: str) -> None:
    """Refuse a member/key path that is absolute or has a ``..`` component (it would land outside the
    destination). Raises `StageError` naming ``label`` (the archive or source) and ``entry``."""
    drive = len(relpath) >= 2 and relpath[0].isalpha() and relpath[1] == ":" and relpath[2:3] in ("", "/", "\\")
    if relpath.startswith(("/", "\\")) or os.path.isabs(relpath) or drive:
        raise StageError(f"{label}: unsafe entry {entry!r}: absolute path; nothing was extracted")
    if ".." in relpath.replace("\\", "/").split("/"):
        raise StageError(f"{label}: unsafe entry {entry!r}: '..' path component; nothing was extracted")


# --------------------------------------------------------------------------------------------- extraction

MAX_EXTRACT_BYTES = 64 * 10**9
"""Default cap on an archive's extracted size, in bytes (64 GB: COCO train2017 + val2017 + annotations is
~20 GB extracted). `extract` also refuses more than the free space of the destination's disk."""
MAX_COMPRESSION_RATIO = 200.0
"""Default cap on extracted bytes / archive bytes. JPEG/PNG archives are ~1x, COCO JSON alone ~5-10x; zip
bombs are 1000x and more (a 1 MB zip of 1 GiB of zeros is ~1000x)."""


def extract(archive: Path | str, dest: Path | str, label: Optional[str] = None, *,
            max_bytes: int = MAX_EXTRACT_BYTES, max_ratio: float = MAX_COMPRESSION_RATIO) -> int:
    """Extract a ``.zip`` or tar (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``) archive into the
    existing folder ``dest``, refusing anything that could write outside it or fill the disk.

    Every entry is checked before anything is extracted: absolute names, ``..`` components, symlinks whose
    target is absolute or resolves outside ``dest``, hard links to paths outside ``dest``, and device/FIFO
    entries are refused. The declared sizes of all entries must sum to at most ``max_bytes``, at most the free
    space of ``dest``'s disk, and at most ``max_ratio`` times the archive's size (declared sizes bound what is
    written: zip members stop at their declared size and fail their CRC if they hold more, tar members are
    stored with their exact size). Tar archives are then extracted with Python's ``filter="data"`` (PEP 706),
    which re-checks links against the real filesystem and drops unsafe modes; zip members are extracted only
    after their names passed the check (zip "symlinks" become regular files).

    Args:
        archive: the archive file; its kind comes from ``label``'s (else its own) suffix.
        dest: existing destination folder.
        label: the source name used in messages (default: ``archive``).
        max_bytes: cap on the extracted size, in bytes.
        max_ratio: cap on extracted size / archive size.
    Returns:
        the number of entries extracted.
    Raises:
        StageError: unsafe entry, size or ratio beyond the limits (one line naming the archive and the limit),
            corrupt or unknown archive.
    """
    archive, dest = Path(archive), Path(dest)
    label = label or str(archive)
    kind = archive_kind(source_name(label)) or archive_kind(archive.name)
    try:
        if kind == "zip":
            with zipfile.ZipFile(archive) as zf:
                infos = zf.infolist()
                for info in infos:
                    check_relpath(info.filename, label, info.filename)
                _check_size(sum(i.file_size for i in infos), archive, dest, label, max_bytes, max_ratio)
                zf.extractall(dest)
                return len(infos)
        if kind == "tar":
            with tarfile.open(archive, "r:*") as tf:
                members = tf.getmembers()
                for m in members:
                    _check_tar_member(m, label)
                _check_size(sum(m.size for m in members if m.isfile()), archive, dest, label, max_bytes, max_ratio)
                tf.extractall(dest, filter="data")
                return len(members)
    except tarfile.FilterError as e:
        name = e.tarinfo.name if getattr(e, "tarinfo", None) is not None else "?"
        raise StageError(f"{label}: unsafe entry {name!r}: {e}".replace("\n", " ")) from None
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, KeyError, RuntimeError, OSError) as e:
        raise StageError(f"{label}: cannot extract: corrupt or unreadable archive ({type(e).__name__}: {e})"
                         .replace("\n", " ")) from None
    raise StageError(f"{label}: not a known archive type (expected one of {ZIP_SUFFIXES + TAR_SUFFIXES})")


def _check_size(total: int, archive: Path, dest: Path, label: str, max_bytes: int, max_ratio: float) -> None:
    """Refuse an extraction of ``total`` bytes beyond the limits of `extract`."""
    packed = max(archive.stat().st_size, 1)
    if total > max_bytes:
        raise StageError(f"{label}: archive would extract to {total} bytes, more than download.max_extract_bytes "
                         f"= {max_bytes}; nothing was extracted")
    if total / packed > max_ratio:
        raise StageError(f"{label}: archive would extract to {total} bytes from {packed} (compression ratio "
                         f"{total / packed:.0f} > download.max_compression_ratio = {max_ratio:g}; a zip bomb?); "
                         "nothing was extracted")
    free = shutil.disk_usage(dest).free
    if total > free:
        raise StageError(f"{label}: archive would extract to {total} bytes but only {free} bytes are free on "
                         f"the disk of {dest.parent}; nothing was extracted")


def _check_tar_member(m: tarfile.TarInfo, label: str) -> None:
    """Refuse a tar entry that could write outside the destination (see `extract`)."""
    check_relpath(m.name, label, m.name)
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
