"""Training/evaluation data from the augmentation cache (`stages.augment`): Dataset, sampler, collate.

`CachedDetectionDataset` reads ``<root>/<split>/index.arrow`` (boxes, labels, sizes: small) at construction and
each image's pixels on demand from its ``part-NNNNN.arrow`` shard. ``root`` is a local folder (shards are
memory-mapped: no copy until the float conversion) or a filesystem URL — anything
``pyarrow.fs.FileSystem.from_uri`` understands (``s3://bucket/cache``, ``gs://…``, ``hdfs://…``, ``file:///…``)
and otherwise any fsspec URL — so every node of a multi-node job can read one cache in object storage directly.
A remote read fetches one image's record batch (a byte range), never a whole shard.

Instance masks (Mask R-CNN) come only with ``with_masks=True``: box-only models never decode them.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import torch
from pycocotools import mask as mask_utils
from torch.utils.data import DataLoader, Dataset, Sampler

from detpipe.io import filesystem as open_filesystem
from detpipe.errors import StageError

INDEX_FILE = "index.arrow"  # written by stages.augment (INDEX_SCHEMA)
_INDEX_COLUMNS = ("image_id", "variant", "height", "width", "orig_height", "orig_width", "scale_y", "scale_x",
                  "offset_y", "offset_x", "boxes", "labels", "shard", "batch")
_MASK_RULE = ("rule: mask models need a polygon or RLE segmentation for every non-crowd object; use data with "
              "masks or a box-only model")
_FLIP_STREAM = 0x666C6970  # a constant third seed word, so flip draws do not reuse the sampler's stream


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


def _list_offsets_values(col: pa.ChunkedArray, width: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A ``list<…>`` column as ``(offsets (N+1,) int64, values (M, width) or (M,))`` numpy arrays."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.flatten()
    if width:
        values = values.flatten()
    flat = np.asarray(values.to_numpy(zero_copy_only=False), dtype=dtype)
    base = offsets[0]
    return offsets - base, (flat.reshape(-1, width) if width else flat)


class CachedDetectionDataset(Dataset):
    """Detection samples from the augmentation cache, in the format torchvision detection models take.

    ``dataset[i]`` (``0 <= i < len(dataset)``, one per image) returns ``(image, target)``:

    * ``image``: ``torch.float32`` tensor ``(3, H, W)``, contiguous, RGB in ``[0, 1]`` (uint8 / 255, as
      ``torchvision.transforms.v2.ToDtype(torch.float32, scale=True)``); H, W = cached size in pixels;
    * ``target``: ``boxes`` ``float32 (N, 4)`` XYXY in cached pixels, ``labels`` ``int64 (N,)``,
      ``image_id`` ``int64`` scalar, ``scale`` ``float64 (2,)`` = ``(scale_y, scale_x)`` and ``offset``
      ``float64 (2,)`` = ``(offset_y, offset_x)`` such that ``original = cached / scale + offset`` (pixels; offset
      is 0 except for crop/zoom-out variants), ``orig_size`` ``int64 (2,)`` = ``(orig_height, orig_width)``;
      with ``with_masks=True`` also ``masks`` ``uint8 (N, H, W)`` (0/1, cached pixels, one per box in the same
      order, flipped with the image; decoded from the cache's compressed RLE with ``pycocotools.mask.decode``).

    With ``augment.copies: K`` the cache holds K variants per image; sample ``i`` in epoch ``e`` is variant
    ``(e + seed) mod K``. Random horizontal flip with probability ``hflip`` is applied at load time; whether
    sample ``i`` is flipped depends only on ``(seed, epoch, i)`` — not on worker processes or global RNG state —
    so a resumed run sees exactly the same samples. Call `set_epoch` before creating each epoch's DataLoader
    iterator (workers take a copy of the dataset then).

    Works in DataLoader worker processes (fork or spawn): each process opens its own memory maps / file
    handles on first use.

    Args:
        root: cache root (``data/cache``) or a URL, see `detpipe.io.filesystem`.
        split: ``"train"`` or ``"val"``.
        hflip: flip probability in ``[0, 1]``.
        seed: seed of the flips and of the variant choice (``train.seed``).
        filesystem: optional explicit pyarrow or fsspec filesystem holding ``root``.
        image_dtype: ``torch.float32`` (default: ``[0, 1]`` as above) or ``torch.uint8`` (the cached 0..255 values,
            4x fewer bytes through worker processes and host-to-device copies; convert on the device with
            ``image.float().mul_(1 / 255)``, which gives bit-identical floats — ``div_(255)`` differs in the last
            bit for about half the values).
        with_masks: also return the instance masks (for Mask R-CNN); off by default, so box-only models pay
            nothing for them.
    Raises:
        StageError: no readable ``index.arrow`` under ``root/split``, or its rows are not grouped by image;
            ``with_masks=True`` and some row has an object without a mask (the cache's ``has_masks``).
    """

    def __init__(self, root: str | Path, split: str, hflip: float = 0.0, seed: int = 0, filesystem: Any = None,
                 image_dtype: torch.dtype = torch.float32, with_masks: bool = False):
        if not 0.0 <= hflip <= 1.0:
            raise ValueError(f"hflip must be in [0, 1], got {hflip}")
        if image_dtype not in (torch.float32, torch.uint8):
            raise ValueError(f"image_dtype must be torch.float32 or torch.uint8, got {image_dtype}")
        self.image_dtype = image_dtype
        self.with_masks = bool(with_masks)
        self.root, self.split, self.hflip, self.seed, self.epoch = str(root), split, float(hflip), int(seed), 0
        self._explicit_fs = filesystem
        fs, base = open_filesystem(self.root, filesystem)
        self._split_dir = f"{base}/{split}"
        table = _read_index(fs, self._split_dir)
        col = lambda name: table.column(name).to_numpy()  # noqa: E731
        variant = col("variant").astype(np.int64)
        image_id = col("image_id").astype(np.int64)
        n_rows = len(variant)
        self.copies = int(variant.max()) + 1 if n_rows else 1
        k = self.copies
        if n_rows % k or not np.array_equal(variant, np.tile(np.arange(k), n_rows // k)) or \
                not (image_id.reshape(-1, k) == image_id[::k, None]).all():
            raise StageError(f"{self._split_dir}/{INDEX_FILE}: rows are not {k} consecutive variants "
                             f"0..{k - 1} per image (re-run the augment stage)")
        self.image_ids: list[int] = image_id[::k].tolist()
        self._image_id = image_id
        self._hw = np.stack([col("height"), col("width")], 1).astype(np.int64)
        self._orig = np.stack([col("orig_height"), col("orig_width")], 1).astype(np.int64)
        self._scale = np.stack([col("scale_y"), col("scale_x")], 1).astype(np.float64)
        self._offset = np.stack([col("offset_y"), col("offset_x")], 1).astype(np.float64)
        self._box_off, self._boxes = _list_offsets_values(table.column("boxes"), 4, np.float32)
        self._lab_off, self._labels = _list_offsets_values(table.column("labels"), 0, np.int64)
        shard = table.column("shard").combine_chunks().dictionary_encode()
        self._shard_names: list[str] = shard.dictionary.to_pylist()
        self._shard = shard.indices.to_numpy().astype(np.int64)
        self._batch = col("batch").astype(np.int64)
        if self.with_masks:
            has = col("has_masks").astype(bool) if "has_masks" in table.schema.names else np.zeros(n_rows, bool)
            if not has.all():
                bad = int((~has).sum())
                first = int(image_id[~has][0])
                raise StageError(f"{self._split_dir}/{INDEX_FILE}: {bad} of {n_rows} rows (first: image_id {first}) "
                                 f"have objects without an instance mask ({_MASK_RULE})")
        self._readers: dict[int, ipc.RecordBatchFileReader] = {}
        self._fs = fs
        self._pid = os.getpid()
        self._flips: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.image_ids)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose variants and flips `__getitem__` draws."""
        self.epoch = int(epoch)

    def row(self, i: int) -> int:
        """Index-file row of sample ``i`` in the current epoch (its variant ``(epoch + seed) mod copies``)."""
        return i * self.copies + (self.epoch + self.seed) % self.copies

    def flipped(self, i: int) -> bool:
        """Whether sample ``i`` is flipped in the current epoch (a function of ``(seed, epoch, i)`` only)."""
        if self.hflip <= 0:
            return False
        if self._flips is None or self._flips[0] != self.epoch:
            draws = np.random.default_rng([self.seed % 2**64, self.epoch, _FLIP_STREAM]).random(len(self))
            self._flips = (self.epoch, draws < self.hflip)
        return bool(self._flips[1][i])

    def __getstate__(self):  # spawned workers re-open files instead of pickling maps / handles
        state = self.__dict__.copy()
        state["_readers"] = {}
        if self._explicit_fs is None:
            state["_fs"] = None
        state["_pid"] = None
        return state

    def _reader(self, shard: int) -> ipc.RecordBatchFileReader:
        if self._pid != os.getpid():  # a forked or spawned worker: never reuse the parent's handles / clients
            self._readers, self._pid = {}, os.getpid()
            self._fs = open_filesystem(self.root, self._explicit_fs)[0]
        reader = self._readers.get(shard)
        if reader is None:
            path = f"{self._split_dir}/{self._shard_names[shard]}"
            try:
                source = pa.memory_map(path) if self._fs is None else self._fs.open_input_file(path)
                reader = ipc.open_file(source)
            except FileNotFoundError:
                raise StageError(f"{path}: not found (cache incomplete; re-run the augment stage)") from None
            except pa.ArrowInvalid as e:
                raise StageError(f"{path}: not a readable Arrow IPC file ({e})") from None
            self._readers[shard] = reader
        return reader

    def _record(self, r: int) -> pa.RecordBatch:
        return self._reader(self._shard[r]).get_batch(self._batch[r])

    def pixels(self, i: int, record: pa.RecordBatch | None = None) -> torch.Tensor:
        """Cached uint8 pixels of sample ``i`` (current epoch's variant, not flipped): ``(3, H, W)`` uint8 tensor
        viewing the memory map / read buffer (read-only: do not write to it)."""
        r = self.row(i)
        h, w = self._hw[r]
        col = (record if record is not None else self._record(r)).column("pixels")
        start = int(np.frombuffer(col.buffers()[1], dtype=np.int32, count=1, offset=4 * col.offset)[0])
        arr = np.frombuffer(col.buffers()[2], dtype=np.uint8, count=3 * h * w, offset=start)
        with warnings.catch_warnings():  # the buffer is read-only; we only ever read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr).view(3, h, w)

    def masks(self, i: int, record: pa.RecordBatch | None = None) -> np.ndarray:
        """Instance masks of sample ``i`` (current epoch's variant, not flipped): ``(N, H, W)`` uint8 0/1 numpy
        array, C-contiguous, one per box of the sample in the same order.
        Raises:
            StageError: the row has no masks (an object without segmentation) or the shard has no masks column.
        """
        return np.ascontiguousarray(self._masks_view(self.row(i), record))

    def _masks_view(self, r: int, record: pa.RecordBatch | None = None) -> np.ndarray:
        """`masks` of index row ``r`` as a strided ``(N, H, W)`` view of pycocotools' column-major output (the
        caller makes its one contiguous copy)."""
        h, w = (int(v) for v in self._hw[r])
        record = record if record is not None else self._record(r)
        where = f"{self._split_dir}/{self._shard_names[self._shard[r]]}"
        if "masks" not in record.schema.names:
            raise StageError(f"{where}: no masks column (a cache from an older augment stage; re-run it)")
        counts = record.column("masks")[0].as_py()
        n = int(self._box_off[r + 1] - self._box_off[r])
        if counts is None or len(counts) != n:
            raise StageError(f"{where}: image_id {int(self._image_id[r])} has {n} boxes but "
                             f"{'no' if counts is None else len(counts)} masks ({_MASK_RULE})")
        if n == 0:
            return np.zeros((0, h, w), dtype=np.uint8)
        decoded = mask_utils.decode([{"size": [h, w], "counts": c} for c in counts])  # (h, w, n), column-major
        return decoded.transpose(2, 0, 1)

    def __getitem__(self, i: int):
        return self._sample(i)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, dict]]:
        """Samples ``indices`` (what a DataLoader fetches per batch). In a DataLoader worker process the batch's
        images, boxes, labels and metadata are written into one tensor each and returned as views of it, so
        the batch crosses to the main process as a few shared-memory segments instead of ~7 per image (values,
        shapes and dtypes exactly as `__getitem__`'s)."""
        if torch.utils.data.get_worker_info() is None:
            return [self._sample(i) for i in indices]
        rows = [self.row(i) for i in indices]
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f"sample {i} out of range (dataset of {len(self)})")
        numel = [3 * int(self._hw[r, 0]) * int(self._hw[r, 1]) for r in rows]
        n_box = [int(self._box_off[r + 1] - self._box_off[r]) for r in rows]
        images = torch.empty(sum(numel), dtype=self.image_dtype)
        boxes = torch.empty(sum(n_box), 4, dtype=torch.float32)
        labels = torch.empty(sum(n_box), dtype=torch.int64)
        ints = torch.empty(len(rows), 3, dtype=torch.int64)
        floats = torch.empty(len(rows), 4, dtype=torch.float64)
        mask_numel = [n * e // 3 for n, e in zip(n_box, numel)] if self.with_masks else [0] * len(rows)
        masks = torch.empty(sum(mask_numel), dtype=torch.uint8)
        out, o, b, m = [], 0, 0, 0
        for j, i in enumerate(indices):
            r = rows[j]
            h, w = (int(v) for v in self._hw[r])
            masks_out = masks[m:m + mask_numel[j]].view(n_box[j], h, w) if self.with_masks else None
            image, target = self._sample(i, images[o:o + numel[j]].view(3, h, w), boxes[b:b + n_box[j]],
                                         labels[b:b + n_box[j]], ints[j], floats[j], masks_out)
            out.append((image, target))
            o, b, m = o + numel[j], b + n_box[j], m + mask_numel[j]
        return out

    def _sample(self, i: int, image: torch.Tensor | None = None, boxes_out: torch.Tensor | None = None,
                labels_out: torch.Tensor | None = None, ints: torch.Tensor | None = None,
                floats: torch.Tensor | None = None, masks_out: torch.Tensor | None = None):
        """Sample ``i``; the optional tensors are preallocated outputs (see `__getitems__`)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (dataset of {len(self)})")
        r = self.row(i)
        record = self._record(r)
        u8 = self.pixels(i, record)
        boxes = self._boxes[self._box_off[r]:self._box_off[r + 1]]
        masks = self._masks_view(r, record) if self.with_masks else None
        if self.flipped(i):
            u8 = u8.flip(-1)  # flip uint8 (cheap), before the float conversion
            w = float(self._hw[r, 1])
            boxes = np.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], axis=1)
            if masks is not None:
                masks = masks[:, :, ::-1]
        if self.image_dtype == torch.uint8:
            image = u8.clone(memory_format=torch.contiguous_format) if image is None else image.copy_(u8)
        elif image is None:
            image = u8.to(torch.float32).mul_(1.0 / 255)
        else:
            torch.mul(u8, 1.0 / 255, out=image)
        labels = self._labels[self._lab_off[r]:self._lab_off[r + 1]]
        if boxes_out is None:
            target = {
                "boxes": torch.from_numpy(np.array(boxes, dtype=np.float32)),
                "labels": torch.from_numpy(labels.copy()),
                "image_id": torch.tensor(int(self._image_id[r]), dtype=torch.int64),
                "scale": torch.from_numpy(self._scale[r].copy()),
                "offset": torch.from_numpy(self._offset[r].copy()),
                "orig_size": torch.from_numpy(self._orig[r].copy()),
            }
        else:
            boxes_out.copy_(torch.from_numpy(np.asarray(boxes, dtype=np.float32)))
            labels_out.copy_(torch.from_numpy(labels))
            ints.copy_(torch.tensor([self._image_id[r], *self._orig[r]], dtype=torch.int64))
            floats.copy_(torch.from_numpy(np.concatenate([self._scale[r], self._offset[r]])))
            target = {"boxes": boxes_out, "labels": labels_out, "image_id": ints[0], "scale": floats[0:2],
                      "offset": floats[2:4], "orig_size": ints[1:3]}
        if masks is not None:
            if masks_out is None:
                target["masks"] = torch.from_numpy(np.ascontiguousarray(masks))
            else:
                masks_out.numpy()[...] = masks  # one strided copy (numpy takes the flip's negative strides)
                target["masks"] = masks_out
        return image, target


class ResumableDistributedSampler(Sampler[int]):
    """Shuffled sample indices for one rank, deterministic per ``(seed, epoch)``, resumable inside an epoch.

    Each epoch is a permutation of ``range(size)`` (``numpy.random.default_rng([seed, epoch]).permutation``;
    identity if ``shuffle`` is False), cut to a multiple of ``world_size`` (``drop_last``) or padded by
    repeating from its start, then strided by rank as in ``torch.utils.data.DistributedSampler``: ranks see
    disjoint samples (with ``drop_last``), together all but ``size mod world_size`` of them.

    Resuming: `state_dict` records ``{"epoch", "start"}`` (plus the settings, checked on load), ``start`` being
    how many of this rank's indices of the epoch are already consumed; `load_state_dict` (or
    ``set_epoch(epoch, start)``) makes the next iteration continue right after them, so a resumed run gets
    exactly the batches it would have seen.
    """

    def __init__(self, size: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size, self.world_size, self.rank, self.seed = size, world_size, rank, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.start, self._yielded = 0, 0, 0
        self.num_samples = (size // world_size) if drop_last else math.ceil(size / world_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch, and how many of this rank's indices of it to skip (already consumed)."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start {start} outside 0..{self.num_samples}")
        self.epoch, self.start, self._yielded = int(epoch), int(start), 0

    def indices(self) -> list[int]:
        """This rank's full index list for the current epoch (``num_samples`` ints in ``[0, size)``)."""
        if self.shuffle:
            order = np.random.default_rng([self.seed % 2**64, self.epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        total = self.num_samples * self.world_size
        if not self.drop_last and total > self.size:
            order = np.resize(order, total)  # pads by repeating from the start
        return order[self.rank:total:self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        self._yielded = 0
        for idx in self.indices()[self.start:]:
            self._yielded += 1
            yield idx

    def __len__(self) -> int:
        return self.num_samples - self.start

    def state_dict(self, consumed: int | None = None) -> dict:
        """Position to resume from: ``{"epoch", "start", "size", "world_size", "seed", "shuffle", "drop_last"}``.

        Args:
            consumed: indices of the current iteration that the training loop has actually used (e.g. batches
                done x batch size). Default: all the indices this sampler has handed out — the same thing when
                the DataLoader has ``num_workers=0``; worker processes read ahead (``prefetch_factor`` batches
                each), so pass ``consumed`` then.
        A finished epoch is recorded as the start of the next one.
        """
        pos = self.start + (self._yielded if consumed is None else int(consumed))
        epoch = self.epoch
        if self.num_samples and pos >= self.num_samples:
            epoch, pos = epoch + 1, 0
        return {"epoch": epoch, "start": pos, "size": self.size, "world_size": self.world_size,
                "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict`'s position.

        Raises:
            ValueError: the state was made with another size, world size, seed, shuffle or drop_last (the
                sequence would differ, so resuming would not reproduce the batches).
        """
        for key in ("size", "world_size", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler {getattr(self, key)!r}")
        self.set_epoch(int(state["epoch"]), int(state["start"]))


def collate(batch: list[tuple[torch.Tensor, dict]]) -> tuple[list[torch.Tensor], list[dict]]:
    """Collate ``(image, target)`` pairs into ``(images, targets)`` lists, as torchvision detection models
    take them (images may differ in size)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


def uses_masks(model: torch.nn.Module) -> bool:
    """Whether a torchvision detection model trains on and predicts instance masks (Mask R-CNN: its
    ``roi_heads`` has a mask head, ``RoIHeads.has_mask()``); such a model needs ``with_masks=True`` data."""
    heads = getattr(model, "roi_heads", None)
    return bool(heads is not None and hasattr(heads, "has_mask") and heads.has_mask())


def check_cache_masks(cache_meta: dict, model_name: str, where: str = "data/cache/meta.json") -> None:
    """Fail unless the augmentation cache described by ``cache_meta`` (its ``meta.json``) holds a mask for every
    object, as mask model ``model_name`` needs.

    Raises:
        StageError: one line naming the model, ``where``, how many rows lack masks, and the rule.
    """
    if cache_meta.get("masks"):
        return
    splits = cache_meta.get("splits", {})
    if "masks" not in cache_meta:
        why = "it was made by an older augment stage without masks (re-run the augment stage)"
    else:
        parts = [f"{c.get('rows_without_masks', 0)} of {c.get('rows', 0)} {name} rows" for name, c in splits.items()]
        why = f"{' and '.join(parts)} have objects without a segmentation"
    raise StageError(f"params.yaml: train.model '{model_name}' needs instance masks, but {where} has none: {why} "
                     f"({_MASK_RULE})")


def read_meta(path: str | Path) -> dict:
    """Read a stage's ``meta.json``. Raises `StageError` naming the file if it is missing or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path}: not found (run the previous stages first)") from None
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e})") from None


def micro_batches(dataset: CachedDetectionDataset, sampler: ResumableDistributedSampler, start_iter: int,
                  iters_per_epoch: int, batch_size: int, accumulate: int, num_workers: int = 0,
                  pin_memory: bool = False, locate=None) -> Iterator[list[tuple[list[torch.Tensor], list[dict]]]]:
    """Endless training input from iteration ``start_iter`` on: each item is one optimizer step's list of
    ``accumulate`` micro-batches ``(images, targets)`` as `collate` returns them (this rank's share).

    Epoch ``e`` covers iterations ``e * iters_per_epoch ..``; the sampler is positioned from ``start_iter``, so
    a resumed run reads exactly what an uninterrupted one would. Incomplete batches at an epoch's end are
    dropped (``drop_last``). ``locate(it) -> (epoch, sampler start)`` replaces that mapping when the world size
    changed at a restart (`detpipe.elastic.EpochPlan.locate`).
    """
    it = start_iter
    while True:
        epoch, start = locate(it) if locate else (it // iters_per_epoch, it % iters_per_epoch * batch_size * accumulate)
        sampler.set_epoch(epoch, start)
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                            collate_fn=collate, drop_last=True, pin_memory=pin_memory)
        micro = []
        for batch in loader:
            micro.append(batch)
            if len(micro) == accumulate:
                yield micro
                micro = []
                it += 1
