"""The train-time augmentation on the training device (``train.augment_device``): the loader reads the samples
without their transforms (``CachedDetectionDataset.defer_augment``) and `augment_batch` runs the same transforms,
with the same draws, on the batch in the training process (nvJPEG decode and torchvision's v2 ops on CUDA)."""
from __future__ import annotations

import torch

from detpipe.data.dataset import CachedDetectionDataset, decode_images
from detpipe.data.multi_image import make_sample


def augment_batch(dataset: CachedDetectionDataset, images: list[torch.Tensor], targets: list[dict],
                  device: torch.device, encoded: bool = False) -> tuple[list[torch.Tensor], list[dict]]:
    """``dataset.transforms`` on a batch the loader read without them (``defer_augment``), on ``device``: each
    sample ``(epoch, i)`` (its target's ``augment_at``) is moved there (``encoded``: JPEG bytes, decoded there with
    `decode_images`, nvJPEG on CUDA), augmented with the dataset's flip draw (``hflip``) and its mosaic / mixup /
    copy-paste partners (`CachedDetectionDataset.cached_sample`, moved there), then scaled to float32 in [0, 1].
    Same function and draws as the loader's path, so the output equals it on the CPU (tested) and up to the
    device's arithmetic on CUDA.

    Returns:
        ``(images, targets)``: float32 ``(3, H, W)`` on ``device``; targets as `CachedDetectionDataset` gives
        them with transforms (``boxes``, ``labels``, ``dropped``, ``masks`` with ``with_masks`` on ``device``).
    """
    def to(sample: dict) -> dict:
        return {k: v.to(device, non_blocking=True) for k, v in sample.items()}

    def load(j: int, epoch: int) -> dict:
        return to(dataset.cached_sample(j, epoch))

    u8s = decode_images(images, device) if encoded else [im.to(device, non_blocking=True) for im in images]
    out_images, out_targets = [], []
    for u8, target in zip(u8s, targets):
        target = dict(target)
        epoch, i = (int(v) for v in target.pop("augment_at"))
        flip = bool(target.pop("hflip"))
        masks = target.pop("masks", None)
        sample = make_sample(u8, target["boxes"].to(device), target["labels"].to(device),
                             None if masks is None else masks.to(device))
        sample, dropped = dataset.transforms(i, epoch, sample, flip, load)
        out_images.append(sample["image"].as_subclass(torch.Tensor).float().mul_(1.0 / 255))
        target["boxes"] = sample["boxes"].as_subclass(torch.Tensor)
        target["labels"] = sample["labels"]
        target["dropped"] = torch.tensor(dropped, dtype=torch.int64)
        if dataset.with_masks:
            target["masks"] = sample["masks"].as_subclass(torch.Tensor)
        out_targets.append(target)
    return out_images, out_targets
