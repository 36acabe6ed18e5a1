"""Train-time augmentation (``train.augment``): the random ops applied to each training sample in the loader, after
the cache decode — not to be confused with the *augment stage* (`detpipe.data.augment`, `detpipe.data.augmentation`),
which resizes once and may store pre-computed copies offline.

Presets (`PRESETS`; every one also flips with probability ``train.hflip``, drawn exactly as without augmentation,
`detpipe.data.dataset.CachedDetectionDataset.flipped`):

* ``flip``: the flip only (no object of this module is made: the dataset's own fast path).
* ``ssd``: torchvision's SSD / SSDlite recipe, ``references/detection/presets.py`` (``data_augmentation == "ssd"``):
  ``RandomPhotometricDistort()`` (p 0.5), ``RandomZoomOut(fill=(123, 117, 104))`` (side range 1..4, p 0.5),
  ``RandomIoUCrop()`` (always tried), ``RandomHorizontalFlip``, ``SanitizeBoundingBoxes``.
* ``detr``: RT-DETR / RT-DETRv2's ``configs/rtdetrv2/include/dataloader.yml``: ``RandomPhotometricDistort(p=0.5)``,
  ``RandomZoomOut(fill=0)``, ``RandomIoUCrop(p=0.8)``, ``SanitizeBoundingBoxes(min_size=1)``,
  ``RandomHorizontalFlip``; its ``stop_epoch`` policy switches those ops off for the last epoch of 72
  (``stop_augment``: 1).
* ``yolo``: Ultralytics' ``ultralytics/cfg/default.yaml``: mosaic 1.0, mixup 0.0, hsv_h 0.015, hsv_s 0.7, hsv_v 0.4
  (here ``ColorJitter(brightness=0.4, saturation=0.7, hue=0.015)``, the HSV gains as torchvision's colour jitter),
  translate 0.1, scale 0.5, fliplr 0.5, close_mosaic 10 of its default 100 epochs (here the same share of
  ``train.epochs``: ``max(1, round(0.1 * epochs))``).

Every op is a `torchvision.transforms.v2` transform or functional on ``tv_tensors`` (`Image`, `BoundingBoxes`
XYXY, `Mask`): boxes, masks and `SanitizeBoundingBoxes` are torchvision's arithmetic, not ours. The multi-image ops
are short implementations on top of v2 in `detpipe.data.multi_image` (kornia is not a dependency; its ``RandomMosaic`` handles boxes but not
instance masks, and would add a library for ~60 lines): `mosaic` places 4 samples around a random centre of a
2H x 2W canvas with ``F.crop`` (boxes and masks shifted and clipped by v2), then scales/translates the canvas with
``RandomAffine`` and takes its centre H x W with ``F.center_crop`` (Ultralytics' ``Mosaic`` + ``random_perspective``
with ``border = -s/2``); `mixup` blends two samples with ratio ~ Beta(32, 32) and concatenates their targets
(Ultralytics' ``MixUp``); `copy_paste` pastes a random subset of another sample's objects (their mask pixels) onto
the sample, cuts the covered pixels out of the sample's own masks, re-derives the boxes of the objects it occluded
from what is left of their masks with ``torchvision.ops.masks_to_boxes`` and drops the objects it covered entirely
(Ghiasi et al. 2021, "Simple Copy-Paste is a Strong Data Augmentation Method for Instance Segmentation",
arXiv:2012.07177, without its scale jitter; Ultralytics' ``copy_paste``). Mask datasets only. With masks, every box
of a sample the ops touched is then its mask's pixel bounds and objects with an empty mask are dropped
(`boxes_from_masks`, detectron2's ``recompute_boxes``): v2's clamped box of an object cut at a border is larger
than the visible mask when the object is not a rectangle.

Determinism: every random draw is a function of ``(seed, epoch, sample index, op)`` only: each op runs under
``torch.random.fork_rng`` with ``torch.manual_seed(draw_seed(seed, epoch, i, op))`` (v2 transforms draw from torch's
global generator; the caller's RNG state is restored afterwards), and mosaic / mixup partners are drawn with a
numpy generator seeded from the same tuple. So the batches do not depend on worker processes, world size or
resumes (tests/unit/test_train_transforms.py; tests/stages/test_train.py's resume test with the ``yolo`` preset).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Optional

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from detpipe.data.multi_image import (YOLO_FILL, Sample, boxes_from_masks, copy_paste, make_sample, mixup, mosaic,
                                     to_size)

__all__ = ["Recipe", "PRESETS", "default_augment", "resolve", "resolve_preset", "TrainTransforms", "draw_seed",
           "per_image_ops", "multi_scale_sizes", "step_size", "resize_batch"]

PRESET_NAMES = ("flip", "ssd", "detr", "yolo")
SSD_MEAN_FILL = (123, 117, 104)
"""Zoom-out fill of torchvision's SSD recipe (``references/detection/presets.py``: ImageNet mean x 255)."""
MIXUP_BETA = 32.0
"""Ultralytics ``MixUp``: blend ratio ~ Beta(32, 32)."""

