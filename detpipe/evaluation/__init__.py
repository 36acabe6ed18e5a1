"""Evaluation: `evaluate` (the evaluate stage), `detections` (model outputs → COCO results in original pixels),
`ground_truth` (the val ground truth from the Arrow shards), `plots` and `drawing` (the stage's plots, boxes drawn),
`coco_metrics` (the COCOeval core)."""
