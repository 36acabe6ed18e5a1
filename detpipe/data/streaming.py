"""Streaming a remote augmentation cache: whole shards fetched ahead of use into a bounded local folder.

`ShardPrefetcher` runs in the training process (one background thread). It is given, lazily, the shards this rank
will read in the order it will read them (from the sampler: `detpipe.data.dataset.micro_batches` builds that plan), copies
each whole shard with ``pyarrow.fs.copy_files`` (pyarrow's multi-threaded, chunked copy; one ranged GET stream per
shard, not one request per image) to ``<local_dir>/<shard>.tmp`` and renames it to ``<local_dir>/<shard>`` when
complete. Readers (the dataset, in the main process or DataLoader workers) wait for that file and memory-map it.
A shard is deleted once the training loop has consumed its last sample in the plan.

Bound: shards are fetched while the held bytes plus the next shard stay within ``max_bytes``; a shard that a
reader needs within the next ``lookahead`` samples is fetched even beyond it (so a bound below the working set
cannot dead-lock: it only slows training). With the sampler's block shuffle a rank needs ``window`` shards at a time
(``2 * window`` at a block boundary), so ``max_bytes`` of ``2 * window`` shards or more streams without waiting.

A failed copy (missing shard, network error) writes ``<local_dir>/<shard>.error`` holding a one-line message naming
the shard's URL; readers raise it as `StageError` and the prefetcher keeps it in `error`.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow.fs as pafs

from detpipe.errors import StageError
from detpipe.files import redact_url

log = logging.getLogger("detpipe.data.streaming")

WAIT_TIMEOUT_S = 600.0  # a reader waiting longer than this for a shard gives up with an error naming it


def redact(url: str) -> str:
    """``url`` for messages, as a base that shard names are appended to: credentials hidden and the query string
    (options such as ``endpoint_override`` may carry hosts or tokens) dropped (`detpipe.files.redact_url`)."""
    return redact_url(url, mark_query=False)


def wait_for_shard(local_dir: str, name: str, url: str, timeout_s: float = WAIT_TIMEOUT_S) -> str:
    """Block until the prefetcher has put shard ``name`` into ``local_dir``; return its local path.

    Raises:
        StageError: the prefetcher recorded an error for it (its one-line message, naming ``url``), or it did not
            arrive within ``timeout_s`` seconds.
    """
    path = os.path.join(local_dir, name)
    deadline, delay = time.monotonic() + timeout_s, 0.001
    while not os.path.exists(path):
        err = path + ".error"
        if os.path.exists(err):
            raise StageError(Path(err).read_text().strip())
        if time.monotonic() > deadline:
            raise StageError(f"{redact(url)}: not fetched into {local_dir} after {timeout_s:g} s (prefetcher stalled)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return path


class ShardPrefetcher:
    """Background copier of whole shards from ``fs`` into ``local_dir`` (see the module docstring).

    Args:
        fs: pyarrow filesystem of the remote cache (`detpipe.files.filesystem`).
        remote_dir: the split's folder inside ``fs``.
        url: the split's URL (for error messages).
        names: shard file names; shard ids in the plan index this list.
        local_dir: folder for the copies (created); None = a new temporary folder, removed by `close`.
        max_bytes: bound on the bytes of shards held (see the module docstring).
        plan: iterable of per-epoch ``(n,)`` int arrays, the shard id of each sample this rank reads, in order.
        lookahead: samples ahead of the consumed position that readers may already be waiting for.
        horizon: the plan is followed at most this many samples ahead of the consumed position (e.g. one epoch).
        threads: shard copies in flight at once.
    Raises:
        StageError: the remote folder cannot be listed, or a shard is missing from it.
    """

    def __init__(self, fs: pafs.FileSystem, remote_dir: str, url: str, names: list[str], local_dir: str | None,
                 max_bytes: int, plan: Iterable[np.ndarray], lookahead: int, horizon: int, threads: int = 4):
        self.fs, self.remote_dir, self.url, self.names = fs, remote_dir, url, names
        self.max_bytes, self.lookahead, self.horizon = int(max_bytes), int(lookahead), max(int(horizon), int(lookahead))
        self._own_dir = local_dir is None
        self.local_dir = tempfile.mkdtemp(prefix="detpipe-shards-") if local_dir is None else str(local_dir)
        os.makedirs(self.local_dir, exist_ok=True)
        for leftover in Path(self.local_dir).iterdir():  # a previous (killed) run's files: never trust them
            if leftover.is_file():
                leftover.unlink()
        try:
            infos = fs.get_file_info(pafs.FileSelector(remote_dir))
        except OSError as e:
            raise StageError(f"{redact(url)}: cannot list the cache shards ({e})") from None
        sizes = {Path(i.path).name: i.size for i in infos if i.type == pafs.FileType.File}
        self.sizes = [sizes.get(n) for n in names]
        self.gets = 0  # whole-shard copies started (each is one GET stream, possibly ranged in parallel chunks)
        self.bytes_fetched = 0
        self.error: str | None = None
        self._plan = iter(plan)
        self._held: dict[int, int] = {}  # shard id -> last position (in samples) it is needed at
        self._consumed = 0
        self._cond = threading.Condition()
        self._closed = False
        # copies run `threads` at a time (a first-byte latency per shard overlaps), in plan order
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="shard-copy")
        self._thread = threading.Thread(target=self._run, name="shard-prefetcher", daemon=True)
        self._thread.start()

    def shard_url(self, shard: int) -> str:
        return f"{redact(self.url)}/{self.names[shard]}"

    def consumed(self, position: int) -> None:
        """The training loop has used every sample of the plan before ``position`` (counted from the plan's
        start): shards not needed after it are deleted."""
        with self._cond:
            self._consumed = int(position)
            self._evict()
            self._cond.notify_all()

    def _evict(self) -> None:
        for shard, last in list(self._held.items()):
            if last < self._consumed:
                del self._held[shard]
                with_suppress_unlink(os.path.join(self.local_dir, self.names[shard]))

    def _held_bytes(self) -> int:
        return sum(self.sizes[s] or 0 for s in self._held)

    def _segments(self) -> Iterator[tuple[int, int, int]]:
        """``(shard, first position, last position)`` per epoch of the plan, ordered by first position."""
        pos = 0
        for shards in self._plan:
            shards = np.asarray(shards, dtype=np.int64)
            if len(shards):
                ids, first = np.unique(shards, return_index=True)
                last = len(shards) - 1 - np.unique(shards[::-1], return_index=True)[1]
                for k in np.argsort(first, kind="stable"):
                    yield int(ids[k]), pos + int(first[k]), pos + int(last[k])
            pos += len(shards)

    def _ready(self, shard: int, first: int) -> bool:
        """Whether the plan's next segment (``shard`` from position ``first``) may be handled now."""
        if first < self._consumed + self.lookahead:
            return True  # a reader needs it (or soon will): fetch even beyond the bound
        if first >= self._consumed + self.horizon:
            return False  # never plan more than `horizon` samples ahead
        size = self.sizes[shard] or 0
        return shard in self._held or not self._held or self._held_bytes() + size <= self.max_bytes

    def _run(self) -> None:
        try:
            for shard, first, last in self._segments():
                if self.sizes[shard] is None:
                    raise StageError(f"{self.shard_url(shard)}: not found (cache incomplete; re-run the augment "
                                     "stage and upload it again)")
                with self._cond:
                    while not self._closed and not self._ready(shard, first):
                        self._cond.wait(0.5)
                    if self._closed:
                        return
                    held = shard in self._held
                    self._held[shard] = max(self._held.get(shard, last), last)
                if not held:  # else: still here from its previous use, kept longer
                    self._pool.submit(self._fetch_reporting, shard)
        except Exception as e:  # noqa: BLE001 - reported to the readers and to the training loop
            self._report(e, locals().get("shard"))

    def _report(self, e: Exception, shard: int | None) -> None:
        msg = str(e) if isinstance(e, StageError) else f"{type(e).__name__}: {e}"
        self.error = self.error or " ".join(msg.split())
        if shard is not None:
            Path(self.local_dir, self.names[shard] + ".error").write_text(" ".join(msg.split()) + "\n")
        log.error("%s", self.error)

    def _fetch_reporting(self, shard: int) -> None:
        if self._closed:
            return
        try:
            self._fetch(shard)
        except Exception as e:  # noqa: BLE001 - reported to the readers and to the training loop
            self._report(e, shard)

    def _fetch(self, shard: int) -> None:
        name = self.names[shard]
        tmp = os.path.join(self.local_dir, name + ".tmp")
        self.gets += 1
        try:
            pafs.copy_files(f"{self.remote_dir}/{name}", tmp, source_filesystem=self.fs,
                            destination_filesystem=pafs.LocalFileSystem())
        except FileNotFoundError:
            raise StageError(f"{self.shard_url(shard)}: not found (cache incomplete; re-run the augment stage "
                             "and upload it again)") from None
        except OSError as e:
            raise StageError(f"{self.shard_url(shard)}: cannot fetch ({' '.join(str(e).split())})") from None
        self.bytes_fetched += os.path.getsize(tmp)
        os.replace(tmp, os.path.join(self.local_dir, name))

    def close(self) -> None:
        """Stop the thread (after its current copy) and delete the copies (and the folder if it made it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._own_dir:
            shutil.rmtree(self.local_dir, ignore_errors=True)
        else:
            for f in Path(self.local_dir).iterdir():
                with_suppress_unlink(str(f))


def with_suppress_unlink(path: str) -> None:
    """``os.unlink(path)``, ignoring a file that is already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
