"""One split of the augmentation cache as files: its ``index.arrow`` and its ``part-NNNNN.arrow`` shards, read from a
local folder (memory-mapped), a filesystem URL, or local copies of whole shards streamed from a URL.

`CacheShards` is what `detpipe.data.dataset.CachedDetectionDataset` reads its rows through: the index table
(`read_index`), each row's record batch (`_record`) and its stored pixel bytes (`_stored`), the shards' names and
URLs, and the streaming of whole shards into a bounded local folder (`start_streaming`, with a
`detpipe.data.streaming.ShardPrefetcher`). Every process (a DataLoader worker, forked or spawned) opens its own
memory maps and filesystem clients on first use.
"""
from __future__ import annotations

import collections
import os
import warnings
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import torch

from detpipe.core.errors import StageError
from detpipe.core.files import filesystem as open_filesystem, is_url, redact_url
from detpipe.data.cache_format import INDEX_FILE
from detpipe.data.streaming import ShardPrefetcher, wait_for_shard

_INDEX_COLUMNS = ("image_id", "variant", "height", "width", "orig_height", "orig_width", "scale_y", "scale_x",
                  "offset_y", "offset_x", "boxes", "labels", "shard", "batch")
_OPEN_SHARDS = 16  # streamed shards a process keeps memory-mapped (older ones are closed: their copies get deleted)


def _read_index(fs: pafs.FileSystem | None, split_dir: str) -> pa.Table:
    path = f"{split_dir}/{INDEX_FILE}"
    try:
        if fs is None:
            if not Path(path).is_file():
                hint = " (a cache from an older augment stage?)" if any(Path(split_dir).glob("*.arrow")) else ""
                raise StageError(f"{path}: not found{hint} (run the augment stage)")
            with pa.memory_map(path) as f:
                table = ipc.open_file(f).read_all()
        else:
            with fs.open_input_file(path) as f:
                table = ipc.open_file(f).read_all()
    except FileNotFoundError:
        raise StageError(f"{path}: not found (run the augment stage)") from None
    except pa.ArrowInvalid as e:
        raise StageError(f"{path}: not a readable Arrow IPC file ({e})") from None
    missing = [c for c in _INDEX_COLUMNS if c not in table.schema.names]
    if missing:
        raise StageError(f"{path}: missing column(s) {missing} (re-run the augment stage)")
    return table



