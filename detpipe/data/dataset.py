"""Training/evaluation data from the augmentation cache (`detpipe.data.augment`): the map-style dataset, collate.

`CachedDetectionDataset` reads ``<root>/<split>/index.arrow`` (boxes, labels, sizes: small) at construction and
each image's pixels on demand from its ``part-NNNNN.arrow`` shard. ``root`` is a local folder (shards are
memory-mapped: no copy until the float conversion) or a filesystem URL — anything
``pyarrow.fs.FileSystem.from_uri`` understands (``s3://bucket/cache``, ``gs://…``, ``hdfs://…``, ``file:///…``)
and otherwise any fsspec URL — so every node of a multi-node job can read one cache in object storage directly.
Read directly, a remote shard is read one image's record batch (a byte range) at a time; training streams whole
shards instead (`detpipe.data.loader.micro_batches` with a `detpipe.data.streaming.ShardPrefetcher`: background copies
into a bounded local folder that the dataset then memory-maps). The files are read through
`detpipe.data.cache_shards.CacheShards`; the training input (DataLoader, steps, streaming) is `detpipe.data.loader`;
the train-time augmentation on the training device is `detpipe.data.batch_augment`.

Pixels are stored raw (``uint8`` CHW) or JPEG-encoded (``augment.encoding``; the Arrow schema metadata of
``index.arrow`` says which); JPEG is decoded at load time with ``torchvision.io.decode_jpeg``, batched per
DataLoader batch, or on the GPU by `detpipe.data.loader.micro_batches` (``decode_device``).

Instance masks (Mask R-CNN) come only with ``with_masks=True``: box-only models never decode them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from pycocotools import mask as mask_utils
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg

from detpipe.core.errors import StageError
from detpipe.data.cache_format import INDEX_FILE
from detpipe.data.cache_shards import CacheShards
from detpipe.data.multi_image import make_sample
from detpipe.data.train_transforms import TrainTransforms

__all__ = ["CachedDetectionDataset", "collate", "check_cache_masks", "decode_images"]

_MASK_RULE = ("rule: mask models need a polygon or RLE segmentation for every non-crowd object; use data with "
              "masks or a box-only model")
_FLIP_STREAM = 0x666C6970  # a constant third seed word, so flip draws do not reuse the sampler's stream
ENCODINGS = ("raw", "jpeg")


def decode_images(data: list[torch.Tensor], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Decode JPEG-encoded cache images: ``data`` are 1-D ``uint8`` CPU tensors (the stored bytes); returns
    ``(3, H, W)`` ``uint8`` RGB tensors on ``device``, via one batched ``torchvision.io.decode_jpeg`` call (nvJPEG on
    CUDA: tests/system/test_gpu.py; its luma agrees with the CPU decode within 0.33 levels on COCO128, its RGB within 2.3,
    the chroma upsampling differing). Raises RuntimeError on bytes that are not a JPEG."""
    if not data:
        return []
    return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


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


