"""Label statistics of the converted splits: instances per class and histograms of box width, height and aspect
ratio, counted while the convert stage writes its shards and written as DVC plots under ``plots/labels/`` (the
convert stage's ``plots:`` in dvc.yaml), so that the labels the model will be fed can be looked at before any
training (docs/convert.md, "What the model is fed").

Memory is bounded whatever the dataset's size: a `LabelStats` holds counts only (one int64 per class and per
bin), each convert worker fills one per shard from the rows it writes, and the stage sums them
(`LabelStats.merge`); no per-box list is ever kept.

What is counted: every annotation kept in the Arrow shards (crowd regions included, also counted apart), with
its stored box: float32 COCO ``[x, y, w, h]`` in original image pixels, after EXIF orientation and clipping to
the image (the convert rules). Bins (fixed, the same for every dataset, so plots of two experiments compare):

* width and height: log-spaced, two bins per octave; bin ``k`` (0 <= k < 29) holds ``SIZE_EDGES[k - 1] <= v <
  SIZE_EDGES[k]`` with ``SIZE_EDGES = 2 ** (arange(1, 29) / 2)`` (1.41 .. 16384 px); bin 0 starts at 0 and the last
  has no upper end;
* aspect ratio ``w / h``: log-spaced, four bins per octave; bin ``k`` (0 <= k < 34) holds ``RATIO_EDGES[k - 1] <=
  r < RATIO_EDGES[k]`` with ``RATIO_EDGES = 2 ** (arange(-16, 17) / 4)`` (1/16 .. 16); bin 0 starts at 0 and the
  last has no upper end.

Each plot file is ``{"<name>": [row, ...]}`` (DVC's plot data format): ``instances.json`` one row per class
(``class``, ``instances``, ``crowd``, ``images``: images with at least one instance); ``box_width.json``,
``box_height.json`` and ``aspect_ratio.json`` one row per bin (``from``: the bin's lower edge rounded for the
axis; ``from_exact`` and ``to_exact``, the exact edges, ``to_exact`` null for the last bin; ``boxes``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from detpipe.core.files import atomic_dir, atomic_write_json

SIZE_EDGES = 2.0 ** (np.arange(1, 29) / 2)
"""Upper edges of the width/height bins but the last (pixels): see the module docstring."""
RATIO_EDGES = 2.0 ** (np.arange(-16, 17) / 4)
"""Upper edges of the aspect-ratio (w / h) bins but the last: see the module docstring."""
PLOT_FILES = ("instances.json", "box_width.json", "box_height.json", "aspect_ratio.json")
"""The files `write_label_plots` writes (dvc.yaml lists them under the convert stage's ``plots:``)."""


class LabelStats:
    """Counts of one split (or one shard of it): per label 0..K (0, background, stays 0) ``instances``, ``crowd``
    and ``images``; the histograms ``width``, ``height`` (``len(SIZE_EDGES) + 1`` bins) and ``ratio``
    (``len(RATIO_EDGES) + 1`` bins). Plain numpy arrays: it pickles from a worker process to the stage."""

    def __init__(self, num_labels: int):
        self.instances = np.zeros(num_labels, np.int64)
        self.crowd = np.zeros(num_labels, np.int64)
        self.images = np.zeros(num_labels, np.int64)
        self.width = np.zeros(len(SIZE_EDGES) + 1, np.int64)
        self.height = np.zeros(len(SIZE_EDGES) + 1, np.int64)
        self.ratio = np.zeros(len(RATIO_EDGES) + 1, np.int64)

    def add_image(self, bboxes: list, labels: list, iscrowd: list) -> None:
        """Count one image's kept annotations: ``bboxes`` COCO ``[x, y, w, h]`` (the stored float32 values, w and h
        > 0), ``labels`` 1..K, ``iscrowd`` 0/1, one per box."""
        if not len(labels):
            return
        lab = np.asarray(labels, np.int64)
        wh = np.asarray(bboxes, np.float32).reshape(-1, 4)[:, 2:].astype(np.float64)
        np.add.at(self.instances, lab, 1)
        np.add.at(self.crowd, lab, np.asarray(iscrowd, np.int64) != 0)
        self.images[np.unique(lab)] += 1
        for hist, values, edges in ((self.width, wh[:, 0], SIZE_EDGES), (self.height, wh[:, 1], SIZE_EDGES),
                                    (self.ratio, wh[:, 0] / wh[:, 1], RATIO_EDGES)):
            np.add.at(hist, np.searchsorted(edges, values, side="right"), 1)

    def merge(self, other: "LabelStats") -> None:
        """Add ``other``'s counts (same number of labels)."""
        for name in ("instances", "crowd", "images", "width", "height", "ratio"):
            getattr(self, name).__iadd__(getattr(other, name))


def _bin_rows(hist: np.ndarray, edges: np.ndarray, digits: int) -> list[dict]:
    lower = np.concatenate(([0.0], edges))
    upper = [*edges.tolist(), None]
    return [{"from": round(float(lo), digits) if lo >= 10 ** -digits else round(float(lo), digits + 2),
             "from_exact": float(lo), "to_exact": hi, "boxes": int(n)}
            for lo, hi, n in zip(lower.tolist(), upper, hist.tolist())]


def plot_rows(stats: LabelStats, label_names: list[str]) -> dict[str, dict]:
    """``{file name: plot data}`` of `PLOT_FILES` (see the module docstring) for ``stats``; ``label_names[k]`` is
    label k's class name (``label_names[0]`` the background, left out)."""
    return {
        "instances.json": {"instances": [
            {"class": name, "instances": int(stats.instances[k]), "crowd": int(stats.crowd[k]),
             "images": int(stats.images[k])} for k, name in enumerate(label_names) if k > 0]},
        "box_width.json": {"box_width": _bin_rows(stats.width, SIZE_EDGES, 1)},
        "box_height.json": {"box_height": _bin_rows(stats.height, SIZE_EDGES, 1)},
        "aspect_ratio.json": {"aspect_ratio": _bin_rows(stats.ratio, RATIO_EDGES, 3)},
    }


def write_label_plots(folder: Path | str, stats: LabelStats, label_names: list[str]) -> None:
    """Replace ``folder`` (``plots/labels``) atomically with the `PLOT_FILES` of ``stats``."""
    with atomic_dir(Path(folder)) as tmp:
        for name, data in plot_rows(stats, label_names).items():
            atomic_write_json(tmp / name, data)
