"""Where the pipeline's data and outputs live, relative to the repository root (the stages run from there).

These are the paths ``dvc.yaml`` lists as each stage's deps and outs; keep the two in step.
"""
from __future__ import annotations

import re
from pathlib import Path

SOURCE_DIR = Path("data/coco128")        # the embedded demo dataset (download.source default)
RAW_DIR = Path("data/raw")               # download -> convert
ARROW_DIR = Path("data/arrow")           # convert -> augment, evaluate, export
ARROW_META = ARROW_DIR / "meta.json"
CACHE_DIR = Path("data/cache")           # augment -> train, evaluate, export
CKPT_DIR = Path("checkpoints")           # train (persisted across runs: resume)
MODELS_DIR = Path("models")
MODEL = MODELS_DIR / "model.pt"          # train -> evaluate, export
LIVE_DIR = Path("dvclive")               # train metrics and plots
METRICS = Path("metrics/eval.json")      # evaluate -> export (model card)
EXPORT_METRICS = Path("metrics/export.json")  # export: each format's gate result (dvc exp show)
PLOTS = Path("plots")
LABEL_PLOTS = PLOTS / "labels"            # convert: label statistics of the train split (DVC plots)
TRAIN_BATCH_PLOT = PLOTS / "train_batch.png"  # train: the first training batch, drawn (DVC image plot)


_CKPT_RE = re.compile(r"^ckpt-(\d{7})\.pt$")


def checkpoint_path(directory: Path | str, done: int) -> Path:
    """``<directory>/ckpt-NNNNNNN.pt`` for ``done`` completed iterations (7 digits, zero-padded)."""
    return Path(directory) / f"ckpt-{done:07d}.pt"


def list_checkpoints(directory: Path | str) -> list[Path]:
    """Checkpoint files ``ckpt-NNNNNNN.pt`` in ``directory``, oldest iteration first ([] if no directory). Here, not in
    `detpipe.engine.checkpoints` (which re-exports it), because the launcher reads the folder too
    (`detpipe.warm_start`)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _CKPT_RE.match(p.name)),
                  key=lambda p: int(_CKPT_RE.match(p.name).group(1)))
