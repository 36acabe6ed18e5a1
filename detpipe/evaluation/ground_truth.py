"""The val ground truth for COCO evaluation, rebuilt from the convert stage's Arrow shards (original pixels):
`gt_from_arrow`, read by the evaluate stage and training's eval hook; scoring is
`detpipe.evaluation.coco_metrics.coco_evaluate`."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from detpipe.data.meta import arrow_shards
from detpipe.core.errors import StageError


def gt_from_arrow(split_dir: Path, meta: dict) -> dict:
    """Rebuild a COCO instances dict (images, annotations, categories) from converted Arrow shards.

    Boxes are ``[x, y, w, h]`` original pixels (float32 in Arrow), ``segmentation`` is parsed back from its
    JSON text (omitted when empty), ids are int64.

    Args:
        split_dir: the split's folder (``data/arrow/val``); its shards are those ``meta`` lists
            (`detpipe.data.meta.arrow_shards`).
        meta: the convert stage's ``meta.json`` (`detpipe.data.meta.read_meta`).
    Raises:
        StageError: no shards listed for the split, or a listed shard missing.
    """
    shards = arrow_shards(split_dir, meta)
    if not shards:
        raise StageError(f"{split_dir}: no Arrow shards found (run the convert stage first)")
    images, annotations = [], []
    cols = ["image_id", "file_name", "width", "height", "ann_id", "bbox", "category_id", "iscrowd", "area",
            "segmentation"]
    for shard in shards:
        table = ipc.open_file(pa.memory_map(str(shard))).read_all().select(cols)
        for row in table.to_pylist():
            images.append({"id": row["image_id"], "file_name": row["file_name"], "width": row["width"],
                           "height": row["height"]})
            for k in range(len(row["ann_id"])):
                ann = {"id": row["ann_id"][k], "image_id": row["image_id"], "category_id": row["category_id"][k],
                       "bbox": [float(v) for v in row["bbox"][k]], "area": float(row["area"][k]),
                       "iscrowd": int(row["iscrowd"][k])}
                if row["segmentation"][k]:
                    ann["segmentation"] = json.loads(row["segmentation"][k])
                annotations.append(ann)
    return {"images": images, "annotations": annotations, "categories": meta["categories"]}
