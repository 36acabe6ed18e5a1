"""Exported detectors (ONNX, torch.export, TorchScript) and the parity gate that checks them against eager.

Every exported file is made from `DetectionExport`: one image in, ``(boxes, scores, labels[, masks], *raw)``
out, where ``raw`` are the *head outputs before any top-k or NMS* (`raw_taps`): SSD/SSDlite, RetinaNet and FCOS
``model.head`` (``cls_logits`` and ``bbox_regression``, plus ``bbox_ctrness`` for FCOS, one row per anchor);
R-CNN models ``model.rpn.head`` (objectness and box deltas per FPN level). These tensors have a fixed order
(anchor, class), so comparing them is immune to the tie-breaking that makes the final detections of a barely
trained model differ between runtimes (scores all ≈ 1/num_classes: which near-equal box survives top-k and NMS
is float noise). `compare_raw` is the gate: every raw tensor of the exported file must agree with the eager
model's within ``rtol`` of its root-mean-square magnitude, on every checked image. The final detections are compared
too (`match_detections`), as figures in the report, not as a verdict. R-CNN box/mask heads run on proposals
that the RPN's NMS picks, so for those models only the detection figures cover them.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import warnings
from pathlib import Path
from typing import Callable, Iterator

import jinja2
import numpy as np
import torch
import torchvision
from torchvision.ops import box_iou

from detpipe.data.meta import read_meta
from detpipe.export.batched import flatten_outputs
from detpipe.core.files import folder_sha256

SCORE_TOL = 1e-5
BOX_TOL = 0.01  # pixels
DET_NAMES = ("boxes", "scores", "labels")


def raw_taps(model: torch.nn.Module) -> list[str]:
    """Dotted paths of the submodules whose outputs are the pre-NMS raw outputs, as the model's family declares
    (`detpipe.models.family.Family.raw_taps`): torchvision ``["rpn.head"]`` for R-CNN models, ``["head"]`` for
    SSD/SSDlite/RetinaNet/FCOS; transformers ``["raw"]`` (logits and normalized boxes of every query); ``[]``
    otherwise."""
    from detpipe.models.family import family_of_model
    return list(family_of_model(model).raw_taps(model))


TORCH_EXPORT_UNSUPPORTED = ("torch.export cannot trace torchvision's R-CNN models (their RPN and ROI heads size "
                            "tensors from data-dependent counts) nor the transformers family's DETRs here; use the "
                            "ONNX file")


def torch_export_supported(model: torch.nn.Module) -> bool:
    """Whether `export_program` can trace ``model``, as its family declares
    (`detpipe.models.family.Family.torch_export_supported`): SSD/SSDlite, RetinaNet, FCOS yes; torchvision's R-CNN
    models (Faster/Mask/Keypoint R-CNN) no (torch 2.14 / torchvision 0.29: ``GuardOnDataDependentSymNode`` in their
    proposal filtering, `TORCH_EXPORT_UNSUPPORTED`); the transformers family no (not checked in this version)."""
    from detpipe.models.family import family_of_model
    return bool(family_of_model(model).torch_export_supported(model))


class DetectionExport(torch.nn.Module):
    """The flat signature of every exported file: ``forward(image)`` with ``image`` ``float32 (3, H, W)`` RGB in
    [0, 1] returns ``boxes`` ``float32 (N, 4)`` XYXY input pixels, ``scores`` ``float32 (N,)``, ``labels``
    ``int64 (N,)``, with ``masks=True`` ``masks`` ``float32 (N, 1, H, W)``, then the raw head outputs named by
    `raw_names` (float32, pre-NMS, fixed order; what the parity gate compares).

    The raw outputs are captured with forward hooks on the `raw_taps` submodules (hooks run while tracing, so
    they become graph outputs of the ONNX and torch.export files)."""

    def __init__(self, model: torch.nn.Module, masks: bool = False):
        super().__init__()
        self.model, self.masks = model, masks
        self.taps = raw_taps(model)
        self._captured: list = []
        for path in self.taps:
            model.get_submodule(path).register_forward_hook(lambda mod, args, out: self._captured.append(out))

    def forward(self, image: torch.Tensor):
        self._captured.clear()
        det = self.model([image])[0]
        flat = [pair for path, out in zip(self.taps, self._captured) for pair in flatten_outputs(path, out)]
        self._captured.clear()  # no tensor kept on the module (torch.export would take it for state)
        self._raw_names = [name for name, _ in flat]
        raw = [t for _, t in flat]
        return (det["boxes"], det["scores"], det["labels"], *([det["masks"]] if self.masks else []), *raw)

    def output_names(self, image: torch.Tensor) -> list[str]:
        """Names of `forward`'s outputs (``boxes``, ``scores``, ``labels``, [``masks``], raw names such as
        ``head.cls_logits``), found by running ``image`` once."""
        with torch.inference_mode():
            self.forward(image)
        return [*DET_NAMES, *(["masks"] if self.masks else []), *self._raw_names]


def split_outputs(outputs, masks: bool) -> tuple[dict, list[torch.Tensor]]:
    """`DetectionExport` outputs (tensors or numpy arrays) -> ``({"boxes", "scores", "labels"}, raw list)``."""
    outs = [torch.as_tensor(np.asarray(o)) if not isinstance(o, torch.Tensor) else o for o in outputs]
    det = {"boxes": outs[0].float(), "scores": outs[1].float(), "labels": outs[2].long()}
    return det, outs[3 + int(masks):]


def compare_raw(ref: list[list[torch.Tensor]], got: list[list[torch.Tensor]], names: list[str],
                rtol: float) -> dict:
    """The parity verdict: raw (pre-NMS) outputs of an exported model against the eager model's, per image.

    Tensor ``k`` of image ``i`` passes when the shapes are equal and ``max |got - ref| <= rtol * rms(ref)``
    (root-mean-square magnitude, floored at 1e-6 for all-zero tensors: a scale that a few outlier logits do not
    inflate, so one changed weight shows); all must pass.

    Args:
        ref, got: per image, the raw tensors in `DetectionExport.output_names` order (after the detections).
        names: their names, for the report.
        rtol: tolerance relative to the root-mean-square magnitude of the eager tensor.
    Returns:
        ``{"compared": tensors compared, "values": numbers compared, "max_rel_diff": largest
        ``max|got - ref| / rms(ref)``, "failed": ["name (image i): why", ...], "ok": bool}``; ``ok`` is False
        when nothing was compared.
    """
    out = {"compared": 0, "values": 0, "max_rel_diff": 0.0, "failed": []}
    for i, (r_list, g_list) in enumerate(zip(ref, got)):
        if len(r_list) != len(g_list):
            out["failed"].append(f"image {i}: {len(g_list)} raw outputs, eager has {len(r_list)}")
            continue
        for name, r, g in zip(names, r_list, g_list):
            r, g = r.detach().double(), torch.as_tensor(g).detach().double()
            out["compared"] += 1
            if r.shape != g.shape:
                out["failed"].append(f"{name} (image {i}): shape {tuple(g.shape)}, eager {tuple(r.shape)}")
                continue
            out["values"] += r.numel()
            scale = max(float(r.pow(2).mean().sqrt()) if r.numel() else 0.0, 1e-6)
            rel = float((g - r).abs().max()) / scale if r.numel() else 0.0
            out["max_rel_diff"] = max(out["max_rel_diff"], rel)
            if not rel <= rtol:
                out["failed"].append(f"{name} (image {i}): max |diff| {rel:.3g} x rms |eager| > rtol {rtol}")
    out["ok"] = out["compared"] > 0 and not out["failed"]
    return out


def match_detections(ref: dict, other: dict, score_threshold: float, iou_match: float) -> dict:
    """Compare one image's final detections of an exported model (``other``) with the eager model's (``ref``).

    Both are dicts of ``boxes`` ``(N, 4)`` XYXY pixels, ``scores`` ``(N,)``, ``labels`` ``(N,)`` tensors.
    An eager detection with score ≥ ``score_threshold`` is matched by the other detection of the same label with
    the highest IoU, if that IoU ≥ ``iou_match`` (coordinates all within `BOX_TOL` pixels count as IoU 1, so
    zero-area boxes clipped at the image border match). An unmatched one is *at the truncation boundary* when
    the other output is full and its score is within `SCORE_TOL` of the lowest score the other kept; those are
    counted apart. These are report figures: NMS among near-equal scores reorders legitimately.

    Returns ``{"compared", "matched", "boundary", "max_box_diff" (pixels), "max_score_diff"}``.
    """
    keep = ref["scores"] >= score_threshold
    rb, rs, rl = ref["boxes"][keep].detach(), ref["scores"][keep].detach(), ref["labels"][keep]
    ob, os_, ol = other["boxes"].detach(), other["scores"].detach(), other["labels"]
    out = {"compared": int(len(rb)), "matched": 0, "boundary": 0, "max_box_diff": 0.0, "max_score_diff": 0.0}
    if len(rb) == 0:
        return out
    ok = torch.zeros(len(rb), dtype=torch.bool)
    idx = torch.zeros(len(rb), dtype=torch.long)
    if len(ob):
        iou = box_iou(rb.float(), ob.float()).nan_to_num(0.0)
        same = torch.cdist(rb.float(), ob.float(), p=float("inf")) <= BOX_TOL
        iou = torch.where(same, torch.ones_like(iou), iou)
        iou[rl[:, None] != ol[None, :]] = -1.0
        best, idx = iou.max(dim=1)
        ok = best >= iou_match
    out["matched"] = int(ok.sum())
    if len(ob) and len(ob) >= len(ref["scores"]):
        at_boundary = ~ok & (rs <= float(os_.min()) + SCORE_TOL)
        out["boundary"] = int(at_boundary.sum())
        out["compared"] -= out["boundary"]
    if ok.any():
        out["max_box_diff"] = float((rb[ok] - ob[idx[ok]]).abs().max())
        out["max_score_diff"] = float((rs[ok] - os_[idx[ok]]).abs().max())
    return out


def summarize_detections(per_image: list[dict]) -> dict:
    """Sum `match_detections` figures over images; ``match`` = matched / compared (1.0 when none compared)."""
    compared = sum(r["compared"] for r in per_image)
    matched = sum(r["matched"] for r in per_image)
    return {"compared": compared, "matched": matched, "match": matched / compared if compared else 1.0,
            "boundary": sum(r["boundary"] for r in per_image),
            "max_box_diff": max((r["max_box_diff"] for r in per_image), default=0.0),
            "max_score_diff": max((r["max_score_diff"] for r in per_image), default=0.0)}


def parity(eager: list[tuple[dict, list]], exported: list[tuple[dict, list]], names: list[str], rtol: float,
           score_threshold: float, iou_match: float) -> dict:
    """One format's report: ``raw`` (`compare_raw`, the verdict, ``raw["ok"]``) and ``detections``
    (`summarize_detections`, figures only). ``eager``/``exported``: per image, `split_outputs` pairs."""
    raw = compare_raw([r for _, r in eager], [r for _, r in exported], names, rtol)
    dets = summarize_detections([match_detections(e, o, score_threshold, iou_match)
                                 for (e, _), (o, _) in zip(eager, exported)])
    return {"raw": raw, "detections": dets}


@contextlib.contextmanager
def _exportable_batched_nms() -> Iterator[None]:
    """While tracing for torch.export: torchvision's ``batched_nms`` with no branch on the (data-dependent)
    number of boxes. Same result: the coordinate trick of ``torchvision.ops.boxes._batched_nms_coordinate_trick``
    (offset each class's boxes by ``class * (max coordinate + 1)``, one NMS), with 0 appended before the max so
    an empty input needs no special case."""
    from torchvision.ops import boxes as box_ops

    def batched_nms(boxes, scores, idxs, iou_threshold):
        top = torch.cat([boxes.flatten(), boxes.new_zeros(1)]).max()
        return torchvision.ops.nms(boxes + (idxs.to(boxes) * (top + 1))[:, None], scores, iou_threshold)

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
        top = torch.cat([boxes.flatten(), boxes.new_zeros(1)]).max()   # 0 appended: no branch for no boxes
        return _CappedNMS.apply(boxes + (idxs.to(boxes) * (top + 1))[:, None], scores, float(iou_threshold),
                                caps[-1])

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
    box_ops.batched_nms = batched_nms
    try:
        yield
    finally:
        box_ops.batched_nms = original
        for owner, name in patched:
            delattr(owner, name)   # the instance attribute: the class's method again


def export_onnx(wrapper: DetectionExport, image: torch.Tensor, path: Path, opset: int) -> Callable:
    """Write ``wrapper`` as ONNX (``torch.onnx.export(dynamo=False)``, input ``image`` with dynamic H and W,
    outputs named by `DetectionExport.output_names`; torchvision's postprocess with its batched NMS capped at the
    detections kept, `onnx_postprocess`); return a runner ``image -> outputs`` (onnxruntime, CPU)."""
    import onnxruntime as ort

    names = wrapper.output_names(image)
    axes = {"image": {1: "height", 2: "width"}, **{n: {0: "n"} for n in DET_NAMES}}
    if wrapper.masks:
        axes["masks"] = {0: "n", 2: "height", 3: "width"}
    with torch.inference_mode():
        shapes = dict(zip(names, (o.dim() for o in wrapper(image))))
    axes.update({n: {d: f"{n}_{d}" for d in range(shapes[n])} for n in names if n not in axes})
    with onnx_postprocess(wrapper.model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings from torchvision's ONNX-aware code paths
        torch.onnx.export(wrapper, (image,), str(path), opset_version=opset, dynamo=False,
                          input_names=["image"], output_names=names, dynamic_axes=axes)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    from detpipe.export.batched import session_runner
    return session_runner(session)


def export_onnx_batched(model: torch.nn.Module, images: list[torch.Tensor], path: Path, opset: int) -> Callable:
    """Write ``model`` as an ONNX graph with a dynamic batch dimension (`detpipe.export.batched.BatchedExport`:
    input ``images`` ``float32 (B, 3, S_h, S_w)``, outputs ``boxes``, ``scores``, ``labels``, ``batch_index``, then
    the raw head outputs with the batch first), traced on ``images`` resized to the model's input size; return
    `detpipe.export.batched.runner` over it (onnxruntime, CPU): ``run(image)`` and ``run.many(images)`` (one call).

    Raises:
        ValueError: the model has no batched form (`detpipe.export.batched.batch_kind`).
    """
    import onnxruntime as ort

    from detpipe.export.batched import BATCH_INPUT, BatchedExport, resize, session_runner

    wrapper = BatchedExport(model).eval()
    try:
        batch = torch.stack([resize(im, wrapper.size) for im in images[:2]])
        names = wrapper.output_names(batch)
        axes = {BATCH_INPUT: {0: "batch"}, **{n: {0: "n"} for n in names[:4]}, **{n: {0: "batch"} for n in names[4:]}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings (shapes read as Python ints: fixed by the input size)
            torch.onnx.export(wrapper, (batch,), str(path), opset_version=opset, dynamo=False,
                              input_names=[BATCH_INPUT], output_names=names, dynamic_axes=axes)
    finally:
        wrapper.remove_hooks()
    return session_runner(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))


def export_program(wrapper: DetectionExport, image: torch.Tensor, path: Path) -> Callable:
    """Write ``wrapper`` as a ``torch.export`` ExportedProgram (``torch.export.save``; H and W dynamic,
    16..8192 pixels); return a runner over the file as loaded back (``torch.export.load(path).module()``)."""
    dims = {1: torch.export.Dim("height", min=16, max=8192), 2: torch.export.Dim("width", min=16, max=8192)}
    with _exportable_batched_nms(), warnings.catch_warnings():
        # torchvision's own fake nms kernel calls a renamed torch API (its message says so); not ours to fix
        warnings.filterwarnings("ignore", message=".*create_unbacked_symint.*")
        program = torch.export.export(wrapper, (image,), dynamic_shapes={"image": dims})
    torch.export.save(program, str(path))
    module = torch.export.load(str(path)).module()
    return lambda im: module(im)


class _Call(torch.nn.Module):
    """Holds a TorchScript submodule so that forward hooks (`DetectionExport`) can watch it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


def _without_hooks(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` without the forward hooks any `DetectionExport` put on it."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        m._forward_hooks.clear()
    return twin


def export_torchscript(model: torch.nn.Module, path: Path, masks: bool) -> Callable:
    """Write ``torch.jit.script(model)`` (torchvision's scripted API: ``model(list of images)`` returns
    ``(losses, detections)``); return a runner giving `DetectionExport` outputs from the file as loaded back:
    detections from the loaded module's own ``forward``, raw outputs from the eager model with the loaded
    module's ``backbone`` and `raw_taps` submodules in place of its own (TorchScript files take no hooks).
    TorchScript is deprecated in PyTorch 2.5+: its ``FutureWarning`` is expected here."""
    torch.jit.script(_without_hooks(model)).save(str(path))
    loaded = torch.jit.load(str(path)).eval()
    twin = _without_hooks(model)
    for sub in ["backbone", *raw_taps(model)]:
        parent, _, leaf = sub.rpartition(".")
        setattr(twin.get_submodule(parent) if parent else twin, leaf,
                _Call(functools.reduce(getattr, sub.split("."), loaded)))  # no get_submodule on ScriptModules
    twin_wrapper = DetectionExport(twin, masks)

    def run(im):
        det = loaded([im])[1][0]
        raw = twin_wrapper(im)[3 + int(masks):]
        return (det["boxes"], det["scores"], det["labels"], *([det["masks"]] if masks else []), *raw)
    return run


MODEL_CARD_TEMPLATE = """\
{# Jinja2, rendered by `model_card`; a line ending in a backslash continues on the next (Python's string). #}
# Model card: {{ ckpt['config']['name'] }}

- Trained for {{ ckpt.get('iters') }} iterations{{ ' (EMA weights)' if ckpt.get('ema') else '' }}; \
{{ meta['num_classes'] - 1 }} classes + background (labels 1..{{ meta['num_classes'] - 1 }}).
- Dataset: `{{ meta.get('annotations_file') }}`; Arrow shards manifest sha256 `{{ dataset_sha256 }}`; \
train {{ meta['splits']['train']['images'] }} images, val {{ meta['splits']['val']['images'] }} images.
- Model builder kwargs: `{{ ckpt['config'].get('kwargs', {}) | json }}`

## Metrics (COCO {{ 'bbox and segm' if segm else 'bbox' }} on val)

{% if segm %}
| stat | bbox | segm |
|---|---|---|
{% for stat, value in metrics['bbox'].items() %}
| {{ stat }} | {{ value | fmt('.4f') }} | {{ metrics['segm'][stat] | fmt('.4f') }} |
{% endfor %}
{% elif metrics %}
| stat | value |
|---|---|
{% for stat, value in metrics['bbox'].items() %}
| {{ stat }} | {{ value | fmt('.4f') }} |
{% endfor %}
{% else %}
(no {{ metrics_path }} yet: run the evaluate stage)
{% endif %}

## Training params

```yaml
{% for key, value in ckpt.get('params', {}).items() %}
{{ key }}: {{ value | json }}
{% endfor %}
```

## Files

{% set batched = report.get('batch', {}).get('dynamic') %}
{% if batched %}
{% set image_spec = '`images`: `float32 (B, 3, %d, %d)` RGB in [0, 1], B dynamic (each image resized to %d x %d, \
bilinear)' % (report['batch']['input_size'][0], report['batch']['input_size'][1], report['batch']['input_size'][0],\
 report['batch']['input_size'][1]) %}
{% else %}
{% set image_spec = '`image`: `float32 (3, H, W)` RGB in [0, 1], H and W dynamic' %}
{% endif %}
{% set outputs %}
`boxes` `float32 (N, 4)` XYXY input pixels, `scores` `float32 (N,)`, `labels` `int64 (N,)`\
{{ ', `batch_index` `int64 (N,)` (the image of the batch)' if batched else '' }}\
{{ ', `masks` `float32 (N, 1, H, W)` mask probabilities in [0, 1] at input pixels (> 0.5: in the mask)'\
 if masks else '' }}\
, then the raw pre-NMS head outputs \
{% for name in report['raw_outputs'] %}{{ ', ' if not loop.first else '' }}`{{ name }}`{% endfor %}
{% endset %}
| file | input | output |
|---|---|---|
| `model.onnx` (opset {{ report['opset'] }}) | {{ image_spec }} | {{ outputs }} |
{% if 'torch_export' in report['formats'] %}
| `torch_export/model.pt2` (torch.export) | {{ image_spec }} | {{ outputs }} |
{% endif %}
{% if 'torchscript' in report['formats'] %}
| `torchscript/model.ts` (TorchScript) | `list[Tensor]`, each `float32 (3, H, W)` RGB in [0, 1] | \
`(losses, detections)`; `detections[i]`: `boxes`, `scores`, `labels`{{ ', `masks`' if masks else '' }} as above |
{% endif %}
{% if 'openvino' in report['formats'] and report['formats']['openvino'].get('written', True) %}
| `openvino/model.xml` + `model.bin` (OpenVINO IR, float32, from the ONNX file) | {{ image_spec }} | {{ outputs }} |
{% endif %}
{% if 'int8' in report['formats'] and report['formats']['int8'].get('written', True) %}
| `int8/model.int8.onnx` (int8, QDQ: {{ report['formats']['int8']['quantizer']['method'] }}, \
calibrated on {{ report['formats']['int8']['calibration_images'] }} train images) | {{ image_spec }} | {{ outputs }} |
{% endif %}

Gates, per format:

| format | gate | result |
|---|---|---|
{% for name, r in report['formats'].items() %}
{% if r.get('gate') == 'accuracy' %}
| {{ name }} | accuracy: COCO AP and AP50 on {{ r['val_images'] }} val images within \
{{ r['accuracy']['max_ap_drop'] }} of eager; detections at score >= {{ r['scores']['count_score'] }} within \
x{{ r['scores']['max_count_ratio'] }} of eager's | {{ 'pass' if r['ok'] else 'FAIL' }}: \
AP {{ r['accuracy']['int8']['AP'] | fmt('.4f') }} (eager {{ r['accuracy']['eager']['AP'] | fmt('.4f') }}), \
AP50 {{ r['accuracy']['int8']['AP50'] | fmt('.4f') }} (eager {{ r['accuracy']['eager']['AP50'] | fmt('.4f') }}), \
{{ r['scores']['int8']['count'] }} detections (eager {{ r['scores']['eager']['count'] }})\
{{ '; NOT WRITTEN (export.on_gate_fail: skip)' if r.get('written') is false else '' }} |
{% else %}
| {{ name }} | parity: raw head outputs (before top-k/NMS) on {{ report['images'] }} val images equal within \
{{ report['rtol'] }} of their rms magnitude | {{ 'pass' if r['raw']['ok'] else 'FAIL' }} \
(largest relative difference {{ r['raw']['max_rel_diff'] | fmt('.2g') }}; \
final detections matched {{ r['detections']['match'] | fmt('.3f') }})\
{{ '; NOT WRITTEN (export.on_gate_fail: skip)' if r.get('written') is false else '' }} |
{% endif %}
{% endfor %}
{% for name, r in report['formats'].items() if r.get('written') is false %}

**{{ name }} is not in this export:** {{ r['skipped'] }}.
{% endfor %}
{% if 'int8' in report['formats'] %}
{% set q = report['formats']['int8']['quantizer'] %}

int8 quantizer: {{ q['method'] }}\
{% if 'kept_float' in q %}
; {{ q['quantized_layers'] }} of {{ q['layers'] }} layers int8, kept float: \
{{ q['kept_float'] | join(', ') if q['kept_float'] else 'none' }} (reverted by the accuracy control: \
{{ q['reverted'] | join(', ') if q['reverted'] else 'none' }}; score head by rule: {{ q['score_head'] | join(', ') }})\
{% elif q.get('score_head') %}
; score head kept float by rule: {{ q['score_head'] | join(', ') }}\
{% endif %}
. Scores (val, int8 vs eager): {{ report['formats']['int8']['scores']['int8']['count'] }} vs \
{{ report['formats']['int8']['scores']['eager']['count'] }} detections at score >= \
{{ report['formats']['int8']['scores']['count_score'] }}; 90th percentile \
{{ report['formats']['int8']['scores']['int8']['p90'] | fmt('.3f') if report['formats']['int8']['scores']['int8']['p90'] is not none else '-' }} vs \
{{ report['formats']['int8']['scores']['eager']['p90'] | fmt('.3f') if report['formats']['int8']['scores']['eager']['p90'] is not none else '-' }}.
{% endif %}

Classes: the model's output `labels` are training labels; `predict` and `evaluate` report the dataset's own
category ids and names (`category_id_to_label` in `data/arrow/meta.json`; label 0 is the background)\
{% if meta.get('format') %}; {{ meta['format'] }} dataset\
{{ ': ids are the class indices of ' + meta['annotations_file'] if meta['format'] == 'yolo' else '' }}{% endif %}:

| label | category_id | name |
|---|---|---|
{% for cid, label in meta['category_id_to_label'].items() | sort(attribute='1') %}
| {{ label }} | {{ cid }} | {{ meta['label_names'][label] }} |
{% endfor %}

## Run

{% if 'torch_export' in report['formats'] %}
```python
import torch
from PIL import Image
from torchvision.transforms.functional import to_tensor
image = to_tensor(Image.open('image.jpg').convert('RGB'))  # float32 (3, H, W) in [0, 1]
model = torch.export.load('models/torch_export/model.pt2').module()
boxes, scores, labels = model(image)[:3]
```

{% endif %}
```python
import numpy as np, onnxruntime as ort
from PIL import Image
image = np.asarray(Image.open('image.jpg').convert('RGB'), np.float32).transpose(2, 0, 1) / 255
session = ort.InferenceSession('models/model.onnx', providers=['CPUExecutionProvider'])
{% if batched %}
# a batch of images (any sizes), resized to the input size; boxes mapped back to each image's pixels
import torch
from detpipe.export.batched import feed, split
size, images = {{ report['batch']['input_size'] | json }}, [torch.from_numpy(image)]
boxes, scores, labels = split(session.run(None, feed(images, size)), [im.shape[-2:] for im in images], size)[0][:3]
{% else %}
boxes, scores, labels = session.run(['boxes', 'scores', 'labels'], {'image': image})
{% endif %}
```
{% if not batched %}

One image per call: {{ report['batch']['reason'] if 'batch' in report else 'no batched export' }}.
{% endif %}
{% if 'openvino' in report['formats'] %}

```python
import openvino as ov
compiled = ov.Core().compile_model('models/openvino/model.xml', 'CPU', {'INFERENCE_PRECISION_HINT': 'f32'})
result = compiled({'image': image})  # image as for onnxruntime
boxes, scores, labels = (result[compiled.output(name)] for name in ('boxes', 'scores', 'labels'))
```
{% endif %}
{% if 'int8' in report['formats'] and report['formats']['int8'].get('written', True) %}

The int8 file runs like `model.onnx` (`ort.InferenceSession('models/int8/model.int8.onnx', ...)`).
{% endif %}
"""


@functools.cache
def _model_card_template() -> jinja2.Template:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    env.filters.update(json=json.dumps, fmt=format)  # json.dumps as is (Jinja's tojson escapes <>&'), format(v, spec)
    return env.from_string(MODEL_CARD_TEMPLATE)


def model_card(ckpt: dict, report: dict, arrow_dir: Path, metrics_path: Path) -> str:
    """Markdown model card, rendered from `MODEL_CARD_TEMPLATE` (Jinja2): dataset hash (manifest sha256 of the
    Arrow shards, `detpipe.core.files.folder_sha256`), training params, COCO metrics (if ``metrics_path`` exists), the
    input/output spec of each exported file, the parity figures and minimal snippets to run the files.

    Args:
        ckpt: the final checkpoint (``models/model.pt``: ``config``, ``iters``, ``ema``, ``params``).
        report: the export report (``models/export_report.json``: ``opset``, ``formats``, ``images``, ``rtol``,
            ``raw_outputs``, ``masks``).
        arrow_dir: the convert stage's output (its ``meta.json`` and shards).
        metrics_path: the evaluate stage's ``metrics/eval.json`` (bbox, and segm for mask models).
    Returns:
        The card's markdown text, ending with one newline.
    Raises:
        detpipe.core.errors.StageError: ``arrow_dir/meta.json`` missing or not JSON (`detpipe.data.meta.read_meta`).
        OSError: ``arrow_dir`` or ``metrics_path`` unreadable.
        jinja2.UndefinedError: ``ckpt``, ``report`` or ``meta.json`` lacks a key the card shows.
    """
    meta = read_meta(Path(arrow_dir) / "meta.json", "convert")
    metrics = json.loads(Path(metrics_path).read_text()) if Path(metrics_path).is_file() else None
    return _model_card_template().render(
        ckpt=ckpt, report=report, meta=meta, metrics=metrics, metrics_path=metrics_path,
        segm=bool(metrics and "segm" in metrics), masks=bool(report.get("masks")),
        dataset_sha256=folder_sha256(Path(arrow_dir)))
