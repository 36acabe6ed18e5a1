"""Patches of torchvision's detection postprocess that hold only while tracing for export.

`onnx_postprocess` (ONNX): torchvision's batched NMS as one ``NonMaxSuppression`` capped at the detections the
caller keeps (`NMS_CAPS`); `exportable_batched_nms` (torch.export): the same NMS without a branch on the
data-dependent number of boxes. Both restore torchvision's functions when their ``with`` block ends.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torchvision


@contextlib.contextmanager
def exportable_batched_nms() -> Iterator[None]:
    """While tracing for torch.export: torchvision's ``batched_nms`` with no branch on the (data-dependent)
    number of boxes. Same result: the coordinate trick of ``torchvision.ops.boxes._batched_nms_coordinate_trick``
    (offset each class's boxes by ``class * (max coordinate + 1)``, one NMS), with 0 appended before the max so
    an empty input needs no special case."""
    def batched_nms(boxes, scores, idxs, iou_threshold):
        return torchvision.ops.nms(_offset_by_class(boxes, idxs), scores, iou_threshold)

    with _batched_nms_replaced(batched_nms):
        yield


def _offset_by_class(boxes: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
    """torchvision's coordinate trick (``torchvision.ops.boxes._batched_nms_coordinate_trick``): ``boxes`` ``(N, 4)``
    XYXY offset by ``class * (max coordinate + 1)`` so that one NMS never suppresses across classes; 0 is appended
    before the max, so an empty input needs no branch on the (data-dependent) number of boxes."""
    top = torch.cat([boxes.flatten(), boxes.new_zeros(1)]).max()
    return boxes + (idxs.to(boxes) * (top + 1))[:, None]


@contextlib.contextmanager
def _batched_nms_replaced(batched_nms: Callable) -> Iterator[None]:
    """``torchvision.ops.boxes.batched_nms`` is ``batched_nms`` inside the ``with`` block, torchvision's again after."""
    from torchvision.ops import boxes as box_ops

    original = box_ops.batched_nms
    box_ops.batched_nms = batched_nms
    try:
        yield
    finally:
        box_ops.batched_nms = original


class _CappedNMS(torch.autograd.Function):
    """``torchvision.ops.nms(boxes, scores, iou_threshold)[:cap]``; in ONNX one ``NonMaxSuppression`` with
    ``max_output_boxes_per_class = cap``, so onnxruntime stops once ``cap`` boxes are kept (greedy NMS keeps boxes
    in descending score order: the first ``cap`` of the full result, computed without the rest)."""

    @staticmethod
    def forward(ctx, boxes, scores, iou_threshold: float, cap: int):
        return torchvision.ops.nms(boxes, scores, iou_threshold)[:cap]

    @staticmethod
    def symbolic(g, boxes, scores, iou_threshold: float, cap: int):
        from torch.onnx import symbolic_opset11 as opset11

        float_ = torch.onnx.TensorProtoDataType.FLOAT
        nms = g.op("NonMaxSuppression",
                   g.op("Cast", opset11.unsqueeze(g, boxes, 0), to_i=float_),
                   g.op("Cast", opset11.unsqueeze(g, opset11.unsqueeze(g, scores, 0), 0), to_i=float_),
                   g.op("Constant", value_t=torch.tensor([cap], dtype=torch.long)),
                   g.op("Constant", value_t=torch.tensor([iou_threshold], dtype=torch.float)))
        return opset11.squeeze(g, opset11.select(g, nms, 1, g.op("Constant", value_t=torch.tensor([2]))), 1)


# The torchvision postprocess steps that call ``box_ops.batched_nms`` and then keep the first N of its result:
# (submodule path, method, attribute giving N; a callable is called).
NMS_CAPS = (("", "postprocess_detections", "detections_per_img"),            # SSD/SSDlite, RetinaNet, FCOS
            ("roi_heads", "postprocess_detections", "detections_per_img"),   # Faster/Mask/Keypoint R-CNN
            ("rpn", "filter_proposals", "post_nms_top_n"))                   # R-CNN proposals


@contextlib.contextmanager
def onnx_postprocess(model: torch.nn.Module) -> Iterator[None]:
    """While exporting ``model`` to ONNX: torchvision's eager postprocess (its own code runs unchanged: per-class
    (SSD) or per-level (RetinaNet, FCOS, RPN) score threshold and top-k, then one batched NMS, then the first N),
    with the batched NMS as torchvision's coordinate trick (each class's boxes offset by ``class * (max coordinate
    + 1)``, one NMS) *capped at N*: ``NonMaxSuppression``'s ``max_output_boxes_per_class`` is the N that the caller
    keeps (``detections_per_img``, ``post_nms_top_n``; `NMS_CAPS`), where torchvision's ONNX symbolic leaves it
    unbounded and onnxruntime then compares every candidate (80 classes x 300 for SSDlite) with every kept box.
    Same detections: greedy NMS keeps boxes in descending score order, so its first N do not depend on the rest.
    Eager code is not affected outside the ``with`` block; `batched_nms` calls outside `NMS_CAPS` keep
    torchvision's behaviour."""
    from torchvision.ops import boxes as box_ops

    original = box_ops.batched_nms
    caps: list[int] = []

    def batched_nms(boxes, scores, idxs, iou_threshold):
        if not caps:
            return original(boxes, scores, idxs, iou_threshold)
        return _CappedNMS.apply(_offset_by_class(boxes, idxs), scores, float(iou_threshold), caps[-1])

    def capped(method, attr, owner):
        @functools.wraps(method)
        def call(*args, **kwargs):
            n = getattr(owner, attr)
            caps.append(int(n() if callable(n) else n))
            try:
                return method(*args, **kwargs)
            finally:
                caps.pop()
        return call

    patched = []
    for path, name, attr in NMS_CAPS:
        owner = getattr(model, path, None) if path else model
        if owner is not None and hasattr(owner, name) and hasattr(owner, attr):
            patched.append((owner, name))
            setattr(owner, name, capped(getattr(owner, name), attr, owner))
    try:
        with _batched_nms_replaced(batched_nms):
            yield
    finally:
        for owner, name in patched:
            delattr(owner, name)   # the instance attribute: the class's method again
