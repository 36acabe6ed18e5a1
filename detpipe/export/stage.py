"""Exporting the trained model as a torch.export ExportedProgram and ONNX (TorchScript on request), each checked
against the eager model: the export stage's work (`export`; ``python -m stages.export`` calls it with params
section ``export``).

`export` writes ``models/torch_export/model.pt2`` (``torch.export.save``; not for R-CNN models,
see `detpipe.export.exporter.torch_export_supported`; ``torch.export.load(...).module()``
takes one ``float32 (3, H, W)`` RGB image in [0, 1], H and W dynamic), ``models/model.onnx`` (opset
``export.opset``, ``torch.onnx.export(dynamo=False)``, input ``image`` of the same form), both with the outputs of
`detpipe.export.exporter.DetectionExport`: ``boxes`` ``float32 (N, 4)`` XYXY input pixels, ``scores`` ``float32 (N,)``,
``labels`` ``int64 (N,)``, for mask models ``masks`` ``float32 (N, 1, H, W)`` (probabilities, > 0.5 in the mask),
then the raw pre-NMS head outputs; ``models/torchscript/`` (empty, or with ``export.torchscript: true``
``model.ts``: ``torch.jit.script``, torchvision's ``(losses, detections)`` API, for LibTorch/C++ users);
``models/export_report.json`` and ``models/model_card.md``.

Parity gate, on ``export.num_images`` val images: every raw head output (before top-k and NMS, so that ties among
the near-equal scores of a barely trained model cannot reorder anything) of each file, as loaded back, must equal
the eager model's within ``export.rtol`` of its root-mean-square magnitude (`detpipe.export.exporter.compare_raw`). The final
detections are matched too (``export.score_threshold``, ``export.iou_match``) and reported, not gated. A run that
compared nothing fails unless ``export.require_parity: false``. Nothing is written unless every check passes.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from detpipe import params as params_mod
from detpipe.data.dataset import CachedDetectionDataset, uses_masks
from detpipe.errors import StageError
from detpipe.export.exporter import (TORCH_EXPORT_UNSUPPORTED, DetectionExport, export_onnx, export_program,
                                     export_torchscript, model_card, parity, split_outputs, torch_export_supported)
from detpipe.files import atomic_dir, atomic_write_bytes, atomic_write_json, temp_prefix
from detpipe.models import load_model
from detpipe.paths import ARROW_DIR, CACHE_DIR, METRICS, MODEL, MODELS_DIR

log = logging.getLogger(__name__)
FILES = {"torch_export": "torch_export/model.pt2", "onnx": "model.onnx", "torchscript": "torchscript/model.ts"}


def export(cfg: params_mod.Export, model_path: Path = MODEL, cache_dir: Path = CACHE_DIR,
           out_dir: Path = MODELS_DIR, arrow_dir: Path = ARROW_DIR, metrics_path: Path = METRICS,
           model: torch.nn.Module | None = None) -> dict:
    """Write the files of `FILES` (TorchScript only with ``cfg.torchscript``, torch.export unless
    ``cfg.torch_export`` is false), ``export_report.json`` and
    ``model_card.md`` into ``out_dir``, nothing unless every parity check passes; return the report.

    Args:
        cfg: params section ``export``.
        model_path: the trained model (``models/model.pt``), also the eager reference.
        cache_dir: the augmentation cache; its first ``cfg.num_images`` val images are the parity inputs.
        out_dir: where the files go (``models/``), each replaced only after every check passed.
        arrow_dir, metrics_path: read for the model card.
        model: export this module instead of the one in ``model_path`` (the eager reference stays the one in
            ``model_path``; tests pass a perturbed copy to see the gate fail).
    Returns:
        the report written to ``export_report.json``.
    Raises:
        StageError: missing inputs; parity failed (names the format, tensor, image and figures); nothing compared
            and ``cfg.require_parity``.
    """
    reference, ckpt = load_model(model_path)
    masks = uses_masks(reference)
    dataset = CachedDetectionDataset(cache_dir, "val")
    images = [dataset[i][0] for i in range(min(cfg.num_images, len(dataset)))]
    if not images:
        raise StageError(f"{cache_dir}/val: no images to check the export on")
    eager_wrapper = DetectionExport(reference, masks).eval()
    names = eager_wrapper.output_names(images[0])[3 + int(masks):]
    with torch.inference_mode():
        eager = [split_outputs(eager_wrapper(im), masks) for im in images]
    target = model.eval() if model is not None else reference
    wrapper = DetectionExport(target, masks).eval() if model is not None else eager_wrapper
    report = {"images": len(images), "rtol": cfg.rtol, "score_threshold": cfg.score_threshold,
              "iou_match": cfg.iou_match, "opset": cfg.opset, "masks": masks, "raw_outputs": names, "formats": {}}

    # named by the temporary-name rule, so that `detpipe.ops.repair` removes what a killed export left
    staging = Path(out_dir) / f"{temp_prefix(Path(out_dir) / 'export')}{os.getpid()}"
    with atomic_dir(staging) as tmp:
        (tmp / "torchscript").mkdir()
        (tmp / "torch_export").mkdir()
        runners = {"onnx": lambda p: export_onnx(wrapper, images[0], p, cfg.opset)}
        if not cfg.torch_export:
            report["skipped"] = {"torch_export": "export.torch_export: false"}
        elif torch_export_supported(target):
            runners["torch_export"] = lambda p: export_program(wrapper, images[0], p)
        else:
            report["unsupported"] = {"torch_export": TORCH_EXPORT_UNSUPPORTED}
            log.warning("models/torch_export left empty: %s", TORCH_EXPORT_UNSUPPORTED)
        if cfg.torchscript:
            runners["torchscript"] = lambda p: export_torchscript(target, p, masks)
        if not names and cfg.require_parity:   # no raw output to compare: fail before minutes of exporting
            _nothing_compared(list(runners), cfg)
        for fmt, make in runners.items():
            run = make(tmp / FILES[fmt])
            with torch.inference_mode():
                outs = [split_outputs(run(im), masks) for im in images]
            report["formats"][fmt] = r = parity(eager, outs, names, cfg.rtol, cfg.score_threshold, cfg.iou_match)
            log.info("%s parity: raw %s; detections %s", fmt, r["raw"], r["detections"])
        _verdict(report, cfg)
        atomic_write_json(tmp / "export_report.json", report)
        atomic_write_bytes(tmp / "model_card.md", model_card(ckpt, report, arrow_dir, metrics_path).encode())
    for rel in ["torch_export", FILES["onnx"], "torchscript", "export_report.json", "model_card.md"]:
        dest = Path(out_dir) / rel
        if dest.is_dir():
            for old in dest.iterdir():
                old.unlink()
            dest.rmdir()
        (staging / rel).replace(dest)
    staging.rmdir()
    return report


def _verdict(report: dict, cfg: params_mod.Export) -> None:
    """Raise `StageError` for a format whose raw outputs disagree, or (``cfg.require_parity``) compared nothing."""
    failed = {f: r["raw"] for f, r in report["formats"].items() if r["raw"]["failed"]}
    if failed:
        raise StageError("export parity check failed: " + "; ".join(
            f"{f}: {len(raw['failed'])} of {raw['compared']} raw outputs differ from eager, e.g. {raw['failed'][0]}"
            for f, raw in failed.items()))
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
