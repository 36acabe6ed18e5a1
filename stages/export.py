"""Export stage: TorchScript and ONNX files of the trained model, each checked against the eager model.

``python -m stages.export`` writes ``models/model.ts`` (``torch.jit.script``; called with a list of
``float32 (3, H, W)`` RGB images in [0, 1], it returns ``(losses, detections)`` as torchvision's scripted
detection models do) and ``models/model.onnx`` (opset ``export.opset``, ``torch.onnx.export(dynamo=False)``;
input ``image`` ``float32 (3, H, W)`` in [0, 1] with dynamic H and W, outputs ``boxes`` ``float32 (N, 4)``
XYXY pixels of the input, ``scores`` ``float32 (N,)``, ``labels`` ``int64 (N,)``; mask models (Mask R-CNN) also
``masks`` ``float32 (N, 1, H, W)``, each detection's mask probability in [0, 1] at the input's pixels, threshold at
0.5 for a binary mask), ``models/export_report.json`` and ``models/model_card.md`` (dataset hash, training params,
metrics, the input/output spec of each file and a snippet to run it).

Parity check, on ``export.num_images`` val images: every eager detection with score ≥
``export.score_threshold`` must be matched in the exported model's output by a detection with the same label
and IoU ≥ ``export.iou_match`` (default 0.99); the stage fails when the matched share is below
``export.min_match`` (default 0.99) for either format. The report also gives the largest box coordinate
difference (pixels) and score difference among matched detections. Detections at the top-k truncation
boundary among near-equal scores are counted apart (see `match_detections`). A model with no detection
above the threshold (e.g. barely trained: every score ≈ 1/num_classes, so which near-equal box survives
top-k and NMS is float noise and comparing means nothing) gets a report marked ``vacuous: true`` and a
logged warning instead of a verdict. Masks are not part of the parity figures (boxes, scores and labels are).
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from torchvision.ops import box_iou

from detpipe import params as params_mod
from detpipe.errors import StageError, run_stage
from detpipe.io import atomic_dir, atomic_write_bytes, atomic_write_json, folder_sha256
from detpipe.data import CachedDetectionDataset, uses_masks
from detpipe.models import load_model
from detpipe.paths import ARROW_DIR, CACHE_DIR, METRICS, MODEL, MODELS_DIR

log = logging.getLogger("stages.export")

SCORE_TOL = 1e-5
BOX_TOL = 0.01  # pixels


def match_detections(ref: dict, other: dict, score_threshold: float, iou_match: float) -> dict:
    """Compare one image's detections of an exported model (``other``) with the eager model's (``ref``).

    Both are dicts of ``boxes`` ``(N, 4)`` XYXY pixels, ``scores`` ``(N,)``, ``labels`` ``(N,)`` tensors.
    An eager detection is matched by the other detection of the same label with the highest IoU, if that
    IoU ≥ ``iou_match`` (a box whose coordinates all agree within `BOX_TOL` pixels counts as IoU 1, so that
    zero-area boxes clipped at the image border match). An unmatched one is *at the truncation boundary* when the other output is full
    (as many detections as the eager one) and its score is within `SCORE_TOL` of the lowest score the other
    kept: which of several near-equal candidates survive top-k is float noise (typical of a barely trained
    model, whose scores are all ≈ 1/num_classes), not a disagreement; those are counted apart and left out.

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
        # boxes clipped flat at the image border have zero area: their IoU is NaN even with themselves, so
        # coordinates equal within BOX_TOL pixels also count as a match
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


def _summarize(per_image: list[dict]) -> dict:
    compared = sum(r["compared"] for r in per_image)
    matched = sum(r["matched"] for r in per_image)
    return {"compared": compared, "matched": matched, "match": matched / compared if compared else 1.0,
            "boundary": sum(r["boundary"] for r in per_image), "vacuous": compared == 0,
            "max_box_diff": max((r["max_box_diff"] for r in per_image), default=0.0),
            "max_score_diff": max((r["max_score_diff"] for r in per_image), default=0.0)}


