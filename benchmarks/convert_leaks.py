"""Benchmark: what the near-duplicate leak check costs the convert stage (``convert.leaks: report``, the default,
against ``off``; rule ``val_near_duplicate``, docs/convert.md "Near-duplicate leaks").

The data: a COCO128 replica of ``--images`` images (`benchmarks.convert.build_replica`: the 128 COCO128 files
copied under new names and ids, each with a JPEG comment naming it, so no two files are equal), split as
params.yaml says (val_fraction 0.2). Every val image has same-pixel twins in train (distance 0: all are listed
and kept, which costs the same as checking distinct images: each val image is compared with every train image
either way).

Each convert is ``python -c <convert>`` in a fresh process (as ``python -m stages.convert`` runs it: module imports,
the worker pool, ImageHash's import when the check is on) with params.yaml's convert section (workers, shard_mb,
val_fraction, seed) and ``leaks`` off or report; the runs alternate (off, report, off, ...), page cache warm, best
of ``--repeat`` per mode. Printed: seconds per image of each mode (best run / images; also the CPU time of the
process and its workers, user + system, which a shared machine's load moves less), the difference per image,
and, measured in this process on the 128 distinct COCO128 files, the hashing cost per image
(`detpipe.data.imageio.inspect` with ``phash=True`` minus without: the two pHashes on the 1/8-scale decode the
check makes anyway) and the comparison cost per val image (`detpipe.data.leaks.nearest_train`) against this
run's train images and against 118,287 random hashes (COCO train2017's size).

Last line: ``ratio: X`` = report seconds / off seconds (best runs).

    python -m benchmarks.convert_leaks [--images 4096] [--repeat 4]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.convert import ANN, CONVERT_CODE, build_replica, warm  # noqa: E402
from detpipe.params import Convert, load  # noqa: E402

COCO_TRAIN2017 = 118_287


def run_convert(raw: Path, out: Path, params: Convert) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system of the process and its workers) of one convert of ``raw`` into
    ``out`` in a fresh process (output removed afterwards)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", CONVERT_CODE, str(raw), str(out), params.model_dump_json()], cwd=REPO,
                   env=env, check=True, capture_output=True)
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out)
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def hashing_ms(rounds: int = 5) -> tuple[float, float, float]:
    """(ms per image of `inspect` without and with ``phash``, their difference), best of ``rounds``, on the 128
    COCO128 files (bytes in memory)."""
    from detpipe.data.imageio import inspect, preload_phash

    preload_phash()
    datas = [p.read_bytes() for p in sorted((REPO / "data/coco128/train2017").glob("*.jpg"))]
    best = {False: float("inf"), True: float("inf")}
    for _ in range(rounds):
        for phash in (False, True):                 # alternating: both see the same load
            t = time.perf_counter()
            for data in datas:
                inspect(data, phash=phash)
            best[phash] = min(best[phash], (time.perf_counter() - t) / len(datas) * 1e3)
    return best[False], best[True], best[True] - best[False]


def nearest_us(n_train: int, queries: int = 200) -> float:
    """Microseconds per val image of `nearest_train` against ``n_train`` random train hash pairs (memory-mapped,
    as the val workers read them)."""
    from detpipe.data.leaks import LeakCheck, load_leak_check, nearest_train

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench-leaks-") as folder:
        np.save(f"{folder}/keys.npy", np.sort(rng.integers(-2**63, 2**63 - 1, n_train, dtype=np.int64)))
        np.save(f"{folder}/rows.npy", np.stack([np.arange(n_train), np.zeros(n_train, np.int64),
                                                np.ones(n_train, np.int64)], axis=1))
        np.save(f"{folder}/names.npy", np.frombuffer(b"x", np.uint8))
        np.save(f"{folder}/phash.npy", rng.integers(0, 2**64 - 1, (2, n_train), dtype=np.uint64, endpoint=True))
        leak = LeakCheck(folder, folder)
        tables = load_leak_check(leak)
        hashes = [tuple(int(v) for v in rng.integers(0, 2**63, 2)) for _ in range(queries)]
        nearest_train(leak, tables, hashes[0])
        t = time.perf_counter()
        for h in hashes:
            nearest_train(leak, tables, h)
        return (time.perf_counter() - t) / queries * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=4096, help="images of the replica")
    ap.add_argument("--repeat", type=int, default=4, help="runs per mode (best counts)")
    ap.add_argument("--tmp", default=None, help="folder for the replica (default: system temp)")
    args = ap.parse_args()
    base = load("convert", REPO / "params.yaml")
    params = Convert(annotations=ANN, images="train2017", val_fraction=base.val_fraction, seed=base.seed,
                     shard_mb=base.shard_mb, workers=base.workers, leak_distance=base.leak_distance)
    print(f"load before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-convert-leaks-", dir=args.tmp) as tmp:
        tmp = Path(tmp)
        raw = build_replica(tmp / "replica", args.images)
        warm(raw / "train2017")
        times: dict[str, list[float]] = {"off": [], "report": []}
        cpu: dict[str, list[float]] = {"off": [], "report": []}
        for _ in range(args.repeat):
            for mode in times:
                warm(raw / "train2017")
                wall, used = run_convert(raw, tmp / "arrow", params.model_copy(update={"leaks": mode}))
                times[mode].append(wall)
                cpu[mode].append(used)
        n_val = round(args.images * params.val_fraction)
        n_train = args.images - n_val
    off, report = min(times["off"]), min(times["report"])
    print(f"images: {args.images} ({n_train} train, {n_val} val), convert.workers={params.workers}, "
          f"shard_mb={params.shard_mb}, cpu cores={os.cpu_count()}")
    for mode, best in (("off", off), ("report", report)):
        print(f"leaks {mode:>6s}: best {best:.3f} s = {best / args.images * 1e3:.3f} ms per image "
              f"({args.images / best:.1f} images/s; runs: {', '.join(f'{x:.3f}' for x in times[mode])}); CPU best "
              f"{min(cpu[mode]) / args.images * 1e3:.3f} ms per image (runs: "
              f"{', '.join(f'{x:.2f}' for x in cpu[mode])} s)", flush=True)
    print(f"report - off: {(report - off) / args.images * 1e3:.3f} ms per image of wall time "
          f"({params.workers} workers), {(min(cpu['report']) - min(cpu['off'])) / args.images * 1e3:.3f} ms of CPU")
    plain, hashed, cost = hashing_ms()
    print(f"hashing in one process (128 COCO128 files, best of 5): image check {plain:.3f} ms per image, with the "
          f"two pHashes {hashed:.3f} ms: hashing {cost:.3f} ms per image (CPU, one core)")
    print(f"comparison per val image (nearest_train): {nearest_us(n_train):.1f} us against {n_train} train images, "
          f"{nearest_us(COCO_TRAIN2017):.1f} us against {COCO_TRAIN2017} (COCO train2017's size)")
    print(f"load after: {os.getloadavg()}")
    print(f"ratio: {report / off:.3f}")


if __name__ == "__main__":
    main()