class CacheShards:
    """The files of split ``split`` of the cache at ``root`` (a local folder or a URL, see
    `detpipe.core.files.filesystem`; ``filesystem``: an explicit pyarrow or fsspec filesystem holding it).

    The constructor opens the filesystem only; `read_index` reads ``index.arrow`` and `index_shards` takes its
    ``shard`` and ``batch`` columns (which shard and record batch hold each index row).
    """

    def __init__(self, root: str | Path, split: str, filesystem: Any = None):
        self.root, self.split = str(root), split
        self._explicit_fs = filesystem
        fs, base = open_filesystem(self.root, filesystem)
        self._split_dir = f"{base}/{split}"
        self.local_dir: str | None = None  # streamed shards: where the prefetcher puts them (`start_streaming`)
        self.prefetcher: ShardPrefetcher | None = None  # set by `start_streaming` (micro_batches) while it streams
        self._readers: collections.OrderedDict[int, ipc.RecordBatchFileReader] = collections.OrderedDict()
        self._fs = fs
        self._pid = os.getpid()

    def read_index(self) -> pa.Table:
        """The split's ``index.arrow`` table (one row per image variant).
        Raises:
            StageError: missing, unreadable, or without a column the loader needs (naming the file).
        """
        return _read_index(self._fs, self._split_dir)

    def index_shards(self, table: pa.Table) -> None:
        """Take the index's ``shard`` (file name per row) and ``batch`` (record batch in that file) columns."""
        shard = table.column("shard").combine_chunks().dictionary_encode()
        self._shard_names: list[str] = shard.dictionary.to_pylist()
        self._shard = shard.indices.to_numpy().astype(np.int64)
        self._batch = table.column("batch").to_numpy().astype(np.int64)

    def shard_names(self) -> list[str]:
        """File names of the split's shards (``part-NNNNN.arrow``), indexed as in `sample_shards`."""
        return list(self._shard_names)

    def __getstate__(self):  # spawned workers re-open files instead of pickling maps / handles
        state = self.__dict__.copy()
        state["_readers"] = collections.OrderedDict()
        if self._explicit_fs is None:
            state["_fs"] = None
        state["_pid"] = None
        state["prefetcher"] = None  # lives in the training process only
        return state

    def shard_url(self, shard: int) -> str:
        """Where shard ``shard`` lives (local path, or the URL without its query string)."""
        base = redact_url(self.root, mark_query=False) if is_url(self.root) else self._split_dir.rsplit("/", 1)[0]
        return f"{base.rstrip('/')}/{self.split}/{self._shard_names[shard]}"

    def start_streaming(self, plan: Iterable[np.ndarray], local_dir: str | None, max_bytes: int,
                        lookahead: int) -> ShardPrefetcher | None:
        """Stream this split's whole shards into a local folder that the readers then memory-map (what
        `micro_batches` does for training), if the dataset reads a URL through its own filesystem; a local folder or
        an explicit ``filesystem`` is read directly.

        Args:
            plan: per-epoch ``(n,)`` int64 arrays: the shard (as `sample_shards` numbers them) of each sample this
                rank will read, in order; consumed lazily.
            local_dir: folder for the copies (None: a new temporary folder).
            max_bytes: bound on the bytes of the copies held, in bytes.
            lookahead: samples ahead of the consumed position that readers may already wait for.
        Returns:
            the running `detpipe.data.streaming.ShardPrefetcher` (also ``self.prefetcher``; ``self.local_dir`` is its
            folder), or None when there is nothing to stream. `stop_streaming` ends it.
        Raises:
            StageError: the split's remote folder cannot be listed.
        """
        if self._fs is None or self._explicit_fs is not None or not is_url(self.root):
            return None
        self.prefetcher = ShardPrefetcher(self._fs, self._split_dir,
                                          f"{redact_url(self.root, mark_query=False)}/{self.split}",
                                          self.shard_names(), local_dir, max_bytes, plan, lookahead)
        self.local_dir = self.prefetcher.local_dir
        return self.prefetcher

    def stop_streaming(self) -> None:
        """Stop the prefetcher of `start_streaming` (its copies are deleted) and read the shards directly again;
        nothing to do when none runs."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.local_dir = self.prefetcher = None

    def _reader(self, shard: int) -> ipc.RecordBatchFileReader:
        if self._pid != os.getpid():  # a forked or spawned worker: never reuse the parent's handles / clients
            self._readers, self._pid = collections.OrderedDict(), os.getpid()
            # streamed: only local copies are read here (an S3 client made in a forked child can dead-lock)
            self._fs = None if self.local_dir is not None else open_filesystem(self.root, self._explicit_fs)[0]
        reader = self._readers.get(shard)
        if reader is not None:
            self._readers.move_to_end(shard)
            return reader
        streamed = self.local_dir is not None
        path = f"{self._split_dir}/{self._shard_names[shard]}"
        where = self.shard_url(shard) if streamed else path
        try:
            if streamed:  # a whole-shard copy made by the prefetcher: memory-map it
                source = pa.memory_map(wait_for_shard(self.local_dir, self._shard_names[shard], where))
            else:
                source = pa.memory_map(path) if self._fs is None else self._fs.open_input_file(path)
            reader = ipc.open_file(source)
        except FileNotFoundError:
            raise StageError(f"{where}: not found (cache incomplete; re-run the augment stage)") from None
        except (pa.ArrowInvalid, OSError) as e:
            raise StageError(f"{where}: not a readable Arrow IPC file ({' '.join(str(e).split())})") from None
        self._readers[shard] = reader
        if streamed and len(self._readers) > _OPEN_SHARDS:  # unmap the least recently used copy
            self._readers.popitem(last=False)
        return reader

    def _record(self, r: int) -> pa.RecordBatch:
        shard = int(self._shard[r])
        try:
            return self._reader(shard).get_batch(int(self._batch[r]))
        except (pa.ArrowInvalid, OSError) as e:
            raise StageError(f"{self.shard_url(shard)}: record batch {int(self._batch[r])} unreadable "
                             f"({' '.join(str(e).split())})") from None

    def _stored(self, r: int, record: pa.RecordBatch) -> torch.Tensor:
        """The ``pixels`` cell of row ``r`` as a 1-D uint8 tensor viewing the record's buffer (read-only)."""
        col = record.column("pixels")
        offsets = np.frombuffer(col.buffers()[1], dtype=np.int32, count=2, offset=4 * col.offset)
        arr = np.frombuffer(col.buffers()[2], dtype=np.uint8, count=int(offsets[1] - offsets[0]),
                            offset=int(offsets[0]))
        with warnings.catch_warnings():  # the buffer is read-only; we only ever read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
