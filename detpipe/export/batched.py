"""ONNX graphs with a dynamic batch dimension: one call runs a micro-batch of images (`BatchedExport`), and the
helpers that feed such a graph and split its answer per image (`graph_size`, `feed`, `split`, `runner`).

Why the graph takes an already-resized, fixed-size batch: torchvision's detection models run their transform and
postprocess as Python loops over the images of a list (``for image in images``, ``for boxes, scores, ... in
zip(...)``); ``torch.onnx.export`` traces, so those loops unroll to the traced batch size and the file only takes that
many images. The families whose network input has one fixed size anyway (torchvision's SSD/SSDlite, whose
``GeneralizedRCNNTransform`` resizes every image to ``fixed_size``; transformers' RT-DETRv2 / D-FINE `HFDetector`,
resized to ``size`` x ``size``) get a graph over ``images`` ``float32 (B, 3, S_h, S_w)`` with B dynamic: the caller
resizes each image to the fixed size with the model's own interpolation (`resize`: bilinear,
``align_corners=False``, no antialias, as both models do) and maps the boxes back per image (`split`), which is what
the eager model does inside. The decode runs batched in the graph: SSD's per-class top-k and score threshold, then
torchvision's batched NMS (each class's boxes shifted apart, the coordinate trick of ``batched_nms``) as one ONNX
``NonMaxSuppression`` whose batch axis is the images (`_BatchedNMS`), capped at ``detections_per_img`` per image; the DETRs' top-k over query x
class pairs (no NMS). Families with per-image input sizes or data-dependent proposal counts (RetinaNet, FCOS, R-CNN:
keep-ratio resize, per-level top-k, RoI heads) keep the one-image graph (`BATCH_UNSUPPORTED`).

Outputs of a batched graph: ``boxes`` ``float32 (N, 4)`` XYXY pixels of the fixed-size input, ``scores`` ``float32
(N,)``, ``labels`` ``int64 (N,)``, ``batch_index`` ``int64 (N,)`` (which image of the batch; sorted by image, then
by descending score), then the raw head outputs of `detpipe.export.exporter.raw_taps`, each with the batch first.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torchvision

BATCH_INPUT = "images"
BATCH_INDEX = "batch_index"
BATCH_UNSUPPORTED = ("one-image graph: the family's input size or proposal count is per image (keep-ratio resize, "
                     "per-level top-k, R-CNN RoI heads), so a traced batch would unroll to its traced size; batched "
                     "export covers torchvision's SSD/SSDlite and the transformers family (RT-DETRv2, D-FINE)")


def batch_kind(model: torch.nn.Module) -> str | None:
    """``"ssd"`` (torchvision ``SSD``, SSDlite included), ``"detr"`` (`detpipe.models.transformers_family.HFDetector`)
    or None (no batched export: `BATCH_UNSUPPORTED`)."""
    from torchvision.models.detection.ssd import SSD

    if isinstance(model, SSD):
        return "ssd"
    if type(model).__name__ == "HFDetector" and hasattr(model, "hf"):
        return "detr"
    return None


def input_size(model: torch.nn.Module) -> tuple[int, int]:
    """The fixed network input ``(height, width)`` in pixels of a `batch_kind` model: SSD's ``transform.fixed_size``
    read as torchvision's ``_resize_image_and_masks`` reads it (``size = [fixed_size[1], fixed_size[0]]``);
    `HFDetector`'s ``(size, size)``."""
    if batch_kind(model) == "ssd":
        fixed = model.transform.fixed_size
        return int(fixed[1]), int(fixed[0])
    return int(model.size), int(model.size)


def resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``float32 (3, H, W)`` -> ``(3, size[0], size[1])`` as the models resize (bilinear, ``align_corners=False``,
    no antialias: torchvision's ``GeneralizedRCNNTransform`` and `HFDetector`); unchanged when already that size."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return torch.nn.functional.interpolate(image[None], size=list(size), mode="bilinear", align_corners=False)[0]


class _BatchedNMS(torch.autograd.Function):
    """Greedy NMS per image, capped: ``boxes`` ``float32 (B, M, 4)`` XYXY (each class already shifted apart:
    torchvision's coordinate trick), ``scores`` ``float32 (B, M)`` (a score <= ``score_threshold`` is no
    candidate) -> ``int64 (K, 3)`` rows ``[image, 0, candidate]`` of the kept boxes, by image, each image's in
    descending score order and at most ``cap`` of them. In ONNX one ``NonMaxSuppression`` over the batch axis
    (``max_output_boxes_per_class = cap``: greedy NMS keeps boxes in descending score order, so its first ``cap``
    are those torchvision keeps before ``keep[:detections_per_img]``); eagerly ``torchvision.ops.nms`` per image."""

    @staticmethod
    def forward(ctx, boxes, scores, iou_threshold: float, score_threshold: float, cap: int):
        rows = []
        for b in range(boxes.shape[0]):
            cand = (scores[b] > score_threshold).nonzero().flatten()
            keep = cand[torchvision.ops.nms(boxes[b, cand], scores[b, cand], iou_threshold)[:cap]]
            rows.append(torch.stack([torch.full_like(keep, b), torch.zeros_like(keep), keep], dim=1))
        return torch.cat(rows) if rows else torch.zeros((0, 3), dtype=torch.long)

    @staticmethod
    def symbolic(g, boxes, scores, iou_threshold: float, score_threshold: float, cap: int):
        from torch.onnx import symbolic_opset11 as opset11

        float_ = torch.onnx.TensorProtoDataType.FLOAT
        return g.op("NonMaxSuppression", g.op("Cast", boxes, to_i=float_),
                    g.op("Cast", opset11.unsqueeze(g, scores, 1), to_i=float_),
                    g.op("Constant", value_t=torch.tensor([cap], dtype=torch.long)),
                    g.op("Constant", value_t=torch.tensor([iou_threshold], dtype=torch.float)),
                    g.op("Constant", value_t=torch.tensor([score_threshold], dtype=torch.float)))


def flatten_outputs(prefix: str, value) -> list[tuple[str, torch.Tensor]]:
    """A raw tap's output (a tensor, or dicts/lists/tuples of them) as ``[(dotted name, tensor)]`` in a fixed order:
    ``head.cls_logits``, ``raw.0``, ... (the names the parity gate and the ONNX graph's raw outputs carry)."""
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [pair for key, v in items for pair in flatten_outputs(f"{prefix}.{key}", v)]


class BatchedExport(torch.nn.Module):
    """``forward(images)``: ``images`` ``float32 (B, 3, S_h, S_w)`` RGB in [0, 1] at `input_size` -> ``(boxes,
    scores, labels, batch_index, *raw)`` (module docstring), the same detections as the eager model on each image
    resized to the input size, in one batched computation that traces with B dynamic.

    SSD: the model's normalisation, backbone and head on the batch; anchors of one image (all are equal at a fixed
    size); ``box_coder.decode_single``, clip, softmax; then torchvision's ``SSD.postprocess_detections`` batched:
    per class the top ``topk_candidates`` anchors above ``score_thresh``, then per image one NMS at ``nms_thresh``
    over the class-shifted boxes, its first ``detections_per_img`` (`_BatchedNMS`). DETR: the HF model on the batch and
    `detpipe.models.transformers_family.postprocess`'s top-``detections`` over query x class pairs, batched.

    Raises:
        ValueError: the model has no batched form (`batch_kind` None).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        from detpipe.models.family import family_of_model

        self.kind = batch_kind(model)
        if self.kind is None:
            raise ValueError(f"{type(model).__name__}: {BATCH_UNSUPPORTED}")
        self.model, self.size = model, input_size(model)
        self.taps = list(family_of_model(model).raw_taps(model))   # what exporter.raw_taps returns
        self._captured: list = []
        self._hooks = [model.get_submodule(p).register_forward_hook(lambda m, a, out: self._captured.append(out))
                       for p in self.taps]

    def remove_hooks(self) -> None:
        """Take this wrapper's forward hooks off the model (the eager model runs as before)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def forward(self, images: torch.Tensor):
        self._captured.clear()
        det = self._ssd(images) if self.kind == "ssd" else self._detr(images)
        flat = [pair for path, out in zip(self.taps, self._captured) for pair in flatten_outputs(path, out)]
        self._captured.clear()
        self._raw_names = [name for name, _ in flat]
        return (*det, *[t for _, t in flat])

    def output_names(self, images: torch.Tensor) -> list[str]:
        """``boxes``, ``scores``, ``labels``, ``batch_index``, then the raw names (e.g. ``head.cls_logits``)."""
        with torch.inference_mode():
            self.forward(images)
        return ["boxes", "scores", "labels", BATCH_INDEX, *self._raw_names]

    def _ssd(self, images: torch.Tensor):
        from torchvision.models.detection.image_list import ImageList

        m = self.model
        mean = torch.tensor(m.transform.image_mean, dtype=images.dtype)[:, None, None]
        std = torch.tensor(m.transform.image_std, dtype=images.dtype)[:, None, None]
        x = (images - mean) / std
        features = m.backbone(x)
        features = list(features.values()) if isinstance(features, dict) else [features]
        head = m.head(features)
        anchors = m.anchor_generator(ImageList(x[:1], [self.size]), [f[:1] for f in features])[0]   # (A, 4)
        reg, logits = head["bbox_regression"], head["cls_logits"]                                   # (B, A, .)
        b, a, c = logits.shape
        boxes = m.box_coder.decode_single(reg.reshape(-1, 4), anchors.repeat(b, 1)).reshape(b, a, 4)
        h, w = self.size
        boxes = torch.stack([boxes[..., 0].clamp(0, w), boxes[..., 1].clamp(0, h), boxes[..., 2].clamp(0, w),
                             boxes[..., 3].clamp(0, h)], dim=-1)
        scores = torch.softmax(logits, dim=-1)[..., 1:].transpose(1, 2)                              # (B, G, A)
        k = min(int(m.topk_candidates), a)
        top, idx = scores.topk(k, dim=2)                          # each class's top k anchors: (B, G, k)
        cand_boxes = boxes.gather(1, idx.reshape(b, -1, 1).expand(-1, -1, 4))                     # (B, G*k, 4)
        labels = torch.arange(1, c).repeat_interleave(k)                                          # (G*k,)
        shift = (labels.to(boxes.dtype) * (max(h, w) + 1))[None, :, None]   # classes apart: boxes lie in [0, S]
        sel = _BatchedNMS.apply(cand_boxes + shift, top.reshape(b, -1), float(m.nms_thresh),
                                float(m.score_thresh), int(m.detections_per_img))
        img, j = sel[:, 0], sel[:, 2]
        return cand_boxes[img, j], top.reshape(b, -1)[img, j], labels[j], img

    def _detr(self, images: torch.Tensor):
        out = self.model.hf(pixel_values=images)
        logits, norm = out.logits, out.pred_boxes
        b, q, k = logits.shape
        top = min(int(self.model.detections), q * k)
        score, index = logits.sigmoid().flatten(1).topk(top, dim=1)
        query, label = index // k, index % k
        cx, cy, bw, bh = norm.unbind(-1)
        h, w = self.size
        xyxy = torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], dim=-1)
        sel = xyxy.gather(1, query[..., None].expand(-1, -1, 4)) * xyxy.new_tensor([w, h, w, h])
        sel = torch.stack([sel[..., 0].clamp(0, w), sel[..., 1].clamp(0, h), sel[..., 2].clamp(0, w),
                           sel[..., 3].clamp(0, h)], dim=-1)
        img = torch.arange(b)[:, None].expand(b, top)
        return sel.reshape(-1, 4), score.reshape(-1), label.reshape(-1) + 1, img.reshape(-1)


