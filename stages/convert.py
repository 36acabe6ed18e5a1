"""Convert stage: COCO instances JSON (or a YOLO dataset, ``convert.format``) + image files -> Apache Arrow IPC
shards, with a validation report.

``python -m stages.convert`` reads ``data/raw`` and writes ``data/arrow`` (params section ``convert``), and the train
split's label statistics as DVC plots under ``plots/labels/`` (`detpipe.data.label_stats`). The work,
the output's layout and schema, the split and the validation rules are `detpipe.data.convert.convert`'s (see its
module docstring).
"""
from __future__ import annotations

from detpipe.data.convert import convert
from detpipe.core.errors import run_program
from detpipe.params import load
from detpipe.core.paths import ARROW_DIR, LABEL_PLOTS, RAW_DIR


def main() -> None:
    """``python -m stages.convert``: ``data/raw`` -> ``data/arrow`` (and ``plots/labels/``) with params section
    ``convert``."""
    convert(RAW_DIR, ARROW_DIR, load("convert"), label_plots=LABEL_PLOTS)


if __name__ == "__main__":
    run_program(main)
