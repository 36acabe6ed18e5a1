"""The training sampler: shard-aware shuffling, a pure function of ``(seed, epoch, world size)``, resumable inside
an epoch, also at another world size.

Order of an epoch (``global order``, one permutation of ``range(size)``):

* without ``shards`` (or ``shuffle=False``): ``numpy.random.default_rng([seed, epoch]).permutation(size)``
  (identity without shuffle) — a global shuffle, for local memory-mapped caches;
* with ``shards`` (the shard of every sample, `detpipe.data.dataset.CachedDetectionDataset.sample_shards`): the shards are
  permuted with the same generator, cut into blocks of ``window`` consecutive shards of that permutation, and the
  samples of each block are shuffled together (MosaicML Streaming's block shuffle, ``py1b``-like). A rank then
  needs at most ``window`` shards at a time (two at a block boundary), so a streamed cache is read as whole shards,
  each downloaded about once per epoch.

Ranks take the global order strided (``order[offset + rank :: world_size]``, as
``torch.utils.data.DistributedSampler``), cut to a multiple of ``world_size`` (``drop_last``) or padded by
repeating from its start. Because ranks advance together (DDP), the samples consumed by all ranks after each has
consumed ``start`` of its own are exactly the prefix ``order[:offset + start * world_size]``: that prefix is what
makes a resume at another world size exact (see `ResumableDistributedSampler.load_state_dict`).
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

DEFAULT_WINDOW = 8  # shards shuffled together; with ~32 MB shards a rank holds ~0.25-0.5 GB of them


class ResumableDistributedSampler(Sampler[int]):
    """Shuffled sample indices for one rank, deterministic per ``(seed, epoch, world_size)``, resumable inside an
    epoch (see the module docstring for the order).

    Args:
        size: number of samples.
        world_size, rank: this rank of ``world_size`` (``0 <= rank < world_size``).
        seed: seed of the permutations.
        shuffle: False gives ``range(size)`` in order.
        drop_last: cut each epoch to a multiple of ``world_size`` (ranks disjoint) instead of padding.
        shards: optional ``(size,)`` ints, the shard of each sample; enables the shard-aware block shuffle.
        window: shards per shuffle block (>= 1).
    Attributes:
        num_samples: indices per rank of a full epoch.
        epoch, start, offset: the current epoch, how many of this rank's indices of it are consumed, and how many
            samples of the epoch's global order were consumed before this world size took over (0 unless resumed
            from another world size mid-epoch).
    Raises:
        ValueError: bad rank/size/window, or ``shards`` of another length.
    """

    def __init__(self, size: int, world_size: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, shards: Sequence[int] | np.ndarray | None = None,
                 window: int = DEFAULT_WINDOW):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.size, self.world_size, self.rank, self.seed = size, world_size, rank, seed
        self.shuffle, self.drop_last, self.window = shuffle, drop_last, int(window)
        self.shards = None if shards is None else np.asarray(shards, dtype=np.int64)
        if self.shards is not None and len(self.shards) != size:
            raise ValueError(f"shards has {len(self.shards)} entries for {size} samples")
        self.epoch, self.start, self.offset, self._yielded = 0, 0, 0, 0
        self.num_samples = self._count(0)

    def _count(self, offset: int) -> int:
        left = max(0, self.size - offset)
        return left // self.world_size if self.drop_last else math.ceil(left / self.world_size)

    def set_epoch(self, epoch: int, start: int = 0, offset: int = 0) -> None:
        """Select the epoch, how many of this rank's indices of it to skip (already consumed), and the epoch's
        ``offset`` (samples of its global order consumed at another world size; 0 normally).
        Raises ValueError when ``start`` or ``offset`` is out of range."""
        if not 0 <= offset <= self.size:
            raise ValueError(f"offset {offset} outside 0..{self.size}")
        count = self._count(offset)
        if not 0 <= start <= count:
            raise ValueError(f"start {start} outside 0..{count}")
        self.epoch, self.start, self.offset, self._yielded = int(epoch), int(start), int(offset), 0

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The global order of ``epoch`` (default: the current one): ``(size,)`` int64, a permutation of
        ``range(size)``, the same on every rank and at every world size."""
        epoch = self.epoch if epoch is None else int(epoch)
        if not self.shuffle:
            return np.arange(self.size, dtype=np.int64)
        rng = np.random.default_rng([self.seed % 2**64, epoch])
        if self.shards is None:
            return rng.permutation(self.size).astype(np.int64)
        ids, inverse = np.unique(self.shards, return_inverse=True)
        by_shard = np.argsort(inverse, kind="stable")  # samples grouped by shard, ascending index inside
        bounds = np.searchsorted(inverse[by_shard], np.arange(len(ids) + 1))
        perm = rng.permutation(len(ids))
        out = []
        for b in range(0, len(perm), self.window):
            block = np.concatenate([by_shard[bounds[s]:bounds[s + 1]] for s in perm[b:b + self.window]])
            out.append(rng.permutation(block))
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def indices(self) -> list[int]:
        """This rank's full index list for the current epoch and offset (``_count(offset)`` ints in
        ``[0, size)``; ``num_samples`` when ``offset == 0``)."""
        order = self.order()[self.offset:]
        count = self._count(self.offset)
        total = count * self.world_size
        if not self.drop_last and total > len(order):
            order = np.resize(order, total)  # pads by repeating from the start
        return order[self.rank:total:self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        self._yielded = 0
        for idx in self.indices()[self.start:]:
            self._yielded += 1
            yield idx

    def __len__(self) -> int:
        return self.remaining_in_epoch()

    def remaining_in_epoch(self) -> int:
        """Indices this rank still has to consume in the current epoch (``count - start``, where ``count`` is
        ``(size - offset) // world_size`` with ``drop_last``). The trainer counts the rest of a resumed epoch's
        iterations from it: ``remaining_in_epoch() // (batch_size * accumulate)`` (equal on every rank)."""
        return self._count(self.offset) - self.start

    def state_dict(self, consumed: int | None = None) -> dict:
        """Position to resume from: ``{"epoch", "start", "offset", "size", "world_size", "seed", "shuffle",
        "drop_last", "window", "sharded"}``.

        Args:
            consumed: indices of the current iteration that the training loop has actually used (e.g. batches
                done x batch size). Default: all the indices this sampler has handed out.
        A finished epoch is recorded as the start of the next one.
        """
        pos = self.start + (self._yielded if consumed is None else int(consumed))
        epoch, offset = self.epoch, self.offset
        if pos >= self._count(offset) and (self._count(offset) or offset):
            epoch, pos, offset = epoch + 1, 0, 0
        return {"epoch": epoch, "start": pos, "offset": offset, "size": self.size, "world_size": self.world_size,
                "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last, "window": self.window,
                "sharded": self.shards is not None}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict`'s position, at this sampler's world size.

        Same world size: the rest of the epoch is exactly what an uninterrupted run reads. Another world size
        (e.g. 2 -> 1 or 1 -> 2 after an elastic restart): the samples of the interrupted epoch consumed by all
        ranks together are the prefix ``order[:offset + start * saved_world_size]`` of its global order; the
        rest of that prefix-free order is spread over the new ranks (each sample not yet consumed is seen
        exactly once, apart from the up to ``world_size - 1`` last ones that ``drop_last`` leaves out, as in
        every epoch), and later epochs are the normal function of ``(seed, epoch, world_size)``. Use
        `remaining_in_epoch` for the number of iterations left in that epoch.

        Raises:
            ValueError: the state was made with another size, seed, shuffle, drop_last, window or shard-awareness
                (the order would differ, so resuming would not reproduce it).
        """
        mine = {"size": self.size, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "window": self.window, "sharded": self.shards is not None}
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler {value!r}")
        epoch, start, offset = int(state["epoch"]), int(state["start"]), int(state.get("offset", 0))
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world != self.world_size:
            offset, start = min(self.size, offset + start * saved_world), 0
            if self._count(offset) == 0:
                epoch, offset = epoch + 1, 0
        self.set_epoch(epoch, start, offset)
