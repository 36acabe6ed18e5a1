"""The evaluation a training runs every ``train.eval_every`` iterations (`detpipe.engine.hooks.EvalHook`): COCO bbox
stats of the model on the val cache, as the evaluate stage computes them (`detpipe.evaluation.evaluate`).

The train stage (`stages.train`) hands `make_eval_fn` to the trainer (`detpipe.engine.trainer.train`'s
``eval_fn_factory``): the engine calls whatever it is given and never imports this package.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.meta import read_meta
from detpipe.evaluation.coco_metrics import coco_evaluate
from detpipe.evaluation.detections import detect_dataset, label_to_category_id
from detpipe.evaluation.ground_truth import gt_from_arrow


def make_eval_fn(cache_dir: str | Path, arrow_meta: Path) -> Callable[[torch.nn.Module], dict[str, float]]:
    """``eval_fn(model) -> stats`` for `detpipe.engine.hooks.EvalHook`: the 12 COCO bbox stats (``{"AP": ..., "AP50":
    ..., ...}``, 0..1) of ``model`` on the val split of the cache ``cache_dir`` (a folder or a cache URL), against
    the ground truth of the converted data beside ``arrow_meta`` (``data/arrow/meta.json`` -> ``data/arrow/val``).
    Bbox stats only: a mask model's masks are not encoded here.

    Raises:
        StageError: missing or unreadable val data (`detpipe.data.meta.read_meta`, the cache reader).
    """
    meta = read_meta(arrow_meta)
    gt = gt_from_arrow(Path(arrow_meta).parent / "val", meta)
    dataset = CachedDetectionDataset(cache_dir, "val")
    l2c = label_to_category_id(meta)

    def eval_fn(model):
        return coco_evaluate(gt, detect_dataset(model, dataset, l2c, device=next(model.parameters()).device,
                                                masks=False)).stats

    return eval_fn
