"""Benchmark (the loader's nvJPEG row): training-input images/s of `detpipe.data.loader.micro_batches` over the
default JPEG cache with its images decoded on the GPU by nvJPEG (``decode_device`` = ``cuda:0``, what the trainer
passes on a GPU) ÷ the same loader decoding on the CPU (libjpeg-turbo in the loader, images then copied to the GPU
as the trainer does), same images, sampler, batch size, flips and ``num_workers``, same run.

Both sides deliver what a training step consumes: float32 images in [0, 1] on ``cuda:0`` plus their targets. One
untimed warm-up step (worker start-up, nvJPEG's handle), then at least ``--batches`` steps and ``--min-seconds``
are timed, each ending with ``torch.cuda.synchronize``; each side is measured ``--rounds`` times, alternating, and
the best round counts. Before anything is timed, every train image is decoded both ways and their differences
printed (RGB and luma, per image, in levels); the luma must agree within torchvision's bound for nvJPEG vs the CPU
decoder (mean absolute difference < 2 levels; tests/system/test_gpu.py says why luma).

    python -m benchmarks.nvjpeg [--images 128] [--batch-size 16] [--batches 20] [--min-seconds 1]
                                [--rounds 3] [--workers 0]

Without CUDA it prints one line saying so and exits 0 (there is no GPU decode to measure). Last line:
``ratio: <nvJPEG images/s / CPU-decode images/s>``.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks._workdir import temporary_workdir
from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.loader import micro_batches
from detpipe.data.sampler import ResumableDistributedSampler

SKIP_LINE = "nvjpeg: skipped: CUDA is not available (torch.cuda.is_available() is False); no GPU decode to measure"


def _steps(cache, decode_device, batch_size: int, workers: int):
    """An endless `micro_batches` iterator over the train split (``hflip`` 0.5, seed 0), as the trainer builds it
    (pinned memory when the GPU decodes)."""
    dataset = CachedDetectionDataset(cache, "train", hflip=0.5, seed=0)
    if dataset.encoding != "jpeg":
        raise SystemExit(f"nvjpeg: the cache at {cache} is {dataset.encoding!r}, not 'jpeg' (augment.encoding)")
    sampler = ResumableDistributedSampler(len(dataset), seed=0, shards=dataset.sample_shards())
    return micro_batches(dataset, sampler, (0, 0, 0), batch_size, 1, num_workers=workers,
                         pin_memory=decode_device is not None, decode_device=decode_device)


def _on_gpu(step, device: torch.device) -> list[torch.Tensor]:
    """One step's images as the trainer uses them: float32 on ``device`` (the CPU side copies them there)."""
    (images, _targets), = step
    return [im.to(device, non_blocking=True) for im in images]


def images_per_s(cache, decode_device, device: torch.device, batch_size: int, batches: int, min_seconds: float,
                 workers: int) -> float:
    """Images/s over at least ``batches`` steps and ``min_seconds`` seconds after one untimed step."""
    steps = _steps(cache, decode_device, batch_size, workers)
    try:
        _on_gpu(next(steps), device)
        torch.cuda.synchronize(device)
        n, t0 = 0, time.perf_counter()
        while True:
            n += len(_on_gpu(next(steps), device))
            torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            if n >= batches * batch_size and elapsed >= min_seconds:
                return n / elapsed
    finally:
        steps.close()


def _luma(images: torch.Tensor) -> torch.Tensor:
    """``(N, 3, H, W)`` RGB -> ``(N, H, W)`` luma (ITU-R BT.601 weights, JPEG's colour transform)."""
    return (images * torch.tensor([0.299, 0.587, 0.114], device=images.device).view(1, 3, 1, 1)).sum(1)


def decoder_differences(cache, device: torch.device) -> dict:
    """nvJPEG vs CPU (libjpeg-turbo) decode of every train image of ``cache``, in uint8 levels: per image the mean
    absolute difference of RGB and of the luma recomputed from it (where a difference of chroma upsampling
    cancels), the largest of each and its image id, and the smallest RGB distance to the horizontally flipped CPU
    decode (what a missing flip would give)."""
    from detpipe.data.dataset import decode_images

    dataset = CachedDetectionDataset(cache, "train")
    dataset.defer_decode = True  # the stored JPEG bytes, undecoded
    rgb, luma, flipped, ids = [], [], [], []
    for i in range(len(dataset)):
        data, target = dataset[i]
        g = decode_images([data], device)[0].float()
        c = decode_images([data])[0].float().to(device)
        rgb.append(float((g - c).abs().mean()))
        luma.append(float((_luma(g[None]) - _luma(c[None])).abs().mean()))
        flipped.append(float((g - c.flip(-1)).abs().mean()))
        ids.append(int(target["image_id"]))
    worst = max(range(len(ids)), key=rgb.__getitem__)
    worst_luma = max(range(len(ids)), key=luma.__getitem__)
    return {"images": len(ids), "rgb_mean": sum(rgb) / len(rgb), "rgb_max": rgb[worst], "rgb_max_id": ids[worst],
            "rgb_over_2": [(ids[k], round(rgb[k], 2)) for k in range(len(ids)) if rgb[k] >= 2],
            "luma_max": luma[worst_luma], "luma_max_id": ids[worst_luma], "unflipped_min": min(flipped)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=128, help="COCO128 images to convert (the train split is used)")
    ap.add_argument("--batch-size", type=int, default=16, help="images per step (params.yaml's train default)")
    ap.add_argument("--batches", type=int, default=20, help="timed steps per measurement (at least)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="timed seconds per measurement (at least)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating measurements per side; the best counts")
    ap.add_argument("--workers", type=int, default=0, help="loader workers on both sides (train.num_workers: 0)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(SKIP_LINE)
        return
    device = torch.device("cuda", 0)
    with temporary_workdir(args.images, keep=args.keep) as work:
        cache = work / "data/cache"
        d = decoder_differences(cache, device)
        print(f"{torch.cuda.get_device_name(device)}; JPEG cache of {args.images} COCO128 images (train split), "
              f"batch {args.batch_size}, {args.workers} workers, >= {args.batches} timed steps and >= "
              f"{args.min_seconds:g} s, best of {args.rounds}", flush=True)
        print(f"decoders on all {d['images']} train images, mean |nvJPEG - CPU| per image in levels: RGB mean "
              f"{d['rgb_mean']:.2f}, max {d['rgb_max']:.2f} (image {d['rgb_max_id']}), >= 2 levels: "
              f"{d['rgb_over_2']}; luma max {d['luma_max']:.2f} (image {d['luma_max_id']}); RGB distance to the "
              f"unflipped CPU decode: min {d['unflipped_min']:.1f}", flush=True)
        assert d["luma_max"] < 2.0, f"nvJPEG and CPU decode differ by {d['luma_max']:.2f} levels of luma (bound 2)"
        best = {"cpu": 0.0, "nvjpeg": 0.0}
        for _ in range(args.rounds):
            for side, decode_device in (("cpu", None), ("nvjpeg", device)):
                r = images_per_s(cache, decode_device, device, args.batch_size, args.batches, args.min_seconds,
                                 args.workers)
                best[side] = max(best[side], r)
        print(f"CPU decode (libjpeg-turbo in the loader, then copied): {best['cpu']:.1f} images/s; "
              f"nvJPEG decode on {device}: {best['nvjpeg']:.1f} images/s")
        print(f"ratio: {best['nvjpeg'] / best['cpu']:.3f}")


if __name__ == "__main__":
    main()
