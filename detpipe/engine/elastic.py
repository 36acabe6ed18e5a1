"""Worker side of elastic restarts (the launcher side is `detpipe.launch.torchrun`): which epoch, and where in it,
each iteration reads when the world size may have changed at the last restart; and an optional per-rank record of
the samples each iteration trained on.

Without a world-size change iteration ``i`` reads epoch ``i // iters_per_epoch`` from sampler position
``(i % iters_per_epoch) * per_step``. After a restart at another world size the interrupted epoch is finished
first: the sampler, loaded from the checkpoint made at the old world size, yields this rank's share of the
samples that epoch had not yet consumed (``ResumableDistributedSampler.load_state_dict`` across world sizes),
which takes ``len(sampler) // per_step`` iterations; the following epochs are whole epochs at the new world
size. `EpochPlan` holds that schedule; it is rebuilt from the sampler at every resume, so nothing extra goes
into the checkpoint.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SAMPLE_LOG_ENV = "DETPIPE_SAMPLE_LOG"


@dataclass(frozen=True)
class EpochPlan:
    """Iteration -> (epoch, sampler position) for iterations ``>= start_iter``.

    Attributes:
        iters_per_epoch: iterations of a whole epoch at this world size.
        per_step: sampler indices one iteration consumes on one rank (``batch_size * accumulate``).
        start_iter: first iteration of this plan (0, or the iteration resumed from).
        epoch: epoch in progress at ``start_iter``.
        start: sampler position (this rank's indices of ``epoch`` already consumed) at ``start_iter``.
        first_iters: iterations that finish ``epoch`` from ``start_iter``.
        offset: samples of ``epoch``'s global order consumed at an earlier world size (the sampler's ``offset``;
            0 unless the world size changed at the last restart).
    """

    iters_per_epoch: int
    per_step: int
    start_iter: int = 0
    epoch: int = 0
    start: int = 0
    first_iters: int | None = None
    offset: int = 0

    def __post_init__(self):
        if self.first_iters is None:
            object.__setattr__(self, "first_iters", self.iters_per_epoch - self.start // self.per_step)

    @classmethod
    def resumed(cls, done: int, sampler, iters_per_epoch: int, per_step: int) -> "EpochPlan":
        """The plan after loading a checkpoint made after ``done`` iterations into ``sampler`` (its ``epoch``,
        ``start`` and ``len()`` — the indices it still yields in that epoch — define the rest of the epoch)."""
        return cls(iters_per_epoch, per_step, done, sampler.epoch, sampler.start,
                   sampler.remaining_in_epoch() // per_step, sampler.offset)

    def locate(self, it: int) -> tuple[int, int, int]:
        """``(epoch, sampler start, offset)`` of iteration ``it`` (``>= start_iter``): pass them to
        ``sampler.set_epoch``. Raises `ValueError` for an iteration before the plan."""
        if it < self.start_iter:
            raise ValueError(f"iteration {it} is before this plan's first iteration {self.start_iter}")
        k = it - self.start_iter
        if k < self.first_iters:
            return self.epoch, self.start + k * self.per_step, self.offset
        epochs, pos = divmod(k - self.first_iters, self.iters_per_epoch)
        return self.epoch + 1 + epochs, pos * self.per_step, 0

    def max_iter(self, epochs: int) -> int:
        """Iteration count at the end of epoch ``epochs - 1`` (``epochs * iters_per_epoch`` without a change of
        world size); ``start_iter`` when the plan starts at or after that end (a completed run resumed from its
        last checkpoint, whose sampler already points at epoch ``epochs``, trains nothing more)."""
        if self.epoch >= epochs:
            return self.start_iter
        return self.start_iter + self.first_iters + (epochs - self.epoch - 1) * self.iters_per_epoch


def record_samples(it: int, epoch: int, rank: int, world_size: int, micro: list) -> None:
    """With ``$DETPIPE_SAMPLE_LOG`` set to a folder: append one JSON line ``{"iter", "epoch", "rank", "world_size",
    "image_ids"}`` for this iteration's micro-batches to ``<folder>/rank<rank>-pid<pid>.jsonl`` (an audit of which
    samples each rank trained on; the elastic tests use it). A no-op otherwise."""
    folder = os.environ.get(SAMPLE_LOG_ENV)
    if not folder:
        return
    ids = [int(t["image_id"]) for _, targets in micro for t in targets]
    row = {"iter": it, "epoch": epoch, "rank": rank, "world_size": world_size, "image_ids": ids}
    with open(Path(folder) / f"rank{rank}-pid{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
