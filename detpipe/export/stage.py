"""Exporting the trained model as a torch.export ExportedProgram and ONNX (TorchScript on request), each checked
against the eager model: the export stage's work (`export`; ``python -m stages.export`` calls it with params
section ``export``).

`export` writes ``models/torch_export/model.pt2`` (``torch.export.save``; not for R-CNN models,
see `detpipe.export.exporter.torch_export_supported`; ``torch.export.load(...).module()``
takes one ``float32 (3, H, W)`` RGB image in [0, 1], H and W dynamic), ``models/model.onnx`` (opset
``export.opset``, ``torch.onnx.export(dynamo=False)``, input ``image`` of the same form; for SSD/SSDlite and the
transformers DETRs a batched graph instead, input ``images`` ``float32 (B, 3, S_h, S_w)`` with B dynamic and a
``batch_index`` output, `detpipe.export.batched`; the report's ``batch`` says which, and why not), both with the outputs of
`detpipe.export.exporter.DetectionExport`: ``boxes`` ``float32 (N, 4)`` XYXY input pixels, ``scores`` ``float32 (N,)``,
``labels`` ``int64 (N,)``, for mask models ``masks`` ``float32 (N, 1, H, W)`` (probabilities, > 0.5 in the mask),
then the raw pre-NMS head outputs; ``models/torchscript/`` (empty, or with ``export.torchscript: true``
``model.ts``: ``torch.jit.script``, torchvision's ``(losses, detections)`` API, for LibTorch/C++ users);
``models/export_report.json`` and ``models/model_card.md``. With ``export.formats`` (opt-in, default ``[]``;
`detpipe.export.formats`), from the checked ONNX file: ``models/openvino/model.xml`` + ``model.bin`` (OpenVINO IR,
float32, same signature) and ``models/int8/model.int8.onnx`` (int8 QDQ: NNCF's accuracy control,
`detpipe.export.quantize`, its choice of float layers written by onnxruntime's quantizer when that file passes,
or with ``export.int8_method: plain`` onnxruntime static quantization; calibrated on ``export.calibration_images``
images of ``data/cache/train``); their folders stay empty otherwise.

Parity gate, on ``export.num_images`` val images (a batched graph: all in one call, plus the first image's top
three quarters when they all have one size, so that two original sizes are checked): every raw head output (before top-k and NMS, so that ties among
the near-equal scores of a barely trained model cannot reorder anything) of each file, as loaded back, must equal
the eager model's within ``export.rtol`` of its root-mean-square magnitude (`detpipe.export.parity.compare_raw`). The final
detections are matched too (``export.score_threshold``, ``export.iou_match``) and reported, not gated. A run that
compared nothing fails unless ``export.require_parity: false``. The OpenVINO IR gets the same parity gate. The
int8 file gets an accuracy gate instead (it cannot be bit-close): COCO AP and AP50 (bbox, 0-1) of the int8 file and
of the eager model on every val image, scored by the evaluate stage's code, must each drop by at most
``export.max_ap_drop``, and its count of val detections at score >= ``export.count_score`` within
``export.max_count_ratio`` of eager's. Nothing is written unless every check passes; with ``export.on_gate_fail:
skip`` a format other than ONNX that fails its gate is left out instead (its folder empty, the report, model card
and ``metrics/export.json`` saying why) and the rest is written.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

from detpipe import params as params_mod
from detpipe.data.dataset import CachedDetectionDataset
from detpipe.core.errors import StageError
from detpipe.export.batched import BATCH_UNSUPPORTED, batch_kind, input_size
from detpipe.export.exporter import (TORCH_EXPORT_UNSUPPORTED, DetectionExport, export_onnx, export_onnx_batched,
                                     export_program, export_torchscript, torch_export_supported)
from detpipe.export.model_card import model_card
from detpipe.export.parity import parity, split_outputs
from detpipe.export.formats import (accuracy_gate, calibration_images, coco_ap, export_openvino, quantize_int8,
                                    val_results, score_head_nodes)
from detpipe.core.files import atomic_dir, atomic_write_bytes, atomic_write_json, temp_prefix
from detpipe.models import load_model, uses_masks
from detpipe.core.paths import ARROW_DIR, CACHE_DIR, EXPORT_METRICS, METRICS, MODEL, MODELS_DIR

log = logging.getLogger(__name__)
FILES = {"torch_export": "torch_export/model.pt2", "onnx": "model.onnx", "torchscript": "torchscript/model.ts",
         "openvino": "openvino/model.xml", "int8": "int8/model.int8.onnx"}
FOLDERS = ("torch_export", "torchscript", "openvino", "int8")   # DVC outputs, empty when their format is off


def export(cfg: params_mod.Export, model_path: Path = MODEL, cache_dir: Path = CACHE_DIR,
           out_dir: Path = MODELS_DIR, arrow_dir: Path = ARROW_DIR, metrics_path: Path = METRICS,
           model: torch.nn.Module | None = None, calibration: list[torch.Tensor] | None = None,
           validate: Callable | None = None, gate_metrics_path: Path = EXPORT_METRICS) -> dict:
    """Write the files of `FILES` (TorchScript only with ``cfg.torchscript``, torch.export unless
    ``cfg.torch_export`` is false, OpenVINO and int8 as ``cfg.formats`` says), ``export_report.json`` and
    ``model_card.md`` into ``out_dir``, nothing unless every gate passes (the parity gate for the float files, the
    accuracy gate for int8); return the report.

    Args:
        cfg: params section ``export``.
        model_path: the trained model (``models/model.pt``), also the eager reference.
        cache_dir: the augmentation cache; its first ``cfg.num_images`` val images are the parity inputs.
        out_dir: where the files go (``models/``), each replaced only after every check passed.
        arrow_dir, metrics_path: read for the model card.
        model: export this module instead of the one in ``model_path`` (the eager reference stays the one in
            ``model_path``; tests pass a perturbed copy to see the gate fail).
        calibration: int8: calibrate on these ``float32 (3, H, W)`` images instead of ``cfg.calibration_images``
            images of ``cache_dir/train`` (tests pass blank images to see the accuracy gate fail).
        validate: int8 accuracy control: NNCF's validation function instead of our val AP (`_int8`).
        gate_metrics_path: ``metrics/export.json`` (`gate_metrics`), written last.
    Returns:
        the report written to ``export_report.json``: per format under ``formats``, ``gate`` (``parity`` or
        ``accuracy``) and its figures (`detpipe.export.parity.parity`; int8: `_int8`'s entry); a format that
        failed its gate under ``export.on_gate_fail: skip`` has ``written: false`` and ``skipped`` (the reason);
        ``seconds`` per format (export + check).
    Raises:
        StageError: missing inputs; ONNX's parity failed (names the format, tensor, image and figures); with
            ``export.on_gate_fail: error`` (the default) any other format's gate failed too: parity, or the int8
            model's AP or AP50 on val more than ``cfg.max_ap_drop`` below the eager model's, or its count of
            detections at ``cfg.count_score`` beyond ``cfg.max_count_ratio`` of eager's (one line with the figures;
            nothing written); nothing compared and ``cfg.require_parity``; OpenVINO, onnxruntime's quantizer or NNCF
            refused the graph.
    """
    reference, ckpt = load_model(model_path)
    masks = uses_masks(reference)
    dataset = CachedDetectionDataset(cache_dir, "val")
    images = [dataset[i][0] for i in range(min(cfg.num_images, len(dataset)))]
    if not images:
        raise StageError(f"{cache_dir}/val: no images to check the export on")
    target = model.eval() if model is not None else reference
    kind = batch_kind(target)
    if kind and len({tuple(im.shape) for im in images}) == 1:
        # the batched graph's gate covers another original size too: the first image's top three quarters
        images.append(images[0][:, : images[0].shape[1] * 3 // 4].contiguous())
    eager_wrapper = DetectionExport(reference, masks).eval()
    all_names = eager_wrapper.output_names(images[0])
    names = all_names[3 + int(masks):]
    with torch.inference_mode():
        eager = [split_outputs(eager_wrapper(im), masks) for im in images]
    wrapper = DetectionExport(target, masks).eval() if model is not None else eager_wrapper
    report = {"images": len(images), "rtol": cfg.rtol, "score_threshold": cfg.score_threshold,
              "iou_match": cfg.iou_match, "opset": cfg.opset, "masks": masks, "raw_outputs": names, "formats": {},
              "seconds": {}, "image_sizes": [list(im.shape[1:]) for im in images],
              "batch": ({"dynamic": True, "family": kind, "input_size": list(input_size(target))} if kind else
                        {"dynamic": False, "reason": BATCH_UNSUPPORTED})}
    if not kind:
        log.warning("models/model.onnx takes one image per call: %s", BATCH_UNSUPPORTED)

    # named by the temporary-name rule, so that `detpipe.orchestration.repair` removes what a killed export left
    staging = Path(out_dir) / f"{temp_prefix(Path(out_dir) / 'export')}{os.getpid()}"
    with atomic_dir(staging) as tmp:
        for folder in FOLDERS:
            (tmp / folder).mkdir()
        runners = {"onnx": (lambda p: export_onnx_batched(target, images, p, cfg.opset)) if kind else
                   (lambda p: export_onnx(wrapper, images[0], p, cfg.opset))}
        if not cfg.torch_export:
            report["skipped"] = {"torch_export": "export.torch_export: false"}
        elif torch_export_supported(target):
            runners["torch_export"] = lambda p: export_program(wrapper, images[0], p)
        else:
            report["unsupported"] = {"torch_export": TORCH_EXPORT_UNSUPPORTED}
            log.warning("models/torch_export left empty: %s", TORCH_EXPORT_UNSUPPORTED)
        if cfg.torchscript:
            runners["torchscript"] = lambda p: export_torchscript(target, p, masks)
        if "openvino" in cfg.formats:   # from the ONNX file just written (runners run in this order)
            runners["openvino"] = lambda p: export_openvino(tmp / FILES["onnx"], p, all_names)
        if not names and cfg.require_parity:   # no raw output to compare: fail before minutes of exporting
            _nothing_compared(list(runners), cfg)
        for fmt, make in runners.items():
            t0 = time.perf_counter()
            run = make(tmp / FILES[fmt])
            with torch.inference_mode():   # a batched graph: every image in ONE call (`run.many`)
                outs = [split_outputs(o, masks) for o in (run.many(images) if hasattr(run, "many")
                                                          else [run(im) for im in images])]
            report["formats"][fmt] = r = {"gate": "parity", **parity(eager, outs, names, cfg.rtol,
                                                                     cfg.score_threshold, cfg.iou_match)}
            report["seconds"][fmt] = time.perf_counter() - t0
            log.info("%s parity: raw %s; detections %s", fmt, r["raw"], r["detections"])
        _verdict(report, cfg, tmp)
        if "int8" in cfg.formats:
            t0 = time.perf_counter()
            report["formats"]["int8"] = r = _int8(tmp, cfg, eager_wrapper, eager, images, names, masks, cache_dir,
                                                  arrow_dir, calibration, validate)
            report["seconds"]["int8"] = time.perf_counter() - t0
            if not r["ok"]:
                _gate_failed(report, "int8", r["failure"], tmp, cfg)
        atomic_write_json(tmp / "export_report.json", report)
        atomic_write_bytes(tmp / "model_card.md", model_card(ckpt, report, arrow_dir, metrics_path).encode())
    for rel in [*FOLDERS, FILES["onnx"], "export_report.json", "model_card.md"]:
        dest = Path(out_dir) / rel
        if dest.is_dir():
            for old in dest.iterdir():
                old.unlink()
            dest.rmdir()
        (staging / rel).replace(dest)
    staging.rmdir()
    Path(gate_metrics_path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(gate_metrics_path), gate_metrics(report))
    return report


def _int8(tmp: Path, cfg: params_mod.Export, eager_wrapper: DetectionExport, eager: list, images: list[torch.Tensor],
          names: list[str], masks: bool, cache_dir: Path, arrow_dir: Path,
          calibration: list[torch.Tensor] | None, validate: Callable | None = None) -> dict:
    """Quantize ``tmp/model.onnx`` to ``tmp/`` ``FILES["int8"]`` (``cfg.int8_method``: NNCF's accuracy control,
    `detpipe.export.quantize.quantize_accuracy_control`, with our val AP as its validation function, its choice of
    float layers then written by onnxruntime's quantizer when that file passes, `_onnxruntime_layout`; plain
    onnxruntime QDQ, `detpipe.export.formats.quantize_int8`; auto: plain, then accuracy control when the plain file
    fails this gate, the plain figures under ``quantizer["auto_plain_first"]``) and gate it: COCO AP and AP50
    (bbox, 0-1) of the int8
    file and of the eager model over every val image of ``cache_dir``, against ``arrow_dir/val``'s ground truth,
    scored by the evaluate stage's code (`detpipe.export.formats.val_results`, `detpipe.export.formats.coco_ap`),
    each within ``cfg.max_ap_drop``; and the score calibration: the count of detections at or above
    ``cfg.count_score`` within ``cfg.max_count_ratio`` of eager's (`detpipe.export.quantize.count_check`). The gate
    measures the written file itself, whatever the quantizer's validation function said.

    Args:
        validate: accuracy control: NNCF's validation function instead of `detpipe.export.quantize.ap_metric`
            (tests pass a constant to see the gate stay independent of it).
    Returns:
        the report entry: ``gate``, ``ok``, ``failure`` (the one-line reason, or None), ``accuracy``
        (`detpipe.export.formats.accuracy_gate`), ``scores`` (`detpipe.export.quantize.score_figures` of eager and
        int8, ``count_ratio``, ``max_count_ratio``, ``ok``), ``quantizer`` (method; accuracy control: the layers
        kept float and reverted; both: ``score_head``, the convolutions kept float by rule),
        ``calibration_images``, ``val_images`` and the raw-output figures (not gated); accuracy control:
        ``quantizer["file"]``, which file was written and why (`_onnxruntime_layout`).
    """
    import onnx

    from detpipe.data.meta import read_meta
    from detpipe.evaluation.detections import label_to_category_id
    from detpipe.evaluation.ground_truth import gt_from_arrow
    from detpipe.export.quantize import (ap_metric, count_check, count_ratio, onnx_runner,
                                         quantize_accuracy_control, score_figures)

    t0 = time.perf_counter()
    calib = calibration if calibration is not None else calibration_images(cache_dir, cfg.calibration_images)
    meta = read_meta(Path(arrow_dir) / "meta.json", "convert")
    l2c = label_to_category_id(meta)
    val = CachedDetectionDataset(cache_dir, "val")
    gt = gt_from_arrow(Path(arrow_dir) / "val", meta)
    with torch.inference_mode():
        eager_results = val_results(eager_wrapper, val, l2c, masks)
    eager_ap = coco_ap(eager_results, gt, "eager predictions")
    eager_count = sum(r["score"] >= cfg.count_score for r in eager_results)
    t1 = time.perf_counter()

    def check(run: Callable, what: str) -> dict:   # a candidate file's AP, AP50 and count, and the gate's verdict
        res = val_results(run, val, l2c, masks)
        ap = coco_ap(res, gt, f"predictions of {what} {FILES['int8']}")
        count = sum(r["score"] >= cfg.count_score for r in res)
        return {"AP": ap["AP"], "AP50": ap["AP50"], "count": count,
                "ok": accuracy_gate(eager_ap, ap, cfg.max_ap_drop)["ok"]
                and count_check(count, eager_count, cfg.max_count_ratio)}
    method, first = cfg.int8_method, None
    if method in ("plain", "auto"):
        run = quantize_int8(tmp / FILES["onnx"], tmp / FILES["int8"], calib, names)
        quantizer = {"method": "plain (onnxruntime quantize_static, QDQ, every network layer but the score head)",
                     "score_head": score_head_nodes(onnx.load(str(tmp / FILES["onnx"])), names)}
        if method == "auto":   # the fast plain file when it passes the gate, else accuracy control
            first = check(run, "plain")
            method = "plain" if first["ok"] else "accuracy_control"
            log.info("int8 auto: plain quantizer AP %.4f AP50 %.4f, %d detections: %s", first["AP"],
                     first["AP50"], first["count"], "kept" if first["ok"] else "fails its gate, accuracy control next")
    if method == "accuracy_control":
        from detpipe.export.batched import feed, onnx_graph_size

        size = onnx_graph_size(tmp / FILES["onnx"])
        metric = validate or ap_metric(val, gt, l2c, masks, eager_ap, cfg.count_score, eager_count,
                                       cfg.max_count_ratio)
        quantizer = quantize_accuracy_control(
            tmp / FILES["onnx"], tmp / FILES["int8"], calib, names, list(range(len(val))),
            lambda i: feed([val[i][0]], size), metric, cfg.max_ap_drop)
        run = (_onnxruntime_layout(tmp, calib, names, quantizer, check)
               or onnx_runner(onnx.load(str(tmp / FILES["int8"]))))
    if first is not None:
        quantizer["auto_plain_first"] = first
    t2 = time.perf_counter()
    int8_results = val_results(run, val, l2c, masks)
    int8_ap = coco_ap(int8_results, gt, f"predictions of {FILES['int8']}")
    t3 = time.perf_counter()
    verdict = accuracy_gate(eager_ap, int8_ap, cfg.max_ap_drop)
    scores = {"eager": score_figures(eager_results, cfg.count_score),
              "int8": score_figures(int8_results, cfg.count_score), "count_score": cfg.count_score,
              "max_count_ratio": cfg.max_count_ratio}
    scores["count_ratio"] = count_ratio(scores["int8"]["count"], scores["eager"]["count"])
    scores["ok"] = count_check(scores["int8"]["count"], scores["eager"]["count"], cfg.max_count_ratio)
    with torch.inference_mode():
        outs = [split_outputs(run(im), masks) for im in images]
    figures = parity(eager, outs, names, cfg.rtol, cfg.score_threshold, cfg.iou_match)
    log.info("int8 (%s) on %d val images: AP %.4f (eager %.4f), AP50 %.4f (eager %.4f), %d detections >= %.2f "
             "(eager %d); %s (eager val %.1f s, quantized in %.1f s, int8 val %.1f s)", cfg.int8_method, len(val),
             int8_ap["AP"], eager_ap["AP"], int8_ap["AP50"], eager_ap["AP50"], scores["int8"]["count"],
             cfg.count_score, scores["eager"]["count"], "pass" if verdict["ok"] and scores["ok"] else "FAIL",
             t1 - t0, t2 - t1, t3 - t2)
    failure = None
    if not verdict["ok"]:
        failure = (f"export accuracy gate failed: int8 ({FILES['int8']}, {cfg.int8_method}, calibrated on "
                   f"{len(calib)} images) on {len(val)} val images: AP {int8_ap['AP']:.4f} vs eager "
                   f"{eager_ap['AP']:.4f}, AP50 {int8_ap['AP50']:.4f} vs eager {eager_ap['AP50']:.4f} (drops "
                   f"{verdict['drop']['AP']:.4f} and {verdict['drop']['AP50']:.4f}; export.max_ap_drop "
                   f"{cfg.max_ap_drop})")
    elif not scores["ok"]:
        failure = (f"export score-calibration gate failed: int8 ({FILES['int8']}, {cfg.int8_method}) on "
                   f"{len(val)} val images: {scores['int8']['count']} detections at score >= {cfg.count_score} vs "
                   f"eager {scores['eager']['count']} (x{scores['count_ratio']:.2f}; export.max_count_ratio "
                   f"{cfg.max_count_ratio})")
    return {"gate": "accuracy", "ok": failure is None, "failure": failure, "accuracy": verdict, "scores": scores,
            "quantizer": quantizer, "calibration_images": len(calib), "val_images": len(val),
            "raw_figures": figures["raw"], "detections": figures["detections"],
            "seconds": {"eager_val": t1 - t0, "quantize": t2 - t1, "int8_val": t3 - t2}}


def _onnxruntime_layout(tmp: Path, calib: list[torch.Tensor], names: list[str], quantizer: dict,
                        check: Callable) -> Callable | None:
    """NNCF's file is laid out for OpenVINO (onnxruntime fuses few of its convolutions into int8 kernels: slow
    there, docs/export.md): write the same choice of float layers with onnxruntime's own quantizer
    (`detpipe.export.formats.quantize_int8`, ``keep_float``: the layers the accuracy control reverted, with the
    activations feeding only them) to a side file, check it with ``check`` (the gate's figures) and keep it in
    place of NNCF's file when it passes. Records ``quantizer["file"]`` (which file was kept and why, both
    candidates' figures) and, when kept, its ``kept_float``/``quantized_layers``. Returns its runner, or None
    (NNCF's file stays)."""
    import onnx

    from detpipe.export.formats import network_nodes
    from detpipe.export.quantize import float_layers

    side = tmp / FILES["int8"].replace(".int8.onnx", ".ort.onnx")
    try:
        run = quantize_int8(tmp / FILES["onnx"], side, calib, names, keep_float=quantizer["reverted"])
        figures = check(run, "onnxruntime-layout")
    except StageError as e:
        figures = {"ok": False, "error": str(e)}
    quantizer["file"] = {"onnxruntime": {**figures, "keep_float": quantizer["reverted"]}}
    if not figures["ok"]:
        side.unlink(missing_ok=True)
        quantizer["file"].update(kept="nncf", why="onnxruntime's quantizer with the accuracy control's float layers "
                                 "fails the gate (its figures under onnxruntime); NNCF's own file is written")
        log.info("int8: onnxruntime layout of the accuracy control's choice fails the gate, NNCF's file kept")
        return None
    side.replace(tmp / FILES["int8"])
    network = set(network_nodes(onnx.load(str(tmp / FILES["onnx"])), names))
    model = onnx.load(str(tmp / FILES["int8"]))
    kept = float_layers(model, [n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")
                               and n.name in network])
    quantizer.update(kept_float=kept, quantized_layers=quantizer["layers"] - len(kept),
                     method="accuracy_control (NNCF quantize_with_accuracy_control chose the float layers; written "
                     "by onnxruntime quantize_static, QDQ)")
    quantizer["file"].update(kept="onnxruntime", why="onnxruntime's quantizer with the accuracy control's float "
                             "layers passes the gate; its QDQ layout runs as int8 kernels in onnxruntime")
    log.info("int8: onnxruntime layout of the accuracy control's choice passes, kept (%d layers float)", len(kept))
    return run


def _gate_failed(report: dict, fmt: str, message: str, tmp: Path, cfg: params_mod.Export) -> None:
    """A format other than ONNX failed its gate: ``export.on_gate_fail: error`` raises `StageError` (``message``,
    "nothing written"); ``skip`` empties its folder in the staging folder ``tmp``, marks it in the report
    (``written: false``, ``skipped``: the reason) and logs a warning."""
    if cfg.on_gate_fail == "error" or fmt == "onnx":
        raise StageError(f"{message}; nothing written")
    for f in (tmp / FILES[fmt]).parent.iterdir():
        f.unlink()
    report["formats"][fmt].update(written=False, skipped=f"{message}; export.on_gate_fail: skip")
    log.warning("%s: models/%s left empty (export.on_gate_fail: skip)", message, Path(FILES[fmt]).parent)


def gate_metrics(report: dict) -> dict:
    """What ``metrics/export.json`` holds (DVC metrics: ``dvc exp show`` columns): per format its gate's result
    (``pass``, ``skipped`` when it failed under ``export.on_gate_fail: skip``, ``off`` for an int8 or OpenVINO not
    asked for); int8's AP and AP50 drops, detection-count ratio and layers kept float when it ran."""
    gates = {f: ("skipped" if r.get("written") is False else "pass") for f, r in report["formats"].items()}
    out: dict = {"gate": {f: gates.get(f, "off") for f in ("onnx", "openvino", "int8")}}
    if "int8" in report["formats"]:
        r = report["formats"]["int8"]
        out["int8"] = {"AP_drop": round(r["accuracy"]["drop"]["AP"], 6),
                       "AP50_drop": round(r["accuracy"]["drop"]["AP50"], 6),
                       "count_ratio": (None if r["scores"]["count_ratio"] is None
                                       else round(r["scores"]["count_ratio"], 4)),
                       "kept_float": len(r["quantizer"].get("kept_float", []))}
    return out


def _verdict(report: dict, cfg: params_mod.Export, tmp: Path) -> None:
    """A format whose raw outputs disagree fails its gate (`_gate_failed`: an error, or with
    ``export.on_gate_fail: skip`` that format left out; ONNX, the source of the others, is always an error); then
    `_nothing_compared` for formats that compared nothing (``cfg.require_parity``)."""
    failed = {f: r["raw"] for f, r in report["formats"].items() if r["raw"]["failed"]}
    lines = {f: f"{f}: {len(raw['failed'])} of {raw['compared']} raw outputs differ from eager, e.g. {raw['failed'][0]}"
             for f, raw in failed.items()}
    if failed and (cfg.on_gate_fail == "error" or "onnx" in failed):
        raise StageError("export parity check failed: " + "; ".join(lines.values()))
    for f in failed:
        _gate_failed(report, f, f"export parity check failed: {lines[f]}", tmp, cfg)
    empty = [f for f, r in report["formats"].items() if not r["raw"]["compared"]]
    if empty:
        _nothing_compared(empty, cfg)


def _nothing_compared(formats: list[str], cfg: params_mod.Export) -> None:
    """Raise `StageError` (``cfg.require_parity``) or log a warning: the gate compares nothing for ``formats``."""
    message = (f"export parity: nothing compared for {', '.join(formats)} (the model has no head whose raw "
               "outputs the gate knows, see detpipe.export.exporter.raw_taps)")
    if cfg.require_parity:
        raise StageError(message + "; set export.require_parity: false to export anyway")
    log.warning("%s; exported anyway (export.require_parity: false)", message)
