"""Benchmark: does train-time augmentation help? Val AP of the same model, data, seed and training length from
random init with ``train.augment: flip`` (the baseline) and with each preset (ssd, detr, yolo), same run.

Each preset trains in its own copy of one COCO128 working directory (convert + augment of ``--images`` images by
the stages' own CLIs: 96 train / 32 val at 128), with the repository's params.yaml except ``train.augment``,
``train.epochs`` (``--epochs``) and ``train.mixup`` for yolo (``--yolo-mixup``, default 0 as Ultralytics'), by
the real train stage (``python -m stages.train``: ssdlite320_mobilenet_v3_large, random init, batch 16, the
default lr schedule, ``train.close_mosaic`` / ``stop_augment`` as the preset says), then scored by the real
evaluate stage (COCO AP@[.5:.95] and AP50 on val, ``metrics/eval.json``). Same number of iterations for every
preset ("same CPU budget" up to the loader's extra cost, which each row reports as wall seconds).

    python -m benchmarks.augment_quality [--images 128] [--epochs 15] [--presets ssd detr yolo]
        [--categories person] [--batch-size 16]

``--categories``: keep only those COCO categories' boxes (every image stays; the others become negatives): one
class (person: 259 of COCO128's 929 boxes) is a shorter learning problem, so AP leaves 0 within a CPU budget that
80 classes from random init do not (48 steps: every AP ~0, docs/measurements.md).

Prints one row per preset (AP, AP50, train seconds) and as the last line ``ratio: <best preset AP / flip AP>``
(goal >= 1.3; ``nan`` when flip's AP is 0).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import env, temporary_workdir  # noqa: E402


def train_and_score(base: Path, work: Path, train: dict) -> tuple[dict, float]:
    """Copy ``base``'s data into ``work``, set ``train`` keys, run train and evaluate; returns (bbox stats, train s)."""
    shutil.copytree(base / "data", work / "data")
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"].update(train)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    t0 = time.perf_counter()
    for stage in ("train", "evaluate"):
        proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=work, env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            raise SystemExit(f"{stage} failed in {work}:\n{proc.stderr[-3000:]}")
        if stage == "train":
            seconds = time.perf_counter() - t0
    return json.loads((work / "metrics/eval.json").read_text())["bbox"], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--presets", nargs="+", default=["ssd", "detr", "yolo"])
    ap.add_argument("--yolo-mixup", type=float, default=0.0)
    ap.add_argument("--categories", nargs="+", default=None,
                    help="keep only these COCO categories (e.g. person: one class learns within a CPU budget)")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    with temporary_workdir(args.images, categories=args.categories) as base:
        results = {}
        for preset in ["flip", *args.presets]:
            train = {"augment": preset, "epochs": args.epochs, "resume": "never", "batch_size": args.batch_size}
            if preset == "yolo":
                train["mixup"] = args.yolo_mixup
            stats, seconds = train_and_score(base, base / f"run-{preset}", train)
            results[preset] = stats
            print(f"{preset}: AP {stats['AP']:.4f}, AP50 {stats['AP50']:.4f}, train {seconds:.0f} s "
                  f"({args.epochs} epochs)", flush=True)
        flip = results["flip"]["AP"]
        best = max(args.presets, key=lambda p: results[p]["AP"])
        print(f"best preset: {best}")
        print(f"ratio: {results[best]['AP'] / flip:.2f}" if flip > 0 else "ratio: nan")


if __name__ == "__main__":
    main()
