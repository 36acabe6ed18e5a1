"""Benchmark: COCO evaluation with faster_coco_eval vs the pycocotools reference, same data, same run.

The COCO API's example detections for 100 val2014 images (tests/data/coco_eval_reference) are replicated
``--copies`` times (default 50: 5,000 images, 41,950 ground-truth objects, 36,700 detections) with new image and
annotation ids, then `detpipe.evaluation.coco_metrics.coco_evaluate` (validation + COCO objects + evaluate/accumulate/summarize)
is timed with each backend on the same inputs. Both backends must give the same 12 stats (to 1e-9).

    python -m benchmarks.eval [--copies 50] [--iou-type bbox] [--repeats 1]

Prints each backend's time in seconds and, as the last line, ``ratio: <faster_coco_eval s / pycocotools s>``
(goal <= 0.4).

``--analysis`` (issue 33.5): the error analysis' cost instead, at COCO val2017's size (5,000 images, ~36k boxes,
100 detections per image). The example detections (7.3 per image) are topped up to ``--per-image`` (default 100)
per image with seeded synthetic ones (half jittered copies of the image's ground-truth boxes, 70 % of those with
the right class, half random boxes; scores uniform in [0, 0.5), below the example detections' typical scores), then
the evaluate stage's two steps are timed on the same inputs: `coco_evaluate` (the stage's default backend,
faster_coco_eval: validation, COCO objects, evaluate/accumulate/summarize) and
`detpipe.evaluation.error_analysis.analyze_validated` on its validated records plus writing its JSON plots (what the stage
adds: TIDE breakdown, confusion matrix, per-image errors; drawing the few worst images, a fixed cost per run, is not
included). Their AP50 must agree to 1e-9. Last line ``ratio: <(analysis + JSON plots) s / COCOeval s>``
(goal <= 0.5).

    python -m benchmarks.eval --analysis [--copies 50] [--per-image 100] [--repeats 1]
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


def top_up(gt: dict, dets: list[dict], per_image: int, seed: int = 0) -> list[dict]:
    """``dets`` plus seeded synthetic detections so that every image has ``per_image`` (`--analysis` in the module
    docstring says how they are drawn)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cats = [c["id"] for c in gt["categories"]]
    have: dict[int, int] = {}
    for d in dets:
        have[d["image_id"]] = have.get(d["image_id"], 0) + 1
    objects: dict[int, list[dict]] = {}
    for a in gt["annotations"]:
        objects.setdefault(a["image_id"], []).append(a)
    out = list(dets)
    for im in gt["images"]:
        W, H, objs = im["width"], im["height"], objects.get(im["id"], [])
        for k in range(per_image - have.get(im["id"], 0)):
            if objs and k % 2 == 0:
                a = objs[rng.integers(len(objs))]
                x, y, w, h = a["bbox"]
                j = rng.normal(0.0, 0.2, 4)
                box = [x + j[0] * w, y + j[1] * h, w * np.exp(j[2]), h * np.exp(j[3])]
                cat = a["category_id"] if rng.random() < 0.7 else cats[rng.integers(len(cats))]
            else:
                w, h = rng.uniform(5, W / 2), rng.uniform(5, H / 2)
                box = [rng.uniform(0, W - w), rng.uniform(0, H - h), w, h]
                cat = cats[rng.integers(len(cats))]
            out.append({"image_id": im["id"], "category_id": int(cat), "bbox": [float(v) for v in box],
                        "score": float(rng.uniform(0.0, 0.5))})
    return out


def analysis_ratio(gt: dict, dets: list[dict], repeats: int) -> None:
    """Time `coco_evaluate` (faster_coco_eval) and `analyze_validated` on its records; print the ratio."""
    import tempfile

    from detpipe.evaluation.error_analysis import analyze_validated
    from detpipe.evaluation.plots import write_error_plots

    best_coco = best_analysis = best_json = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = coco_evaluate(gt, dets, "bbox", "faster_coco_eval")
        best_coco = min(best_coco, time.perf_counter() - t0)
        t0 = time.perf_counter()
        a = analyze_validated(r.dataset, r.results, 0.3)
        t1 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:   # the JSON plots; no worst image drawn (a fixed few per run)
            write_error_plots(Path(tmp), a, Path(tmp) / "val", 0)
        best_analysis, best_json = min(best_analysis, t1 - t0), min(best_json, time.perf_counter() - t1)
    print(f"COCOeval (faster_coco_eval, coco_evaluate end to end): {best_coco:.3f} s  (AP50 {r.stats['AP50']:.10f})")
    print(f"error analysis (analyze_validated): {best_analysis:.3f} s  (AP50 {a.ap50:.10f}; "
          + ", ".join(f"{k} {v:.4f}" for k, v in a.delta_ap50.items()) + ")")
    print(f"its JSON plots (confusion.json: {int(a.confusion.sum())} rows, confusion_counts.json, errors.json): "
          f"{best_json:.3f} s", flush=True)
    if abs(a.ap50 - r.stats["AP50"]) > 1e-9:
        sys.exit("error: the analysis' AP50 is not COCOeval's")
    print(f"ratio: {(best_analysis + best_json) / best_coco:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=50)
    ap.add_argument("--iou-type", choices=("bbox", "segm"), default="bbox")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per backend; the fastest counts")
    ap.add_argument("--analysis", action="store_true", help="time the error analysis against COCOeval instead")
    ap.add_argument("--per-image", type=int, default=100, help="--analysis: detections per image")
    args = ap.parse_args()
    if args.analysis:
        gt0 = json.loads((REF / "gt/instances_val2014_100.json").read_text())
        dt0 = json.loads((REF / "cocoapi/results/instances_val2014_fakebbox100_results.json").read_text())
        gt, dets = replicate(gt0, dt0, args.copies)
        dets = top_up(gt, dets, args.per_image)
        coco_evaluate(gt0, dt0)  # warm-up: imports, caches
        print(f"{len(gt['images'])} images, {len(gt['annotations'])} ground-truth objects, {len(dets)} detections, "
              f"bbox", flush=True)
        analysis_ratio(gt, dets, args.repeats)
        return

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
