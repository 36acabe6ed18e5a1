"""Issue 49.2: the ONNX graph with a dynamic batch dimension (`detpipe.export.batched`) runs a batch of images of
different original sizes in ONE call, and agrees with the eager model (torchvision's own SSDlite, transformers'
RT-DETRv2 through `HFDetector`) run on each image alone: the export gate's raw-output verdict (`compare_raw`,
``export.rtol``) and the final detections (`match_detections`: same label, IoU >= ``export.iou_match``), for the
trained models of the session fixtures (`fitted_workdir`, `fitted_detr_workdir`: they fit their images, so their
scores are far apart and the detections compare without ties). The predict runner of the file takes the whole batch
too (``per_image`` false: the serve batcher sends it the micro-batch as one call).
"""
from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch

from detpipe.data.imageio import decode_rgb
from detpipe.export.batched import BATCH_INPUT, graph_size, runner
from detpipe.export.exporter import DetectionExport, export_onnx_batched
from detpipe.export.parity import compare_raw, match_detections, split_outputs
from detpipe.models import load_model
from detpipe.params import Export
from detpipe.predict.runners import load_runner
from support.pipeline import COCO128

# COCO128 images of three original sizes (640x480, 640x426, 481x640), none the models' input size
IMAGES = ("000000000009.jpg", "000000000025.jpg", "000000000036.jpg")


def _images() -> list[torch.Tensor]:
    out = []
    for name in IMAGES:
        pixels = torch.from_numpy(decode_rgb((COCO128 / "train2017" / name).read_bytes(), name))
        out.append(pixels.permute(2, 0, 1).float().div(255).contiguous())
    out.append(out[0][:, 100:420, 200:520].contiguous())   # a fourth size: 320 x 320, the SSDlite input size
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["fitted_workdir", "fitted_detr_workdir"])
def test_batched_graph_runs_mixed_sizes_in_one_call(fixture, request, tmp_path):
    work = request.getfixturevalue(fixture)
    cfg = Export()
    model, _ = load_model(work / "models/model.pt")
    images = _images()
    assert len({tuple(im.shape) for im in images}) == len(images)
    export_onnx_batched(model, images, tmp_path / "model.onnx", cfg.opset)

    first = onnx.load(str(tmp_path / "model.onnx")).graph.input[0]
    assert first.name == BATCH_INPUT and first.type.tensor_type.shape.dim[0].dim_param   # B is symbolic
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    size = graph_size([(i.name, i.shape) for i in session.get_inputs()])
    calls = []

    def call(feed):
        calls.append(feed[BATCH_INPUT].shape)
        return session.run(None, feed)
    got = [split_outputs(o, False) for o in runner(call, size).many(images)]
    assert calls == [(len(images), 3, *size)]          # the whole batch, one graph call

    wrapper = DetectionExport(model).eval()
    names = wrapper.output_names(images[0])[3:]
    with torch.inference_mode():
        eager = [split_outputs(wrapper(im), False) for im in images]
    raw = compare_raw([r for _, r in eager], [r for _, r in got], names, cfg.rtol)
    assert raw["ok"] and raw["compared"] == len(images) * len(names), raw
    for i, ((e, _), (g, _)) in enumerate(zip(eager, got)):
        m = match_detections(e, g, cfg.score_threshold, cfg.iou_match)
        assert m["compared"] > 0 and m["matched"] == m["compared"], (i, m)
        assert (g["boxes"][:, 2] <= images[i].shape[2] + 1e-3).all()   # mapped back to this image's pixels

    # the same image alone gives the same detections as inside the batch (no cross-image leak)
    alone, _ = split_outputs(runner(lambda f: session.run(None, f), size).many(images[1:2])[0], False)
    assert torch.equal(alone["labels"], got[1][0]["labels"])
    assert torch.allclose(alone["boxes"], got[1][0]["boxes"], atol=1e-3)

    run, _, _ = load_runner(tmp_path / "model.onnx")   # predict's and serve's runner: one call per micro-batch
    assert run.per_image is False
    dets = run(images)
    assert [len(d["boxes"]) for d in dets] == [len(g["boxes"]) for g, _ in got]
