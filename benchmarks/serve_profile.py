"""Benchmark: where the serve command's CPU time goes per image, at one image per model call against
``--batch-size`` images per call, same model, same images, same run (interleaved repeats), and what that leaves
batching to gain: the ceiling of ``python -m benchmarks.serve``'s ratio on a CPU-bound machine.

Each image of ``--images`` files of the folder (default ``data/coco128/train2017``) goes through the server's own
functions, in its order: the intake (`detpipe.serve.intake.decode`: header check, decode, predict's `prepare`),
the model call (the server's runner, `detpipe.predict.Predictor.run`: `detpipe.export.batched.feed`, onnxruntime,
`split`) on batches of 1 and of ``--batch-size`` images, and the answer (`detpipe.predict.Predictor.results`, then
the JSON encoding Starlette's ``JSONResponse`` does). Every stage is timed in CPU seconds of the process
(``time.process_time``: all its threads, so onnxruntime's intra-op threads count, their spin-waiting included) and in
wall seconds; the batch-1 and batched model calls alternate, ``--repeats`` rounds, the fastest round of each counts.

On a machine whose cores the server keeps busy (8 clients on 2 cores), served images/s is about cores / CPU seconds
per image, so the most batching can give is

    ceiling = (intake + model at batch 1 + answer) / (intake + model at batch B + answer)   (CPU ms per image)

HTTP, the event loop and the thread hand-offs add the same per-image time to both sides and only lower it. The last
line is ``ratio: <ceiling>``; the model call's own ratio (batch 1 / batch B, CPU per image) is printed before it.

    python -m benchmarks.serve_profile [--workdir .] [--model models/model.onnx] [--images 32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import add_model_args  # noqa: E402

from detpipe.predict import BATCH_SIZE, list_sources, load_predictor  # noqa: E402
from detpipe.serve.intake import decode  # noqa: E402


def timed(fn) -> tuple[float, float, object]:
    """``(CPU seconds of the process, wall seconds, fn())``."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, ROOT)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="the batched side's images per model call")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    predictor = load_predictor(args.workdir / args.model, args.workdir / "data")
    files = list_sources(args.source)[:args.images]
    n, b = len(files), args.batch_size
    print(f"{n} images from {args.source}; model {args.model}: {predictor.runtime}; batch {b}; CPUs {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    bodies = [(f.file_name, f.read()) for f in files]
    intake = lambda: [decode(data, name, predictor.cfg, 40_000_000) for name, data in bodies]  # noqa: E731
    prepared = intake()
    images = [p[0] for p in prepared]
    predictor.run(images[:1])
    predictor.run(images[:b])                                                   # warm-up, both shapes
    per_image = lambda: [predictor.run([im])[0] for im in images]              # noqa: E731
    batched = lambda: [d for i in range(0, n, b) for d in predictor.run(images[i:i + b])]  # noqa: E731
    dets = per_image()

    def answer():
        for det, (_, scale, orig), (name, _) in zip(dets, prepared, bodies):
            json.dumps(predictor.results(det, (scale, orig), 1, name), ensure_ascii=False, allow_nan=False,
                       separators=(",", ":")).encode()

    best: dict[str, tuple[float, float]] = {}
    for r in range(args.repeats):
        for stage, fn in (("intake", intake), ("model, batch 1", per_image), (f"model, batch {b}", batched),
                          ("answer", answer)):
            cpu, wall, _ = timed(fn)
            cpu, wall = cpu / n * 1000, wall / n * 1000
            print(f"round {r + 1}: {stage}: {cpu:.1f} CPU ms/image, {wall:.1f} wall ms/image", flush=True)
            if stage not in best or cpu < best[stage][0]:
                best[stage] = (cpu, wall)
    print(f"load average {os.getloadavg()[0]:.2f} after")
    print("| stage | CPU ms/image | wall ms/image |")
    print("|---|---|---|")
    for stage, (cpu, wall) in best.items():
        print(f"| {stage} | {cpu:.1f} | {wall:.1f} |")
    one, many = best["model, batch 1"][0], best[f"model, batch {b}"][0]
    rest = best["intake"][0] + best["answer"][0]
    print(f"model call alone, CPU per image, batch 1 / batch {b}: {one / many:.2f}")
    print(f"share of the model call in an image's CPU time at batch 1: {one / (one + rest):.0%}")
    print(f"served images/s ceiling, batch {b} / batch 1 (CPU per image, batch 1 / batch {b}):")
    print(f"ratio: {(rest + one) / (rest + many):.2f}")


if __name__ == "__main__":
    main()
