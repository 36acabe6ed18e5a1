"""torchvision's detection builders as a model family (`detpipe.models.registry.Family`): SSD/SSDlite, RetinaNet,
FCOS, Faster/Mask/Keypoint R-CNN, built by ``torchvision.models.get_model`` with random init.

What the other stages used to find by name prefix or module attributes lives here: the input sizing
(`model_kwargs`), masks (`uses_masks`), the raw pre-NMS outputs the export parity gate compares (`raw_taps`),
whether torch.export traces the model (`torch_export_supported`), and the SGD recipe of torchvision's
references/detection.
"""
from __future__ import annotations

import torch
import torchvision
from torch import nn

from detpipe.core.errors import StageError
from detpipe.models.registry import Family, register, registered_names


def detection_model_names() -> list[str]:
    """Names torchvision's ``get_model`` builds in ``torchvision.models.detection`` (sorted)."""
    return sorted(torchvision.models.list_models(module=torchvision.models.detection))


def build_model(name: str, num_classes: int, **kwargs) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=...)``.

    Args:
        name: a torchvision detection builder, e.g. ``ssdlite320_mobilenet_v3_large``, ``fasterrcnn_resnet50_fpn``.
        num_classes: number of classes including background (label 0).
        kwargs: passed to the builder (e.g. ``min_size``, ``max_size`` for R-CNN, RetinaNet, FCOS).
    Raises:
        StageError: unknown model name (the message lists the valid ones, of every family).
    """
    names = detection_model_names()
    if name not in names:
        raise StageError(f"params.yaml: key 'train.model': unknown model '{name}'; the models are: "
                         f"{', '.join(registered_names())}")
    return torchvision.models.get_model(name, weights=None, weights_backbone=None,
                                        num_classes=num_classes, **kwargs)


def model_kwargs(name: str, cache_meta: dict) -> dict:
    """Builder kwargs so the model's own transform keeps the cached size (no second resize).

    SSD/SSDlite resize to a fixed size set by the builder: the cache must be ``fixed`` at that size.
    The others (R-CNN, RetinaNet, FCOS) get ``min_size``/``max_size`` from the cache's resize settings.

    Args:
        name: the torchvision builder (``train.model``).
        cache_meta: the augmentation cache's ``meta.json`` as a dict (``resize``, ``size``, ``min_size``,
            ``max_size``; sizes in pixels).
    Returns:
        ``{}`` for SSD models, else ``{"min_size": int, "max_size": int}`` (pixels).
    Raises:
        StageError: an SSD model with a cache of another size or mode.
    """
    if name.startswith("ssd"):
        native = 320 if name.startswith("ssdlite320") else 300 if name.startswith("ssd300") else None
        if cache_meta["resize"] != "fixed" or (native and cache_meta["size"] != native):
            raise StageError(f"params.yaml: {name} resizes images to {native}x{native}; set augment.resize: fixed "
                             f"and augment.size: {native} (cache has {cache_meta['resize']} {cache_meta['size']})")
        return {}
    if cache_meta["resize"] == "fixed":
        return {"min_size": cache_meta["size"], "max_size": cache_meta["size"]}
    return {"min_size": cache_meta["min_size"], "max_size": cache_meta["max_size"]}


def uses_masks(model: torch.nn.Module) -> bool:
    """Whether a torchvision detection model trains on and predicts instance masks (Mask R-CNN: its
    ``roi_heads`` has a mask head, ``RoIHeads.has_mask()``); such a model needs ``with_masks=True`` data."""
    heads = getattr(model, "roi_heads", None)
    return bool(heads is not None and hasattr(heads, "has_mask") and heads.has_mask())


def raw_taps(model: torch.nn.Module) -> list[str]:
    """Dotted paths of the submodules whose outputs are the pre-NMS raw outputs: ``["rpn.head"]`` for
    torchvision's R-CNN models (``model.rpn``), ``["head"]`` for SSD/SSDlite/RetinaNet/FCOS; ``[]`` otherwise."""
    if hasattr(model, "rpn") and hasattr(model.rpn, "head"):
        return ["rpn.head"]
    return ["head"] if isinstance(getattr(model, "head", None), torch.nn.Module) else []


def torch_export_supported(model: torch.nn.Module) -> bool:
    """Whether torch.export can trace ``model``: SSD/SSDlite, RetinaNet, FCOS yes; torchvision's R-CNN models
    (Faster/Mask/Keypoint R-CNN) no (torch 2.14 / torchvision 0.29: ``GuardOnDataDependentSymNode`` in their
    proposal filtering)."""
    return raw_taps(model) != ["rpn.head"]


def default_augment(name: str) -> str:
    """``ssd`` for SSD/SSDlite (their papers' photometric + expand + min-IoU crop), ``flip`` for the rest."""
    return "ssd" if name.startswith("ssd") else "flip"


TORCHVISION = register(Family(
    name="torchvision", owns=lambda name: True, names=detection_model_names, sizing="keep_ratio_or_fixed",
    optimizer="sgd", backbone_lr_mult=1.0, default_augment=default_augment, model_kwargs=model_kwargs,
    build=build_model, uses_masks=uses_masks, raw_taps=raw_taps, torch_export_supported=torch_export_supported,
    notes={"sizing": "SSD/SSDlite: augment.resize fixed at the builder's size (300 or 320); others either mode"}))
