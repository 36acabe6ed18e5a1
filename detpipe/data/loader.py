"""The training input: `micro_batches`, one DataLoader over a `detpipe.data.dataset.CachedDetectionDataset` for
every epoch, fed ``(epoch, i)`` pairs by the rank's `detpipe.data.sampler.ResumableDistributedSampler` plan from a
resumable position, grouped into optimizer steps of micro-batches; whole shards streamed ahead of the plan when the
cache is a URL; JPEG decode or the train-time augmentation on the training device when asked."""
from __future__ import annotations

import copy
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from detpipe.core.errors import StageError
from detpipe.data.batch_augment import augment_batch
from detpipe.data.dataset import CachedDetectionDataset, collate, decode_images
from detpipe.data.sampler import ResumableDistributedSampler

__all__ = ["micro_batches"]


def _epoch_plan(sampler: ResumableDistributedSampler, epoch: int, start: int, offset: int,
                step: int) -> list[int]:
    """The indices this rank reads in ``epoch`` from its position ``start`` (whole optimizer steps of ``step``
    samples only, as training uses them)."""
    s = copy.copy(sampler)
    s.set_epoch(epoch, start, offset)
    left = s.indices()[start:]
    return left[:len(left) // step * step]


def _plan(sampler: ResumableDistributedSampler, epoch: int, start: int, offset: int,
          step: int) -> Iterator[tuple[int, list[int]]]:
    """``(epoch, indices)`` for the first (possibly resumed) epoch and every later one (endless)."""
    while True:
        yield epoch, _epoch_plan(sampler, epoch, start, offset, step)
        epoch, start, offset = epoch + 1, 0, 0


class _BatchPlan:
    """Endless batch sampler over `_plan`: lists of ``(epoch, i)`` (one DataLoader batch each)."""

    def __init__(self, plan: Iterator[tuple[int, list[int]]], batch_size: int):
        self.plan, self.batch_size = plan, batch_size

    def __iter__(self):
        for epoch, indices in self.plan:
            for b in range(0, len(indices), self.batch_size):
                yield [(epoch, i) for i in indices[b:b + self.batch_size]]


def _one_line(e: Exception) -> str:
    """A DataLoader worker's re-raised `StageError` carries the worker's traceback: keep its own message."""
    last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    prefix = "detpipe.core.errors.StageError: "
    return last[len(prefix):] if last.startswith(prefix) else " ".join(str(e).split())


def micro_batches(dataset: CachedDetectionDataset, sampler: ResumableDistributedSampler,
                  position: tuple[int, int, int], batch_size: int, accumulate: int, num_workers: int = 0,
                  pin_memory: bool = False, local_dir: str | None = None, local_bytes: int = 2 * 10**9,
                  decode_device: torch.device | None = None, augment_device: torch.device | None = None,
                  ) -> Iterator[list[tuple[list[torch.Tensor], list[dict]]]]:
    """Endless training input from ``position`` on: each item is one optimizer step's list of ``accumulate``
    micro-batches ``(images, targets)`` as `collate` returns them (this rank's share).

    ``position`` is where the first step reads, as ``(epoch, start, offset)`` in the meaning of
    `ResumableDistributedSampler.set_epoch` (``start``: this rank's indices of ``epoch`` already consumed;
    ``offset``: samples of the epoch's global order consumed at an earlier world size): ``(0, 0, 0)`` for a fresh
    run; the trainer passes ``detpipe.engine.elastic.EpochPlan.locate(iteration)``, the one place that maps an
    iteration to an epoch and a position, also after a change of world size. That epoch is read from ``start`` on,
    every later epoch whole (``offset`` 0); the sampler's own position (``epoch``, ``start``, ``offset``) is not
    used and not changed. Incomplete steps at an epoch's end are dropped (``drop_last``).

    One DataLoader serves every epoch (its ``num_workers`` processes start once and live until the generator is
    closed): the batch sampler hands out ``(epoch, i)`` pairs, so nothing in a worker depends on per-epoch state.

    Streaming: when ``dataset`` reads a URL, a `detpipe.data.streaming.ShardPrefetcher` copies the whole shards this
    rank will need, in the order of the plan, into ``local_dir`` (None: a temporary folder), holding at most about
    ``local_bytes`` bytes, and deletes each once its last sample is consumed; the dataset memory-maps the copies.
    ``decode_device`` (a CUDA device) decodes a JPEG cache's images there (`decode_images`) instead of in the
    loader; images then arrive as float32 on that device. With ``dataset.transforms`` (train-time augmentation) the
    samples are augmented in the loader (CPU workers), unless ``augment_device`` is given: then the loader only
    reads, and `augment_batch` decodes (nvJPEG on CUDA) and runs the same transforms on that device in this
    process (``train.augment_device``; the same draws, so the same batches up to the device's arithmetic).

    Raises:
        StageError: one line from the data (unreadable or missing shard, naming its path or URL).
    """
    step = batch_size * accumulate
    epoch, start, offset = position
    on_device = augment_device is not None and dataset.transforms is not None
    if on_device:
        decode_device = augment_device
    defer = decode_device is not None and torch.device(decode_device).type == "cuda" and dataset.encoding == "jpeg" \
        and (dataset.transforms is None or on_device)  # else augmentation runs on the decoded pixels in the loader
    dataset.defer_decode = defer
    dataset.defer_augment = on_device
    shards = dataset.sample_shards()
    lookahead = batch_size * (max(1, num_workers) * 2 + 2)  # DataLoader read-ahead: prefetch_factor 2/worker
    prefetcher = dataset.start_streaming((shards[np.asarray(ix, dtype=np.int64)]
                                          for _, ix in _plan(sampler, epoch, start, offset, step)),
                                         local_dir, local_bytes, lookahead)
    loader = DataLoader(dataset, batch_sampler=_BatchPlan(_plan(sampler, epoch, start, offset, step), batch_size),
                        num_workers=num_workers, collate_fn=collate, pin_memory=pin_memory)
    it, consumed, micro = iter(loader), 0, []
    try:
        while True:
            try:
                images, targets = next(it)
            except StageError as e:
                raise StageError(prefetcher.error if prefetcher and prefetcher.error else _one_line(e)) from None
            consumed += len(images)
            if prefetcher is not None:
                if prefetcher.error:
                    raise StageError(prefetcher.error)
                prefetcher.consumed(consumed)
            if on_device:
                images, targets = augment_batch(dataset, images, targets, torch.device(augment_device), defer)
            elif defer:
                flips = [bool(t.pop("hflip")) for t in targets]
                images = [(im.flip(-1) if f else im).float().mul_(1 / 255)
                          for im, f in zip(decode_images(images, decode_device), flips)]
            micro.append((images, targets))
            if len(micro) == accumulate:
                yield micro
                micro = []
    finally:
        del it
        if prefetcher is not None:
            dataset.stop_streaming()
        dataset.defer_decode = False
        dataset.defer_augment = False
