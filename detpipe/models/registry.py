"""The model families' registry: what a model library ("family") declares (`Family`), and the list the families
register into (`register`). This module imports nothing of the project and no model library: the family modules
(`detpipe.models.torchvision_family`, `detpipe.models.transformers_family`) import it to register themselves,
and the lookups (`detpipe.models.family.family_of`) import the family modules, so no module imports back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Family:
    """One model library's declarations.

    Attributes:
        name: ``torchvision`` or ``transformers``.
        names: the ``train.model`` names it builds (sorted), computed lazily (importing the library).
        owns: whether a ``train.model`` name is this family's (no library import).
        sizing: ``keep_ratio_or_fixed`` (the model resizes itself: R-CNN, RetinaNet, FCOS take either cache),
            ``native_fixed`` (SSD: a fixed cache at the builder's own size) or ``fixed`` (DETRs: a fixed square
            cache, any multiple of 32 pixels).
        optimizer: the optimizer recipe of the family's papers that ``train.optimizer: auto`` picks: ``sgd``
            (torchvision's references/detection) or ``adamw`` (RT-DETR / D-FINE).
        backbone_lr_mult: the backbone's lr factor ``train.backbone_lr_mult: null`` picks (1.0 = none).
        default_augment: the ``train.augment`` preset name suited to a model name (``ssd``, ``detr`` or ``flip``).
        model_kwargs: ``(name, cache meta.json dict) -> builder kwargs`` (raises `StageError` on a size mismatch).
        build: ``(name, num_classes incl. background, **kwargs) -> nn.Module`` with torchvision detection's
            interface (``model(images, targets) -> losses`` in train mode, ``-> detections`` in eval mode).
        uses_masks: ``model -> bool``: trains on and predicts instance masks.
        raw_taps: ``model -> [dotted submodule paths]`` whose outputs are the pre-NMS raw outputs the export
            parity gate compares.
        torch_export_supported: ``model -> bool``: torch.export can trace it.
        backbone_prefix: dotted prefix of the backbone's parameters (for ``backbone_lr_mult``).
        variable_input: ``name -> bool``: the model trains on batches of another square size than the cache's
            (``train.multi_scale``); False where its own transform resizes every input to one size again (SSD's
            fixed 300/320, R-CNN's ``min_size``), which would undo the multi-scale sizes.
    """
    name: str
    owns: Callable[[str], bool]
    names: Callable[[], list[str]]
    sizing: str
    optimizer: str
    backbone_lr_mult: float
    default_augment: Callable[[str], str]
    model_kwargs: Callable
    build: Callable
    uses_masks: Callable
    raw_taps: Callable
    torch_export_supported: Callable
    backbone_prefix: str = "backbone."
    variable_input: Callable[[str], bool] = lambda name: False
    notes: dict = field(default_factory=dict)


_FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Add ``family`` to the registry; torchvision's is asked last (it is the fallback: any name no other family
    owns goes to its builder, which fails with the list of names)."""
    if family.name == "torchvision":
        _FAMILIES.append(family)
    else:
        _FAMILIES.insert(0, family)
    return family


def registered() -> list[Family]:
    """The registered families, in lookup order (torchvision's last); only those whose module was imported
    (`detpipe.models.family` imports them all before it looks)."""
    return list(_FAMILIES)


def registered_names() -> list[str]:
    """Every ``train.model`` name of the registered families (sorted)."""
    return sorted({n for fam in _FAMILIES for n in fam.names()})
