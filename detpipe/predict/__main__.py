"""``python -m detpipe.predict SOURCE [options]``: the command line of `detpipe.predict.predict` (``--help``)."""
from __future__ import annotations

import argparse

from detpipe.core.errors import run_program
from detpipe.predict import BATCH_SIZE, DEFAULT_DATA, DEFAULT_MODEL, DEFAULT_OUT, SCORE_THRESHOLD, predict


def main(argv: list[str] | None = None) -> None:
    """``python -m detpipe.predict``: parse the command line (``--help``) and run `detpipe.predict.predict`."""
    parser = argparse.ArgumentParser(
        prog="python -m detpipe.predict",
        description="Run the exported (ONNX, default; int8 ONNX; OpenVINO .xml) or trained (model.pt) detector on "
                    "images; write COCO "
                    "results JSON (original-image pixels, the dataset's category ids) and drawn images.")
    parser.add_argument("source", metavar="SOURCE",
                        help="image file, folder, glob (quoted), http(s):// URL of an image, or s3:// file/prefix/glob")
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="models/model.onnx or models/int8/model.int8.onnx (onnxruntime), models/openvino/model.xml "
                             f"(OpenVINO) or models/model.pt (eager PyTorch), chosen by the file; default {DEFAULT_MODEL}")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help=f"output folder: predictions.json, report.json, images/ (default {DEFAULT_OUT})")
    parser.add_argument("--score-threshold", type=float, default=SCORE_THRESHOLD,
                        help=f"keep detections with at least this score, in [0, 1] (default {SCORE_THRESHOLD})")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                        help=f"images decoded and run together (default {BATCH_SIZE})")
    parser.add_argument("--data", default=str(DEFAULT_DATA),
                        help="the pipeline's data folder with arrow/meta.json (category ids and names) and "
                             f"cache/meta.json (resize rule) (default {DEFAULT_DATA})")
    parser.add_argument("--no-draw", action="store_true", help="do not write images/ (JSON only)")
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for s3:// sources")
    args = parser.parse_args(argv)
    predict(args.source, args.model, args.out, args.score_threshold, args.batch_size, args.data,
            draw_images=not args.no_draw, endpoint_url=args.endpoint_url)


if __name__ == "__main__":
    run_program(main, stage="predict")
