"""The train/val split of every format: image ids sorted, then a seeded permutation's first ``val_fraction``
go to val (`val_positions`, `split_ids`); the convert stage applies it to any dataset without its own val split."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from detpipe.core.errors import StageError


def val_positions(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Positions (ascending, int64) among ``n`` sorted image ids that go to val: the first
    ``round(n * val_fraction)`` of ``numpy.random.default_rng(seed).permutation(n)``.

    Raises:
        StageError: ``seed`` is negative.
    """
    if seed < 0:
        raise StageError(f"convert.seed must be >= 0 (got {seed})")
    return np.sort(np.random.default_rng(seed).permutation(n)[:round(n * val_fraction)]).astype(np.int64)


def split_ids(ids: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/val split of image ids: sorted, then `val_positions` go to val.

    Returns:
        (train_ids, val_ids), each sorted ascending.
    Raises:
        StageError: ``seed`` is negative.
    """
    ids = sorted(ids)
    val = np.zeros(len(ids), bool)
    val[val_positions(len(ids), val_fraction, seed)] = True
    return ([i for i, v in zip(ids, val.tolist()) if not v], [i for i, v in zip(ids, val.tolist()) if v])