class _OnnxWrapper(torch.nn.Module):
    """One image in, ``(boxes, scores, labels)`` out (plus ``masks`` with ``masks=True``): the flat signature the
    ONNX file exposes."""

    def __init__(self, model: torch.nn.Module, masks: bool = False):
        super().__init__()
        self.model, self.masks = model, masks

    def forward(self, image: torch.Tensor):
        det = self.model([image])[0]
        if self.masks:
            return det["boxes"], det["scores"], det["labels"], det["masks"]
        return det["boxes"], det["scores"], det["labels"]


def model_card(ckpt: dict, report: dict, arrow_dir: Path, metrics_path: Path) -> str:
    """Markdown model card: dataset hash (manifest sha256 of the Arrow shards, see
    `stages.download.folder_sha256`), training params, COCO metrics (if ``metrics_path`` exists), the
    input/output spec of each exported file and minimal snippets to run them."""
    meta = json.loads((Path(arrow_dir) / "meta.json").read_text())
    metrics = json.loads(Path(metrics_path).read_text()) if Path(metrics_path).is_file() else None
    params = ckpt.get("params", {})
    masks = bool(report.get("masks"))
    ts_masks = ", `masks` `float32 (N, 1, H, W)` mask probabilities in [0, 1] at input pixels (> 0.5: in the " \
               "mask)" if masks else ""
    onnx_masks = ", `masks` `float32 (N, 1, H, W)` mask probabilities in [0, 1] at input pixels (> 0.5: in the " \
                 "mask)" if masks else ""
    lines = [f"# Model card: {ckpt['config']['name']}", "",
             f"- Trained for {ckpt.get('iters')} iterations{' (EMA weights)' if ckpt.get('ema') else ''}; "
             f"{meta['num_classes'] - 1} classes + background (labels 1..{meta['num_classes'] - 1}).",
             f"- Dataset: `{meta.get('annotations_file')}`; Arrow shards manifest sha256 "
             f"`{folder_sha256(Path(arrow_dir))}`; train {meta['splits']['train']['images']} images, "
             f"val {meta['splits']['val']['images']} images.",
             f"- Model builder kwargs: `{json.dumps(ckpt['config'].get('kwargs', {}))}`", "",
             f"## Metrics (COCO {'bbox and segm' if metrics and 'segm' in metrics else 'bbox'} on val, "
             "pycocotools COCOeval)", ""]
    if metrics and "segm" in metrics:
        lines += ["| stat | bbox | segm |", "|---|---|---|"] + [
            f"| {k} | {v:.4f} | {metrics['segm'][k]:.4f} |" for k, v in metrics["bbox"].items()]
    elif metrics:
        lines += ["| stat | value |", "|---|---|"] + [f"| {k} | {v:.4f} |" for k, v in metrics["bbox"].items()]
    else:
        lines += [f"(no {metrics_path} yet: run the evaluate stage)"]
    lines += ["", "## Training params", "", "```yaml"] + [f"{k}: {json.dumps(v)}" for k, v in params.items()]
    lines += ["```", "", "## Files", "",
              "| file | input | output |", "|---|---|---|",
              "| `model.ts` (TorchScript) | `list[Tensor]`, each `float32 (3, H, W)` RGB in [0, 1] | "
              "`(losses, detections)`; `detections[i]`: `boxes` `float32 (N, 4)` XYXY input pixels, `scores` "
              f"`float32 (N,)`, `labels` `int64 (N,)`{ts_masks} |",
              f"| `model.onnx` (opset {report['opset']}) | `image`: `float32 (3, H, W)` RGB in [0, 1], H and W "
              "dynamic | `boxes` `float32 (N, 4)` XYXY input pixels, `scores` `float32 (N,)`, `labels` "
              f"`int64 (N,)`{onnx_masks} |", "",
              f"Parity with the eager model on {report['images']} val images (detections with score ≥ "
              f"{report['score_threshold']} matched with the same label and IoU ≥ {report['iou_match']}): "
              f"TorchScript {report['torchscript']['match']:.3f}, ONNX {report['onnx']['match']:.3f}"
              f"{' (boxes; masks are not compared)' if masks else ''}.",
              "Labels map to COCO category ids via `category_id_to_label` in `data/arrow/meta.json`:",
              "", "```json", json.dumps(meta["label_names"]), "```", "",
              "## Run", "", "```python", "import torch", "from PIL import Image",
              "from torchvision.transforms.functional import to_tensor",
              "image = to_tensor(Image.open('image.jpg').convert('RGB'))  # float32 (3, H, W) in [0, 1]",
              "model = torch.jit.load('models/model.ts').eval()",
              "_, detections = model([image])",
              "print(detections[0]['boxes'], detections[0]['scores'], detections[0]['labels'])", "```", "",
              "```python", "import numpy as np, onnxruntime as ort", "from PIL import Image",
              "image = np.asarray(Image.open('image.jpg').convert('RGB'), np.float32).transpose(2, 0, 1) / 255",
              "session = ort.InferenceSession('models/model.onnx', providers=['CPUExecutionProvider'])",
              f"boxes, scores, labels{', masks' if masks else ''} = session.run(None, {{'image': image}})", "```", ""]
    return "\n".join(lines)


