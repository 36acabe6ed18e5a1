"""Benchmark: augmentation cache size vs the source JPEGs, and loader speed per encoding vs the classic path.

On COCO128 (128 images, the convert stage's train/val split), the augment stage builds:

* ``encoding: jpeg`` (quality ``--quality``, default 90) at ``fixed 320`` and at ``keep_ratio 800/1333`` (with
  ``upscale: false``: images the rule would enlarge are stored at their own size; ``upscale: true`` is printed
  too, for reference), and ``encoding: raw`` at ``fixed 320``;
* size = all bytes under the cache folder (shards, index, meta.json) per image ÷ the mean size of the source JPEG
  files of the same images.

Loader: `benchmarks.loader`'s comparison (our `CachedDetectionDataset` through a DataLoader, batch 8,
``num_workers=0``, one torch thread, best of ``--rounds``) against ``CocoDetection`` + PIL + v2 resize, for the
raw and the jpeg cache at ``fixed 320``; outputs are checked equal first (raw within 1 level, jpeg within its loss:
PSNR >= 28 dB).

    python -m benchmarks.cache_size [--quality 90] [--rounds 2]

Last line: ``ratio: <the larger of the two jpeg size ratios>`` (goal <= 1.0). Loader goals: raw >= 10x, jpeg >=
1.5x the classic path on CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import temporary_workdir  # noqa: E402
from benchmarks.loader import baseline_dataset, check_close, images_per_s  # noqa: E402
from detpipe import params as params_mod  # noqa: E402
from detpipe.data.dataset import CachedDetectionDataset  # noqa: E402
from detpipe.data.augment import build_cache  # noqa: E402


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with temporary_workdir(128) as work:
        base_cfg = params_mod.load("augment", work / "params.yaml").model_copy(update={"jpeg_quality": args.quality})
        arrow = work / "data/arrow"
        ids = {im: None for split in ("train", "val")
               for im in CachedDetectionDataset(work / "data/cache", split).image_ids}
        coco = json.loads((work / "data/raw/annotations/instances_train2017.json").read_text())
        names = {im["id"]: im["file_name"] for im in coco["images"]}
        source = sum((work / "data/raw/train2017" / names[i]).stat().st_size for i in ids) / len(ids)
        print(f"COCO128: {len(ids)} images, source JPEG {source / 1e3:.1f} kB per image", flush=True)
        variants = {
            "jpeg fixed 320": {"encoding": "jpeg", "resize": "fixed"},
            "jpeg keep_ratio 800/1333 upscale false": {"encoding": "jpeg", "resize": "keep_ratio", "upscale": False},
            "jpeg keep_ratio 800/1333 upscale true": {"encoding": "jpeg", "resize": "keep_ratio", "upscale": True},
            "raw fixed 320": {"encoding": "raw", "resize": "fixed"},
            "raw keep_ratio 800/1333 upscale true": {"encoding": "raw", "resize": "keep_ratio", "upscale": True},
        }
        caches, ratios = {}, {}
        for name, update in variants.items():
            cfg = base_cfg.model_copy(update={**update, "min_size": 800, "max_size": 1333, "size": 320})
            out = work / f"cache-{len(caches)}"
            build_cache(arrow, out, cfg)
            caches[name] = (out, cfg)
            ratios[name] = folder_bytes(out) / len(ids) / source
            print(f"{name}: {folder_bytes(out) / len(ids) / 1e3:.1f} kB per image = {ratios[name]:.3f} x source",
                  flush=True)
        speed = {}
        for name, min_psnr in (("raw fixed 320", 48.0), ("jpeg fixed 320", 28.0)):
            cache, cfg = caches[name]
            ours = CachedDetectionDataset(cache, "train")
            base = baseline_dataset(work / "data/raw", ours.image_ids, cfg)
            psnr = check_close(ours, base, min_psnr)
            best = {"ours": 0.0, "base": 0.0}
            for _ in range(args.rounds):
                for key, ds in (("base", base), ("ours", ours)):
                    best[key] = max(best[key], images_per_s(ds, args.batch_size, 40, 1.0, 0))
            speed[name] = best["ours"] / best["base"]
            print(f"loader {name}: ours {best['ours']:.1f} images/s, classic CocoDetection + PIL {best['base']:.1f} "
                  f"images/s, ratio {speed[name]:.2f} (outputs checked: PSNR >= {psnr:.1f} dB)", flush=True)
        jpeg = [ratios["jpeg fixed 320"], ratios["jpeg keep_ratio 800/1333 upscale false"]]
        print(f"jpeg size ratios: fixed 320 {jpeg[0]:.3f}, keep_ratio 800/1333 {jpeg[1]:.3f}; loader ratios: raw "
              f"{speed['raw fixed 320']:.2f} (goal >= 10), jpeg {speed['jpeg fixed 320']:.2f} (goal >= 1.5)")
        print(f"ratio: {max(jpeg):.3f}")



if __name__ == "__main__":
    main()
