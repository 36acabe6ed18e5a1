"""Benchmark: does the train-time augmentation keep up with training? Loader images/s with each ``train.augment``
preset ÷ the images/s a training step of ``ssdlite320_mobilenet_v3_large`` consumes, same machine, same run.

* loader: `detpipe.data.loader.micro_batches` over the default JPEG cache of COCO128's train split (fixed 320),
  batch ``--batch-size`` (16), ``--workers`` DataLoader processes (0: in the training process), hflip 0.5, the
  preset's `detpipe.data.train_transforms.TrainTransforms` (``flip``: none, the dataset's fast path; ``yolo``:
  mosaic 1 and, here, mixup 0.5 so that both multi-image ops are timed); at least ``--min-seconds`` per preset
  after one untimed step (worker start-up), ``--rounds`` alternating measurements, the best counting.
* consumption: one SGD step (forward, backward, update) of ssdlite320_mobilenet_v3_large, random init, 81
  classes, on one loader batch, on ``--device``; best of ``--steps`` steps after 2 untimed ones.

The loader is measured alone (not overlapped with the step): with ``num_workers: 0`` training alternates loading
and stepping, so the ratio says how much of each iteration the augmentation takes (ratio 1.5: a third as long as
the step itself); with workers it says whether they keep the step fed.

    python -m benchmarks.augment_loader [--images 128] [--batch-size 16] [--workers 0] [--device cpu|cuda]
        [--augment-device cuda]

Prints one row per preset (images/s, ratio) and as the last line ``ratio: <the smallest of ssd, detr and yolo>``
(goal >= 1.5 on this 2-core machine).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import temporary_workdir  # noqa: E402
from detpipe.data.dataset import CachedDetectionDataset  # noqa: E402
from detpipe.data.loader import micro_batches  # noqa: E402
from detpipe.data.sampler import ResumableDistributedSampler  # noqa: E402
from detpipe.data.train_transforms import TrainTransforms, resolve_preset  # noqa: E402

PRESETS = ("flip", "ssd", "detr", "yolo")


def dataset(cache: Path, preset: str, epochs: int = 10) -> CachedDetectionDataset:
    ds = CachedDetectionDataset(cache, "train", hflip=0.5, seed=0)
    recipe = resolve_preset(preset, epochs)
    if preset == "yolo":
        recipe = dataclasses.replace(recipe, mixup=0.5)
    if not recipe.is_flip_only:
        ds.transforms = TrainTransforms(recipe, 0, len(ds))
    return ds


def loader_images_per_s(cache: Path, preset: str, batch_size: int, workers: int, min_seconds: float,
                        augment_device: str | None = None) -> float:
    ds = dataset(cache, preset)
    sampler = ResumableDistributedSampler(len(ds), seed=0, shards=ds.sample_shards())
    device = torch.device(augment_device) if augment_device else None
    data = micro_batches(ds, sampler, (0, 0, 0), batch_size, 1, num_workers=workers, decode_device=device,
                         augment_device=device)
    try:
        next(data)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_seconds or n < 4 * batch_size:
            n += len(next(data)[0][0])
        return n / (time.perf_counter() - t0)
    finally:
        data.close()


def step_images_per_s(cache: Path, batch_size: int, steps: int, device: str) -> float:
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    torch.manual_seed(0)
    model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=81).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ds = dataset(cache, "flip")
    sampler = ResumableDistributedSampler(len(ds), seed=0, shards=ds.sample_shards())
    data = micro_batches(ds, sampler, (0, 0, 0), batch_size, 1)
    images, targets = next(data)[0]
    data.close()
    images = [im.to(device) for im in images]
    targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
    best = float("inf")
    for k in range(steps + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = sum(model(images, targets).values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if k >= 2:
            best = min(best, time.perf_counter() - t0)
    return batch_size / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=128, help="COCO128 images to convert (the train split is used)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (train.num_workers)")
    ap.add_argument("--min-seconds", type=float, default=5.0, help="timed seconds per preset (at least)")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps (best counts)")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per preset, alternating; best counts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--augment-device", default=None, help="run the augmentation on this device in the training "
                    "process (train.augment_device: cuda; the JPEG cache decoded there too); default: in the loader")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, all cores)")
    args = ap.parse_args()
    if "cuda" in (args.device + str(args.augment_device)) and not torch.cuda.is_available():
        print("augment_loader: no CUDA here (--device / --augment-device cuda); nothing measured")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    with temporary_workdir(args.images) as work:
        cache = work / "data/cache"
        step = step_images_per_s(cache, args.batch_size, args.steps, args.device)
        print(f"training step (ssdlite320_mobilenet_v3_large, batch {args.batch_size}, {args.device}, "
              f"{torch.get_num_threads()} threads): {step:.1f} images/s", flush=True)
        rates = {p: 0.0 for p in PRESETS}
        for _ in range(args.rounds):
            for preset in PRESETS:
                rates[preset] = max(rates[preset], loader_images_per_s(cache, preset, args.batch_size, args.workers,
                                                                       args.min_seconds, args.augment_device))
        ratios = {p: r / step for p, r in rates.items()}
        for preset in PRESETS:
            print(f"{preset}: loader {rates[preset]:.1f} images/s ({args.workers} workers), "
                  f"ratio {ratios[preset]:.2f}", flush=True)
        print(f"ratio: {min(ratios[p] for p in ('ssd', 'detr', 'yolo')):.2f}")


if __name__ == "__main__":
    main()
