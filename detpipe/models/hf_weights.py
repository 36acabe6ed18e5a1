"""``train.weights`` for the transformers family (`detpipe.models.transformers_family.HFDetector`): a local Hugging
Face model folder (``config.json`` + ``model.safetensors``, as ``save_pretrained`` writes it), a single
``.safetensors`` file, or a hub id (``PekingU/rtdetr_v2_r18vd``, ``ustc-community/dfine-small-coco``; online only).

The tensors are read by transformers' own ``from_pretrained`` into a model of the chosen ``train.model``'s config
(so its checkpoint key conversions apply), then copied into the wrapper. A class head trained for another number of
classes (``class_embed``, ``enc_score_head``, ``denoising_class_embed``) is re-initialised and logged; any other
difference (missing, unexpected or differently shaped tensors) means another architecture and is refused.

Pinning: ``train.weights_sha256`` is the folder-manifest digest of the download stage (`detpipe.core.files.folder_sha256`,
``python -m stages.download --print-sha256 <folder>``) for a folder or a hub snapshot, the file's sha256 for a file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from torch import nn

from detpipe.core.errors import StageError
from detpipe.core.files import folder_sha256, is_url, read_url_bytes

log = logging.getLogger("detpipe.models")

KEY = "params.yaml: key 'train.weights'"
# Captured before `detpipe.models.transformers_family.hf_config` sets HF_HUB_OFFLINE=1 for its own (config-only)
# use: whether the user asked for offline mode.
_USER_OFFLINE = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
# transformers' model_type of each of our architectures
_MODEL_TYPE = {"rtdetr_v2": "rt_detr_v2", "dfine": "d_fine"}
_HEAD_KEYS = ("class_embed", "enc_score_head", "denoising_class_embed")
# what a hub download fetches: the folder `load_hf_folder` reads (its manifest digest is the pin)
HUB_FILES = ["config.json", "model.safetensors"]


def is_hub_id(source: str) -> bool:
    """``owner/name`` that is no existing path, URL or weights file name: a Hugging Face hub model id."""
    parts = source.split("/")
    return (len(parts) == 2 and all(parts) and not is_url(source) and not source.startswith((".", "~"))
            and not source.endswith((".pt", ".pth", ".safetensors")) and not Path(source).exists())


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "hf") and hasattr(model, "detpipe_model_name")


def wants_hf_loader(model: nn.Module, source: str) -> bool:
    """True when ``source`` is a Hugging Face folder, ``.safetensors`` file or hub id (`load_hf_weights`)."""
    return (source.endswith(".safetensors") or Path(source).is_dir() or is_hub_id(source))


def _check_model(model: nn.Module, source: str) -> str:
    if not _is_hf(model):
        raise StageError(f"{KEY}: '{source}' is a Hugging Face checkpoint; train.model "
                         f"{getattr(model, '_detpipe_name', '?')} is not of the transformers family (rtdetr_v2_*, "
                         f"dfine_*): use a torch state_dict file")
    from detpipe.models.transformers_family import CONFIGS
    return _MODEL_TYPE[CONFIGS[model.detpipe_model_name][0]]


def check_hub_offline(source: str) -> None:
    """Raise the one-line offline error for a hub id when the user set ``HF_HUB_OFFLINE`` (the launcher calls it
    before any worker starts, `detpipe.launch.jobs.check_inputs`)."""
    if is_hub_id(source) and _USER_OFFLINE:
        raise StageError(f"{KEY}: '{source}' is a Hugging Face hub id, and HF_HUB_OFFLINE is set: no download "
                         f"(offline); use a local model folder (config.json + model.safetensors)")


def _hub_download(repo_id: str) -> Path:
    check_hub_offline(repo_id)
    import huggingface_hub
    from huggingface_hub import constants
    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False   # hf_config sets it for config-only use; the user did not ask for it
    try:
        path = huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_FILES, etag_timeout=10)
    except Exception as e:
        raise StageError(f"{KEY}: '{repo_id}' is a Hugging Face hub id; its download failed (offline?): "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        constants.HF_HUB_OFFLINE = saved
    return Path(path)


def load_hf_weights(model: nn.Module, source: str, sha256: str | None = None) -> dict:
    """Load a Hugging Face folder, ``.safetensors`` file or hub id into the transformers-family ``model``.

    Returns ``{"loaded": n, "skipped": [keys re-initialised]}`` (keys of the wrapper, ``hf.`` prefixed).
    Raises:
        StageError: one line naming ``train.weights``: a torchvision model, a folder without config.json /
            model.safetensors, another architecture (model_type or any tensor other than a class head differing),
            an sha256 mismatch, a hub id offline or its failed download.
    """
    arch_type = _check_model(model, source)
    with tempfile.TemporaryDirectory(prefix="detpipe-hfw-") as tmp:
        if source.endswith(".safetensors"):
            data = read_url_bytes(source, "train.weights")
            actual = hashlib.sha256(data).hexdigest()
            folder = Path(tmp)
            (folder / "model.safetensors").write_bytes(data)
            model.hf.config.to_json_file(str(folder / "config.json"))
        else:
            folder = _hub_download(source) if is_hub_id(source) else Path(source)
            for name in HUB_FILES:
                if not (folder / name).is_file():
                    raise StageError(f"{KEY}: '{source}' is a folder without {name} (a Hugging Face model folder "
                                     f"has config.json + model.safetensors, as save_pretrained writes them)")
            actual = folder_sha256(folder)
            try:
                their_type = json.loads((folder / "config.json").read_text()).get("model_type")
            except (OSError, ValueError) as e:
                raise StageError(f"{KEY}: {folder / 'config.json'} is not a JSON config ({e})") from None
            if their_type != arch_type:
                raise StageError(f"{KEY}: '{source}' is a {their_type} model, train.model "
                                 f"{model.detpipe_model_name} is {arch_type}")
        if sha256 is not None and actual != sha256:
            what = "file" if source.endswith(".safetensors") else "folder manifest"
            raise StageError(f"{KEY}: '{source}' {what} sha256 is {actual}, train.weights_sha256 says {sha256}")
        try:
            loaded, info = type(model.hf).from_pretrained(str(folder), config=model.hf.config,
                                                          ignore_mismatched_sizes=True, output_loading_info=True)
        except Exception as e:
            raise StageError(f"{KEY}: '{source}' could not be read by transformers: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
    mismatched = sorted(k for k, *_ in info.get("mismatched_keys", []))
    other = sorted(set(info.get("missing_keys", [])) | set(info.get("unexpected_keys", [])) |
                   {k for k in mismatched if not any(h in k for h in _HEAD_KEYS)})
    if other:
        raise StageError(f"{KEY}: '{source}' is another architecture than train.model {model.detpipe_model_name}: "
                         f"{len(other)} tensors missing, unexpected or of another shape (first: {other[0]})")
    state = loaded.state_dict()
    model.hf.load_state_dict(state)
    reinit = {state[k].data_ptr() for k in mismatched if k in state}   # tied copies (class_embed) included
    skipped = sorted("hf." + k for k, v in state.items() if v.data_ptr() in reinit)
    if skipped:
        log.info("%s was trained for another number of classes than this model's %d: its class heads are "
                 "re-initialised (%d tensors: %s)", source, model.hf.config.num_labels, len(skipped), skipped[:4])
    n = len(model.hf.state_dict()) - len(skipped)
    log.info("loaded %d tensors from %s (sha256 %s)", n, source, actual)
    return {"loaded": n, "skipped": skipped}
