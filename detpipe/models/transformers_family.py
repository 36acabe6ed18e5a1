"""Hugging Face transformers' real-time DETRs as a model family: RT-DETRv2 (``RTDetrV2ForObjectDetection``,
Lv et al. 2024, arXiv:2407.17140) and D-FINE (``DFineForObjectDetection``, Peng et al. 2024, arXiv:2410.13842),
built from a config alone (random init, no hub access) and wrapped in `HFDetector`, which has torchvision
detection's interface so the trainer, evaluate, export, predict and serve do not know the difference.

Why transformers and not our own implementation: it is a well-kept Apache-2.0 library that builds both
architectures and their Hungarian-matching losses (varifocal / focal, L1, GIoU, and D-FINE's FGL and DDF terms)
from a config; the configs below are those of the papers' tables as transformers' own conversion scripts set them
(``convert_rt_detr_v2_weights_to_hf.py``, ``convert_d_fine_original_pytorch_checkpoint_to_hf.py``). Parameter
counts at 80 classes: docs/train.md, checked by tests/unit/test_model_families.py.

Label convention: our labels are 1..K with 0 = background (torchvision's); transformers' ``class_labels`` are
0..K-1, so `HFDetector` maps l -> l - 1 on the way in and back on the way out; ``num_classes`` (incl. background)
is K + 1 as for torchvision's models, ``num_labels`` = K.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from detpipe.core.boxes import convert
from detpipe.core.errors import StageError
from detpipe.models.registry import Family, register

# name -> (architecture, config overrides of the architecture's defaults, backbone config overrides). The
# defaults of RTDetrV2Config are RT-DETRv2-L (ResNet-50-vd); of DFineConfig, D-FINE-L's decoder with an HGNetV2-B4
# backbone that every size below overrides. "_tiny" configs are ours: small enough that the CPU tests fit a few
# images in CI time (docs/train.md, "Small test configs"); the papers have no such size.
_HGNET_B0 = dict(hidden_sizes=[128, 256, 512, 1024], stem_channels=[3, 16, 16], stage_in_channels=[16, 64, 256, 512],
                 stage_mid_channels=[16, 32, 64, 128], stage_out_channels=[64, 256, 512, 1024],
                 stage_num_blocks=[1, 1, 2, 1], stage_downsample=[False, True, True, True],
                 stage_light_block=[False, False, True, True], stage_kernel_size=[3, 3, 5, 5],
                 stage_numb_of_layers=[3, 3, 3, 3], use_learnable_affine_block=True)
_HGNET_B2 = dict(hidden_sizes=[192, 384, 768, 1536], stem_channels=[3, 24, 32], stage_in_channels=[32, 96, 384, 768],
                 stage_mid_channels=[32, 64, 128, 256], stage_out_channels=[96, 384, 768, 1536],
                 stage_num_blocks=[1, 1, 3, 1], stage_downsample=[False, True, True, True],
                 stage_light_block=[False, False, True, True], stage_kernel_size=[3, 3, 5, 5],
                 stage_numb_of_layers=[4, 4, 4, 4], use_learnable_affine_block=True)
_R18 = dict(hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], layer_type="basic")
CONFIGS: dict[str, tuple[str, dict, dict]] = {
    "rtdetr_v2_r18vd": ("rtdetr_v2", dict(encoder_in_channels=[128, 256, 512], hidden_expansion=0.5,
                                          decoder_layers=3), _R18),
    "rtdetr_v2_r34vd": ("rtdetr_v2", dict(encoder_in_channels=[128, 256, 512], hidden_expansion=0.5,
                                          decoder_layers=4),
                        dict(hidden_sizes=[64, 128, 256, 512], depths=[3, 4, 6, 3], layer_type="basic")),
    "rtdetr_v2_r50vd_m": ("rtdetr_v2", dict(hidden_expansion=0.5), {}),
    "rtdetr_v2_r50vd": ("rtdetr_v2", {}, {}),
    "rtdetr_v2_r101vd": ("rtdetr_v2", dict(encoder_ffn_dim=2048, encoder_hidden_dim=384,
                                           decoder_in_channels=[384, 384, 384]), dict(depths=[3, 4, 23, 3])),
    "dfine_n": ("dfine", dict(num_feature_levels=2, encoder_ffn_dim=512, encode_proj_layers=[1], d_model=128,
                              encoder_hidden_dim=128, decoder_ffn_dim=512, encoder_in_channels=[512, 1024],
                              decoder_n_points=[6, 6], decoder_in_channels=[128, 128], feat_strides=[16, 32],
                              depth_mult=0.5, decoder_layers=3, hidden_expansion=0.34),
                {**_HGNET_B0, "out_indices": [3, 4]}),
    "dfine_s": ("dfine", dict(decoder_layers=3, hidden_expansion=0.5, depth_mult=0.34, decoder_n_points=[3, 6, 3],
                              encoder_in_channels=[256, 512, 1024]), _HGNET_B0),
    "dfine_m": ("dfine", dict(decoder_layers=4, decoder_n_points=[3, 6, 3], encoder_in_channels=[384, 768, 1536],
                              depth_mult=0.67), _HGNET_B2),
    # ours, for CPU tests: RT-DETRv2-S's ResNet-18-vd halved in width, a 64-wide encoder/decoder,
    # 2 decoder layers, 50 queries; D-FINE-N with 2 decoder layers, 64 wide and 50 queries
    "rtdetr_v2_tiny": ("rtdetr_v2", dict(encoder_in_channels=[64, 128, 256], hidden_expansion=0.5, decoder_layers=2,
                                         encoder_hidden_dim=64, d_model=64, decoder_in_channels=[64, 64, 64],
                                         encoder_ffn_dim=256, decoder_ffn_dim=256, num_queries=50,
                                         num_denoising=20, encoder_attention_heads=4, decoder_attention_heads=4),
                       dict(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], layer_type="basic",
                            embedding_size=32)),
    "dfine_tiny": ("dfine", dict(num_feature_levels=2, encoder_ffn_dim=256, encode_proj_layers=[1], d_model=64,
                                 encoder_hidden_dim=64, decoder_ffn_dim=256, encoder_in_channels=[512, 1024],
                                 decoder_n_points=[6, 6], decoder_in_channels=[64, 64], feat_strides=[16, 32],
                                 depth_mult=0.34, decoder_layers=2, hidden_expansion=0.34, num_queries=50,
                                 num_denoising=20, encoder_attention_heads=4, decoder_attention_heads=4),
                   {**_HGNET_B0, "out_indices": [3, 4]}),
}

# What the papers' tables give (millions of parameters, COCO val2017 AP at 640 px): RT-DETRv2 (arXiv:2407.17140,
# Table 1) and D-FINE (arXiv:2410.13842, Table 1). docs/train.md shows them beside the built models' counts.
PAPER_PARAMS_M = {"rtdetr_v2_r18vd": 20, "rtdetr_v2_r34vd": 31, "rtdetr_v2_r50vd_m": 36, "rtdetr_v2_r50vd": 42,
                  "rtdetr_v2_r101vd": 76, "dfine_n": 4, "dfine_s": 10, "dfine_m": 19}


def names() -> list[str]:
    """The ``train.model`` names of this family (sorted)."""
    return sorted(CONFIGS)


def owns(name: str) -> bool:
    return name in CONFIGS


def hf_config(name: str, num_labels: int):
    """The transformers config of ``name`` for ``num_labels`` object classes (no background), no pretrained
    backbone, nothing downloaded.

    Raises:
        StageError: unknown name.
    """
    if name not in CONFIGS:
        raise StageError(f"params.yaml: key 'train.model': unknown transformers model '{name}'; known: "
                         f"{', '.join(names())}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # a config never needs the hub; never reach for it
    from transformers import DFineConfig, RTDetrV2Config
    arch, over, backbone = CONFIGS[name]
    config = (RTDetrV2Config if arch == "rtdetr_v2" else DFineConfig)(num_labels=num_labels, **over)
    for key, value in backbone.items():
        setattr(config.backbone_config, key, value)
    return config


class HFDetector(nn.Module):
    """A transformers real-time DETR with torchvision detection's interface.

    ``forward(images, targets=None)``: ``images`` a list of ``float32 (3, H, W)`` RGB in [0, 1], all the same size
    (a ``fixed`` augmentation cache; a different size is resized to ``size`` x ``size``, boxes scaled back). In
    train mode a batch of one square size that is a multiple of 32 goes in at that size (``train.multi_scale``:
    RT-DETR's multi-scale training sizes; the anchors are generated for the input's size).
    Train mode with ``targets`` (list of ``{"boxes": float32 (N, 4) XYXY pixels, "labels": int64 (N,) 1..K}``):
    returns transformers' weighted loss terms (their sum is its ``loss``), plus ``loss_all_params`` = 0 x every
    trainable parameter, so that every parameter has a gradient on every rank even when a batch has no boxes (the
    denoising branch then does not run) and DDP's reducer never waits for a gradient that does not come
    (lyuwenyu/RT-DETR#672). Eval mode: a list of ``{"boxes": float32 (D, 4) XYXY input pixels, "scores": float32
    (D,), "labels": int64 (D,) 1..K}``, D = ``detections`` (RT-DETR's postprocess: sigmoid scores, top-D over all
    query x class pairs, no NMS).

    The input is not normalized (transformers' RT-DETR / D-FINE image processors only rescale to [0, 1]).
    """

    def __init__(self, name: str, num_classes: int, size: int = 640, detections: int = 100):
        super().__init__()
        from transformers import DFineForObjectDetection, RTDetrV2ForObjectDetection
        config = hf_config(name, num_classes - 1)
        arch = CONFIGS[name][0]
        self.detpipe_model_name, self.size, self.detections = name, int(size), int(detections)
        self.hf = (RTDetrV2ForObjectDetection if arch == "rtdetr_v2" else DFineForObjectDetection)(config)

    def _batch(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        sizes = [(int(im.shape[-2]), int(im.shape[-1])) for im in images]
        h, w = sizes[0]
        if self.training and h == w and h % 32 == 0 and all(s == (h, w) for s in sizes):
            return torch.stack(images), sizes  # multi-scale training: the batch's own size
        ims = [im if im.shape[-2:] == (self.size, self.size) else
               torch.nn.functional.interpolate(im[None], size=(self.size, self.size), mode="bilinear",
                                               align_corners=False)[0] for im in images]
        return torch.stack(ims), sizes

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        pixels, sizes = self._batch(images)
        if self.training:
            if targets is None:
                raise ValueError("HFDetector in training mode needs targets")
            labels = []
            for t, (h, w) in zip(targets, sizes):
                b = t["boxes"].to(pixels.dtype)
                scale = b.new_tensor([w, h, w, h])
                xyxy = b / scale
                labels.append({"class_labels": t["labels"].long() - 1, "boxes": convert(xyxy, "xyxy", "cxcywh")})
            out = self.hf(pixel_values=pixels, labels=labels)
            losses = dict(out.loss_dict)
            losses["loss_all_params"] = sum(p.reshape(-1)[0] for p in self.parameters() if p.requires_grad) * 0.0
            return losses
        out = self.hf(pixel_values=pixels)
        return postprocess(out.logits, out.pred_boxes, sizes, self.detections)


def postprocess(logits: torch.Tensor, boxes: torch.Tensor, sizes: list[tuple[int, int]],
                detections: int = 100) -> list[dict]:
    """RT-DETR / D-FINE outputs -> torchvision-style detections (transformers' ``post_process_object_detection``
    with focal-loss scores, without its threshold: top-``detections`` over all query x class pairs).

    Args:
        logits: ``float32 (B, Q, K)`` class logits (sigmoid scores, no background class).
        boxes: ``float32 (B, Q, 4)`` normalized (cx, cy, w, h) in [0, 1].
        sizes: per image ``(H, W)`` in pixels of the input image.
        detections: how many to keep per image (min with Q x K).
    Returns:
        per image ``{"boxes": float32 (D, 4) XYXY pixels, "scores": float32 (D,), "labels": int64 (D,) 1..K}``.
    """
    b, q, k = logits.shape
    scores = logits.sigmoid().flatten(1)
    top = min(detections, q * k)
    score, index = scores.topk(top, dim=1)
    query, label = index // k, index % k
    xyxy = convert(boxes, "cxcywh", "xyxy")
    out = []
    for i, (hh, ww) in enumerate(sizes):
        sel = xyxy[i].gather(0, query[i, :, None].expand(-1, 4)) * xyxy.new_tensor([ww, hh, ww, hh])
        sel = torch.stack([sel[:, 0].clamp(0, ww), sel[:, 1].clamp(0, hh), sel[:, 2].clamp(0, ww),
                           sel[:, 3].clamp(0, hh)], dim=1)
        out.append({"boxes": sel, "scores": score[i], "labels": label[i] + 1})
    return out


def build(name: str, num_classes: int, size: int = 640, **kwargs) -> HFDetector:
    """`HFDetector` ``name`` for ``num_classes`` (incl. background) at ``size`` x ``size`` pixels, random init."""
    return HFDetector(name, num_classes, size, **kwargs)


def model_kwargs(name: str, cache_meta: dict) -> dict:
    """``{"size": augment.size}``: the DETRs take a square, fixed-size input (a multiple of 32 pixels, their
    largest stride); a keep-ratio cache or another size is a one-line params error.

    Raises:
        StageError: ``augment.resize`` is not ``fixed``, or ``augment.size`` is not a multiple of 32.
    """
    if cache_meta["resize"] != "fixed" or cache_meta["size"] % 32:
        raise StageError(f"params.yaml: {name} takes a square input of a multiple of 32 pixels; set augment.resize: "
                         f"fixed and augment.size: 640 (the papers') or 320 (cache has {cache_meta['resize']} "
                         f"{cache_meta['size']})")
    return {"size": int(cache_meta["size"])}


# The export parity gate's raw outputs: the encoder's class and box heads over every anchor of every level (fixed
# order: level, row, column), before the top-k query selection. The decoder's per-query outputs come after that top-k,
# whose near-ties in a barely trained model pick other queries in another runtime (measured: ONNX vs eager differ by
# 1.6x the outputs' rms on `rtdetr_v2_tiny` at init), so, like the R-CNN box heads after the RPN's NMS, they are
# covered by the detection figures of the report, not by the verdict.
RAW_TAPS = ("hf.model.enc_score_head", "hf.model.enc_bbox_head")


TRANSFORMERS = register(Family(
    name="transformers", owns=owns, names=names, sizing="fixed", optimizer="adamw", backbone_lr_mult=0.1,
    variable_input=lambda name: True,  # multi-scale training sizes (RT-DETR's BatchImageCollateFunction scales)
    default_augment=lambda name: "detr", model_kwargs=model_kwargs, build=build, uses_masks=lambda model: False,
    raw_taps=lambda model: list(RAW_TAPS), torch_export_supported=lambda model: False, backbone_prefix="hf.model.backbone.",
    notes={"sizing": "augment.resize fixed, augment.size a multiple of 32 (640 in the papers)"}))
