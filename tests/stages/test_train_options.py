"""Training options on real cached COCO128 images: AMP, accumulation, EMA, periodic eval with best checkpoint,
LR scaling; other torchvision detectors by name; weights over HTTP."""
from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import threading

import pytest
import torch

from support.pipeline import checkpoints, stage_cli, write_params
from detpipe.engine.train_loop import HookBase
from detpipe.core.errors import StageError
from detpipe.data.dataset import CachedDetectionDataset, collate
from detpipe.models import build_from_config, load_weights, model_config
from detpipe.models import model_kwargs


@pytest.mark.slow
def test_amp_accumulate_ema_eval(cached_workdir, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(cached_workdir / "data", work / "data")
    write_params(work, {"train": {"amp": "bf16", "accumulate": 2, "batch_size": 2, "ema": True, "ema_decay": 0.5,
                                  "eval_every": 1, "base_batch_size": 8, "epochs": 1, "channels_last": True}})
    proc = stage_cli("train", work)
    # 9 images // (2 per batch x 2 micro-batches) = 2 optimizer steps
    model = torch.load(work / "models/model.pt", weights_only=True)
    assert model["iters"] == 2 and model["ema"] is True
    best = torch.load(work / "checkpoints/best.pt", weights_only=True)
    assert best["iters"] in (1, 2) and 0 <= best["AP"] <= 1
    assert proc.stderr.count("best so far") >= 1
    metrics = json.loads((work / "dvclive/metrics.json").read_text())
    assert "AP" in metrics["val"] and metrics["step"] == 2
    # linear scaling: lr 0.01 * (2 x 1 x 2) / 8, times the warmup factor at iteration 0 (warmup_iters 1)
    lrs = [float(l.split("\t")[-1]) for l in open(work / "dvclive/plots/metrics/train/lr.tsv").read().splitlines()[1:]]
    assert lrs[1] == pytest.approx(0.01 * 4 / 8)
    # the EMA weights (decay 0.5 over 2 steps) differ from the raw weights in the last checkpoint
    last = torch.load(checkpoints(work)[-1], weights_only=True)
    assert any(not torch.equal(model["model"][k], last["model"][k]) for k in model["model"]
               if model["model"][k].is_floating_point())


class _Observer(HookBase):
    """Records, during a real training step, the dtype the first convolution computes in and whether the
    weights are channels_last."""

    def __init__(self):
        self.seen = {}

    def before_train(self):
        conv = next(m for m in self.trainer.module.modules() if isinstance(m, torch.nn.Conv2d))
        self.handle = conv.register_forward_hook(self._record)
        self.seen["channels_last"] = conv.weight.is_contiguous(memory_format=torch.channels_last) and \
            not conv.weight.is_contiguous()

    def _record(self, module, inputs, output) -> None:
        self.seen.setdefault("dtype", output.dtype)

    def after_train(self):
        self.handle.remove()


@pytest.mark.parametrize("amp, channels_last", [("off", False), ("bf16", True)])
def test_amp_and_channels_last_reach_the_forward_pass(cached_workdir, tmp_path, amp, channels_last):
    """AMP changes the dtype the model computes in; channels_last the weights' memory format. The ("off",
    False) case is the check that fails if either option were ignored: its observations must differ."""
    from detpipe.params import load
    from detpipe.engine.trainer import build_trainer

    cfg = load("train", cached_workdir / "params.yaml").model_copy(update={"amp": amp, "channels_last": channels_last})
    observer = _Observer()
    trainer = build_trainer(cfg, cached_workdir / "data/cache", cached_workdir / "data/arrow/meta.json",
                            tmp_path / "checkpoints", str(tmp_path / "dvclive"), extra_hooks=(observer,))
    trainer.train(0, 1)
    assert observer.seen == {"dtype": torch.bfloat16 if amp == "bf16" else torch.float32,
                             "channels_last": channels_last}
    assert torch.isfinite(torch.tensor(trainer.storage.value("loss")))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fasterrcnn_mobilenet_v3_large_320_fpn", "retinanet_resnet50_fpn",
                                  "fcos_resnet50_fpn", "ssd300_vgg16"])
def test_other_detectors_train_a_step(cached_workdir, name):
    """Each torchvision family builds by name with sizes from the cache and takes a training step on it."""
    cache_meta = json.loads((cached_workdir / "data/cache/meta.json").read_text())
    if name.startswith("ssd300"):
        with pytest.raises(StageError, match="augment.size: 300"):
            model_kwargs(name, cache_meta)
        return
    kwargs = model_kwargs(name, cache_meta)
    assert kwargs == {"min_size": 320, "max_size": 320}
    model = build_from_config(model_config(name, 81, **kwargs)).train()
    images, targets = collate([CachedDetectionDataset(cached_workdir / "data/cache", "train")[i] for i in range(2)])
    targets = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
    # the model's own transform keeps the cached 320 x 320 size: no second resize
    batched, _ = model.transform(images, [dict(t) for t in targets])
    assert batched.image_sizes == [(320, 320), (320, 320)]
    losses = model(images, targets)
    loss = sum(losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.fixture
def http_dir(tmp_path):
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_weights_over_http_with_sha256(trained_workdir, http_dir):
    root, url = http_dir
    ckpt = torch.load(trained_workdir / "models/model.pt", weights_only=True)
    torch.save({"model": ckpt["model"]}, root / "w.pt")
    digest = hashlib.sha256((root / "w.pt").read_bytes()).hexdigest()
    # another number of classes: the heads keep their fresh values, everything else loads
    model = build_from_config(model_config(ckpt["config"]["name"], 5))
    out = load_weights(model, f"{url}/w.pt", digest)
    assert out["loaded"] > 0 and out["skipped"] and all("head.classification_head" in k for k in out["skipped"])
    with pytest.raises(StageError, match="sha256"):
        load_weights(model, f"{url}/w.pt", "f" * 64)
    with pytest.raises(StageError, match="not found|cannot read"):
        load_weights(model, f"{url}/missing.pt")
