"""Training images/s on one GPU: our train stage's data path and loop ÷ the torchvision detection reference recipe's,
same model, batch, network input size and device, same run. Goal >= 1.3 (on a GPU).

* ours: `detpipe.engine.trainer.build_trainer` + ``Trainer.train`` as the train stage runs them in one process (DDP
  off): the augment stage's cache (default: JPEG, fixed 320, decoded by nvJPEG on the GPU inside
  `detpipe.data.loader.micro_batches`), `ResumableDistributedSampler`, every default hook (LR schedule, DVCLive
  metrics, progress, checkpoints: none falls in the timed window), ``train.amp: fp16`` with ``--amp on``.
* reference: a reimplementation of torchvision's ``references/detection`` recipe (not installed here; the code
  below follows it step by step):

  - ``train.py`` ``get_dataset`` -> ``coco_utils.get_coco(..., use_v2=True)``: ``torchvision.datasets.CocoDetection``
    over the JPEG files, ``wrap_dataset_for_transforms_v2(target_keys=["boxes", "labels", "image_id"])``, and for
    train ``_coco_remove_images_without_annotations`` (`_has_valid_annotation`);
  - ``presets.DetectionPresetTrain(data_augmentation="hflip", backend="pil", use_v2=True)`` (``hflip`` is the
    reference's default augmentation and what our default cache does: ``augment.copies: 0``, ``train.hflip: 0.5``):
    RandomHorizontalFlip(0.5), ToImage, ToDtype(float, scale=True), ConvertBoundingBoxFormat(XYXY),
    SanitizeBoundingBoxes, ToPureTensor; the image keeps its size — SSDlite's own transform resizes it to 320x320
    inside the model, on the GPU, as in the reference;
  - ``--aspect-ratio-group-factor -1`` (the reference's ssdlite320 command in its README): a plain
    ``BatchSampler(RandomSampler(dataset), batch_size, drop_last=True)``, no ``GroupedBatchSampler``;
    ``collate_fn`` = ``utils.collate_fn`` = ``tuple(zip(*batch))``; ``DataLoader(num_workers=--ref-workers)``
    (the reference's ``-j`` default is 4), no pin_memory;
  - the model from ``torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=...)``,
    ``model.train()``; ``torch.optim.SGD(lr, momentum, weight_decay)``; ``--amp``: ``GradScaler`` and autocast;
  - ``engine.train_one_epoch``: epoch 0's ``LinearLR(start_factor=1/1000, total_iters=min(1000, len - 1))``,
    images and targets ``.to(device)``, ``loss_dict = model(images, targets)``, ``losses.item()`` (stop on a
    non-finite loss), ``zero_grad``, ``scaler.scale(losses).backward()``, ``scaler.step``, ``scaler.update``
    (or plain backward/step without AMP), ``lr_scheduler.step()``, and the MetricLogger's ``.item()`` per loss term.

  Two deviations, both in the reference's favour or neutral: labels are mapped from COCO category ids to our
  contiguous labels (one lookup per target) so both models have the same ``num_classes`` (the reference uses 91 for
  COCO); and the sampler draws enough samples for the whole measurement in one DataLoader epoch, so the workers
  start once (as in an epoch of COCO train2017, thousands of iterations long) instead of once per 96-image COCO128
  epoch.

Both loops run ``--warmup`` untimed then ``--iters`` timed iterations, alternating ``--rounds`` times; the best
round of each counts. The device is ``cuda:0`` when CUDA is available (ours picks it the same way), else the CPU:
the figure is then labelled a CPU figure (AMP off on both sides there, as the reference's ``torch.cuda.amp``
does on CPU); the goal is for a GPU.

    python -m benchmarks.gpu_train [--images 128] [--batch-size 16] [--iters 30] [--warmup 5] [--rounds 2]
                                   [--ref-workers 4] [--workers 0] [--amp on|off] [--threads 0] [--gpu-only]
                                   [--family-model rtdetr_v2_r18vd] [--family-iters 200] [--family-amp bf16]

``--family-model`` (issue 45): after the rounds, our loop also trains that model of another family (the
transformers family's RT-DETRv2 / D-FINE: its recipe, AdamW at lr 1e-4 and weight decay 1e-4, ``train.optimizer:
auto``, the same cache, batch and 320 px input) for ``--family-iters`` timed iterations with ``train.amp``
``--family-amp`` (bf16 by default; off on CPU), and prints its images/s beside the reference recipe's (the
torchvision model above): a row, not part of the ratio (the reference recipe cannot train that model).

``--gpu-only`` (what .ci/gpu_run.py passes): without CUDA, one line saying so instead of a CPU figure.

Last line: ``ratio: <ours images/s / reference images/s>``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import shutil
import time
from pathlib import Path

import torch
import torchvision
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torchvision import datasets, tv_tensors
from torchvision.transforms import v2 as T

from benchmarks._workdir import temporary_workdir
from detpipe import params as params_mod
from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.meta import read_meta
from detpipe.engine.train_loop import HookBase
from detpipe.engine.trainer import build_trainer


class _Stamps(HookBase):
    """``time.perf_counter()`` at every ``before_step`` (after a CUDA synchronize, so a stamp closes the work of
    the iteration before it)."""

    def __init__(self, device: torch.device):
        self.device, self.stamps = device, []

    def before_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())


def ours(work: Path, cfg: params_mod.Train, iters: int, warmup: int, device: torch.device) -> float:
    """Images/s of our trainer over ``iters`` iterations after ``warmup`` (one more iteration runs untimed after
    them, so the final checkpoint written at the end falls outside the window). Raises AssertionError if the
    trainer did not run on ``device``."""
    for d in ("checkpoints", "dvclive"):
        shutil.rmtree(work / d, ignore_errors=True)
    clock = _Stamps(device)
    trainer = build_trainer(cfg, work / "data/cache", work / "data/arrow/meta.json", work / "checkpoints",
                            str(work / "dvclive"), extra_hooks=(clock,))
    assert trainer.device.type == device.type, (trainer.device, device)
    trainer.train(0, warmup + iters + 1)
    seconds = clock.stamps[warmup + iters] - clock.stamps[warmup]
    return iters * cfg.batch_size / seconds


# ---------------------------------------------------------------------------------------------- the reference

def _has_only_empty_bbox(anno: list[dict]) -> bool:
    """references/detection/coco_utils.py: every box has a side of at most 1 pixel."""
    return all(any(o <= 1 for o in obj["bbox"][2:]) for obj in anno)


def _has_valid_annotation(anno: list[dict]) -> bool:
    """references/detection/coco_utils.py (the keypoint rule does not apply to boxes)."""
    return len(anno) > 0 and not _has_only_empty_bbox(anno)


class _Labels:
    """COCO category ids -> our contiguous labels (``category_id_to_label`` of the convert stage's meta.json), so
    the reference's model has our ``num_classes``."""

    def __init__(self, category_id_to_label: dict[int, int]):
        self.lut = torch.zeros(max(category_id_to_label) + 1, dtype=torch.int64)
        for c, label in category_id_to_label.items():
            self.lut[c] = label

    def __call__(self, image, target):
        return image, {**target, "labels": self.lut[target["labels"]]}


def reference_dataset(raw: Path, image_ids: list[int], category_id_to_label: dict[int, int]):
    """``get_coco(image_set="train", use_v2=True)`` over ``raw`` restricted to ``image_ids`` (our train split),
    with ``DetectionPresetTrain(data_augmentation="hflip", backend="pil", use_v2=True)``."""
    transforms = T.Compose([T.RandomHorizontalFlip(p=0.5), T.ToImage(), T.ToDtype(torch.float, scale=True),
                            T.ConvertBoundingBoxFormat(tv_tensors.BoundingBoxFormat.XYXY),
                            T.SanitizeBoundingBoxes(), T.ToPureTensor(), _Labels(category_id_to_label)])
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints "creating index..."
        ds = datasets.CocoDetection(str(raw / "train2017"), str(raw / "annotations/instances_train2017.json"),
                                    transforms=transforms)
    wanted = set(image_ids)
    ds.ids = [i for i in ds.ids if i in wanted
              and _has_valid_annotation(ds.coco.loadAnns(ds.coco.getAnnIds(imgIds=i, iscrowd=None)))]
    return datasets.wrap_dataset_for_transforms_v2(ds, target_keys=["boxes", "labels", "image_id"])


def _collate_fn(batch):
    """references/detection/utils.py ``collate_fn``."""
    return tuple(zip(*batch))


def reference(dataset, cfg: params_mod.Train, num_classes: int, iters: int, warmup: int, device: torch.device,
              amp: bool, workers: int) -> float:
    """Images/s of the reference's ``train_one_epoch`` over ``iters`` iterations after ``warmup``.
    Raises SystemExit on a non-finite loss (as the reference does)."""
    torch.manual_seed(cfg.seed)
    model = torchvision.models.get_model(cfg.model, weights=None, weights_backbone=None, num_classes=num_classes)
    model.to(device)
    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    total = warmup + iters
    sampler = RandomSampler(dataset, num_samples=total * cfg.batch_size)  # one epoch covers the measurement
    loader = DataLoader(dataset, batch_sampler=BatchSampler(sampler, cfg.batch_size, drop_last=True),
                        num_workers=workers, collate_fn=_collate_fn)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / 1000,
                                                     total_iters=min(1000, len(loader) - 1))
    t0 = None
    for it, (images, targets) in enumerate(loader):
        if it == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        images = list(image.to(device) for image in images)
        targets = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]
        with torch.autocast(device.type, enabled=scaler is not None):
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())
        loss_value = losses.item()  # reduce_dict is the identity with one process
        if not math.isfinite(loss_value):
            raise SystemExit(f"reference: loss is {loss_value}, stopping training")
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            optimizer.step()
        lr_scheduler.step()
        for v in loss_dict.values():  # MetricLogger.update: .item() of every term
            v.item()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return iters * cfg.batch_size / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=128, help="COCO128 images to convert (the train split is used)")
    ap.add_argument("--batch-size", type=int, default=16, help="images per iteration (params.yaml's default)")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations before them")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per side; the best counts")
    ap.add_argument("--ref-workers", type=int, default=4, help="reference DataLoader workers (its -j default: 4)")
    ap.add_argument("--workers", type=int, default=0, help="our train.num_workers (params.yaml's default: 0)")
    ap.add_argument("--amp", choices=("on", "off"), default="on",
                    help="fp16 AMP on both sides (reference --amp, our train.amp: fp16); always off on CPU")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (our train.threads; 0 = cores)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    ap.add_argument("--family-model", default="",
                    help="also time our loop training this model of another family (e.g. rtdetr_v2_r18vd) with its "
                         "recipe (AdamW lr 1e-4, weight decay 1e-4) and AMP --family-amp, printed beside the "
                         "reference recipe's images/s (not in the ratio); empty: skip")
    ap.add_argument("--family-iters", type=int, default=200, help="timed iterations of --family-model (one round)")
    ap.add_argument("--family-amp", choices=("bf16", "fp16", "off"), default="bf16",
                    help="--family-model's train.amp on a GPU (off on CPU)")
    ap.add_argument("--gpu-only", action="store_true",
                    help="without CUDA print one line and stop instead of measuring a CPU figure (.ci/gpu_run.py)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.gpu_only and not torch.cuda.is_available():
        print("gpu_train: skipped: CUDA is not available (torch.cuda.is_available() is False; --gpu-only)")
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    amp = args.amp == "on" and device.type == "cuda"

    with temporary_workdir(args.images, keep=args.keep) as work:
        cfg = params_mod.Train.model_validate({
            **params_mod.load("train", work / "params.yaml").model_dump(),
            "batch_size": args.batch_size, "num_workers": args.workers, "amp": "fp16" if amp else "off",
            "threads": args.threads, "checkpoint_every": args.warmup + args.iters + 10, "eval_every": 0,
            "augment": "flip"})  # the reference's hflip preset (train.augment: auto would be ssd for ssdlite)
        torch.set_num_threads(args.threads or torch.get_num_threads())
        meta = read_meta(work / "data/arrow/meta.json")
        cache = CachedDetectionDataset(work / "data/cache", "train")
        ref_ds = reference_dataset(work / "data/raw", cache.image_ids,
                                   {int(k): v for k, v in meta["category_id_to_label"].items()})
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"{cfg.model}, {meta['num_classes']} classes, random init, network input 320x320; batch "
              f"{cfg.batch_size}, {args.warmup} + {args.iters} timed iterations, best of {args.rounds}; device "
              f"{device} ({name}); AMP {'fp16' if amp else 'off'}; ours: {cache.encoding} cache, "
              f"{len(cache)} train images, {args.workers} workers; reference: {len(ref_ds)} JPEG files "
              f"(images without a valid annotation removed), {args.ref_workers} workers", flush=True)
        best = {"ours": 0.0, "reference": 0.0}
        for r in range(args.rounds):
            ref = reference(ref_ds, cfg, int(meta["num_classes"]), args.iters, args.warmup, device, amp,
                            args.ref_workers)
            our = ours(work, cfg, args.iters, args.warmup, device)
            best = {"ours": max(best["ours"], our), "reference": max(best["reference"], ref)}
            print(f"round {r + 1}: reference {ref:.1f} images/s, ours {our:.1f} images/s", flush=True)
        ratio = best["ours"] / best["reference"]
        print(f"reference recipe (CocoDetection + v2 hflip preset, model resizes): {best['reference']:.1f} images/s; "
              f"our train loop (cache + micro_batches + hooks): {best['ours']:.1f} images/s")
        if args.family_model:
            family_amp = args.family_amp if device.type == "cuda" else "off"
            fam = params_mod.Train.model_validate({**cfg.model_dump(), "model": args.family_model, "lr": 1e-4,
                                                   "weight_decay": 1e-4, "optimizer": "auto", "amp": family_amp})
            fam_ips = ours(work, fam, args.family_iters, args.warmup, device)
            print(f"family {fam.model} (our loop, AdamW lr 1e-4, AMP {family_amp}, {args.family_iters} timed "
                  f"iterations): {fam_ips:.1f} images/s; {fam_ips / best['reference']:.3f}x the reference recipe's "
                  f"{cfg.model}", flush=True)
        if device.type != "cuda":
            print("device: cpu (no CUDA available): this is a CPU figure, not the GPU figure the goal (>= 1.3) is for")
        print(f"ratio: {ratio:.3f}")



if __name__ == "__main__":
    main()
