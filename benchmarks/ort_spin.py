"""Benchmark: CPU time of the exported model's onnxruntime call per image with the intra-op threads spin-waiting
(onnxruntime's default) against sleeping (``session.intra_op.allow_spinning = 0``, what `detpipe.predict.load_runner`
sets), at one image per call and at ``--batch-size`` images per call, same file, same images, same run.

The images are the serve command's (`detpipe.serve.intake.decode` of ``--images`` files of the folder, fed as the
runner feeds them: `detpipe.export.batched.feed`). Three sessions (default threads spinning; default threads not
spinning; one intra-op thread) run the same calls, interleaved, ``--repeats`` rounds; the fastest round counts. CPU
time is the process's (``time.process_time``: every thread, spin-waiting included), in ms per image; wall time too.
The last line is ``ratio: <CPU per image spinning / not spinning, one image per call>`` (> 1: spinning burns CPU
that the server's decoding threads could use).

    python -m benchmarks.ort_spin [--workdir .] [--model models/model.onnx] [--images 32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import add_model_args  # noqa: E402

import onnxruntime as ort  # noqa: E402

from detpipe.export.batched import graph_size, feed  # noqa: E402
from detpipe.predict import BATCH_SIZE, list_sources, load_predictor  # noqa: E402
from detpipe.serve.intake import decode  # noqa: E402


def session(path: Path, spin: bool, threads: int = 0) -> ort.InferenceSession:
    """A CPU session of ``path``: intra-op threads spinning or not; ``threads`` of them (0: onnxruntime's default,
    one per physical core)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, ROOT)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    path = args.workdir / args.model
    predictor = load_predictor(path, args.workdir / "data")
    files = list_sources(args.source)[:args.images]
    images = [decode(f.read(), f.file_name, predictor.cfg, 40_000_000)[0] for f in files]
    n, b = len(images), args.batch_size
    sessions = {"default threads, spinning": session(path, True), "default threads, not spinning": session(path, False),
                "1 thread": session(path, False, 1)}
    first = next(iter(sessions.values()))
    size = graph_size([(i.name, i.shape) for i in first.get_inputs()])
    calls = {1: [feed([im], size) for im in images]}
    if size is not None:
        calls[b] = [feed(images[i:i + b], size) for i in range(0, n, b)]
    print(f"{n} images; {path}; graph input {size or 'one image'}; CPUs {os.cpu_count()}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for s in sessions.values():
        for fed in calls.values():
            s.run(None, fed[0])                                   # warm-up, each shape
    for r in range(args.repeats):
        for name, s in sessions.items():
            for per_call, fed in calls.items():
                c0, w0 = time.process_time(), time.perf_counter()
                for f in fed:
                    s.run(None, f)
                cpu, wall = (time.process_time() - c0) / n * 1000, (time.perf_counter() - w0) / n * 1000
                print(f"round {r + 1}: {name}, {per_call} per call: {cpu:.1f} CPU ms/image, {wall:.1f} wall ms/image",
                      flush=True)
                best[name, per_call] = min(best.get((name, per_call), (cpu, wall)), (cpu, wall))
    print(f"load average {os.getloadavg()[0]:.2f} after")
    print("| session | images per call | CPU ms/image | wall ms/image |")
    print("|---|---|---|---|")
    for (name, per_call), (cpu, wall) in best.items():
        print(f"| {name} | {per_call} | {cpu:.1f} | {wall:.1f} |")
    print("CPU per image at one image per call, spinning / not spinning:")
    print(f"ratio: {best['default threads, spinning', 1][0] / best['default threads, not spinning', 1][0]:.2f}")


if __name__ == "__main__":
    main()
