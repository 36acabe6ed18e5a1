"""Where the pipeline's data and outputs live, relative to the repository root (the stages run from there).

These are the paths ``dvc.yaml`` lists as each stage's deps and outs; keep the two in step.
"""
from __future__ import annotations

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
PLOTS = Path("plots")
LABEL_PLOTS = PLOTS / "labels"            # convert: label statistics of the train split (DVC plots)
TRAIN_BATCH_PLOT = PLOTS / "train_batch.png"  # train: the first training batch, drawn (DVC image plot)
