"""Export stage: TorchScript and ONNX files of the trained model, each checked against the eager model.

``python -m stages.export`` writes ``models/model.ts`` (``torch.jit.script``; called with a list of
``float32 (3, H, W)`` RGB images in [0, 1], it returns ``(losses, detections)`` as torchvision's scripted
detection models do) and ``models/model.onnx`` (opset ``export.opset``, ``torch.onnx.export(dynamo=False)``;
input ``image`` ``float32 (3, H, W)`` in [0, 1] with dynamic H and W, outputs ``boxes`` ``float32 (N, 4)``
XYXY pixels of the input, ``scores`` ``float32 (N,)``, ``labels`` ``int64 (N,)``), and
``models/export_report.json``.

Parity check, on ``export.num_images`` val images: every eager detection with score ≥
``export.score_threshold`` must be matched in the exported model's output by a detection with the same label
and IoU ≥ ``export.iou_match`` (default 0.99); the stage fails when the matched share is below
``export.min_match`` (default 0.99) for either format. The report also gives the largest box coordinate
difference (pixels) and score difference among matched detections. If the model has fewer than
`MIN_COMPARED` detections above the threshold on an image, its `MIN_COMPARED` highest-scoring ones are
compared instead, so the check never passes vacuously.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from torchvision.ops import box_iou

from stages import params as params_mod
from stages.common import StageError, atomic_dir, atomic_write_json, run_stage
from stages.data import CachedDetectionDataset
from stages.evaluate import CACHE_DIR, MODEL, load_model

log = logging.getLogger("stages.export")

MODELS_DIR = Path("models")
MIN_COMPARED = 10


def match_detections(ref: dict, other: dict, score_threshold: float, iou_match: float) -> dict:
    """Compare one image's detections of an exported model (``other``) with the eager model's (``ref``).

    Both are dicts of ``boxes`` ``(N, 4)`` XYXY pixels, ``scores`` ``(N,)``, ``labels`` ``(N,)`` tensors.
    Returns ``{"compared": n, "matched": m, "max_box_diff": px, "max_score_diff": d}``: an eager detection
    is matched by the other detection of the same label with the highest IoU, if that IoU ≥ ``iou_match``.
    """
    keep = ref["scores"] >= score_threshold
    if int(keep.sum()) < MIN_COMPARED:
        keep = torch.zeros_like(keep)
        keep[torch.argsort(ref["scores"], descending=True)[:MIN_COMPARED]] = True
    rb, rs, rl = ref["boxes"][keep], ref["scores"][keep], ref["labels"][keep]
    ob, os_, ol = other["boxes"], other["scores"], other["labels"]
    out = {"compared": int(len(rb)), "matched": 0, "max_box_diff": 0.0, "max_score_diff": 0.0}
    if len(rb) == 0 or len(ob) == 0:
        return out
    iou = box_iou(rb.float(), ob.float())
    iou[rl[:, None] != ol[None, :]] = -1.0
    best, idx = iou.max(dim=1)
    ok = best >= iou_match
    out["matched"] = int(ok.sum())
    if ok.any():
        out["max_box_diff"] = float((rb[ok] - ob[idx[ok]]).abs().max())
        out["max_score_diff"] = float((rs[ok] - os_[idx[ok]]).abs().max())
    return out


def _summarize(per_image: list[dict]) -> dict:
    compared = sum(r["compared"] for r in per_image)
    matched = sum(r["matched"] for r in per_image)
    return {"compared": compared, "matched": matched, "match": matched / compared if compared else 0.0,
            "max_box_diff": max((r["max_box_diff"] for r in per_image), default=0.0),
            "max_score_diff": max((r["max_score_diff"] for r in per_image), default=0.0)}


class _OnnxWrapper(torch.nn.Module):
    """One image in, ``(boxes, scores, labels)`` out: the flat signature the ONNX file exposes."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor):
        det = self.model([image])[0]
        return det["boxes"], det["scores"], det["labels"]


def export(cfg: params_mod.Export, model_path: Path = MODEL, cache_dir: Path = CACHE_DIR,
           out_dir: Path = MODELS_DIR) -> dict:
    """Write ``model.ts``, ``model.onnx`` and ``export_report.json`` into ``out_dir`` (nothing is written
    there unless every check passes); return the report.

    Raises:
        StageError: missing inputs, or parity below ``cfg.min_match`` (names the format and figures).
    """
    import onnxruntime as ort

    model, _ = load_model(model_path)
    dataset = CachedDetectionDataset(cache_dir, "val")
    images = [dataset[i][0] for i in range(min(cfg.num_images, len(dataset)))]
    if not images:
        raise StageError(f"{cache_dir}/val: no images to check the export on")
    with torch.inference_mode():
        eager = [model([im])[0] for im in images]

    staging = Path(out_dir) / ".export-staging"
    with atomic_dir(staging) as tmp:
        ts_path, onnx_path = tmp / "model.ts", tmp / "model.onnx"
        scripted = torch.jit.script(model)
        scripted.save(str(ts_path))
        loaded = torch.jit.load(str(ts_path))
        with torch.inference_mode():
            ts_out = [loaded([im])[1][0] for im in images]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_OnnxWrapper(model), (images[0],), str(onnx_path), opset_version=cfg.opset,
                              dynamo=False, input_names=["image"], output_names=["boxes", "scores", "labels"],
                              dynamic_axes={"image": {1: "height", 2: "width"}, "boxes": {0: "n"},
                                            "scores": {0: "n"}, "labels": {0: "n"}})
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        onnx_out = []
        for im in images:
            b, s, lab = session.run(None, {"image": im.numpy()})
            onnx_out.append({"boxes": torch.from_numpy(b), "scores": torch.from_numpy(s),
                             "labels": torch.from_numpy(lab.astype(np.int64))})

        report = {"images": len(images), "score_threshold": cfg.score_threshold, "iou_match": cfg.iou_match,
                  "min_match": cfg.min_match, "opset": cfg.opset}
        for name, outs in (("torchscript", ts_out), ("onnx", onnx_out)):
            report[name] = _summarize([match_detections(e, o, cfg.score_threshold, cfg.iou_match)
                                       for e, o in zip(eager, outs)])
            log.info("%s parity: %s", name, report[name])
        failed = [n for n in ("torchscript", "onnx") if report[n]["match"] < cfg.min_match]
        if failed:
            raise StageError("export parity check failed: " + "; ".join(
                f"{n} matched {report[n]['matched']}/{report[n]['compared']} eager detections "
                f"({report[n]['match']:.3f} < export.min_match {cfg.min_match})" for n in failed))
        atomic_write_json(tmp / "export_report.json", report)
    for name in ("model.ts", "model.onnx", "export_report.json"):
        (staging / name).replace(Path(out_dir) / name)
    staging.rmdir()
    return report


def main() -> None:
    export(params_mod.load("export"))


if __name__ == "__main__":
    run_stage(main)
