"""Preparing predict's images as the augment stage prepared the training and val images (`prepare`), with the
settings of the run that trained the model (`data_meta`, `preprocess_config`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from detpipe import params as params_mod
from detpipe.data.augmentation import encode_pixels, resize_pixels, target_size
from detpipe.data.dataset import decode_images
from detpipe.data.imageio import decode_rgb
from detpipe.data.meta import read_meta
from detpipe.core.errors import StageError

PREPROCESS_KEYS = ("resize", "size", "min_size", "max_size", "upscale", "encoding", "jpeg_quality")


@dataclasses.dataclass
class Prepared:
    """One decoded image ready for the model.

    ``image``: ``float32 (3, h, w)`` RGB in [0, 1], h and w the prepared size in pixels; ``pixels``: the decoded
    original, ``uint8 (3, H, W)`` RGB (for drawing); ``scale``: ``(scale_y, scale_x)`` prepared pixels per original
    pixel (``h / H``, ``w / W``)."""

    image: torch.Tensor
    pixels: torch.Tensor
    scale: tuple[float, float]

    @property
    def orig_size(self) -> tuple[int, int]:
        """``(H, W)`` of the original image in pixels (after EXIF orientation)."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[2])


def preprocess_config(cache_meta: dict, where: str = "data/cache/meta.json") -> params_mod.Augment:
    """The augment stage's resize and encoding settings recorded in the cache's ``meta.json``
    (`detpipe.data.augment.build_cache` writes them), as an ``augment`` params section for `prepare`.
    Raises `StageError` naming ``where`` when a setting is missing or invalid."""
    missing = [k for k in PREPROCESS_KEYS[:-1] if k not in cache_meta]
    if missing:
        raise StageError(f"{where}: no {', '.join(missing)} (made by an older augment stage: re-run it)")
    try:
        return params_mod.Augment(**{k: cache_meta[k] for k in PREPROCESS_KEYS if cache_meta.get(k) is not None})
    except ValueError as e:
        raise StageError(f"{where}: invalid preprocessing settings ({' '.join(str(e).split())})") from None


def data_meta(data_dir: Path) -> tuple[dict, params_mod.Augment]:
    """The data facts predict needs from the run that trained the model: ``data_dir/arrow/meta.json`` (the
    convert stage's: ``category_id_to_label``, ``label_names``, ``num_classes``) and the preprocessing of
    ``data_dir/cache/meta.json`` (the augment stage's, `preprocess_config`).
    Raises `StageError` naming the missing or invalid file and what it is needed for."""
    metas = []
    for rel, stage, why in (("arrow/meta.json", "convert", "the dataset's category ids and names"),
                            ("cache/meta.json", "augment", "the resize rule the model was trained with")):
        path = data_dir / rel
        if not path.is_file():
            raise StageError(f"{path}: not found; predict reads {why} from it (the {stage} stage writes it: run "
                             "`dvc repro`, or pass --data DIR of the run that trained the model)")
        metas.append(read_meta(path))
    missing = [k for k in ("category_id_to_label", "label_names", "num_classes") if k not in metas[0]]
    if missing:
        raise StageError(f"{data_dir / 'arrow/meta.json'}: no {', '.join(missing)} (re-run the convert stage)")
    return metas[0], preprocess_config(metas[1], str(data_dir / "cache/meta.json"))


def prepare(data: bytes, name: str, cfg: params_mod.Augment) -> Prepared:
    """Decode one encoded image and prepare it as the augment stage prepared training and val images:
    `detpipe.data.imageio.decode_rgb`, resize to `detpipe.data.augmentation.target_size` (bilinear, antialias:
    `detpipe.data.augmentation.resize_pixels`), with ``cfg.encoding == "jpeg"`` the cache's JPEG round trip
    (`detpipe.data.augmentation.encode_pixels` at ``cfg.jpeg_quality``, decoded by
    `detpipe.data.dataset.decode_images` as the loader does), then ``/ 255`` to float32.

    Args:
        data: the file's bytes.
        name: the file's name, for errors.
        cfg: the preprocessing settings (`preprocess_config`).
    Returns:
        `Prepared` (shapes and units there).
    Raises:
        StageError: the bytes are not a readable image (names ``name``).
    """
    pixels = decode_rgb(data, name)
    oh, ow = pixels.shape[:2]
    h, w = target_size(oh, ow, cfg)
    chw = resize_pixels(pixels, (h, w))
    if cfg.encoding == "jpeg":
        u8 = decode_images([torch.frombuffer(bytearray(encode_pixels(chw, cfg)), dtype=torch.uint8)])[0]
    else:
        u8 = torch.from_numpy(chw)
    image = u8.to(torch.float32, memory_format=torch.contiguous_format).mul_(1.0 / 255)  # as the loader does
    return Prepared(image, torch.from_numpy(pixels).permute(2, 0, 1), (h / oh, w / ow))