class CachedDetectionDataset(CacheShards, Dataset):
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
        root: cache root (``data/cache``) or a URL, see `detpipe.core.files.filesystem`.
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
        transforms: the train-time augmentation (`detpipe.data.train_transforms.TrainTransforms`, ``train.augment``
            other than ``flip``), applied to each sample after the decode, the flip drawn as above included; its
            draws are functions of ``(seed, epoch, i, op)`` too. The target then also holds ``dropped`` (``int64``
            scalar: boxes the ops removed, e.g. cut away by a crop). None: the flip only (the fast path).

    Indices are ``i`` (current epoch, `set_epoch`) or ``(epoch, i)`` pairs, which is what `detpipe.data.loader.micro_batches` feeds the
    DataLoader, so worker processes kept alive across epochs never depend on a stale `set_epoch`.
    ``encoding`` (``"raw"`` or ``"jpeg"``) is the cache's pixel encoding; ``defer_decode = True`` (set by
    `detpipe.data.loader.micro_batches` for GPU decoding) makes samples carry the JPEG bytes (1-D ``uint8``) and ``target["hflip"]``
    instead of pixels (boxes and masks are already flipped).
    Raises:
        StageError: no readable ``index.arrow`` under ``root/split``, or its rows are not grouped by image;
            ``with_masks=True`` and some row has an object without a mask (the cache's ``has_masks``).
    """

    def __init__(self, root: str | Path, split: str, hflip: float = 0.0, seed: int = 0, filesystem: Any = None,
                 image_dtype: torch.dtype = torch.float32, with_masks: bool = False,
                 transforms: TrainTransforms | None = None):
        if not 0.0 <= hflip <= 1.0:
            raise ValueError(f"hflip must be in [0, 1], got {hflip}")
        if image_dtype not in (torch.float32, torch.uint8):
            raise ValueError(f"image_dtype must be torch.float32 or torch.uint8, got {image_dtype}")
        self.image_dtype = image_dtype
        self.with_masks = bool(with_masks)
        self.transforms = transforms
        CacheShards.__init__(self, root, split, filesystem)
        self.hflip, self.seed, self.epoch = float(hflip), int(seed), 0
        table = self.read_index()
        schema_meta = table.schema.metadata or {}
        self.encoding = schema_meta.get(b"encoding", b"raw").decode()
        if self.encoding not in ENCODINGS:
            raise StageError(f"{self._split_dir}/{INDEX_FILE}: unknown pixel encoding {self.encoding!r} "
                             f"(expected one of {ENCODINGS}; re-run the augment stage)")
        self.defer_decode = False
        self.defer_augment = False  # set by micro_batches: the transforms run there, on the training device
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
        self.index_shards(table)
        if self.with_masks:
            has = col("has_masks").astype(bool) if "has_masks" in table.schema.names else np.zeros(n_rows, bool)
            if not has.all():
                bad = int((~has).sum())
                first = int(image_id[~has][0])
                raise StageError(f"{self._split_dir}/{INDEX_FILE}: {bad} of {n_rows} rows (first: image_id {first}) "
                                 f"have objects without an instance mask ({_MASK_RULE})")
        self._flips: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.image_ids)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose variants and flips `__getitem__` draws."""
        self.epoch = int(epoch)

    def row(self, i: int, epoch: int | None = None) -> int:
        """Index-file row of sample ``i`` in ``epoch`` (default: the current one): its variant
        ``(epoch + seed) mod copies``."""
        epoch = self.epoch if epoch is None else epoch
        return i * self.copies + (epoch + self.seed) % self.copies

    def flipped(self, i: int, epoch: int | None = None) -> bool:
        """Whether sample ``i`` is flipped in ``epoch`` (default: the current one); a function of
        ``(seed, epoch, i)`` only."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self.hflip <= 0:
            return False
        if self._flips is None or self._flips[0] != epoch:
            draws = np.random.default_rng([self.seed % 2**64, epoch, _FLIP_STREAM]).random(len(self))
            self._flips = (epoch, draws < self.hflip)
        return bool(self._flips[1][i])

    def sample_shards(self, epoch: int = 0) -> np.ndarray:
        """``(len(self),)`` int64: the shard (index into the cache's shard list) holding each sample's row in
        ``epoch``. An image's variants share a shard (the augment stage never splits them), so this is the same
        for every epoch; it is what the shard-aware `ResumableDistributedSampler` takes as ``shards``."""
        return self._shard[np.arange(len(self)) * self.copies + (epoch + self.seed) % self.copies]

    def _split(self, index) -> tuple[int, int]:
        """``(epoch, i)`` of a DataLoader index (``i`` or an ``(epoch, i)`` pair)."""
        if isinstance(index, (tuple, list)):
            return int(index[0]), int(index[1])
        return self.epoch, int(index)

    def _decoded(self, r: int, stored: torch.Tensor) -> torch.Tensor:
        h, w = (int(v) for v in self._hw[r])
        if self.encoding == "raw":
            return stored.view(3, h, w)
        try:
            image = decode_images([stored])[0]
        except RuntimeError as e:
            raise StageError(f"{self.shard_url(int(self._shard[r]))}: image_id {int(self._image_id[r])}: "
                             f"JPEG not decodable ({' '.join(str(e).split())})") from None
        if tuple(image.shape) != (3, h, w):
            raise StageError(f"{self.shard_url(int(self._shard[r]))}: image_id {int(self._image_id[r])}: decoded "
                             f"size {tuple(image.shape)} != index (3, {h}, {w})")
        return image

    def pixels(self, i: int, record: pa.RecordBatch | None = None, epoch: int | None = None) -> torch.Tensor:
        """Cached uint8 pixels of sample ``i`` (``epoch``'s variant, default the current epoch; not flipped):
        ``(3, H, W)`` uint8 tensor; for a raw cache a view of the memory map / read buffer (read-only: do not
        write to it), for a JPEG cache freshly decoded."""
        r = self.row(i, epoch)
        return self._decoded(r, self._stored(r, record if record is not None else self._record(r)))

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

    def __getitem__(self, index):
        epoch, i = self._split(index)
        return self._sample(i, epoch)

    def cached_sample(self, i: int, epoch: int | None = None) -> dict:
        """Sample ``i``'s cached variant of ``epoch`` un-augmented and un-flipped, as a v2 sample dict
        (`detpipe.data.multi_image.make_sample`: ``image`` uint8 ``(3, H, W)``, ``boxes`` XYXY cached pixels,
        ``labels``, ``masks`` with ``with_masks``): what `TrainTransforms` starts from, and its mosaic / mixup
        partners."""
        epoch = self.epoch if epoch is None else int(epoch)
        r = self.row(i, epoch)
        record = self._record(r)
        u8 = self._decoded(r, self._stored(r, record))
        boxes = torch.from_numpy(np.array(self._boxes[self._box_off[r]:self._box_off[r + 1]], dtype=np.float32))
        labels = torch.from_numpy(self._labels[self._lab_off[r]:self._lab_off[r + 1]].copy())
        masks = torch.from_numpy(np.ascontiguousarray(self._masks_view(r, record))) if self._read_masks else None
        return make_sample(u8, boxes, labels, masks)

    @property
    def _read_masks(self) -> bool:
        """Whether samples are read with their masks: for the model (``with_masks``) or for the train-time
        augmentation alone (copy-paste on a box-only model: the masks are dropped after it)."""
        return self.with_masks or bool(getattr(self.transforms, "needs_masks", False))

    def _decode_batch(self, pairs: list[tuple[int, int]]) -> list[torch.Tensor | None]:
        """Decoded pixels of a batch's JPEG samples with one `decode_images` call (None entries for a raw cache or
        with ``defer_decode``: `_sample` reads those itself)."""
        if self.encoding != "jpeg" or self.defer_decode or len(pairs) < 2:
            return [None] * len(pairs)
        rows = [self.row(i, e) for e, i in pairs]
        stored = [self._stored(r, self._record(r)) for r in rows]
        try:
            images = decode_images(stored)
        except RuntimeError:  # find the bad one and name it
            return [self._decoded(r, s) for r, s in zip(rows, stored)]
        return [self._decoded(r, s) if tuple(im.shape) != (3, *self._hw[r]) else im
                for r, s, im in zip(rows, stored, images)]

    def __getitems__(self, indices: list) -> list[tuple[torch.Tensor, dict]]:
        """Samples ``indices`` (what a DataLoader fetches per batch; ints or ``(epoch, i)`` pairs), JPEGs decoded
        in one batched call. In a DataLoader worker process the batch's images, boxes, labels and metadata are
        written into one tensor each and returned as views of it, so the batch crosses to the main process as a
        few shared-memory segments instead of ~7 per image (values, shapes and dtypes exactly as
        `__getitem__`'s)."""
        pairs = [self._split(index) for index in indices]
        for _, i in pairs:
            if not 0 <= i < len(self):
                raise IndexError(f"sample {i} out of range (dataset of {len(self)})")
        decoded = self._decode_batch(pairs)
        if torch.utils.data.get_worker_info() is None or self.defer_decode or self.transforms is not None:
            return [self._sample(i, e, u8=d) for (e, i), d in zip(pairs, decoded)]
        rows = [self.row(i, e) for e, i in pairs]
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
        for j, (e, i) in enumerate(pairs):
            r = rows[j]
            h, w = (int(v) for v in self._hw[r])
            masks_out = masks[m:m + mask_numel[j]].view(n_box[j], h, w) if self.with_masks else None
            image, target = self._sample(i, e, images[o:o + numel[j]].view(3, h, w), boxes[b:b + n_box[j]],
                                         labels[b:b + n_box[j]], ints[j], floats[j], masks_out, u8=decoded[j])
            out.append((image, target))
            o, b, m = o + numel[j], b + n_box[j], m + mask_numel[j]
        return out

    def _sample(self, i: int, epoch: int | None = None, image: torch.Tensor | None = None,
                boxes_out: torch.Tensor | None = None, labels_out: torch.Tensor | None = None,
                ints: torch.Tensor | None = None, floats: torch.Tensor | None = None,
                masks_out: torch.Tensor | None = None, u8: torch.Tensor | None = None):
        """Sample ``i`` of ``epoch``; the optional tensors are preallocated outputs (see `__getitems__`), ``u8``
        the already decoded pixels."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (dataset of {len(self)})")
        epoch = self.epoch if epoch is None else epoch
        r = self.row(i, epoch)
        record = self._record(r) if u8 is None or self._read_masks else None
        flip = self.flipped(i, epoch)
        if self.defer_decode and self.encoding == "jpeg":
            u8 = self._stored(r, record).clone()  # the JPEG bytes; decoded (and flipped) by micro_batches
        elif u8 is None:
            u8 = self._decoded(r, self._stored(r, record))
        boxes = self._boxes[self._box_off[r]:self._box_off[r + 1]]
        masks = self._masks_view(r, record) if self._read_masks else None
        deferred = self.defer_decode and self.encoding == "jpeg"
        labels = self._labels[self._lab_off[r]:self._lab_off[r + 1]]
        dropped = None
        if self.defer_augment:  # `detpipe.data.batch_augment.augment_batch` runs the transforms (and the flip) on the training device
            target_extra = {"augment_at": torch.tensor([epoch, i], dtype=torch.int64), "hflip": torch.tensor(flip)}
            flip = False
        else:
            target_extra = {}
        if self.transforms is not None and not deferred and not self.defer_augment:
            sample = make_sample(u8, torch.from_numpy(np.array(boxes, dtype=np.float32)),
                                 torch.from_numpy(labels.copy()),
                                 None if masks is None else torch.from_numpy(np.ascontiguousarray(masks)))
            sample, dropped = self.transforms(i, epoch, sample, flip, self.cached_sample)
            u8 = sample["image"].as_subclass(torch.Tensor)
            boxes = sample["boxes"].as_subclass(torch.Tensor).numpy()
            labels = sample["labels"].numpy()
            masks = None if masks is None or not self.with_masks else sample["masks"].as_subclass(torch.Tensor).numpy()
            flip = False  # drawn and applied by the transforms
        if flip:
            if not deferred:
                u8 = u8.flip(-1)  # flip uint8 (cheap), before the float conversion
            w = float(self._hw[r, 1])
            boxes = np.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], axis=1)
            if masks is not None:
                masks = masks[:, :, ::-1]
        if deferred:
            image = u8
        elif self.defer_augment:
            image = u8.clone(memory_format=torch.contiguous_format)
        elif self.image_dtype == torch.uint8:
            image = u8.clone(memory_format=torch.contiguous_format) if image is None else image.copy_(u8)
        elif image is None:
            image = u8.to(torch.float32, memory_format=torch.contiguous_format).mul_(1.0 / 255)
        else:
            torch.mul(u8, 1.0 / 255, out=image)
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
        if deferred and not self.defer_augment:
            target["hflip"] = torch.tensor(flip)
        target.update(target_extra)
        if dropped is not None:
            target["dropped"] = torch.tensor(dropped, dtype=torch.int64)
        if masks is not None:
            if masks_out is None:
                target["masks"] = torch.from_numpy(np.ascontiguousarray(masks))
            else:
                masks_out.numpy()[...] = masks  # one strided copy (numpy takes the flip's negative strides)
                target["masks"] = masks_out
        return image, target


def collate(batch: list[tuple[torch.Tensor, dict]]) -> tuple[list[torch.Tensor], list[dict]]:
    """Collate ``(image, target)`` pairs into ``(images, targets)`` lists, as torchvision detection models
    take them (images may differ in size)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


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


