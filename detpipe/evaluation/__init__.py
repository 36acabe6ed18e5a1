"""Evaluation: COCO results and ground truth from the pipeline's files, plots, the COCOeval core."""
