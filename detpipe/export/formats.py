"""The export stage's extra deployment formats (``export.formats``), made from the checked ONNX file: OpenVINO IR
(`export_openvino`, gated like ONNX by the raw-output parity gate) and int8 ONNX (NNCF's accuracy control by default,
`detpipe.export.quantize`; `quantize_int8`: onnxruntime's post-training static quantization, QDQ, with
``export.int8_method: plain``; gated by `accuracy_gate`: COCO AP and AP50 on val within ``export.max_ap_drop`` of
the eager model's).

OpenVINO is run on its CPU plugin with ``INFERENCE_PRECISION_HINT: f32`` (`OPENVINO_CONFIG`): on CPUs with bf16
or AMX units the plugin's default would compute in bf16, which is not the float model the parity gate checks.
Telemetry: `openvino_quiet` keeps OpenVINO's converter from sending anything or writing into the home folder (see
its docstring); the runtime (``openvino.Core``) sends none.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from detpipe.core.errors import StageError

OPENVINO_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}
# The network's op types that int8 quantization covers (the QDQ pairs onnxruntime fuses into QLinearConv etc.);
# the postprocess (softmax, box decoding, top-k, NMS) stays float32: `network_nodes`.
QUANTIZED_OPS = ("Conv", "Add", "Mul", "GlobalAveragePool", "HardSigmoid", "Relu", "Clip", "MaxPool", "AveragePool")


@contextlib.contextmanager
def openvino_quiet() -> Iterator[None]:
    """While converting with ``openvino.convert_model``: no telemetry, nothing written to the home folder.

    OpenVINO's converter (``openvino.tools.ovc.telemetry_utils.init_ovc_telemetry``, openvino 2026.4) starts the
    ``openvino_telemetry`` package (2025.2) with ``enable_opt_in_dialog=False, disable_in_ci=True``: opt-out
    telemetry, sent to Google Analytics unless the consent file ``~/intel/openvino_telemetry`` says ``0`` (what
    ``opt_in_out --opt_out`` writes: https://docs.openvino.ai/2026/about-openvino/additional-resources/telemetry.html),
    and without that file it *creates* ``~/intel/`` and a client-id file. Its
    ``OptInChecker.check`` declines first thing, before any file is touched, when the process looks like a CI job
    (``CI=true`` in the environment, ``_run_in_ci``); ``Telemetry.consent`` is then False and every
    ``send_*`` call returns without sending. So ``CI=true`` is set for the block and the previous value restored:
    the opt-out holds for this process without editing the user's consent file. Nothing to do with the package
    missing (``telemetry_stub``)."""
    previous = os.environ.get("CI")
    os.environ["CI"] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("CI", None)
        else:
            os.environ["CI"] = previous


def export_openvino(onnx_path: Path, xml_path: Path, names: list[str] | None = None) -> Callable:
    """Convert the ONNX file to OpenVINO IR (``openvino.convert_model``, then ``openvino.save_model`` with
    ``compress_to_fp16=False``: float32 weights, as checked) at ``xml_path`` (+ ``.bin`` beside it); return a
    runner over the saved IR as loaded back (`openvino_runner`, outputs in the order of ``names``).

    Raises:
        StageError: the converter refused the graph, or the IR lacks one of ``names`` (names the file and the
            reason).
    """
    import openvino as ov

    try:
        with openvino_quiet():
            model = ov.convert_model(str(onnx_path))
        ov.save_model(model, str(xml_path), compress_to_fp16=False)
    except Exception as e:  # noqa: BLE001 - OpenVINO raises its own error types for unsupported graphs
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise StageError(f"{onnx_path}: OpenVINO cannot convert it ({type(e).__name__}: {reason})") from None
    return openvino_runner(xml_path, names)


def openvino_runner(xml_path: Path, names: list[str] | None = None) -> Callable:
    """A runner for an OpenVINO IR written by `export_openvino`: ``run(image)`` (``float32 (3, H, W)`` torch tensor
    in [0, 1]) -> the outputs named ``names`` in that order (None: the file's outputs,
    `detpipe.export.exporter.DetectionExport`'s order), and ``run.many(images)``: one tuple per image, one infer call
    for the whole batch when the IR is a batched graph (`detpipe.export.batched.runner`: the images resized to its
    input size, boxes mapped back per image). CPU plugin with `OPENVINO_CONFIG`; one infer request, so one call
    at a time.

    Raises:
        StageError: an output of ``names`` is not in the file.
    """
    import openvino as ov

    from detpipe.export.batched import BATCH_INDEX, graph_size, runner

    compiled = ov.Core().compile_model(str(xml_path), "CPU", OPENVINO_CONFIG)
    request = compiled.create_infer_request()
    by_name = {name: o for o in compiled.outputs for name in o.get_names()}
    missing = [n for n in names or [] if n not in by_name]
    if missing:
        raise StageError(f"{xml_path}: outputs {missing} missing (the file has {sorted(by_name)})")
    first = compiled.inputs[0]
    shape = first.get_partial_shape()
    size = graph_size([(first.get_any_name(), [d.get_length() if d.is_static else None for d in shape])])
    if names and size is not None and BATCH_INDEX not in names:   # batched: each detection's image index after the labels
        names = [*names[:3], BATCH_INDEX, *names[3:]]
    outputs = [by_name[n] for n in names] if names else list(compiled.outputs)

    def call(inputs: dict) -> list[np.ndarray]:
        result = request.infer(inputs)
        return [np.array(result[o]) for o in outputs]
    return runner(call, size)


SCORE_OUTPUT_HINTS = ("cls", "logits", "score", "objectness", "ctrness")


def score_head_nodes(onnx_model, raw_names: list[str]) -> list[str]:
    """Names of the last ``Conv`` nodes before each raw score output (a raw output whose name contains one of
    `SCORE_OUTPUT_HINTS`: ``head.cls_logits``): walking back from the output through the non-Conv nodes (reshape,
    permute, concat), the first ``Conv`` met on each path. Quantizing these (per-level classification convs) puts an
    8-bit grid on the logits that the softmax turns into scores; they are kept float."""
    graph = onnx_model.graph
    producer = {out: node for node in graph.node for out in node.output}
    found: list[str] = []
    seen: set[str] = set()
    todo = [producer[n] for n in raw_names if n in producer and any(h in n.lower() for h in SCORE_OUTPUT_HINTS)]
    while todo:
        node = todo.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == "Conv":
            found.append(node.name)
            continue
        todo += [producer[i] for i in node.input if i in producer]
    return sorted(found)


def network_nodes(onnx_model, raw_names: list[str]) -> list[str]:
    """Names of the ONNX nodes int8 quantization covers: those of type `QUANTIZED_OPS` on a path from the graph's
    first ``Conv`` (the backbone's stem) to a raw head output (``raw_names``: the convolutional network itself),
    so the input normalisation, the resize arithmetic and the postprocess (softmax, box decoding, top-k, NMS: float
    ops whose ranges are data-dependent and whose rounding would move boxes and reorder scores) stay float32."""
    graph = onnx_model.graph
    producer = {out: node for node in graph.node for out in node.output}
    ancestors: set[str] = set()
    todo = [producer[n] for n in raw_names if n in producer]
    while todo:
        node = todo.pop()
        if node.name in ancestors:
            continue
        ancestors.add(node.name)
        todo += [producer[i] for i in node.input if i in producer]
    consumers: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    first = next((node for node in graph.node if node.op_type == "Conv"), None)
    if first is None:
        return []
    descendants: set[str] = set()
    todo = [first]
    while todo:
        node = todo.pop()
        if node.name in descendants:
            continue
        descendants.add(node.name)
        todo += [c for out in node.output for c in consumers.get(out, [])]
    return [node.name for node in graph.node
            if node.op_type in QUANTIZED_OPS and node.name in ancestors and node.name in descendants]


def float_closure(onnx_model, layers: list[str], nodes: list[str]) -> list[str]:
    """The nodes of ``nodes`` (quantizable, `network_nodes`) that must stay unquantized in onnxruntime's QDQ
    file for each of ``layers`` (``Conv`` names, e.g. those NNCF's accuracy control reverted) to run on a float
    input: the layer itself, and walking up from its activation input (``input[0]``) every producer whose outputs
    feed nothing but that chain (activations, then the first ``Conv``, included, where the walk stops).
    onnxruntime's QDQ quantizer puts a quantizer on a quantized ``Conv``'s *output* too
    (``onnxruntime.quantization.operators.conv.QDQConv``), so excluding the layer alone would leave its input on
    an 8-bit grid; a producer whose output also feeds another node (a residual ``Add``) stays quantized."""
    graph = onnx_model.graph
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[str]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node.name)
    allowed, out = set(nodes), []
    by_name = {node.name: node for node in graph.node}
    for name in layers:
        node = by_name.get(name)
        if node is None:
            continue
        chain = [name]
        while node.input and node.input[0] in producer:
            up = producer[node.input[0]]
            if up.name not in allowed or any(set(consumers.get(o, [])) - set(chain) for o in up.output):
                break
            chain.append(up.name)
            if up.op_type == "Conv":
                break
            node = up
        out += [n for n in chain if n not in out]
    return out


def quantize_int8(onnx_path: Path, out_path: Path, calibration: list[torch.Tensor], raw_names: list[str],
                  score_head_float: bool = True, keep_float: list[str] = ()) -> Callable:
    """Post-training static int8 quantization of the ONNX file with onnxruntime
    (``onnxruntime.quantization.quantize_static``, https://onnxruntime.ai/docs/performance/model-optimizations/quantization.html):
    QDQ format, activations ``QUInt8`` (asymmetric, MinMax calibration over ``calibration``), weights ``QInt8`` per
    output channel with ``reduce_range`` (7-bit weights: this machine's AVX2 without VNNI multiplies u8 x s8 with a
    16-bit intermediate that saturates at full range, as onnxruntime's documentation warns), on the network's
    nodes only (`network_nodes`) minus, by default, the score head (`score_head_nodes`: the
    last ``Conv`` before each raw score output, kept float32 so that the logits the softmax turns into scores are
    not put on an 8-bit grid; issue 50 item 3). Returns a runner over the written file (onnxruntime, CPU).

    Args:
        onnx_path: the float ONNX file (checked by the parity gate).
        out_path: where the int8 file goes.
        calibration: ``float32 (3, H, W)`` images in [0, 1] (training images from the augmentation cache).
        raw_names: the raw head outputs (`detpipe.export.exporter.DetectionExport.output_names`).
        score_head_float: keep the score head float32 (False: every network node int8, the pre-issue-50 file,
            for comparison in benchmarks).
        keep_float: ``Conv`` names to keep float32 too, with the activation chain feeding only them
            (`float_closure`; the layers NNCF's accuracy control reverted, `detpipe.export.quantize`).
    Raises:
        StageError: no calibration image, or onnxruntime could not quantize the graph.
    """
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    if not calibration:
        raise StageError(f"{out_path}: no calibration images (export.calibration_images >= 1, data/cache/train)")

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([feed([im], size) for im in calibration])   # batched graph: batches of one

        def get_next(self):
            return next(self.items, None)

    from detpipe.export.batched import feed, onnx_graph_size, session_runner

    size = onnx_graph_size(onnx_path)
    model = onnx.load(str(onnx_path))
    nodes = network_nodes(model, raw_names)
    if score_head_float:
        head = set(score_head_nodes(model, raw_names))
        nodes = [n for n in nodes if n not in head]
    if keep_float:
        excluded = set(float_closure(model, list(keep_float), nodes))
        nodes = [n for n in nodes if n not in excluded]
    if not nodes:
        raise StageError(f"{onnx_path}: no convolutional network between the input and the raw outputs "
                         f"{raw_names} to quantize")
    ort.set_default_logger_severity(3)   # the calibration sessions warn once per unused initializer (hundreds)
    try:
        quantize_static(str(onnx_path), str(out_path), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                        reduce_range=True, calibrate_method=CalibrationMethod.MinMax, nodes_to_quantize=nodes,
                        op_types_to_quantize=list(QUANTIZED_OPS))
    except Exception as e:  # noqa: BLE001 - onnxruntime's quantizer raises assorted types
        raise StageError(f"{onnx_path}: onnxruntime could not quantize it ({type(e).__name__}: {e})") from None
    finally:
        ort.set_default_logger_severity(2)   # onnxruntime's default (warnings); it has no getter
    return session_runner(int8_session(out_path))


def int8_session(path: Path, options=None):
    """An onnxruntime CPU session for an int8 QDQ file, its log at errors only: when onnxruntime fuses the QDQ
    pairs into ``QLinearConv`` etc. at load it warns once per float constant the fusion left unused (a hundred
    ``Removing initializer`` lines for SSDlite, nothing wrong). ``options``: an ``ort.SessionOptions`` to start from
    (default: a new one)."""
    import onnxruntime as ort

    options = options or ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def val_results(run: Callable, dataset, label_to_category: dict[int, int], masks: bool) -> list[dict]:
    """COCO results (original-image pixels, the dataset's category ids, every score) of a runner over every image
    of a cached split, one image per call, by the evaluate stage's own mapping
    (`detpipe.evaluation.detections.image_detections`: ``orig = cached / scale + offset``, float32 arithmetic as
    `detpipe.evaluation.detections.detect_dataset`). ``run`` returns `DetectionExport` outputs; masks are not
    scored (bbox AP)."""
    from detpipe.evaluation.detections import image_detections
    from detpipe.export.parity import split_outputs

    results = []
    for i in range(len(dataset)):
        image, t = dataset[i]
        det, _ = split_outputs(run(image), masks)
        results += image_detections(det, int(t["image_id"]), label_to_category, t["scale"], t["orig_size"],
                                    t["offset"], 0.0, masks=False, dtype=torch.float32)
    return results


def accuracy_gate(eager: dict, quantized: dict, max_ap_drop: float) -> dict:
    """The int8 verdict: ``ok`` when the quantized model's COCO AP and AP50 (0-1, COCOeval's ``stats``) are each at
    most ``max_ap_drop`` below the eager model's on the same val images (a gain always passes).

    Args:
        eager, quantized: ``{"AP": float, "AP50": float}``.
        max_ap_drop: largest allowed drop, absolute, on COCOeval's 0-1 scale (0.01 = one AP point).
    Returns:
        ``{"eager": eager, "int8": quantized, "drop": {"AP", "AP50"}, "max_ap_drop", "ok"}``.
    """
    drop = {k: eager[k] - quantized[k] for k in ("AP", "AP50")}
    return {"eager": eager, "int8": quantized, "drop": drop, "max_ap_drop": max_ap_drop,
            "ok": all(d <= max_ap_drop + 1e-12 for d in drop.values())}


def coco_ap(results: list[dict], gt: dict, source: str) -> dict:
    """``{"AP", "AP50"}`` of COCO results against the val ground truth (`detpipe.evaluation.coco_metrics.coco_evaluate`,
    bbox, faster_coco_eval: the evaluate stage's scoring; 0-1)."""
    from detpipe.evaluation.coco_metrics import coco_evaluate

    stats = coco_evaluate(gt, results, "bbox", gt_source="val ground truth", dt_source=source).stats
    return {"AP": stats["AP"], "AP50": stats["AP50"]}


CALIBRATION_CAP = 300   # export.calibration_images: null takes every train image up to this (NNCF's subset_size)


def calibration_images(cache_dir: Path, n: int | None) -> list[torch.Tensor]:
    """``n`` training images of the augmentation cache (``cache_dir/train``), evenly spaced over the split (all of
    them when it has fewer; None: all, at most `CALIBRATION_CAP`): ``float32 (3, H, W)`` in [0, 1], as the model
    is fed.

    Raises:
        StageError: the train split is missing (`detpipe.data.dataset.CachedDetectionDataset`).
    """
    from detpipe.data.dataset import CachedDetectionDataset

    train = CachedDetectionDataset(cache_dir, "train")
    n = CALIBRATION_CAP if n is None else n
    picks = sorted({int(round(x)) for x in np.linspace(0, len(train) - 1, min(n, len(train)))}) if len(train) else []
    return [train[i][0] for i in picks]