_OPS = {"photometric": 1, "zoom_out": 2, "iou_crop": 3, "affine": 4, "mosaic": 5, "mixup": 6, "partners": 7,
        "mosaic_affine": 8, "colour": 9, "copy_paste": 10, "multi_scale": 11}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One resolved augmentation recipe (the preset's values with the user's ``train.*`` keys over them).

    Attributes:
        name: preset name (``flip``, ``ssd``, ``detr``, ``yolo``).
        photometric: probability of the colour op (``RandomPhotometricDistort`` for ssd/detr, the HSV-like
            ``ColorJitter`` for yolo), in [0, 1].
        zoom_out: largest side ratio of ``RandomZoomOut`` (``side_range=(1, zoom_out)``, p 0.5); 1 = off.
        iou_crop: probability that ``RandomIoUCrop`` is tried, in [0, 1].
        scale: random scale gain: the affine scale is drawn from ``[1 - scale, 1 + scale]``; 0 = off.
        translate: largest affine shift as a fraction of the image side (``RandomAffine(translate=(t, t))``).
        mosaic: probability of a 4-image mosaic per sample.
        mixup: probability of blending the sample with another (mosaic'd, when mosaic is on) sample.
        copy_paste: probability of pasting a random subset of another sample's objects onto the sample (`copy_paste`;
            mask datasets only); closed with the mosaic (``close_mosaic``), as Ultralytics' ``close_mosaic`` does.
        multi_scale: multi-scale training sizes per optimizer step (`step_size`): square sides in pixels, or a
            fraction f (the multiples of 32 within the cache's size x [1 - f, 1 + f]); 0 = off. Off with the mosaic.
        close_mosaic: the last this many epochs run without mosaic and mixup.
        stop_augment: the last this many epochs run with the flip only.
        epochs: ``train.epochs`` (where the closing epochs start).
        fill: zoom-out / mosaic / affine fill value, per channel (0..255).
        colour: ``"distort"`` (RandomPhotometricDistort) or ``"hsv"`` (ColorJitter with Ultralytics' gains).
    """
    name: str
    photometric: float = 0.0
    zoom_out: float = 1.0
    iou_crop: float = 0.0
    scale: float = 0.0
    translate: float = 0.0
    mosaic: float = 0.0
    mixup: float = 0.0
    copy_paste: float = 0.0
    multi_scale: float | tuple[int, ...] = 0.0
    close_mosaic: int = 0
    stop_augment: int = 0
    epochs: int = 1
    fill: tuple[int, int, int] = (0, 0, 0)
    colour: str = "distort"

    def mosaic_on(self, epoch: int) -> bool:
        """Whether mosaic/mixup run in ``epoch`` (0-based): not in the last ``close_mosaic`` nor ``stop_augment``
        epochs. A function of the epoch only, so it switches at the same iteration after a resume."""
        return epoch < self.epochs - max(self.close_mosaic, self.stop_augment)

    def per_image_on(self, epoch: int) -> bool:
        """Whether the per-image ops (colour, zoom-out, IoU crop, affine) run in ``epoch``: not in the last
        ``stop_augment`` epochs."""
        return epoch < self.epochs - self.stop_augment

    @property
    def is_flip_only(self) -> bool:
        return not (self.photometric or self.zoom_out > 1 or self.iou_crop or self.scale or self.translate
                    or self.mosaic or self.mixup or self.copy_paste)


def _presets(epochs: int) -> dict[str, Recipe]:
    close = max(1, round(0.1 * epochs))  # Ultralytics: close_mosaic 10 of its default 100 epochs
    return {
        "flip": Recipe("flip", epochs=epochs),
        "ssd": Recipe("ssd", photometric=0.5, zoom_out=4.0, iou_crop=1.0, fill=SSD_MEAN_FILL, epochs=epochs),
        # RT-DETRv2's BatchImageCollateFunction scales 480..800 around its 640: +-25 %
        "detr": Recipe("detr", photometric=0.5, zoom_out=4.0, iou_crop=0.8, stop_augment=1, multi_scale=0.25,
                       epochs=epochs),
        "yolo": Recipe("yolo", photometric=1.0, scale=0.5, translate=0.1, mosaic=1.0, mixup=0.0, close_mosaic=close,
                       fill=(YOLO_FILL,) * 3, colour="hsv", epochs=epochs),
    }


PRESETS = _presets(100)
"""The presets at 100 epochs (the closing epochs scale with ``train.epochs``: `resolve`)."""

TUNABLE = ("photometric", "zoom_out", "iou_crop", "scale", "translate", "mosaic", "mixup", "copy_paste",
           "close_mosaic", "stop_augment")
"""``train.*`` keys that override a preset's value (null keeps the preset's)."""


def default_augment(model_name: str) -> str:
    """The preset ``train.augment: auto`` means for ``model_name``: what its model family declares
    (`detpipe.models.family.Family.default_augment`: SSD and SSDlite ``ssd``, the transformers DETRs ``detr``, the
    other torchvision models ``flip``)."""
    from detpipe.models.family import family_of

    return family_of(model_name).default_augment(model_name)


def resolve(cfg) -> Recipe:
    """The `Recipe` of a ``train`` params section (`detpipe.params.Train`): preset ``cfg.augment`` (``auto``:
    `default_augment` of ``cfg.model``) with each non-null key of `TUNABLE` over it."""
    from detpipe.models.family import family_of

    name = default_augment(cfg.model) if cfg.augment == "auto" else cfg.augment
    base = _presets(cfg.epochs)[name]
    over = {k: getattr(cfg, k) for k in TUNABLE if getattr(cfg, k, None) is not None}
    ms = getattr(cfg, "multi_scale", None)
    if ms is not None:  # the user's sizes (a model that cannot take them is refused: build_detector)
        over["multi_scale"] = tuple(int(s) for s in ms) if isinstance(ms, list) else float(ms)
    elif not family_of(cfg.model).variable_input(cfg.model):
        over["multi_scale"] = 0.0  # a preset's sizes only where the model takes them
    return dataclasses.replace(base, **over)


def resolve_preset(name: str, epochs: int) -> Recipe:
    """Preset ``name`` (`PRESET_NAMES`) for a training of ``epochs`` epochs, no key overridden."""
    return _presets(epochs)[name]


def draw_seed(seed: int, epoch: int, index: int, op: str) -> int:
    """The seed of one random draw: a 63-bit integer hashed (sha256) from ``(seed, epoch, index, op)``."""
    key = f"{int(seed)}/{int(epoch)}/{int(index)}/{_OPS[op]}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def _seeded(seed: int, fn: Callable, *args):
    """``fn(*args)`` with torch's CPU generator seeded to ``seed``; the caller's generator state is restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn(*args)


def _fill(recipe: Recipe) -> dict:
    """v2 fill per input type: the recipe's colour for images, 0 (background) for masks."""
    return {tv_tensors.Image: list(recipe.fill), tv_tensors.Mask: 0}


def per_image_ops(recipe: Recipe) -> list[tuple[str, v2.Transform]]:
    """The recipe's per-image v2 transforms in order, as ``(op name, transform)`` (the op name keys its seed)."""
    ops: list[tuple[str, v2.Transform]] = []
    if recipe.photometric:
        if recipe.colour == "hsv":
            ops.append(("colour", v2.RandomApply([v2.ColorJitter(brightness=0.4, saturation=0.7, hue=0.015)],
                                                 p=recipe.photometric)))
        else:
            ops.append(("photometric", v2.RandomPhotometricDistort(p=recipe.photometric)))
    if recipe.zoom_out > 1:
        ops.append(("zoom_out", v2.RandomZoomOut(fill=_fill(recipe), side_range=(1.0, recipe.zoom_out))))
    if recipe.iou_crop:
        ops.append(("iou_crop", v2.RandomApply([v2.RandomIoUCrop()], p=recipe.iou_crop)))
    return ops


def _affine(recipe: Recipe) -> Optional[v2.Transform]:
    """``RandomAffine`` with the recipe's scale and translate (no rotation or shear), or None when both are 0."""
    if not (recipe.scale or recipe.translate):
        return None
    return v2.RandomAffine(degrees=0.0, translate=(recipe.translate, recipe.translate) if recipe.translate else None,
                           scale=(max(1e-3, 1 - recipe.scale), 1 + recipe.scale) if recipe.scale else None,
                           fill=_fill(recipe), interpolation=v2.InterpolationMode.BILINEAR)


_SANITIZE = v2.SanitizeBoundingBoxes(min_size=1)


def multi_scale_sizes(spec: float | tuple[int, ...], base: int) -> list[int]:
    """The square sides (pixels) a multi-scale spec draws from: a tuple as given; a fraction ``f`` the multiples of
    32 in ``[base (1 - f), base (1 + f)]`` (``base``: the cache's side; at least ``[base]``)."""
    if isinstance(spec, tuple):
        return list(spec)
    lo, hi = -(-int(round(base * (1 - spec))) // 32), int(base * (1 + spec)) // 32
    return [32 * k for k in range(max(1, lo), hi + 1)] or [base]


def step_size(recipe: Recipe, seed: int, epoch: int, iteration: int, base: int) -> Optional[int]:
    """The square side (pixels) every image of optimizer step ``iteration`` (0-based, global; of ``epoch``) is
    resized to, or None (multi-scale off: ``recipe.multi_scale`` 0, or a closing epoch, `Recipe.mosaic_on`). A
    function of ``(seed, epoch, iteration)``: every rank draws the same and a resumed run the same as an
    uninterrupted one (RT-DETR's ``BatchImageCollateFunction`` draws per batch, ``random.choice(scales)``)."""
    if not recipe.multi_scale or not recipe.mosaic_on(epoch):
        return None
    sizes = multi_scale_sizes(recipe.multi_scale, base)
    rng = np.random.default_rng([int(seed) % 2**63, epoch, iteration, _OPS["multi_scale"]])
    return int(sizes[int(rng.integers(0, len(sizes)))])


def resize_batch(images: list[torch.Tensor], targets: list[dict], size: int) -> tuple[list[torch.Tensor], list[dict]]:
    """Every image resized to ``size`` x ``size`` pixels with v2 ``F.resize`` (bilinear, antialias), its target's
    ``boxes`` (float32 ``(N, 4)`` XYXY pixels, as ``BoundingBoxes``) and ``masks`` (uint8 ``(N, H, W)``, nearest)
    by the same call; with masks, the boxes are then the resized masks' bounds and objects whose mask vanished are
    dropped (`boxes_from_masks`; counted in ``dropped`` when the target has it); other target keys unchanged. Runs
    on the tensors' device (CPU or CUDA). Images float32 ``(3, H, W)`` (or uint8)."""
    out_i, out_t = [], []
    for image, target in zip(images, targets):
        h, w = image.shape[-2:]
        if (h, w) == (size, size):
            out_i.append(image)
            out_t.append(target)
            continue
        t = dict(target)
        out_i.append(F.resize(image, [size, size], antialias=True))
        t["boxes"] = F.resize(tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=(h, w)),
                              [size, size]).as_subclass(torch.Tensor)
        if "masks" in target:  # nearest-neighbour masks move by up to a pixel: boxes from them (`boxes_from_masks`)
            fit = boxes_from_masks({"boxes": tv_tensors.BoundingBoxes(t["boxes"], format="XYXY",
                                                                      canvas_size=(size, size)),
                                    "labels": target["labels"],
                                    "masks": F.resize(tv_tensors.Mask(target["masks"]), [size, size])})
            gone = len(target["labels"]) - len(fit["labels"])
            t.update({k: v.as_subclass(torch.Tensor) if k != "labels" else v for k, v in fit.items()})
            if gone and "dropped" in t:
                t["dropped"] = t["dropped"] + gone
        out_t.append(t)
    return out_i, out_t


class TrainTransforms:
    """The train-time augmentation of one `Recipe`, called by `detpipe.data.dataset.CachedDetectionDataset` per
    sample (in the loader: DataLoader worker processes or the training process).

    ``load(j, epoch)`` gives sample ``j``'s cached, un-augmented, un-flipped sample (`make_sample`) — the mosaic
    and mixup partners. The output keeps the sample's cached size ``(H, W)`` (zoom-out / crops are resized back
    with v2 ``F.resize``), so a batch of a fixed-size cache stays one size.
    """

    def __init__(self, recipe: Recipe, seed: int, n_samples: int):
        self.recipe, self.seed, self.n = recipe, int(seed), int(n_samples)
        self.needs_masks = bool(recipe.copy_paste)  # the dataset must read masks even for a box-only model
        self.ops = per_image_ops(recipe)
        self.affine = _affine(recipe)

    def _per_image(self, sample: Sample, epoch: int, i: int, size: tuple[int, int]) -> Sample:
        for op, t in self.ops:
            sample = _seeded(draw_seed(self.seed, epoch, i, op), t, sample)
        if self.affine is not None:
            sample = _seeded(draw_seed(self.seed, epoch, i, "affine"), self.affine, sample)
        return to_size(_SANITIZE(sample), size)

    def _mosaic(self, i: int, epoch: int, first: Sample, load: Callable, size: tuple[int, int]) -> Sample:
        rng = np.random.default_rng([self.seed % 2**63, epoch, i, _OPS["mosaic"]])
        partners = rng.integers(0, self.n, 3).tolist()
        cx, cy = rng.uniform(0.5, 1.5) * size[1], rng.uniform(0.5, 1.5) * size[0]
        tiles = [first] + [to_size(load(j, epoch), size) for j in partners]
        canvas = mosaic(tiles, (cx, cy), size, self.recipe.fill)
        if self.affine is not None:
            canvas = _seeded(draw_seed(self.seed, epoch, i, "mosaic_affine"), self.affine, canvas)
        canvas = {k: (F.center_crop(v, list(size)) if k != "labels" else v) for k, v in canvas.items()}
        return _SANITIZE(canvas)

    def _one(self, i: int, epoch: int, sample: Sample, load: Callable, size: tuple[int, int]) -> Sample:
        """Sample ``i`` without mixup: mosaic (with its probability) or the per-image ops."""
        r = self.recipe
        if r.mosaic and r.mosaic_on(epoch) and \
                np.random.default_rng([self.seed % 2**63, epoch, i, _OPS["mosaic"], 0]).random() < r.mosaic:
            return self._mosaic(i, epoch, sample, load, size)
        if r.per_image_on(epoch):
            return self._per_image(sample, epoch, i, size)
        return sample

    def __call__(self, i: int, epoch: int, sample: Sample, flip: bool, load: Callable) -> tuple[Sample, int]:
        """Augment sample ``i`` of ``epoch`` (``sample``: its cached `make_sample`; ``flip``: the dataset's flip
        draw, `CachedDetectionDataset.flipped`). Returns ``(sample, dropped)``: the augmented sample (same size as
        the input, boxes XYXY pixels, sanitized by v2 ``SanitizeBoundingBoxes(min_size=1)``) and how many boxes
        the ops removed (objects of mixed-in partners and pasted objects count as added, so ``dropped`` is
        ``inputs - outputs`` over every sample that went in, never negative; an object copy-paste covered entirely
        counts as dropped). With masks (`boxes_from_masks`), an object whose mask no op left a pixel of (cut away,
        or a thin object shrunk by nearest-neighbour sampling) is dropped as well, and every box of a sample the
        ops ran on is its mask's pixel bounds (so boxes and masks agree after crops, zoom, mosaic and resizes; a
        sample in a closing epoch, which no op touched, keeps its cached boxes)."""
        r = self.recipe
        size = tuple(sample["image"].shape[-2:])
        n_in = len(sample["labels"])
        loaded = []

        def counting_load(j: int, e: int) -> Sample:
            s = load(j, e)
            loaded.append(len(s["labels"]))
            return s

        out = self._one(i, epoch, sample, counting_load, size)
        if r.mixup and r.mosaic_on(epoch):
            rng = np.random.default_rng([self.seed % 2**63, epoch, i, _OPS["mixup"]])
            if rng.random() < r.mixup:
                j = int(rng.integers(0, self.n))
                # the partner's own draws are keyed by a sample index past the dataset's, so they never repeat i's
                other = self._one(self.n + j, epoch, to_size(counting_load(j, epoch), size), counting_load, size)
                out = mixup(out, other, float(rng.beta(MIXUP_BETA, MIXUP_BETA)))
        pasted = 0
        if r.copy_paste and r.mosaic_on(epoch):
            rng = np.random.default_rng([self.seed % 2**63, epoch, i, _OPS["copy_paste"]])
            if rng.random() < r.copy_paste:
                if "masks" not in out:
                    raise ValueError("train.copy_paste needs samples with instance masks")
                src = to_size(load(int(rng.integers(0, self.n)), epoch), size)
                pick = torch.from_numpy(rng.random(len(src["labels"])) < 0.5).to(src["labels"].device)
                out, _ = copy_paste(out, src, pick)
                pasted = int(pick.sum())
        if "masks" in out:
            out = boxes_from_masks(out, recompute=out is not sample)
        if flip:
            out = {k: (F.horizontal_flip(v) if k != "labels" else v) for k, v in out.items()}
        return out, n_in + sum(loaded) + pasted - len(out["labels"])
