"""Build torchvision detection models by name and load weights from a path, URL or torchvision name."""
from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path

import torch
import torchvision
from torch import nn

from detpipe.errors import StageError
from detpipe.files import is_url, read_url_bytes
from detpipe.paths import MODEL

log = logging.getLogger("detpipe.models")


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
        StageError: unknown model name (the message lists the valid ones).
    """
    names = detection_model_names()
    if name not in names:
        raise StageError(f"params.yaml: key 'train.model': unknown model '{name}'; torchvision detection "
                         f"models are: {', '.join(names)}")
    return torchvision.models.get_model(name, weights=None, weights_backbone=None,
                                        num_classes=num_classes, **kwargs)


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

    Returns ``{"loaded": n, "skipped": [keys]}``.
    Raises:
        StageError: unreadable source, sha256 mismatch, unknown weights name, or offline download.
    """
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
    return model


def load_model(path: Path | str = MODEL, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict]:
    """Rebuild the trained model from ``models/model.pt`` (eval mode). Returns ``(model, checkpoint)``.
    Raises `StageError` if the file is missing."""
    if not Path(path).is_file():
        raise StageError(f"{path}: not found (run the train stage first)")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = build_from_config(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt
