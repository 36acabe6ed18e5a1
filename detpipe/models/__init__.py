"""Build detection models by name (one module per model library, a `detpipe.models.family.Family` each:
`detpipe.models.torchvision_family`, `detpipe.models.transformers_family`) (the train stage's detector sized for its cache: `build_detector`)
and load weights from a path, URL or torchvision name.

Both sides of the train stage's process boundary use `build_detector`: every worker builds the model it trains, the
launcher builds the same one on the meta device to check the inputs before any worker starts (no weights, no
memory).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torchvision
from torch import nn

from detpipe.models.family import all_model_names, family_of, family_of_model  # noqa: F401  (public here)
from detpipe.models.registry import Family  # noqa: F401  (public here)
from detpipe.models import hf_weights  # noqa: F401  (imported first: records the user's HF_HUB_OFFLINE)

from detpipe.core.errors import StageError
from detpipe.core.files import is_url, read_url_bytes
from detpipe.core.model_file import load_model_file
from detpipe.core.paths import ARROW_META, CACHE_DIR, MODEL

if TYPE_CHECKING:
    from detpipe.params import Train

log = logging.getLogger("detpipe.models")


def detection_model_names() -> list[str]:
    """Every ``train.model`` name: torchvision's detection builders and the transformers family's (sorted)."""
    return all_model_names()


def uses_masks(model: nn.Module) -> bool:
    """Whether a detection model trains on and predicts instance masks, as its family says
    (`detpipe.models.registry.Family.uses_masks`: torchvision's Mask R-CNN, whose ``roi_heads`` has a mask head);
    such a model needs ``with_masks=True`` data (`detpipe.data.dataset.CachedDetectionDataset`)."""
    return bool(family_of_model(model).uses_masks(model))


def build_model(name: str, num_classes: int, **kwargs) -> nn.Module:
    """The untrained model ``name`` of its family (`family_of`), random init, nothing downloaded.

    Args:
        name: a torchvision detection builder (``ssdlite320_mobilenet_v3_large``, ``fasterrcnn_resnet50_fpn``) or a
            transformers-family name (``rtdetr_v2_r18vd``, ``dfine_n``: `detpipe.models.transformers_family`).
        num_classes: number of classes including background (label 0).
        kwargs: the family's builder kwargs (`model_kwargs`).
    Raises:
        StageError: unknown model name (the message lists the valid ones).
    """
    return family_of(name).build(name, num_classes, **kwargs)


def _read_weights_bytes(source: str, sha256: str | None) -> bytes:
    data = read_url_bytes(source, "train.weights")
    if sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise StageError(f"train.weights: '{source}' sha256 is {actual}, params say {sha256}")
    return data


def load_weights(model: nn.Module, source: str, sha256: str | None = None) -> dict:
    """Load a state_dict into ``model``, keeping tensors whose shape differs (e.g. a head trained for
    another number of classes) at their initial values.

    ``source`` is a local path or fsspec URL (``http(s)://``, ``s3://``) to a ``torch.save``'d state_dict
    (or a dict holding one under ``"model"``), read with ``torch.load(weights_only=True)`` and checked
    against ``sha256`` when given; or a torchvision weights name of the model (e.g. ``COCO_V1``), which
    needs internet access.

    For a transformers-family model, ``source`` may also be a Hugging Face model folder (``config.json`` +
    ``model.safetensors``; ``sha256`` is its folder-manifest digest), a ``.safetensors`` file or a hub id (online
    only): `detpipe.models.hf_weights.load_hf_weights`.

    Returns ``{"loaded": n, "skipped": [keys]}``.
    Raises:
        StageError: unreadable source, sha256 mismatch, unknown weights name, or offline download.
    """
    from detpipe.models.hf_weights import load_hf_weights, wants_hf_loader
    if wants_hf_loader(model, source):
        return load_hf_weights(model, source, sha256)
    is_path = is_url(source) or "/" in source or source.endswith((".pt", ".pth"))
    if is_path:
        try:
            state = torch.load(io.BytesIO(_read_weights_bytes(source, sha256)), map_location="cpu",
                               weights_only=True)
        except StageError:
            raise
        except Exception as e:
            raise StageError(f"train.weights: '{source}' is not a torch state_dict file ({e})") from None
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            config = state.get("config")
            own_classes = getattr(model, "_detpipe_num_classes", None)
            if isinstance(config, dict) and own_classes is not None and config.get("num_classes") != own_classes:
                log.info("%s was trained for %s classes, this model has %d: its head is re-initialised",
                         source, config.get("num_classes"), own_classes)
            state = state["model"]
    else:
        name = getattr(model, "_detpipe_name", None)
        try:
            enum = torchvision.models.get_model_weights(name)
            weights = enum[source]
        except (KeyError, ValueError):
            raise StageError(f"train.weights: '{source}' is neither a file nor a torchvision weights name "
                             f"of {name}") from None
        try:
            state = weights.get_state_dict(progress=False)
        except OSError as e:
            raise StageError(f"train.weights: torchvision weights {name}.{source} need a download from "
                             f"{weights.url}, which failed (offline?): {e}") from None
    own = model.state_dict()
    keep = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    skipped = sorted(set(state) - set(keep))
    model.load_state_dict(keep, strict=False)
    log.info("loaded %d tensors from %s; kept initial values for %d (shape or name differ): %s",
             len(keep), source, len(skipped), skipped[:8])
    return {"loaded": len(keep), "skipped": skipped}


def model_config(name: str, num_classes: int, **kwargs) -> dict:
    """The plain-dict description stored beside weights so later stages rebuild the same model."""
    return {"name": name, "num_classes": num_classes, "kwargs": kwargs}


def build_from_config(config: dict) -> nn.Module:
    """Rebuild a model from `model_config`'s dict (weights not loaded)."""
    model = build_model(config["name"], config["num_classes"], **config.get("kwargs", {}))
    model._detpipe_name = config["name"]
    model._detpipe_num_classes = config["num_classes"]
    return model


def load_model(path: Path | str = MODEL, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict]:
    """Rebuild the trained model from ``models/model.pt`` (eval mode). Returns ``(model, checkpoint)``.
    Raises `StageError` if the file is missing."""
    ckpt = load_model_file(path)
    model = build_from_config(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt


def model_kwargs(name: str, cache_meta: dict) -> dict:
    """Builder kwargs so the model takes the cached size (no second resize): the family's sizing rule
    (`detpipe.models.family.Family.model_kwargs`).

    torchvision: ``{}`` for SSD models (the cache must be ``fixed`` at the builder's size), else
    ``{"min_size": int, "max_size": int}`` (pixels) from the cache's resize settings. transformers:
    ``{"size": int}`` (a ``fixed`` cache, a multiple of 32 pixels).

    Args:
        name: ``train.model``.
        cache_meta: the augmentation cache's ``meta.json`` as a dict (``resize``, ``size``, ``min_size``,
            ``max_size``; sizes in pixels).
    Raises:
        StageError: a cache of a size or mode the model cannot take (one line naming augment.resize/size).
    """
    return family_of(name).model_kwargs(name, cache_meta)


# What the AdamW refusal tells the user to pass (dvc exp run / python -m stages.train -S ...): RT-DETRv2's recipe
# (arXiv:2407.17140; lyuwenyu/RT-DETR rtdetrv2 configs: lr 1e-4, backbone 1e-5, weight decay 1e-4).
ADAMW_RECIPE_ARGS = "-S train.lr=0.0001 -S train.weight_decay=0.0001"


def optimizer_recipe(cfg: Train) -> tuple[str, float, str]:
    """``(kind, backbone lr multiplier, backbone parameter prefix)`` for ``cfg``: ``train.optimizer`` (``auto``: the
    family's, `detpipe.models.family.Family.optimizer`: ``sgd`` for torchvision, ``adamw`` for transformers) and
    ``train.backbone_lr_mult`` (null: the family's, 1.0 for torchvision, 0.1 for transformers as RT-DETR's and
    D-FINE's configs).

    Raises:
        StageError: AdamW with ``train.lr`` above 0.01 (one line naming what to pass, `ADAMW_RECIPE_ARGS`: the papers'
            AdamW lr is 1e-4 to 4e-4; 0.05, the SGD default, diverges).
    """
    fam = family_of(cfg.model)
    kind = fam.optimizer if cfg.optimizer == "auto" else cfg.optimizer
    mult = fam.backbone_lr_mult if cfg.backbone_lr_mult is None else cfg.backbone_lr_mult
    if kind == "adamw" and cfg.lr > 0.01:
        raise StageError(f"params.yaml: train.lr={cfg.lr} with AdamW (train.optimizer: {cfg.optimizer}, model "
                         f"{cfg.model}) diverges: pass {ADAMW_RECIPE_ARGS} (RT-DETRv2's recipe: AdamW lr 1e-4, "
                         f"backbone 1e-5 = train.backbone_lr_mult 0.1, weight decay 1e-4; 0.05 is SGD's lr)")
    return kind, float(mult), fam.backbone_prefix


def build_detector(cfg: Train, arrow_meta: Path = ARROW_META, cache_dir: Path = CACHE_DIR,
                   device: torch.device | str | None = None) -> tuple[nn.Module, dict, bytes]:
    """The untrained model ``cfg.model`` sized for the cache (`model_kwargs`), with the cache's masks checked
    for a mask model (`uses_masks`, `detpipe.data.dataset.check_cache_masks`).

    Args:
        cfg: the train params (``model``, ``cache_url``).
        arrow_meta: the convert stage's ``meta.json`` (``num_classes``).
        cache_dir: the augmentation cache, read unless ``cfg.cache_url`` names another.
        device: where the model's tensors are made: None builds it as training needs it (initialized weights on
            the CPU, drawing from torch's RNG); ``"meta"`` builds the structure only (no memory, no
            initialization, no RNG draw), what the launcher checks the inputs with (`detpipe.launch.jobs`).
    Returns:
        ``(model, config, cache meta.json bytes)``: ``config`` is `model_config`'s dict.
    Raises:
        StageError: missing inputs (either ``meta.json``), unknown model, an SSD model on a cache of another size
            (`model_kwargs`), a mask model, or ``train.copy_paste``, on a cache without masks; ``train.multi_scale``
            for a model that takes one input size (`detpipe.models.family.Family.variable_input`).
    """
    from detpipe.data.dataset import check_cache_masks
    from detpipe.data.meta import read_cache_meta_bytes, read_meta

    meta = read_meta(arrow_meta)
    cache_root = cfg.cache_url or str(cache_dir)
    cache_meta_bytes = read_cache_meta_bytes(cache_root)
    cache_meta = json.loads(cache_meta_bytes)
    optimizer_recipe(cfg)  # an unusable optimizer choice fails here, in the launcher, before any worker starts
    config = model_config(cfg.model, int(meta["num_classes"]), **model_kwargs(cfg.model, cache_meta))
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = build_from_config(config)
    if uses_masks(model):  # Mask R-CNN: targets carry the cached instance masks
        check_cache_masks(cache_meta, cfg.model, f"{cache_root.split('?')[0]}/meta.json")
    multi_scale = getattr(cfg, "multi_scale", None)
    if multi_scale and not family_of(cfg.model).variable_input(cfg.model):
        raise StageError(f"params.yaml: train.multi_scale {multi_scale}: model '{cfg.model}' takes one input size "
                         f"(its own transform resizes every image to it again, {cache_meta.get('size')} px for SSD): "
                         f"set train.multi_scale: null or 0, or use a model with variable input size "
                         f"(rtdetr_v2_*, dfine_*)")
    copy_paste = getattr(cfg, "copy_paste", None)
    if copy_paste and not cache_meta.get("masks"):  # the preset never sets it: only the key turns it on
        raise StageError(f"params.yaml: train.copy_paste {copy_paste} needs instance masks, but "
                         f"{cache_root.split('?')[0]}/meta.json has none (copy-paste pastes objects by their masks: "
                         f"use a dataset with segmentations, or set train.copy_paste: null)")
    return model, config, cache_meta_bytes
