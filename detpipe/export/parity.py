"""The parity gate: an exported detector's outputs against the eager model's, per image.

`compare_raw` is the verdict: every raw (pre-NMS) head tensor of the exported file (`detpipe.export.exporter.raw_taps`;
fixed order per anchor and class, so immune to the tie-breaking that reorders a barely trained model's final
detections between runtimes) must agree with the eager model's within ``rtol`` of its root-mean-square magnitude, on
every checked image. `match_detections` compares the final detections too, as report figures, not as a verdict.
Outputs are in `detpipe.export.exporter.DetectionExport`'s order (`split_outputs`).
"""
from __future__ import annotations

import numpy as np
import torch
from torchvision.ops import box_iou

SCORE_TOL = 1e-5
BOX_TOL = 0.01  # pixels


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
