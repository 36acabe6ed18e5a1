"""Streaming a remote augmentation cache: whole shards fetched ahead of use into a bounded local folder.

`ShardPrefetcher` runs in the training process (one planning thread and a pool of copy threads). It is given,
lazily, the shards this rank will read in the order it will read them (from the sampler:
`detpipe.data.loader.micro_batches` builds that plan), copies each whole shard to ``<local_dir>/<shard>.tmp`` and
renames it to ``<local_dir>/<shard>`` when complete. Readers (the dataset, in the main process or DataLoader
workers) wait for that file and memory-map it. A shard is deleted once the training loop has consumed its last
sample in the plan.

One copy is one ``open_input_file`` (an S3 HEAD) and one ranged GET per `CHUNK_BYTES` (a 32 MB shard: 1 + 4
requests), each answered after the store's first-byte latency; pyarrow's S3 client retries failed requests
(``AwsStandardS3RetryStrategy``, 3 attempts). ``pyarrow.fs.copy_files`` is not used: it asks for the file's
size twice and reads 1 MiB per GET, i.e. 2 + 31 sequential round trips for a 32 MB shard.

Depth (adaptive): a copy takes ``copy_s`` seconds (measured: first-byte latency x requests + transfer) while the
loop consumes ``rate`` samples per second (measured on the consumed positions); by Little's law a shard must be
requested ``rate x copy_s`` samples before its first use for the loop never to wait. The planner requests every
shard whose first use lies within ``lookahead + SAFETY x rate x copy_s`` samples of the consumed position, so the
copies in flight follow latency x consumption (``SAFETY`` > 1 also makes a loop that waits — whose measured rate
is then the fetch-limited one — double the depth per measurement until it stops waiting). Until both have been
measured, `START_DEPTH` shards are requested ahead. Both estimates rise at once and fall slowly (a pause for
evaluation or a checkpoint does not empty the pipeline). At most `MAX_IN_FLIGHT` copies run at once.

Bound: shards are requested while the held bytes (copies in flight included) plus the next shard stay within
``max_bytes``; a shard that a reader needs within the next ``lookahead`` samples is fetched even beyond it (so a
bound below the working set cannot dead-lock: it only slows training). With the sampler's block shuffle a rank
needs ``window`` shards at a time (``2 * window`` at a block boundary), plus ``rate x copy_s`` samples' shards
ahead to hide the latency.

A failed copy (missing shard, network error) writes ``<local_dir>/<shard>.error`` holding a one-line message naming
the shard's URL; readers raise it as `StageError` and the prefetcher keeps it in `error`.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow.fs as pafs

from detpipe.core.errors import StageError
from detpipe.core.files import redact_url

log = logging.getLogger("detpipe.data.streaming")

WAIT_TIMEOUT_S = 600.0  # a reader waiting longer than this for a shard gives up with an error naming it
START_DEPTH = 4  # shards requested ahead before the copy time and the consumption rate are measured
MAX_IN_FLIGHT = 32  # shard copies running at once, at most (threads and connections)
SAFETY = 2.0  # lead = SAFETY x rate x copy_s (see the module docstring)
RATE_WINDOW_S = 0.1  # the consumption rate is measured over windows at least this long (seconds)
CHUNK_BYTES = 8 << 20  # bytes asked for per GET of a copy (one buffer of this size per copy in flight)


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
            raise StageError(f"{redact_url(url, mark_query=False)}: not fetched into {local_dir} after {timeout_s:g} s "
                             "(prefetcher stalled)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return path


class ShardPrefetcher:
    """Background copier of whole shards from ``fs`` into ``local_dir`` (see the module docstring).

    Args:
        fs: pyarrow filesystem of the remote cache (`detpipe.core.files.filesystem`).
        remote_dir: the split's folder inside ``fs``.
        url: the split's URL (for error messages).
        names: shard file names; shard ids in the plan index this list.
        local_dir: folder for the copies (created); None = a new temporary folder, removed by `close`.
        max_bytes: bound on the bytes of shards held, copies in flight included (see the module docstring).
        plan: iterable of per-epoch ``(n,)`` int arrays, the shard id of each sample this rank reads, in order
            (consumed lazily, as far ahead as the lead and ``max_bytes`` allow).
        lookahead: samples ahead of the consumed position that readers may already be waiting for.
        max_in_flight: shard copies running at once, at most.

    Attributes (read from any thread): ``gets`` (copies started), ``bytes_fetched``, ``in_flight`` (copies
    running), ``copy_s`` (estimated seconds per copy, None before the first), ``rate`` (estimated samples consumed
    per second, None before the first window), ``error`` (the first failure's one-line message, or None).
    Raises:
        StageError: the remote folder cannot be listed.
    """

    def __init__(self, fs: pafs.FileSystem, remote_dir: str, url: str, names: list[str], local_dir: str | None,
                 max_bytes: int, plan: Iterable[np.ndarray], lookahead: int, max_in_flight: int = MAX_IN_FLIGHT):
        self.fs, self.remote_dir, self.url, self.names = fs, remote_dir, url, names
        self.max_bytes, self.lookahead, self.max_in_flight = int(max_bytes), int(lookahead), max(1, int(max_in_flight))
        self._own_dir = local_dir is None
        self.local_dir = tempfile.mkdtemp(prefix="detpipe-shards-") if local_dir is None else str(local_dir)
        os.makedirs(self.local_dir, exist_ok=True)
        for leftover in Path(self.local_dir).iterdir():  # a previous (killed) run's files: never trust them
            if leftover.is_file():
                leftover.unlink()
        try:
            infos = fs.get_file_info(pafs.FileSelector(remote_dir))
        except OSError as e:
            raise StageError(f"{redact_url(url, mark_query=False)}: cannot list the cache shards ({e})") from None
        sizes = {Path(i.path).name: i.size for i in infos if i.type == pafs.FileType.File}
        self.sizes = [sizes.get(n) for n in names]
        self.gets = 0  # whole-shard copies started
        self.bytes_fetched = 0
        self.in_flight = 0
        self.copy_s: float | None = None
        self.rate: float | None = None
        self.error: str | None = None
        self._plan = iter(plan)
        self._held: dict[int, tuple[int, int]] = {}  # shard id -> (first, last) position (in samples) of its use
        self._copying: set[int] = set()  # shards whose copy is queued or running (never evicted meanwhile)
        self._consumed = 0
        self._window: tuple[float, int] | None = None  # (time, position) where the current rate window began
        self._cond = threading.Condition()
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="shard-copy")
        self._thread = threading.Thread(target=self._run, name="shard-prefetcher", daemon=True)
        self._thread.start()

    def shard_url(self, shard: int) -> str:
        return f"{redact_url(self.url, mark_query=False)}/{self.names[shard]}"

    def consumed(self, position: int) -> None:
        """The training loop has used every sample of the plan before ``position`` (counted from the plan's
        start): shards not needed after it are deleted, and the consumption rate is updated."""
        now = time.monotonic()
        with self._cond:
            if self._window is None:
                self._window = (now, int(position))
            elif now - self._window[0] >= RATE_WINDOW_S:
                self.rate = _rise_fast_fall_slow(self.rate, (position - self._window[1]) / (now - self._window[0]))
                self._window = (now, int(position))
            self._consumed = int(position)
            self._evict()
            self._cond.notify_all()

    def _evict(self) -> None:
        for shard, (_, last) in list(self._held.items()):
            if last < self._consumed and shard not in self._copying:  # (a reader may use an older mapping)
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

    def lead(self) -> int | None:
        """Samples beyond ``lookahead`` whose shards are requested ahead of use: ``ceil(SAFETY x rate x copy_s)``;
        None until both estimates exist (then `START_DEPTH` shards are requested ahead instead)."""
        if self.rate is None or self.copy_s is None:
            return None
        return math.ceil(SAFETY * self.rate * self.copy_s)

    def _ready(self, shard: int, first: int) -> bool:
        """Whether the plan's next segment (``shard`` from position ``first``) may be handled now: requested (a
        copy) or, for a shard still held from an earlier use, kept until this one's end (no copy)."""
        if first < self._consumed + self.lookahead:
            return True  # a reader needs it (or soon will): fetch even beyond the bound
        lead = self.lead()
        if lead is None:  # not measured yet: START_DEPTH shards ahead
            if shard in self._held or sum(f >= self._consumed for f, _ in self._held.values()) >= START_DEPTH:
                return False
        elif first >= self._consumed + self.lookahead + lead:
            return False
        if shard in self._held:
            return True
        if self.in_flight >= self.max_in_flight:
            return False
        return not self._held or self._held_bytes() + (self.sizes[shard] or 0) <= self.max_bytes

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
                    held = self._held.get(shard)
                    self._held[shard] = (first, last) if held is None else (held[0], max(held[1], last))
                    if held is None:
                        self.in_flight += 1
                        self.gets += 1
                        self._copying.add(shard)
                if held is None:  # else: still here from its previous use, kept longer
                    log.debug("shard %s first needed at %d (consumed %d): %d in flight, lead %s samples (%s "
                              "samples/s x %s s per copy)", self.names[shard], first, self._consumed, self.in_flight,
                              self.lead(), self.rate, self.copy_s)
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
        try:
            if not self._closed:
                t0 = time.monotonic()
                self._fetch(shard)
                with self._cond:
                    self.copy_s = _rise_fast_fall_slow(self.copy_s, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - reported to the readers and to the training loop
            self._report(e, shard)
        finally:
            with self._cond:
                self.in_flight -= 1
                self._copying.discard(shard)
                self._evict()
                self._cond.notify_all()

    def _fetch(self, shard: int) -> None:
        """Copy shard ``shard`` to ``<local_dir>/<name>.tmp`` in `CHUNK_BYTES` reads, then rename it into place
        (nothing is renamed when the prefetcher closes meanwhile)."""
        name = self.names[shard]
        tmp = os.path.join(self.local_dir, name + ".tmp")
        size = 0
        try:
            with self.fs.open_input_file(f"{self.remote_dir}/{name}") as src, open(tmp, "wb") as out:
                while not self._closed and (chunk := src.read_buffer(CHUNK_BYTES)).size:
                    out.write(chunk)
                    size += chunk.size
        except FileNotFoundError:
            raise StageError(f"{self.shard_url(shard)}: not found (cache incomplete; re-run the augment stage "
                             "and upload it again)") from None
        except OSError as e:
            raise StageError(f"{self.shard_url(shard)}: cannot fetch ({' '.join(str(e).split())})") from None
        if self._closed:
            with_suppress_unlink(tmp)
            return
        os.replace(tmp, os.path.join(self.local_dir, name))
        with self._cond:
            self.bytes_fetched += size

    def close(self) -> None:
        """Stop the threads (copies stop at their next chunk) and delete the copies (and the folder if it made it)."""
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


def _rise_fast_fall_slow(estimate: float | None, sample: float, fall: float = 0.3) -> float:
    """A running estimate that takes a larger ``sample`` at once and moves ``fall`` of the way to a smaller one."""
    return sample if estimate is None or sample > estimate else estimate + fall * (sample - estimate)


def with_suppress_unlink(path: str) -> None:
    """``os.unlink(path)``, ignoring a file that is already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
