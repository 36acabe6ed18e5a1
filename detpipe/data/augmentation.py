"""Per-image work of the augment stage: target size, resize, JPEG encoding, SSD-style variants and instance
masks at the cached size (`process_image`, run in worker processes by `detpipe.data.augment.build_cache`)."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import torch
from pycocotools import mask as mask_utils
from torchvision import tv_tensors
from torchvision.io import encode_jpeg
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from detpipe import params as params_mod
from detpipe.core.boxes import convert
from detpipe.core.errors import StageError
from detpipe.data.imageio import decode_rgb
from detpipe.data.cache_format import ZOOM_OUT_FILL

log = logging.getLogger("detpipe.data.augmentation")


def target_size(orig_h: int, orig_w: int, cfg: params_mod.Augment) -> tuple[int, int]:
    """Output ``(height, width)`` in pixels for an image of ``orig_h x orig_w`` pixels.

    ``fixed``: ``(size, size)``. ``keep_ratio``: with ``s = min(min_size / short, max_size / long)`` (torchvision's
    ``GeneralizedRCNNTransform`` rule), the limiting side becomes exactly ``min_size`` (or ``max_size``) and the
    other ``floor(side * s)`` (at least 1), so the model's transform computes ``s = 1`` on the result and does not
    resize again (see the module docstring). With ``cfg.upscale`` false and ``s > 1``: ``(orig_h, orig_w)``.
    """
    if cfg.resize == "fixed":
        return cfg.size, cfg.size
    short, long_ = min(orig_h, orig_w), max(orig_h, orig_w)
    s_short, s_long = cfg.min_size / short, cfg.max_size / long_
    s = min(s_short, s_long)
    if s > 1 and not getattr(cfg, "upscale", True):
        return orig_h, orig_w
    out = [max(1, math.floor(orig_h * s)), max(1, math.floor(orig_w * s))]
    short_i, long_i = (0, 1) if orig_h <= orig_w else (1, 0)
    if s_short <= s_long:
        out[short_i] = cfg.min_size
        out[long_i] = min(out[long_i], cfg.max_size)
    if s_long <= s_short:
        out[long_i] = cfg.max_size
        out[short_i] = min(out[short_i], cfg.min_size)
    return out[0], out[1]


def resize_pixels(pixels: np.ndarray | torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """Resize uint8 RGB pixels, an ``(H, W, 3)`` array or a ``(3, H, W)`` tensor, to ``size = (h, w)`` with bilinear
    interpolation and antialias (``torchvision.transforms.v2.functional.resize``).

    Returns ``(3, h, w)`` uint8, C-contiguous (planar CHW, the cache's pixel layout).
    """
    chw = pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(np.asarray(pixels)).permute(2, 0, 1)
    chw = chw.as_subclass(torch.Tensor)
    if tuple(chw.shape[-2:]) != tuple(size):
        chw = TF.resize(chw, list(size), interpolation=T.InterpolationMode.BILINEAR, antialias=True)
    return chw.contiguous().numpy()


def encode_pixels(chw: np.ndarray, cfg: params_mod.Augment) -> bytes:
    """The ``pixels`` cell for a ``(3, h, w)`` uint8 image: its raw bytes, or with ``cfg.encoding == "jpeg"`` a
    JPEG at ``cfg.jpeg_quality`` (``torchvision.io.encode_jpeg``: libjpeg-turbo, 4:2:0, deterministic)."""
    if getattr(cfg, "encoding", "raw") == "raw":
        return chw.tobytes()
    return encode_jpeg(torch.from_numpy(np.ascontiguousarray(chw)), quality=cfg.jpeg_quality).numpy().tobytes()


def coco_to_xyxy(bbox_xywh: np.ndarray, height: int, width: int) -> np.ndarray:
    """COCO ``[x, y, w, h]`` boxes ``(N, 4)`` in pixels → XYXY ``(N, 4)`` float64, clamped to the
    ``height x width`` image (as torchvision's ``ConvertCocoPolysToMask``)."""
    xyxy = convert(np.asarray(bbox_xywh, dtype=np.float64).reshape(-1, 4), "xywh", "xyxy")
    xyxy[:, 0::2] = xyxy[:, 0::2].clip(0, width)
    xyxy[:, 1::2] = xyxy[:, 1::2].clip(0, height)
    return xyxy


def valid_boxes(xyxy: np.ndarray) -> np.ndarray:
    """``(N,)`` bool: boxes ``(N, 4)`` XYXY with positive width and height."""
    return (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])


def variant_seed(seed: int, image_id: int, k: int) -> int:
    """The torch seed (uint64) of variant ``k`` of image ``image_id`` under ``augment.seed = seed``
    (``numpy.random.SeedSequence`` of the three, so nearby inputs give unrelated streams)."""
    return int(np.random.SeedSequence([seed % 2**64, image_id % 2**64, k]).generate_state(1, np.uint64)[0])


class _RecordParams:
    """Mixin for a torchvision v2 transform: keeps the parameters of its last call in ``last_params``
    (None when a random-apply transform was skipped)."""

    last_params: dict | None = None

    def forward(self, *inputs):
        self.last_params = None
        return super().forward(*inputs)

    def make_params(self, flat_inputs):
        self.last_params = super().make_params(flat_inputs)
        return self.last_params


class _ZoomOut(_RecordParams, T.RandomZoomOut):
    pass


class _IoUCrop(_RecordParams, T.RandomIoUCrop):
    pass


def ssd_variant(chw: torch.Tensor, boxes: np.ndarray, labels: np.ndarray, seed: int):
    """One SSD-style random variant (torchvision ``references/detection/presets.py``, ``"ssd"``) of an image.

    Args:
        chw: ``(3, H, W)`` uint8 RGB image.
        boxes: ``(N, 4)`` XYXY boxes in its pixels (valid: positive width and height).
        labels: ``(N,)`` int64.
        seed: torch seed for this variant (`variant_seed`); the global torch RNG is left untouched.
    Returns:
        ``(image (3, h, w) uint8, boxes (M, 4) float32, labels (M,) int64, (offset_y, offset_x), kept (M,) int64)``
        where ``offset`` is the original-pixel coordinate of the variant's pixel (0, 0) (whole pixels) and
        ``kept`` the indices into ``boxes`` of the M objects that survive (in order); ``M <= N``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        image = tv_tensors.Image(chw)
        bb = tv_tensors.BoundingBoxes(torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4), format="XYXY",
                                      canvas_size=tuple(chw.shape[-2:]))
        image = T.RandomPhotometricDistort()(image)
        zoom, crop = _ZoomOut(fill=ZOOM_OUT_FILL), _IoUCrop()
        image, bb = zoom(image, bb)
        offset_y = offset_x = 0.0
        if zoom.last_params is not None:
            left, top = zoom.last_params["padding"][:2]
            offset_y, offset_x = -float(top), -float(left)
        if len(bb):  # RandomIoUCrop needs at least one box to aim at
            image, bb = crop(image, bb)
            if crop.last_params:
                offset_y += crop.last_params["top"]
                offset_x += crop.last_params["left"]
        sample = {"image": image, "boxes": bb, "labels": torch.as_tensor(labels, dtype=torch.int64),
                  "kept": torch.arange(len(labels), dtype=torch.int64)}
        out = T.SanitizeBoundingBoxes(labels_getter=lambda d: (d["labels"], d["kept"]))(sample)
    return (out["image"].as_subclass(torch.Tensor), out["boxes"].as_subclass(torch.Tensor).numpy(),
            out["labels"].numpy(), (offset_y, offset_x), out["kept"].numpy())


def parse_segmentation(text: str | None, source: str = "") -> list | dict | None:
    """A `detpipe.data.convert` ``segmentation`` cell (JSON text) as COCO polygons (list of lists) or an RLE dict;
    None when the object has no segmentation (``""``, ``null``, ``[]``, ``{}``).

    Raises:
        StageError: the text is not JSON, or neither polygons nor an RLE dict with ``size`` and ``counts``
        (names ``source``: file, image and annotation id).
    """
    if not text:
        return None
    try:
        seg = json.loads(text) if isinstance(text, (str, bytes)) else text
    except json.JSONDecodeError as e:
        raise StageError(f"{source}: segmentation is not valid JSON ({e})") from None
    if not seg:
        return None
    if isinstance(seg, list) and all(isinstance(p, list) for p in seg):
        return seg
    if isinstance(seg, dict) and "size" in seg and "counts" in seg:
        return seg
    raise StageError(f"{source}: segmentation is neither COCO polygons nor an RLE dict with 'size' and 'counts' "
                     f"(rule: COCO segmentation format)")


def rasterize_mask(seg: list | dict, orig_size: tuple[int, int], src_size: tuple[int, int],
                   offset: tuple[float, float], out_size: tuple[int, int], source: str = "") -> bytes:
    """One object's COCO segmentation (original pixels) as a mask of the cached image, compressed-RLE encoded.

    The cached image is the source canvas ``src_size = (sh, sw)`` (the decoded image, or an SSD variant of it whose
    pixel ``(0, 0)`` is original pixel ``offset = (oy, ox)``, whole pixels) resized to ``out_size = (h, w)``:
    ``cached = (orig - offset) * (h / sh, w / sw)``.

    * Polygons: every point is mapped by that formula and the polygons are rasterized at ``(h, w)`` with
      ``pycocotools.mask.frPyObjects`` + ``merge`` (which clips to the canvas); polygons with < 6 numbers are
      skipped (no area; ``frPyObjects`` would read 4 numbers as a box).
    * RLE (compressed or uncompressed; ``size`` must be ``orig_size``): decoded, translated onto the source
      canvas, resized as float32 with bilinear interpolation and antialias (``torchvision.transforms.v2``) and
      kept where ``>= 0.5``.

    Args:
        seg: `parse_segmentation`'s output (not None).
        orig_size, src_size, out_size: ``(height, width)`` in pixels.
        offset: ``(offset_y, offset_x)`` in original pixels.
        source: names the file/record in errors.
    Returns:
        ``counts`` (bytes) of the pycocotools compressed RLE of the ``(h, w)`` uint8 mask (column-major, as
        ``pycocotools.mask.encode``); decode with ``{"size": [h, w], "counts": counts}``.
    Raises:
        StageError: an RLE whose ``size`` is not ``orig_size``, or malformed polygons/RLE.
    """
    (oh, ow), (sh, sw), (h, w) = orig_size, src_size, out_size
    oy, ox = offset
    sy, sx = h / sh, w / sw
    try:
        if isinstance(seg, list):
            polys = []
            for p in seg:
                if len(p) < 6:
                    continue
                xy = np.asarray(p, dtype=np.float64)[: len(p) // 2 * 2].reshape(-1, 2)
                xy = (xy - [ox, oy]) * [sx, sy]
                polys.append(xy.reshape(-1).tolist())
            if not polys:
                return mask_utils.encode(np.zeros((h, w, 1), dtype=np.uint8, order="F"))[0]["counts"]
            return mask_utils.merge(mask_utils.frPyObjects(polys, h, w))["counts"]
        size = [int(v) for v in seg["size"]]
        if size != [oh, ow]:
            raise StageError(f"{source}: segmentation RLE size {size} != image [height, width] [{oh}, {ow}] "
                             f"(rule: an RLE covers its whole image)")
        rle = mask_utils.frPyObjects(seg, oh, ow) if isinstance(seg["counts"], list) else seg
        m = torch.from_numpy(mask_utils.decode(rle))
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - malformed polygons / RLE from the data
        raise StageError(f"{source}: segmentation is not valid COCO polygons/RLE ({type(e).__name__}: {e})") from None
    if (sh, sw) != (oh, ow) or oy or ox:
        canvas = torch.zeros((sh, sw), dtype=torch.uint8)
        y0, x0 = int(round(oy)), int(round(ox))  # canvas pixel (r, c) is original pixel (r + y0, c + x0)
        r0, r1 = max(0, -y0), min(sh, oh - y0)
        c0, c1 = max(0, -x0), min(sw, ow - x0)
        if r1 > r0 and c1 > c0:
            canvas[r0:r1, c0:c1] = m[r0 + y0:r1 + y0, c0 + x0:c1 + x0]
        m = canvas
    if (sh, sw) != (h, w):
        m = TF.resize(m[None].float(), [h, w], interpolation=T.InterpolationMode.BILINEAR, antialias=True)[0] >= 0.5
    return mask_utils.encode(np.asfortranarray(m.numpy().astype(np.uint8)))["counts"]


def process_image(row: dict, cfg: params_mod.Augment, copies: int) -> tuple[list[dict], dict]:
    """Decode one converted row (a dict of `detpipe.data.convert` columns) and make its cache rows.

    ``copies == 0``: one row, the plain resize. ``copies == K > 0``: K rows, variant ``k`` = `ssd_variant` with
    seed `variant_seed` ``(cfg.seed, image_id, k)``, then resized. Each row's ``masks`` (`rasterize_mask` per
    kept object) is None when the row has no ``segmentation`` column or one of its objects has none.
    Returns ``(rows, counts)``; rows are `CACHE_SCHEMA` dicts, counts has ``crowd_excluded``,
    ``degenerate_dropped``, ``crop_dropped`` (summed over the rows).
    Raises:
        StageError: the image bytes cannot be decoded, or a segmentation is malformed (names the file, image id
        and annotation id).
    """
    image_id = int(row["image_id"])
    where = f"{row['file_name']} (image_id {image_id})"
    pixels = decode_rgb(row["image"], where)
    oh, ow = pixels.shape[:2]
    labels = np.asarray(row["label"], dtype=np.int64)
    crowd = np.asarray(row["iscrowd"], dtype=np.int64).astype(bool)
    xyxy = coco_to_xyxy(np.asarray(row["bbox"], dtype=np.float64), oh, ow)[~crowd]
    labels = labels[~crowd]
    keep = valid_boxes(xyxy)
    counts = {"crowd_excluded": int(crowd.sum()), "degenerate_dropped": int((~keep).sum()), "crop_dropped": 0}
    xyxy, labels = xyxy[keep], labels[keep]
    segs = None
    if row.get("segmentation") is not None:
        ann_ids = row.get("ann_id") or [None] * len(crowd)
        objs = [(t, a) for t, a, c in zip(row["segmentation"], ann_ids, crowd) if not c]
        segs = [(parse_segmentation(t, f"{where}, annotation id {a}"), f"{where}, annotation id {a}")
                for (t, a), k in zip(objs, keep) if k]

    chw = torch.from_numpy(pixels).permute(2, 0, 1)
    if copies == 0:
        sources = [(0, chw, xyxy, labels, (0.0, 0.0), np.arange(len(labels)))]
    else:
        sources = []
        for k in range(copies):
            img, b, lab, offset, kept = ssd_variant(chw, xyxy, labels, variant_seed(cfg.seed, image_id, k))
            counts["crop_dropped"] += len(labels) - len(lab)
            sources.append((k, img, b, lab, offset, kept))

    rows = []
    for k, img, b, lab, (off_y, off_x), kept in sources:
        sh, sw = img.shape[-2:]
        h, w = target_size(sh, sw, cfg)
        sy, sx = h / sh, w / sw
        b = np.asarray(b, dtype=np.float64).reshape(-1, 4) * np.array([sx, sy, sx, sy])
        ok = valid_boxes(b)
        counts["degenerate_dropped"] += int((~ok).sum())
        masks = None
        if segs is not None:
            objs = [segs[j] for j, o in zip(kept, ok) if o]
            if all(seg is not None for seg, _ in objs):
                masks = [rasterize_mask(seg, (oh, ow), (sh, sw), (off_y, off_x), (h, w), src) for seg, src in objs]
        rows.append({
            "image_id": image_id, "variant": k, "height": h, "width": w, "orig_height": oh, "orig_width": ow,
            "scale_y": sy, "scale_x": sx, "offset_y": off_y, "offset_x": off_x,
            "boxes": b[ok].astype(np.float32).tolist(), "labels": np.asarray(lab, dtype=np.int64)[ok].tolist(),
            "masks": masks, "pixels": encode_pixels(resize_pixels(img, (h, w)), cfg),
        })
    return rows, counts


def process_batch(args: tuple[list[dict], params_mod.Augment, int]) -> list[tuple[list[dict], dict]]:
    rows, cfg, copies = args
    torch.set_num_threads(1)
    return [process_image(r, cfg, copies) for r in rows]
