"""Evaluate stage: COCO bbox (and, for mask models, segm) metrics of the trained model on the val split, in
original image coordinates.

``python -m stages.evaluate`` reads ``models/model.pt``, ``data/cache/val`` and ``data/arrow/val`` and writes
``metrics/eval.json`` and ``plots/`` (params section ``evaluate``; with ``evaluate.nproc_per_node > 1`` under
torchrun). The work is `detpipe.evaluation.evaluate.evaluate_or_launch` (see its module docstring).
"""
from __future__ import annotations

from detpipe.core.errors import run_program
from detpipe.evaluation.evaluate import evaluate_or_launch
from detpipe.params import load


def main() -> None:
    """``python -m stages.evaluate`` (also each torchrun worker's entry point)."""
    evaluate_or_launch(load("evaluate"), "stages.evaluate")


if __name__ == "__main__":
    run_program(main)
