"""int8 with accuracy control (``export.int8_method: accuracy_control``, the default) and the int8 gate's
score-calibration figures.

Quantizer: NNCF's ``nncf.quantize_with_accuracy_control`` (nncf 3.4.0, OpenVINO's quantization library,
https://docs.openvino.ai/2026/openvino-workflow/model-optimization-guide/quantizing-models-post-training/quantizing-with-accuracy-control.html)
on the checked ONNX file (its ONNX backend: the result is again an ONNX QDQ file, run by onnxruntime like the plain
int8 file). It quantizes every network layer, measures the validation function on the float and the int8 model,
and while the drop exceeds ``max_drop`` reverts to float the layer group whose quantization changes the outputs most
(ranked on the validation images), re-measuring after each. Chosen over onnxruntime's tools because onnxruntime has
no accuracy-driven loop: its ``onnxruntime.quantization.qdq_loss_debug`` compares per-tensor outputs of float and
QDQ models, but choosing which nodes to exclude from a metric is left to the user; NNCF does that search with our
own metric. Our metric (`ap_metric`) is the val COCO AP the gate checks, so NNCF stops on the gate's own bound.

What NNCF may quantize is the convolutional network between the input and the raw head outputs
(`detpipe.export.formats.network_nodes`) minus the score head (`score_head_nodes`): the rest (input normalisation,
resize arithmetic, softmax, box decoding, top-k, NMS) is given to it as an ignored scope and stays float32.

NNCF lays its QDQ graph out for OpenVINO, slow in onnxruntime (docs/export.md): the export stage then writes the
layers it reverted with onnxruntime's own quantizer (`detpipe.export.formats.quantize_int8` ``keep_float``) and
keeps that file when it passes the gate (`detpipe.export.stage._onnxruntime_layout`).
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from detpipe.core.errors import StageError

log = logging.getLogger(__name__)
def float_layers(onnx_model, layer_names: list[str]) -> list[str]:
    """Of ``layer_names`` (Conv/Gemm/MatMul nodes of the float graph), those whose weight input is not produced by a
    ``DequantizeLinear`` in ``onnx_model`` (a QDQ graph): the layers that run in float32."""
    producer = {out: node for node in onnx_model.graph.node for out in node.output}
    by_name = {node.name: node for node in onnx_model.graph.node}
    kept = []
    for name in layer_names:
        node = by_name.get(name)
        if node is None or len(node.input) < 2:
            continue
        weight = producer.get(node.input[1])
        if weight is None or weight.op_type != "DequantizeLinear":
            kept.append(name)
    return kept


def quantize_accuracy_control(onnx_path: Path, out_path: Path, calibration: list[torch.Tensor], raw_names: list[str],
                              val_items: list, transform: Callable, metric: Callable, max_drop: float) -> dict:
    """Quantize ``onnx_path`` with NNCF's accuracy control to ``out_path`` (ONNX, QDQ).

    Args:
        onnx_path: the float ONNX file (checked by the parity gate).
        out_path: where the int8 file goes.
        calibration: ``float32 (3, H, W)`` images in [0, 1] (training images).
        raw_names: the raw head outputs (what bounds the quantizable network, `detpipe.export.formats.network_nodes`).
        val_items: the validation items (val image indices) NNCF measures and ranks on.
        transform: one item -> the model's input dict ``{"image": float32 (3, H, W) ndarray}``.
        metric: ``(onnx.ModelProto, items) -> float``, higher is better (`ap_metric`); NNCF's drop is the float
            model's value minus the int8 model's.
        max_drop: the largest allowed drop (absolute, the metric's units: ``export.max_ap_drop``).
    Returns:
        ``{"method", "layers": int, "quantized_layers": int, "kept_float": [names], "reverted": [names reverted by
        the accuracy control], "score_head": [names kept float by rule], "metric": {"float", "plain", "last",
        "calls"}}``: the validation function's values for the float model, NNCF's fully quantized one and the last candidate, and how many full validations ran.
    Raises:
        StageError: no calibration image; NNCF could not quantize the graph (names the file and the reason).
    """
    import nncf
    import onnx
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    from detpipe.export.formats import network_nodes, score_head_nodes

    if not calibration:
        raise StageError(f"{out_path}: no calibration images (export.calibration_images >= 1, data/cache/train)")
    model = onnx.load(str(onnx_path))
    network = set(network_nodes(model, raw_names))
    if not network:
        raise StageError(f"{onnx_path}: no convolutional network between the input and the raw outputs "
                         f"{raw_names} to quantize")
    score_head = score_head_nodes(model, raw_names)
    ignored = [n.name for n in model.graph.node if n.name not in network or n.name in score_head]
    layers = [n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul") and n.name in network]
    from detpipe.export.batched import feed, onnx_graph_size

    size = onnx_graph_size(onnx_path)   # a batched graph: each calibration image as a batch of one
    calib = nncf.Dataset(list(calibration), lambda im: feed([im], size))
    val = nncf.Dataset(list(val_items), transform)
    measured: dict[str, float] = {}

    def validate(m, items) -> float:
        items = list(items)
        value = float(metric(m, items))
        if len(items) == len(val_items):   # not NNCF's one-image probe of the return type
            measured["float" if "float" not in measured else "plain" if "plain" not in measured else "last"] = value
            measured["calls"] = measured.get("calls", 0) + 1
        return value

    from detpipe.export.formats import openvino_quiet

    with tempfile.TemporaryDirectory(prefix="detpipe-nncf-") as inter, openvino_quiet():
        try:
            quantized = nncf.quantize_with_accuracy_control(
                model, calib, val, validate, max_drop=max_drop, subset_size=len(calibration),
                ignored_scope=nncf.IgnoredScope(names=ignored, validate=False),
                advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(
                    intermediate_model_dir=inter, ranking_subset_size=len(val_items)))
        except Exception as e:  # noqa: BLE001 - NNCF raises its own and onnxruntime's error types
            log.debug("NNCF failed", exc_info=True)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise StageError(f"{onnx_path}: NNCF could not quantize it ({type(e).__name__}: {reason})") from None
        first = onnx.load(str(Path(inter) / "intermediate_model.onnx"))
    onnx.save(quantized, str(out_path))
    kept = float_layers(quantized, layers)
    plain_kept = set(float_layers(first, layers))
    return {"method": "accuracy_control (NNCF quantize_with_accuracy_control, ONNX QDQ)", "layers": len(layers),
            "quantized_layers": len(layers) - len(kept), "kept_float": kept,
            "reverted": [n for n in kept if n not in plain_kept], "score_head": score_head, "metric": measured}


def onnx_runner(model) -> Callable:
    """A runner over an in-memory ``onnx.ModelProto`` (onnxruntime CPU, errors-only log): ``float32 (3, H, W)``
    tensor -> `detpipe.export.exporter.DetectionExport`-order outputs (numpy; `detpipe.export.batched.session_runner`,
    one-image or batched graph)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    from detpipe.export.batched import session_runner

    return session_runner(session)


def ap_metric(dataset, gt: dict, label_to_category: dict[int, int], masks: bool, eager: dict,
              count_score: float, eager_count: int, max_count_ratio: float) -> Callable:
    """The validation function NNCF's accuracy control maximises: for an ONNX model (``onnx.ModelProto``) and val
    image indices, ``1 + min(AP - eager AP, AP50 - eager AP50)`` over every val image (COCO bbox, the evaluate stage's
    scoring, `detpipe.export.formats.coco_ap`; ``eager``: ``{"AP", "AP50"}`` of the eager model on the same
    images), so that NNCF's drop (float value minus int8 value) is the larger of the two drops the gate bounds;
    0 when the count of detections at or above ``count_score`` is not within ``max_count_ratio`` of
    ``eager_count`` (the score-calibration gate, `count_check`). NNCF calls it once on one image only to learn
    and to rank layers, per image: those calls get the image's AP. (The 1 + keeps the float model's value away from
    0: NNCF 3.4 computes a relative drop beside the absolute one and divides by it.)"""
    from detpipe.export.formats import coco_ap, val_results

    everything = list(range(len(dataset)))
    last: list = [None, None]   # (model, its runner): NNCF calls once per item when it ranks layers

    def metric(model, items: list) -> float:
        if last[0] is not model:
            last[:] = [model, onnx_runner(model)]
        sub = Subset(dataset, items)
        results = val_results(last[1], sub, label_to_category, masks)
        if list(items) != everything:
            ids = {int(sub[i][1]["image_id"]) for i in range(len(sub))}
            g = {**gt, "images": [im for im in gt["images"] if im["id"] in ids],
                 "annotations": [a for a in gt["annotations"] if a["image_id"] in ids]}
            return coco_ap(results, g, "int8 candidate")["AP"]
        ap = coco_ap(results, gt, "int8 candidate")
        count = sum(r["score"] >= count_score for r in results)
        if not count_check(count, eager_count, max_count_ratio):
            return 0.0
        return 1.0 + min(ap["AP"] - eager["AP"], ap["AP50"] - eager["AP50"])
    return metric


class Subset:
    """``dataset`` restricted to the indices ``items`` (what `detpipe.export.formats.val_results` iterates)."""

    def __init__(self, dataset, items: list):
        self.dataset, self.items = dataset, list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.dataset[self.items[i]]


def count_check(count: int, reference: int, max_ratio: float) -> bool:
    """True when ``count`` (int8 detections at or above the counting score) is within a factor ``max_ratio`` of
    ``reference`` (eager's): ``reference / max_ratio <= count <= reference * max_ratio`` (both 0 passes)."""
    return reference / max_ratio - 1e-9 <= count <= reference * max_ratio + 1e-9


def count_ratio(count: int, reference: int) -> float | None:
    """int8's count of detections at or above the counting score ÷ eager's (``reference``), as the report and
    ``metrics/export.json`` give it: 1.0 when both are 0 (equal counts, which `count_check` passes), None when only
    eager's is 0 (no ratio: `count_check` fails it)."""
    if reference == 0:
        return 1.0 if count == 0 else None
    return count / reference


def score_figures(results: list[dict], count_score: float) -> dict:
    """The score distribution of COCO results: ``count`` at or above ``count_score``, ``total``, and the 50th, 90th
    and 99th percentiles and maximum of every score (0-1; None without detections)."""
    scores = np.array([r["score"] for r in results], dtype=np.float64)
    q = (lambda p: float(np.percentile(scores, p))) if len(scores) else (lambda p: None)
    return {"count": int((scores >= count_score).sum()), "total": int(len(scores)), "p50": q(50), "p90": q(90),
            "p99": q(99), "max": float(scores.max()) if len(scores) else None}
