"""The trained-model file: ``models/model.pt`` (the train stage's output) and ``checkpoints/best.pt`` (the best
evaluation of a training), written and read here only.

The file is ``torch.save`` of a dict: ``model`` (the state_dict), ``config`` (what `detpipe.models.build_from_config`
rebuilds the architecture from: ``name``, ``num_classes``, ``kwargs``), ``iters`` (iterations trained), then the
writer's extra keys (model.pt: ``ema``, ``fingerprint``, ``params``; best.pt: ``AP``), in that order (the order is
part of the file's bytes, hence of its md5 in dvc.lock). Read with ``weights_only=True``: tensors and plain types only.
"""
from __future__ import annotations

from pathlib import Path

from detpipe.core.errors import StageError
from detpipe.core.files import atomic_open


def save_torch_atomic(obj, path: Path | str) -> None:
    """``torch.save(obj)`` to ``path`` atomically (`detpipe.core.files.atomic_open`: temporary file, fsync, rename)."""
    import torch

    with atomic_open(path) as f:
        torch.save(obj, f)


def save_model_file(path: Path | str, weights: dict, config: dict, iters: int, **extra) -> None:
    """Write a model file (module docstring) atomically: ``{"model": weights, "config": config, "iters": iters,
    **extra}``."""
    save_torch_atomic({"model": weights, "config": config, "iters": iters, **extra}, path)


def load_model_file(path: Path | str, missing: str = "run the train stage first") -> dict:
    """A model file's dict (module docstring), tensors on the CPU.

    Raises:
        StageError: ``<path>: not found (<missing>)``.
    """
    import torch

    if not Path(path).is_file():
        raise StageError(f"{path}: not found ({missing})")
    return torch.load(path, map_location="cpu", weights_only=True)
