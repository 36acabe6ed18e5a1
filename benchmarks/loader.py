"""Benchmark: images/s of our cached loader vs the classic JPEG pipeline, same images, same tensors, same run.

* ours: `detpipe.data.dataset.CachedDetectionDataset` over the augment stage's cache (memory-mapped uint8 pixels).
* baseline: ``torchvision.datasets.CocoDetection`` (PIL decode, RGB) wrapped by
  ``torchvision.datasets.wrap_dataset_for_transforms_v2``, then ``torchvision.transforms.v2``: ``to_image``,
  ``resize`` to the very size the augment stage uses (bilinear, antialias=True, on uint8 — what the cache holds),
  ``to_dtype(float32, scale=True)``; boxes resized by v2 too.

Both produce float32 CHW images in [0, 1] plus XYXY boxes for the same train-split images; on a sample the
images are asserted equal within one pixel level (1/255) and the non-crowd boxes within 1e-3 px (COCO128 has no
EXIF-rotated image, so CocoDetection's missing EXIF transpose does not matter). Both go through a
``torch.utils.data.DataLoader`` with batch size ``--batch-size`` (8), ``collate_fn=detpipe.data.dataset.collate``, no
flips, in the same fixed order; one warm-up batch (worker start-up included) is not timed, then at least
``--batches`` batches and ``--min-seconds`` are. Each (loader, num_workers) is measured ``--rounds`` times,
alternating, and the best round counts. The main process uses ``--threads`` (1) torch threads.

    python -m benchmarks.loader [--images 128] [--batches 40] [--rounds 3] [--resize fixed|keep_ratio]
                                [--encoding raw|jpeg]

With ``encoding: jpeg`` (the default cache) images are checked within JPEG's loss (PSNR >= 28 dB) instead.

Prints images/s per loader and ``num_workers`` (0 and 2), the ratios, and as the last line
``ratio: <ours / baseline images/s at num_workers=0>`` (goal >= 10).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler
from torchvision import datasets
from torchvision.transforms.v2 import functional as TF

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import temporary_workdir  # noqa: E402
from detpipe import params as params_mod  # noqa: E402
from detpipe.data.augmentation import target_size  # noqa: E402
from detpipe.data.augment import build_cache  # noqa: E402
from detpipe.data.dataset import CachedDetectionDataset, collate  # noqa: E402
from detpipe.data.meta import read_meta  # noqa: E402


class _Cycle(Sampler[int]):
    """``range(size)`` repeated without end (the same fixed order for both loaders)."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        return itertools.cycle(range(self.size))


class _BaselineTransforms:
    """v2 functional ops on ``(PIL image, target with BoundingBoxes)``: to_image, resize to the cache's size
    (bilinear, antialias, uint8), to_dtype(float32, scale=True)."""

    def __init__(self, cfg: params_mod.Augment):
        self.cfg = cfg

    def __call__(self, image, target):
        image = TF.to_image(image)
        size = list(target_size(image.shape[-2], image.shape[-1], self.cfg))
        image = TF.resize(image, size, interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
        if "boxes" in target:
            target = {**target, "boxes": TF.resize(target["boxes"], size)}
        return TF.to_dtype(image, torch.float32, scale=True), target


def baseline_dataset(raw: Path, image_ids: list[int], cfg: params_mod.Augment):
    """CocoDetection over ``raw`` (the augment stage's input images), restricted to ``image_ids`` in that order."""
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints "creating index..."
        ds = datasets.CocoDetection(str(raw / "train2017"), str(raw / "annotations/instances_train2017.json"),
                                    transforms=_BaselineTransforms(cfg))
    ds.ids = list(image_ids)
    return datasets.wrap_dataset_for_transforms_v2(ds, target_keys={"boxes", "labels", "image_id", "iscrowd"})


def check_same(ours: CachedDetectionDataset, base, label_of: dict[int, int], n: int) -> float:
    """Assert the first ``n`` samples agree (images within 1/255, non-crowd boxes within 1e-3 px, labels);
    return the largest pixel difference in levels."""
    worst = 0.0
    for i in range(min(n, len(ours))):
        image, t = ours[i]
        bimage, bt = base[i]
        assert int(t["image_id"]) == int(bt["image_id"]), i
        assert image.shape == bimage.shape, (i, image.shape, bimage.shape)
        diff = float((image - bimage).abs().max()) * 255
        worst = max(worst, diff)
        assert diff <= 1.0 + 1e-4, f"image {i}: pixels differ by {diff:.3f} levels"
        if "boxes" in bt:
            bb, labels = bt["boxes"].as_subclass(torch.Tensor), bt["labels"]
            crowd = torch.as_tensor(bt["iscrowd"], dtype=torch.int64)
            keep = (crowd == 0) & (bb[:, 2] > bb[:, 0]) & (bb[:, 3] > bb[:, 1])
            bb, labels = bb[keep], [label_of[int(c)] for c in labels[keep].tolist()]
        else:  # an image without annotations
            bb, labels = torch.zeros(0, 4), []
        torch.testing.assert_close(t["boxes"], bb, rtol=0, atol=1e-3)
        assert t["labels"].tolist() == labels, i
    return worst


def check_close(ours: CachedDetectionDataset, base, min_psnr: float) -> float:
    """Lowest PSNR (dB) of our images vs the classic path's over the whole split; asserts it is >= ``min_psnr``
    and that boxes agree within 1e-3 px."""
    worst = math.inf
    for i in range(len(ours)):
        (image, t), (bimage, bt) = ours[i], base[i]
        assert int(t["image_id"]) == int(bt["image_id"]) and image.shape == bimage.shape, i
        mse = float(((image.double() - bimage.double()) * 255).pow(2).mean())
        worst = min(worst, math.inf if mse == 0 else 10 * math.log10(255**2 / mse))
        if "boxes" in bt and len(t["boxes"]):
            bb = bt["boxes"].as_subclass(torch.Tensor)
            keep = (torch.as_tensor(bt["iscrowd"]) == 0) & (bb[:, 2] > bb[:, 0]) & (bb[:, 3] > bb[:, 1])
            torch.testing.assert_close(t["boxes"], bb[keep], rtol=0, atol=1e-3)
    assert worst >= min_psnr, f"cache differs from the classic path: PSNR {worst:.1f} dB < {min_psnr}"
    return worst


def images_per_s(dataset, batch_size: int, batches: int, min_seconds: float, num_workers: int) -> float:
    """Images/s over at least ``batches`` DataLoader batches and ``min_seconds`` seconds, after one untimed
    warm-up batch."""
    loader = DataLoader(dataset, batch_size=batch_size, sampler=_Cycle(len(dataset)), collate_fn=collate,
                        num_workers=num_workers)
    it = iter(loader)
    next(it)  # warm-up: worker start-up, first page faults
    n, t0 = 0, time.perf_counter()
    while True:
        images, _ = next(it)
        n += len(images)
        elapsed = time.perf_counter() - t0
        if n >= batches * batch_size and elapsed >= min_seconds:
            break
    del it  # stops the workers
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=128, help="COCO128 images to convert (train split is used)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=40, help="timed batches per measurement (at least)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="timed seconds per measurement (at least)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in the main process (workers "
                    "always use 1); 1 keeps a shared machine's other load from stalling multi-threaded ops")
    ap.add_argument("--rounds", type=int, default=3, help="alternating measurements per loader; best counts")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--resize", choices=("fixed", "keep_ratio"), default=None,
                    help="default: params.yaml's augment.resize (the cache the pipeline builds)")
    ap.add_argument("--encoding", choices=("raw", "jpeg"), default=None,
                    help="default: params.yaml's augment.encoding (the cache the pipeline builds)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with temporary_workdir(args.images, keep=args.keep) as work:
        cfg = params_mod.load("augment", work / "params.yaml")
        cache = work / "data/cache"
        update = {k: v for k, v in (("resize", args.resize), ("encoding", args.encoding))
                  if v and v != getattr(cfg, k)}
        if update:
            cfg = cfg.model_copy(update=update)
            cache = work / "cache-bench"
            build_cache(work / "data/arrow", cache, cfg)
        ours = CachedDetectionDataset(cache, "train")
        base = baseline_dataset(work / "data/raw", ours.image_ids, cfg)
        label_of = {int(k): v for k, v in read_meta(work / "data/arrow/meta.json")["category_id_to_label"].items()}
        if cfg.encoding == "raw":
            worst = f"max pixel difference {check_same(ours, base, label_of, len(ours)):.2f} levels"
        else:  # JPEG-encoded cache: within its loss
            worst = f"min PSNR {check_close(ours, base, 28.0):.1f} dB"
        print(f"{len(ours)} train images, {cfg.encoding} cache, resize {cfg.resize} "
              f"({cfg.size if cfg.resize == 'fixed' else f'{cfg.min_size}/{cfg.max_size}'}), batch {args.batch_size}, "
              f">= {args.batches} timed batches and >= {args.min_seconds:g} s, best of {args.rounds}, torch threads "
              f"{torch.get_num_threads()}; "
              f"outputs checked equal on all {len(ours)} images ({worst})",
              flush=True)
        results: dict[tuple[str, int], float] = {}
        for nw in args.workers:
            for _ in range(args.rounds):
                for name, ds in (("baseline", base), ("ours", ours)):
                    r = images_per_s(ds, args.batch_size, args.batches, args.min_seconds, nw)
                    results[name, nw] = max(results.get((name, nw), 0.0), r)
            print(f"num_workers={nw}: baseline (CocoDetection + PIL + v2 resize) {results['baseline', nw]:.1f} "
                  f"images/s, ours (cached) {results['ours', nw]:.1f} images/s, "
                  f"ratio {results['ours', nw] / results['baseline', nw]:.2f}", flush=True)
        first = args.workers[0]
        print(f"ratio: {results['ours', first] / results['baseline', first]:.2f}")



if __name__ == "__main__":
    main()
