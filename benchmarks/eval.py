"""Benchmark: COCO evaluation with faster_coco_eval vs the pycocotools reference, same data, same run.

The COCO API's example detections for 100 val2014 images (tests/data/coco_eval_reference) are replicated
``--copies`` times (default 50: 5,000 images, 41,950 ground-truth objects, 36,700 detections) with new image and
annotation ids, then `detpipe.evaluation.coco_metrics.coco_evaluate` (validation + COCO objects + evaluate/accumulate/summarize)
is timed with each backend on the same inputs. Both backends must give the same 12 stats (to 1e-9).

    python -m benchmarks.eval [--copies 50] [--iou-type bbox] [--repeats 1]

Prints each backend's time in seconds and, as the last line, ``ratio: <faster_coco_eval s / pycocotools s>``
(goal <= 0.4).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from detpipe.evaluation.coco_metrics import STAT_NAMES, coco_evaluate  # noqa: E402

REF = ROOT / "tests" / "data" / "coco_eval_reference"


def replicate(gt: dict, dets: list[dict], copies: int) -> tuple[dict, list[dict]]:
    """``copies`` copies of the images, annotations and detections, copy j shifting image ids by j * 10^7 and
    annotation ids by j * 10^7 (val2014 ids are < 10^7)."""
    step = 10**7
    images, anns, out = [], [], []
    for j in range(copies):
        images += [dict(im, id=im["id"] + j * step) for im in gt["images"]]
        anns += [dict(a, id=a["id"] + j * step, image_id=a["image_id"] + j * step) for a in gt["annotations"]]
        out += [dict(d, image_id=d["image_id"] + j * step) for d in dets]
    return {"images": images, "annotations": anns, "categories": gt["categories"]}, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=50)
    ap.add_argument("--iou-type", choices=("bbox", "segm"), default="bbox")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per backend; the fastest counts")
    args = ap.parse_args()

    gt0 = json.loads((REF / "gt/instances_val2014_100.json").read_text())
    dt0 = json.loads((REF / f"cocoapi/results/instances_val2014_fake{args.iou_type}100_results.json").read_text())
    for backend in ("pycocotools", "faster_coco_eval"):  # warm-up: imports, caches
        coco_evaluate(gt0, dt0, args.iou_type, backend)
    gt, dets = replicate(gt0, dt0, args.copies)
    print(f"{len(gt['images'])} images, {len(gt['annotations'])} ground-truth objects, {len(dets)} detections, "
          f"iou_type {args.iou_type}", flush=True)

    times, stats = {}, {}
    for backend in ("pycocotools", "faster_coco_eval"):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = coco_evaluate(gt, dets, args.iou_type, backend)
            best = min(best, time.perf_counter() - t0)
        times[backend], stats[backend] = best, r.stats
        print(f"{backend}: {best:.3f} s  (AP {r.stats['AP']:.10f}, AR100 {r.stats['AR100']:.10f})", flush=True)
    worst = max(abs(stats["pycocotools"][n] - stats["faster_coco_eval"][n]) for n in STAT_NAMES)
    print(f"max |stat difference| between backends: {worst:.2e}")
    if worst > 1e-9:
        sys.exit("error: backends disagree by more than 1e-9")
    print(f"ratio: {times['faster_coco_eval'] / times['pycocotools']:.4f}")


if __name__ == "__main__":
    main()
