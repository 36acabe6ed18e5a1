"""A model where per-tensor int8 fails: the learns-fitted SSDlite with one activation-outlier channel, made by an
exact, function-preserving reparametrisation (issue 50 item 4; used by tests/stages/test_export_int8.py and
benchmarks/predict.py).

Why this is a fair model of the real failure: per-tensor int8 activations share one scale across every channel
of a tensor, so one channel with a range far above the others' leaves them a few of the 256 levels. That
per-channel range imbalance is what breaks per-tensor int8 in MobileNets (Nagel et al. 2019, "Data-Free
Quantization Through Weight Equalization and Bias Correction", ICCV, §3-4: cross-layer equalisation rescales
channels across a ReLU to *remove* it), and trained networks do grow such outlier feature channels (Dettmers et
al. 2022, "LLM.int8()", NeurIPS). Here the imbalance is put in by the reverse of Nagel et al.'s equalisation:
in an inverted-residual block whose activation is ReLU (positively homogeneous: ``relu(s x) = s relu(x)`` for
``s > 0``), the depthwise convolution's BatchNorm ``weight[c]`` and ``bias[c]`` are multiplied by ``s`` (channel
``c`` of the ReLU's output is ``s`` times larger) and the projection convolution's input-channel weights
``weight[:, c]`` divided by ``s``. The float function is unchanged (up to float32 rounding; `make_outlier_model`
checks the raw head outputs on real images); only the range of the one tensor between the depthwise ReLU and the
projection (its only consumer) changes. Per-output-channel weight quantization absorbs the weight side; the
per-tensor ``uint8`` activation does not.

Chosen by hand (2026-11-29, learns-fitted model, 4 val images, default ``max_ap_drop`` 0.02): block 3
(``features.0.3``: 24 -> 72 -> 24, ReLU, residual) channel 0 (its largest value on the val images 6.2, the
tensor's 14.7, median channel 4.4), ``s`` = 256. At ``s`` = 64 the plain quantizer already fails (AP drop 0.169) but
NNCF's fully quantized file does not fail at the outlier (its bias correction and the residual absorb it; its
accuracy control reverted an unrelated layer), and block 2 (no residual) at ``s`` = 64 passes plain; at 256 plain
drops AP by 0.313 and NNCF's accuracy control reverts exactly ``BLOCK_PROJECTION``.

    python tests/support/outliers.py FITTED_WORKDIR DEST   # the workdir benchmarks/predict.py times
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

# features[3] of MobileNetV3-Large (SSDlite's backbone.features[0][3]): the 24 -> 72 -> 24 block, ReLU, no
# squeeze-excitation, stride 1; its ONNX projection is BLOCK_PROJECTION.
BLOCK = 3
CHANNEL = 0
SCALE = 256.0
BLOCK_PROJECTION = f"/backbone/features.0/features.0.{BLOCK}/block/block.2/block.2.0/Conv"


def make_outlier_model(model: torch.nn.Module, images: list[torch.Tensor], block: int = BLOCK,
                       channel: int = CHANNEL, scale: float = SCALE, rtol: float = 1e-4) -> torch.nn.Module:
    """A copy of the SSDlite ``model`` (eval mode) whose MobileNetV3 ``backbone.features[0][block]`` carries an
    activation-outlier channel: depthwise BatchNorm ``weight[channel]``, ``bias[channel]`` times ``scale``,
    projection conv ``weight[:, channel]`` divided by ``scale`` (the module docstring says why this is exact).

    Args:
        model: a trained ``ssdlite320_mobilenet_v3_large`` (`detpipe.models.load_model`).
        images: ``float32 (3, H, W)`` images in [0, 1] to check the reparametrisation on.
        block, channel: which inverted-residual block (ReLU, no squeeze-excitation) and which expanded channel.
        scale: ``s`` (> 0), the factor on that channel's activation.
        rtol: every raw head output (`detpipe.export.exporter.DetectionExport`) of the copy must equal the
            original's within ``rtol`` of its root-mean-square magnitude (`detpipe.export.parity.compare_raw`).
    Raises:
        AssertionError: the block is not a ReLU block without squeeze-excitation, or the outputs moved.
    """
    from detpipe.export.exporter import DetectionExport
    from detpipe.export.parity import split_outputs

    out = copy.deepcopy(model).eval()
    seq = out.backbone.features[0][block].block
    assert len(seq) == 3 and isinstance(seq[1][2], torch.nn.ReLU), f"block {block}: not ReLU without SE: {seq}"
    bn, project = seq[1][1], seq[2][0]
    assert project.kernel_size == (1, 1) and project.groups == 1, project
    with torch.no_grad():
        bn.weight[channel] *= scale
        bn.bias[channel] *= scale
        project.weight[:, channel] /= scale
    a, b = DetectionExport(model, False).eval(), DetectionExport(out, False).eval()
    with torch.inference_mode():
        for im in images:
            ra, rb = split_outputs(a(im), False)[1], split_outputs(b(im), False)[1]
            for x, y in zip(ra, rb):
                rms = float(x.float().pow(2).mean().sqrt())
                worst = float((x - y).abs().max())
                assert worst <= rtol * max(rms, 1e-12), f"raw output moved by {worst} (rms {rms})"
    return out


def outlier_workdir(fitted: Path, dest: Path, **kwargs) -> Path:
    """Copy the learns-fitted workdir ``fitted`` (the ``fitted_workdir`` fixture's folder) to ``dest`` with its
    ``models/model.pt`` replaced by `make_outlier_model` of it (checked on the val images; ``kwargs`` go to it):
    a workdir for ``python -m stages.export`` and ``benchmarks.predict``. Returns ``dest``."""
    from detpipe.core.model_file import load_model_file, save_torch_atomic
    from detpipe.data.dataset import CachedDetectionDataset
    from detpipe.models import load_model

    shutil.copytree(fitted, dest)
    model, _ = load_model(dest / "models/model.pt")
    val = CachedDetectionDataset(dest / "data/cache", "val")
    changed = make_outlier_model(model, [val[i][0] for i in range(len(val))], **kwargs)
    ckpt = load_model_file(dest / "models/model.pt")
    ckpt["model"] = changed.state_dict()
    save_torch_atomic(ckpt, dest / "models/model.pt")
    return dest


if __name__ == "__main__":   # python tests/support/outliers.py FITTED_WORKDIR DEST: the benchmark's outlier workdir
    import sys

    sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
    print(outlier_workdir(Path(sys.argv[1]), Path(sys.argv[2])))
