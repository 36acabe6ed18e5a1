"""Training/evaluation data from the augmentation cache (`stages.augment`): Dataset, sampler, collate.

The cache shards are Arrow IPC files opened with ``pyarrow.memory_map`` (local paths) or any pyarrow / fsspec
filesystem URL (``s3://…``), so pixels are read without a copy until they become a float tensor.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import torch
from torch.utils.data import Dataset, Sampler

from stages.common import StageError


def _open_shards(root: str, split: str) -> list[pa.RecordBatch]:
    """Open every ``<root>/<split>/*.arrow`` shard; return its record batches (memory-mapped if local)."""
    if "://" not in root:
        split_dir = Path(root) / split
        shards = sorted(split_dir.glob("*.arrow"))
        if not shards:
            raise StageError(f"{split_dir}: no cache shards (*.arrow) found (run the augment stage first)")
        batches = []
        for shard in shards:
            reader = ipc.open_file(pa.memory_map(str(shard)))
            batches += [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return batches
    path, _, query = root.partition("?")  # keep a query string (endpoint_override=...) after the path
    fs, base = pafs.FileSystem.from_uri(path.rstrip("/") + "/" + split + (f"?{query}" if query else ""))
    infos = sorted((i for i in fs.get_file_info(pafs.FileSelector(base)) if i.path.endswith(".arrow")),
                   key=lambda i: i.path)
    if not infos:
        raise StageError(f"{root}/{split}: no cache shards (*.arrow) found")
    batches = []
    for info in infos:
        reader = ipc.open_file(fs.open_input_file(info.path))
        batches += [reader.get_batch(i) for i in range(reader.num_record_batches)]
    return batches


class CachedDetectionDataset(Dataset):
    """Detection samples from the augmentation cache, in the format torchvision detection models take.

    ``dataset[i]`` returns ``(image, target)``:

    * ``image``: ``torch.float32`` tensor ``(3, H, W)``, RGB in ``[0, 1]`` (H, W = cached size in pixels);
    * ``target``: ``boxes`` ``float32 (N, 4)`` XYXY in cached pixels, ``labels`` ``int64 (N,)``,
      ``image_id`` ``int64`` scalar, ``scale`` ``float64 (2,)`` = ``(scale_y, scale_x)`` (cached / original
      pixels: divide predicted coordinates by it to get original-image pixels), ``orig_size`` ``int64 (2,)``
      = ``(orig_height, orig_width)``.

    Random horizontal flip with probability ``hflip`` is applied at load time. Whether sample ``i`` is
    flipped depends only on ``(seed, epoch, i)`` (call `set_epoch`), not on worker processes or global RNG
    state, so a resumed run sees exactly the same samples.

    Args:
        root: cache root (``data/cache``) or a filesystem URL (``s3://bucket/cache``) pyarrow understands.
        split: ``"train"`` or ``"val"``.
    Raises:
        StageError: no shards under ``root/split``.
    """

    def __init__(self, root: str | Path, split: str, hflip: float = 0.0, seed: int = 0):
        self.root, self.split, self.hflip, self.seed, self.epoch = str(root), split, hflip, seed, 0
        self._batches: list[pa.RecordBatch] | None = None
        batches = _open_shards(self.root, split)
        self._index = [(b, r) for b, batch in enumerate(batches) for r in range(batch.num_rows)]
        self.image_ids = [int(i) for batch in batches for i in batch.column("image_id").to_numpy()]
        self._batches = batches

    def __len__(self) -> int:
        return len(self._index)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose flips `__getitem__` draws."""
        self.epoch = epoch

    def __getstate__(self):  # worker processes re-open the memory maps instead of pickling pixels
        state = self.__dict__.copy()
        state["_batches"] = None
        return state

    def __getitem__(self, i: int):
        if self._batches is None:
            self._batches = _open_shards(self.root, self.split)
        b, r = self._index[i]
        batch = self._batches[b]
        h, w = batch.column("height")[r].as_py(), batch.column("width")[r].as_py()
        buf = batch.column("pixels")[r].as_buffer()
        hwc = np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 3)
        image = torch.empty((3, h, w), dtype=torch.float32)
        image.copy_(torch.from_numpy(np.array(hwc, copy=True)).permute(2, 0, 1)).div_(255.0)
        boxes_arr = batch.column("boxes")[r].values
        boxes = torch.from_numpy(np.array(boxes_arr.flatten().to_numpy(zero_copy_only=False),
                                          dtype=np.float32).reshape(-1, 4))
        labels = torch.from_numpy(np.array(batch.column("labels")[r].values.to_numpy(zero_copy_only=False),
                                           dtype=np.int64))
        if self.hflip > 0 and np.random.default_rng([self.seed, self.epoch, i]).random() < self.hflip:
            image = image.flip(-1)
            boxes = torch.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], dim=1)
        target = {
            "boxes": boxes,
            "labels": labels,
            "image_id": torch.tensor(batch.column("image_id")[r].as_py(), dtype=torch.int64),
            "scale": torch.tensor([batch.column("scale_y")[r].as_py(), batch.column("scale_x")[r].as_py()],
                                  dtype=torch.float64),
            "orig_size": torch.tensor([batch.column("orig_height")[r].as_py(),
                                       batch.column("orig_width")[r].as_py()], dtype=torch.int64),
        }
        return image, target


class ResumableDistributedSampler(Sampler[int]):
    """Shuffled indices for one rank, deterministic per ``(seed, epoch)``, resumable inside an epoch.

    Each epoch is a permutation of ``range(size)`` (``torch.randperm`` with a generator seeded by
    ``seed + epoch``), cut to a multiple of ``world_size`` (``drop_last``) or padded by wrapping, then
    strided by rank as in ``torch.utils.data.DistributedSampler``; ranks therefore see disjoint samples.
    ``set_epoch(epoch, start)`` makes the next iteration skip the first ``start`` indices of this rank,
    so a resumed run continues with exactly the batches it would have seen.
    """

    def __init__(self, size: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.size, self.world_size, self.rank, self.seed = size, world_size, rank, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.start = 0, 0
        self.num_samples = (size // world_size) if drop_last else math.ceil(size / world_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch, and how many of this rank's indices of it to skip (already consumed)."""
        self.epoch, self.start = epoch, start

    def indices(self) -> list[int]:
        """This rank's full index list for the current epoch (``num_samples`` ints)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        total = self.num_samples * self.world_size
        order = order[:total] if self.drop_last else (order * math.ceil(total / max(1, self.size)))[:total]
        return order[self.rank:total:self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(int(state["epoch"]), int(state["start"]))


def collate(batch: list[tuple[torch.Tensor, dict]]) -> tuple[list[torch.Tensor], list[dict]]:
    """Collate ``(image, target)`` pairs into ``(images, targets)`` lists, as torchvision detection models
    take them (images may differ in size)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


def read_meta(path: str | Path) -> dict:
    """Read a stage's ``meta.json``. Raises `StageError` naming the file if it is missing or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path}: not found (run the previous stages first)") from None
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e})") from None