def export(cfg: params_mod.Export, model_path: Path = MODEL, cache_dir: Path = CACHE_DIR,
           out_dir: Path = MODELS_DIR, arrow_dir: Path = ARROW_DIR, metrics_path: Path = METRICS) -> dict:
    """Write ``model.ts``, ``model.onnx`` and ``export_report.json`` into ``out_dir`` (nothing is written
    there unless every check passes); return the report.

    Raises:
        StageError: missing inputs, or parity below ``cfg.min_match`` (names the format and figures).
    """
    import onnxruntime as ort

    model, ckpt = load_model(model_path)
    with_masks = uses_masks(model)
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
            outputs = ["boxes", "scores", "labels"] + (["masks"] if with_masks else [])
            axes = {"image": {1: "height", 2: "width"}, "boxes": {0: "n"}, "scores": {0: "n"}, "labels": {0: "n"}}
            if with_masks:
                axes["masks"] = {0: "n", 2: "height", 3: "width"}
            torch.onnx.export(_OnnxWrapper(model, with_masks).eval(), (images[0],), str(onnx_path),
                              opset_version=cfg.opset, dynamo=False, input_names=["image"], output_names=outputs,
                              dynamic_axes=axes)
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        onnx_out = []
        for im in images:
            b, s, lab = session.run(None, {"image": im.numpy()})[:3]
            onnx_out.append({"boxes": torch.from_numpy(b), "scores": torch.from_numpy(s),
                             "labels": torch.from_numpy(lab.astype(np.int64))})

        report = {"images": len(images), "score_threshold": cfg.score_threshold, "iou_match": cfg.iou_match,
                  "min_match": cfg.min_match, "opset": cfg.opset, "masks": with_masks}
        for name, outs in (("torchscript", ts_out), ("onnx", onnx_out)):
            report[name] = _summarize([match_detections(e, o, cfg.score_threshold, cfg.iou_match)
                                       for e, o in zip(eager, outs)])
            log.info("%s parity: %s", name, report[name])
            if report[name]["vacuous"]:
                log.warning("%s parity: no eager detection scores >= export.score_threshold %s on %d val images "
                            "(an untrained model?): nothing was compared", name, cfg.score_threshold, len(images))
        failed = [n for n in ("torchscript", "onnx") if report[n]["match"] < cfg.min_match]
        if failed:
            raise StageError("export parity check failed: " + "; ".join(
                f"{n} matched {report[n]['matched']}/{report[n]['compared']} eager detections "
                f"({report[n]['match']:.3f} < export.min_match {cfg.min_match})" for n in failed))
        atomic_write_json(tmp / "export_report.json", report)
        atomic_write_bytes(tmp / "model_card.md", model_card(ckpt, report, arrow_dir, metrics_path).encode())
    for name in ("model.ts", "model.onnx", "export_report.json", "model_card.md"):
        (staging / name).replace(Path(out_dir) / name)
    staging.rmdir()
    return report


def main() -> None:
    export(params_mod.load("export"))


if __name__ == "__main__":
    run_stage(main)
