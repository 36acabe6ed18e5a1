"""Training images/s with 2 DDP processes ÷ 1 process on CPU (gloo), one thread each, same run. Goal ≥ 1.8.

Runs the real train stage (``python -m stages.train`` → torchrun) on COCO128's cache, reads the per-step
``images_per_s`` DVCLive logs (each step's images over its wall time, forward + backward incl. gradient
all-reduce + optimizer step) and compares the medians after ``--warmup`` steps.
Usage: ``python -m benchmarks.ddp_scaling``.
"""
from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import subprocess
import sys

from benchmarks._workdir import temporary_workdir, env, write_params


def images_per_s(work, nproc: int, epochs: int, batch: int, warmup: int) -> float:
    for d in ("checkpoints", "dvclive", "models"):
        shutil.rmtree(work / d, ignore_errors=True)
    write_params(work, {"nproc_per_node": nproc, "threads": 1, "epochs": epochs, "batch_size": batch,
                        "checkpoint_every": 1000})
    subprocess.run([sys.executable, "-m", "stages.train"], cwd=work, env=env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(work / "dvclive/plots/metrics/train/images_per_s.tsv") as f:
        rows = [float(r["images_per_s"]) for r in csv.DictReader(f, delimiter="\t")]
    return statistics.median(rows[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8, help="per process")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    with temporary_workdir(128) as work:
        one = images_per_s(work, 1, 1, args.batch_size, args.warmup)   # 12 steps of 8 images
        two = images_per_s(work, 2, 2, args.batch_size, args.warmup)   # 12 steps of 2 x 8 images
        print(f"1 process: {one:.2f} images/s; 2 processes: {two:.2f} images/s "
              f"(batch {args.batch_size} per process, 1 thread each, gloo)")
        print(f"ratio: {two / one:.3f}")



if __name__ == "__main__":
    main()
