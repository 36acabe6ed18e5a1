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

With ``--plain-int8`` the plain quantizer's file (`make_plain_int8`, ``models/int8_plain/``) is timed beside the
stage's int8 (accuracy-controlled by default). ``int8_nncf`` (``models/int8_nncf/model.int8.onnx``, timed when
present) is for NNCF's own accuracy-controlled file beside the stage's onnxruntime layout of it. int8 rows give the AP drop (the larger of AP and AP50, measured in this run) and the layers
kept float (network ``Conv``/``Gemm``/``MatMul`` nodes without int8 weights, counted in the file itself).

The model where the plain quantizer fails (docs/export.md, "Proof on a model where plain int8 fails"):
``python tests/support/outliers.py FITTED DEST`` makes ``DEST`` from the learns-fitted workdir ``FITTED``; then
``python -m stages.export`` there with ``export.formats: [openvino, int8]``.

Prints one row per format and, as the last line, ``ratio: <best int8 images/s / eager images/s>`` of the whole
predict, the best among the int8 rows whose drop is within the export's ``max_ap_drop`` (goal >= 2.5 on 2 CPU
cores). ``int8_nncf`` is made by hand: docs/measurements.md says how (NNCF's file, copied aside during the export).
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
           "int8": "models/int8/model.int8.onnx", "int8_plain": "models/int8_plain/model.int8.onnx",
           "int8_nncf": "models/int8_nncf/model.int8.onnx"}
PLAIN = "int8_plain"   # made here (``--plain-int8``) from models/model.onnx: the plain quantizer beside the stage's


def make_plain_int8(workdir: Path) -> None:
    """Write ``workdir/`` ``FORMATS["int8_plain"]``: `detpipe.export.formats.quantize_int8` (onnxruntime, every
    network layer int8 but the score head) of ``models/model.onnx``, calibrated as the export stage
    calibrates (``export.calibration_images`` of the workdir's params.yaml, default when absent)."""
    import json as _json

    from detpipe.export.formats import calibration_images, quantize_int8
    from detpipe.params import Export, load

    params = workdir / "params.yaml"
    cfg = load("export", params) if params.is_file() else Export()
    raw = _json.loads((workdir / "models/export_report.json").read_text())["raw_outputs"]
    out = workdir / FORMATS[PLAIN]
    out.parent.mkdir(exist_ok=True)
    quantize_int8(workdir / FORMATS["onnx"], out, calibration_images(workdir / "data/cache", cfg.calibration_images),
                  raw)


def gate_figures(workdir: Path, fmt: str, row: dict, eager: dict | None) -> tuple[str, str, bool]:
    """(AP drop text, layers kept float text, passes the export gate's ``max_ap_drop``) of an int8 row: the drop
    is the larger of eager's AP and AP50 minus the row's, measured in this run; kept float counted in the row's
    file (`detpipe.export.quantize.float_layers` over the network's layers, `detpipe.export.formats.network_nodes`);
    the bound from ``models/export_report.json``."""
    import json as _json

    import onnx

    from detpipe.export.formats import network_nodes
    from detpipe.export.quantize import float_layers

    report = _json.loads((workdir / "models/export_report.json").read_text())
    entry = report["formats"].get("int8", {})
    limit = entry.get("accuracy", {}).get("max_ap_drop", 0.02)
    if eager is None:
        return "-", "-", False
    drop = max(eager["AP"] - row["AP"], eager["AP50"] - row["AP50"])
    network = set(network_nodes(onnx.load(str(workdir / FORMATS["onnx"])), report["raw_outputs"]))
    model = onnx.load(str(workdir / FORMATS[fmt]))   # counted in the file itself: Conv/Gemm/MatMul without int8 weights
    kept = str(len(float_layers(model, [n.name for n in model.graph.node
                                        if n.op_type in ("Conv", "Gemm", "MatMul") and n.name in network])))
    return f"{drop:.4f}", kept, drop <= limit + 1e-12


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
    ap.add_argument("--plain-int8", action="store_true",
                    help="also quantize models/model.onnx with the plain quantizer (models/int8_plain/) and time it")
    ap.add_argument("--one", choices=list(FORMATS), help=argparse.SUPPRESS)   # the child process
    ap.add_argument("--ap", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.workdir = args.workdir.resolve()
    if args.one:
        one(args)
        return

    import torch

    if args.plain_int8:
        make_plain_int8(args.workdir)
    elif PLAIN in args.formats:
        args.formats.remove(PLAIN)
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
    print(f"{'format':10} {'images/s':>9} {'model alone':>12} {'peak RSS MiB':>13} {'val AP50':>9} {'val AP':>7} "
          f"{'AP drop':>8} {'kept float':>10}  runtime")
    passing = {}
    for fmt, row in rows.items():
        drop, kept, ok = gate_figures(args.workdir, fmt, row, rows.get("eager")) if fmt.startswith("int8") \
            else ("-", "-", False)
        if ok:
            passing[fmt] = row
        print(f"{fmt:10} {row['images'] / row['seconds']:9.2f} {row['images'] / row['alone_seconds']:12.2f} "
              f"{row['peak_rss_mib']:13.0f} {row['AP50']:9.4f} {row['AP']:7.4f} {drop:>8} {kept:>10}  "
              f"{row['runtime']}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if passing and "eager" in rows:
        e = rows["eager"]
        best = min(passing, key=lambda f: passing[f]["seconds"])
        q = passing[best]
        print(f"best int8 passing its gate: {best}; vs eager: AP50 {q['AP50']:.4f} vs {e['AP50']:.4f}, AP "
              f"{q['AP']:.4f} vs {e['AP']:.4f}; model alone {e['alone_seconds'] / q['alone_seconds']:.2f}x")
        print(f"ratio: {e['seconds'] / q['seconds']:.2f}")
    else:
        print("ratio: nan (no int8 row within export.max_ap_drop, or no eager row)")


if __name__ == "__main__":
    main()
