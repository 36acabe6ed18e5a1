"""Small helpers shared by the stages: one-line errors, atomic outputs, hashing, logging."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger("stages")


class StageError(Exception):
    """Bad input or a failed check. The message is one line naming the file/record and the rule broken."""


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's ``main`` as a program: configure logging, turn `StageError` into a one-line
    ``error: ...`` on stderr and exit status 2 (no traceback). Other exceptions propagate (bugs)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        main()
    except StageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


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
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; outputs get the usual permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.is_dir() and not target.is_symlink():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if target.exists() or target.is_symlink():
            target.unlink()
        tmp.rename(target)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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