def graph_size(inputs: Sequence) -> tuple[int, int] | None:
    """The fixed ``(height, width)`` of a batched graph's input, None for a one-image graph. ``inputs``: the
    session's or compiled model's inputs as ``(name, shape)`` pairs (shape entries int, or str/None/-1 dynamic)."""
    name, shape = inputs[0]
    if name != BATCH_INPUT:
        return None
    return int(shape[2]), int(shape[3])


def feed(images: Sequence[torch.Tensor], size: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """The input dict of one call: a one-image graph (``size`` None) ``{"image": float32 (3, H, W)}`` (exactly one
    image); a batched graph ``{"images": float32 (B, 3, S_h, S_w)}``, each image `resize`-d to ``size``.

    Raises:
        ValueError: several images for a one-image graph.
    """
    if size is None:
        if len(images) != 1:
            raise ValueError(f"a one-image graph takes 1 image per call, got {len(images)}")
        return {"image": np.ascontiguousarray(images[0].numpy())}
    return {BATCH_INPUT: np.ascontiguousarray(torch.stack([resize(im, size) for im in images]).numpy())}


def split(outputs: Sequence, shapes: Sequence[tuple[int, int]], size: tuple[int, int], n_raw: int | None = None
          ) -> list[tuple]:
    """A batched graph's outputs (numpy or torch, in `BatchedExport` order) -> per image a tuple in
    `detpipe.export.exporter.DetectionExport`'s order: ``boxes`` (XYXY pixels of that image: scaled from the
    input size by ``W / S_w`` and ``H / S_h``, as torchvision's ``resize_boxes`` does), ``scores``, ``labels``, then
    its slice ``[i:i + 1]`` (batch dim kept, as the one-image graph has it) of each raw output (all outputs after ``batch_index``; ``n_raw`` of them if given).

    Args:
        shapes: per image of the batch ``(H, W)`` in pixels.
        size: the graph's input ``(S_h, S_w)`` (`graph_size`).
    """
    outs = [torch.as_tensor(np.asarray(o)) if not isinstance(o, torch.Tensor) else o for o in outputs]
    boxes, scores, labels, index, raw = outs[0], outs[1], outs[2], outs[3], outs[4:]
    if n_raw is not None:
        raw = raw[:n_raw]
    per = []
    for i, (h, w) in enumerate(shapes):
        mine = index == i
        scale = boxes.new_tensor([w / size[1], h / size[0], w / size[1], h / size[0]])
        per.append((boxes[mine] * scale, scores[mine], labels[mine].long(), *[r[i:i + 1] for r in raw]))
    return per


def runner(call: Callable[[dict], Sequence], size: tuple[int, int] | None) -> Callable:
    """A runner over a graph: ``run(image)`` (``float32 (3, H, W)`` in [0, 1]) -> outputs in
    `detpipe.export.exporter.DetectionExport`'s order, and ``run.many(images)`` -> one such tuple per image, from
    ONE graph call for a batched graph (``size``: `graph_size`; `feed`, `split`), one call per image for a one-image
    graph (``size`` None; ``run.batched`` says which).

    Args:
        call: ``feed dict -> outputs`` of the file (onnxruntime ``session.run(None, ...)``, an OpenVINO request),
            for a batched graph in `BatchedExport`'s order (``batch_index`` fourth).
    """
    def many(images: Sequence[torch.Tensor]) -> list:
        if size is None:
            return [call(feed([im], None)) for im in images]
        return split(call(feed(images, size)), [tuple(im.shape[-2:]) for im in images], size)

    def run(image: torch.Tensor):
        return many([image])[0]
    run.many, run.batched = many, size is not None
    return run


def onnx_graph_size(path) -> tuple[int, int] | None:
    """`graph_size` of an ONNX file, read from its first graph input (no session built)."""
    import onnx

    first = onnx.load(str(path), load_external_data=False).graph.input[0]
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in first.type.tensor_type.shape.dim]
    return graph_size([(first.name, dims)])


def session_runner(session) -> Callable:
    """`runner` over an onnxruntime ``InferenceSession`` of an exported file (one-image or batched)."""
    size = graph_size([(i.name, i.shape) for i in session.get_inputs()])
    return runner(lambda f: session.run(None, f), size)
