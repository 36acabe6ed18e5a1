"""Exported detectors (ONNX, torch.export, TorchScript): the wrapper every file is made from and the writers.

Every exported file is made from `DetectionExport`: one image in, ``(boxes, scores, labels[, masks], *raw)``
out, where ``raw`` are the *head outputs before any top-k or NMS* (`raw_taps`): SSD/SSDlite, RetinaNet and FCOS
``model.head`` (``cls_logits`` and ``bbox_regression``, plus ``bbox_ctrness`` for FCOS, one row per anchor);
R-CNN models ``model.rpn.head`` (objectness and box deltas per FPN level). These tensors have a fixed order
(anchor, class), so comparing them is immune to the tie-breaking that makes the final detections of a barely
trained model differ between runtimes (scores all ≈ 1/num_classes: which near-equal box survives top-k and NMS
is float noise). The parity gate (`detpipe.export.parity.compare_raw`): every raw tensor of the exported file
must agree with the eager model's within ``rtol`` of its root-mean-square magnitude, on every checked image. The
final detections are compared too (`detpipe.export.parity.match_detections`), as figures in the report, not as a
verdict. R-CNN box/mask heads run on proposals that the RPN's NMS picks, so for those models only the detection
figures cover them.

The NMS patches that hold while tracing are in `detpipe.export.nms_patches`; the model card in
`detpipe.export.model_card`.
"""
from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path
from typing import Callable

import torch

from detpipe.export.batched import flatten_outputs
from detpipe.export.nms_patches import exportable_batched_nms, onnx_postprocess

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
    with exportable_batched_nms(), warnings.catch_warnings():
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
