"""Benchmark: `detpipe.predict` with the exported ONNX model (onnxruntime) vs the eager PyTorch model.pt, on the
CPU, same images, same batch size, same run.

Both runtimes predict over the same folder (default ``data/coco128/train2017``, 128 images) with the default
run's model (``models/model.onnx`` and ``models/model.pt`` of ``--workdir``, which also gives ``data/arrow`` and
``data/cache``'s meta files), the command's defaults otherwise (score threshold 0.25, drawn images written to a
temporary folder). After one warm-up run each on 8 images, the two are timed alternately ``--repeats`` times; the
fastest run of each counts. Also timed, as a second figure: the model alone (`detpipe.predict.load_runner`'s
runner over the prepared images, decoding excluded).

    python -m benchmarks.predict [--workdir .] [--source data/coco128/train2017] [--batch-size 8] [--repeats 2]

The learns-fitted model (docs/benchmarks.md's second figure): ``--workdir`` a copy of the ``fitted_workdir`` test
fixture's folder (tests/conftest.py) with ``models/model.onnx`` written by `detpipe.export.stage.export`.

Prints images/s of each and, as the last line, ``ratio: <onnxruntime images/s / eager images/s>`` of the whole
predict (goal >= 1.0).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from detpipe.predict import BATCH_SIZE, data_meta, list_sources, load_runner, predict, prepare  # noqa: E402


def model_only(model: Path, images: list[torch.Tensor], batch_size: int) -> float:
    """Seconds for `load_runner`'s runner of ``model`` over ``images`` in batches of ``batch_size`` (one warm-up
    batch first, not timed)."""
    run, _, _ = load_runner(model)
    run(images[:batch_size])
    t0 = time.perf_counter()
    for i in range(0, len(images), batch_size):
        run(images[i:i + batch_size])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT, help="folder with models/ and data/ of a pipeline run")
    ap.add_argument("--source", default=str(ROOT / "data" / "coco128" / "train2017"))
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per runtime; the fastest counts")
    args = ap.parse_args()

    models = {"onnxruntime": args.workdir / "models" / "model.onnx", "eager": args.workdir / "models" / "model.pt"}
    data = args.workdir / "data"
    files = list_sources(args.source)
    print(f"{len(files)} files from {args.source}; batch {args.batch_size}; torch threads "
          f"{torch.get_num_threads()}, CPUs {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="detpipe-bench-predict-") as tmp:
        warm = Path(tmp) / "warm"
        warm.mkdir()
        for f in files[:8]:
            (warm / f.file_name).write_bytes(f.read())
        for name, model in models.items():
            predict(str(warm), model, Path(tmp) / f"out-{name}", batch_size=args.batch_size, data_dir=data)
        best = {name: float("inf") for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                report = predict(args.source, model, Path(tmp) / f"out-{name}", batch_size=args.batch_size,
                                 data_dir=data)
                best[name] = min(best[name], report["seconds"])
                print(f"{name}: {report['num_images']} images in {report['seconds']:.2f} s "
                      f"({report['num_images'] / report['seconds']:.2f} images/s), "
                      f"{report['num_detections']} detections", flush=True)
    n = len(files)
    _, cfg = data_meta(data)
    inputs = [prepare(f.read(), f.file_name, cfg).image for f in files]
    alone = {name: model_only(model, inputs, args.batch_size) for name, model in models.items()}
    for name in models:
        print(f"{name}: predict {n / best[name]:.2f} images/s (best of {args.repeats}); model alone "
              f"{n / alone[name]:.2f} images/s")
    print(f"model alone ratio: {alone['eager'] / alone['onnxruntime']:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"ratio: {best['eager'] / best['onnxruntime']:.2f}")


if __name__ == "__main__":
    main()
