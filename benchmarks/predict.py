"""Benchmark: `detpipe.predict` with every exported format (ONNX float and int8 with onnxruntime, OpenVINO IR with
OpenVINO's CPU runtime) vs the eager PyTorch model.pt, on the CPU, same images, same batch size, same run.

Each format predicts over the same folder (default ``data/coco128/train2017``, 128 images) with the files of
``--workdir`` (``models/model.pt``, ``models/model.onnx``, ``models/openvino/model.xml``,
``models/int8/model.int8.onnx``: a run with ``export.formats: [openvino, int8]``; a missing file's row says so),
which also gives ``data/arrow`` and ``data/cache``'s meta files; the command's defaults otherwise (score threshold
0.25, drawn images written to a temporary folder). Every (format, repeat) runs in its own process, the formats
alternating within each of the ``--repeats`` rounds: one warm-up predict on 8 images, then the timed predict of
the folder (the fastest of the rounds counts), then the model alone (`detpipe.predict.load_runner`'s runner over
the prepared images, decoding excluded) and, in the first round, COCO AP50 and AP on the workdir's val split
(``data/cache/val`` against ``data/arrow/val``: `detpipe.export.formats.val_results` and `coco_ap`, the export
stage's accuracy gate's scoring; for the learns-fitted model these are its 4 training images). Peak RSS is the
process's ``ru_maxrss`` (the largest of its rounds), model load and all.

    python -m benchmarks.predict [--workdir .] [--source data/coco128/train2017] [--batch-size 8] [--repeats 2]

The learns-fitted model (docs/benchmarks.md's second figure): ``--workdir`` a copy of the ``fitted_workdir`` test
fixture's folder (tests/conftest.py) after ``python -m stages.export`` there.

Prints one row per format and, as the last line, ``ratio: <best int8 images/s / eager images/s>`` of the whole
predict (goal >= 2.5 on 2 CPU cores, with the int8 AP drop within ``export.max_ap_drop``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = {"eager": "models/model.pt", "onnx": "models/model.onnx", "openvino": "models/openvino/model.xml",
           "int8": "models/int8/model.int8.onnx"}


def model_only(model: Path, images: list, batch_size: int) -> float:
    """Seconds for `load_runner`'s runner of ``model`` over ``images`` in batches of ``batch_size`` (one warm-up
    batch first, not timed)."""
    from detpipe.predict import load_runner

    run, _, _ = load_runner(model)
    run(images[:batch_size])
    t0 = time.perf_counter()
    for i in range(0, len(images), batch_size):
        run(images[i:i + batch_size])
    return time.perf_counter() - t0


def val_ap(model: Path, workdir: Path) -> dict:
    """COCO ``{"AP", "AP50"}`` (0-1) of ``model`` on ``workdir``'s val split, one image per call, scored as the
    export stage's accuracy gate scores (`detpipe.export.formats`)."""
    import torch

    from detpipe.data.dataset import CachedDetectionDataset
    from detpipe.data.meta import read_meta
    from detpipe.evaluation.detections import label_to_category_id
    from detpipe.evaluation.ground_truth import gt_from_arrow
    from detpipe.export.formats import coco_ap
    from detpipe.predict import load_runner

    run, _, _ = load_runner(model)
    meta = read_meta(workdir / "data/arrow/meta.json", "convert")
    l2c = label_to_category_id(meta)
    val = CachedDetectionDataset(workdir / "data/cache", "val")
    from detpipe.evaluation.detections import image_detections

    results = []
    with torch.inference_mode():
        for i in range(len(val)):
            image, t = val[i]
            det = run([image])[0]
            results += image_detections(det, int(t["image_id"]), l2c, t["scale"], t["orig_size"], t["offset"], 0.0,
                                        masks=False, dtype=torch.float32)
    return coco_ap(results, gt_from_arrow(workdir / "data/arrow/val", meta), str(model))


def one(args) -> None:
    """The child process: one format, one round; prints one JSON line."""
    from detpipe.predict import data_meta, list_sources, predict, prepare

    model = args.workdir / FORMATS[args.one]
    data = args.workdir / "data"
    files = list_sources(args.source)
    out: dict = {"format": args.one}
    with tempfile.TemporaryDirectory(prefix="detpipe-bench-predict-") as tmp:
        warm = Path(tmp) / "warm"
        warm.mkdir()
        for f in files[:8]:
            (warm / f.file_name).write_bytes(f.read())
        predict(str(warm), model, Path(tmp) / "out-warm", batch_size=args.batch_size, data_dir=data)
        report = predict(args.source, model, Path(tmp) / "out", batch_size=args.batch_size, data_dir=data)
    out.update(seconds=report["seconds"], images=report["num_images"], detections=report["num_detections"],
               runtime=report["runtime"])
    _, cfg = data_meta(data)
    inputs = [prepare(f.read(), f.file_name, cfg).image for f in files]
    out["alone_seconds"] = model_only(model, inputs, args.batch_size)
    if args.ap:
        out.update(val_ap(model, args.workdir))
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT, help="folder with models/ and data/ of a pipeline run")
    ap.add_argument("--source", default=str(ROOT / "data" / "coco128" / "train2017"))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per format; the fastest counts")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--one", choices=list(FORMATS), help=argparse.SUPPRESS)   # the child process
    ap.add_argument("--ap", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.workdir = args.workdir.resolve()
    if args.one:
        one(args)
        return

    import torch

    formats = [f for f in args.formats if (args.workdir / FORMATS[f]).is_file()]
    for f in args.formats:
        if f not in formats:
            print(f"{f}: {args.workdir / FORMATS[f]} missing (export with export.formats: [openvino, int8])")
    print(f"{args.source}; batch {args.batch_size}; torch threads {torch.get_num_threads()}, CPUs {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: dict[str, dict] = {}
    for r in range(args.repeats):
        for fmt in formats:
            cmd = [sys.executable, "-m", "benchmarks.predict", "--one", fmt, "--workdir", str(args.workdir),
                   "--source", args.source, "--batch-size", str(args.batch_size), *(["--ap"] if r == 0 else [])]
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  round {r + 1} {fmt}: {got['images']} images in {got['seconds']:.2f} s "
                  f"({got['images'] / got['seconds']:.2f} images/s), {got['detections']} detections", flush=True)
            row = rows.setdefault(fmt, got)
            for key in ("seconds", "alone_seconds"):
                row[key] = min(row[key], got[key])
            row["peak_rss_mib"] = max(row["peak_rss_mib"], got["peak_rss_mib"])
    print(f"{'format':9} {'images/s':>9} {'model alone':>12} {'peak RSS MiB':>13} {'val AP50':>9} {'val AP':>7}  runtime")
    for fmt, row in rows.items():
        print(f"{fmt:9} {row['images'] / row['seconds']:9.2f} {row['images'] / row['alone_seconds']:12.2f} "
              f"{row['peak_rss_mib']:13.0f} {row['AP50']:9.4f} {row['AP']:7.4f}  {row['runtime']}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if "int8" in rows and "eager" in rows:
        e, q = rows["eager"], rows["int8"]
        print(f"int8 vs eager: AP50 {q['AP50']:.4f} vs {e['AP50']:.4f}, AP {q['AP']:.4f} vs {e['AP']:.4f}; "
              f"model alone {e['alone_seconds'] / q['alone_seconds']:.2f}x")
        print(f"ratio: {e['seconds'] / q['seconds']:.2f}")
    else:
        print("ratio: nan (no int8 or no eager row)")


if __name__ == "__main__":
    main()
