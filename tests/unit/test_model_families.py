"""The model families (`detpipe.models.family`): the transformers family's configs are the papers' sizes, its
wrapper speaks torchvision detection's interface (losses in train mode, XYXY pixel detections in eval mode, checked
against transformers' own post-processing), the optimizer recipe per family, and a DDP rank whose batch has no boxes
does not hang (lyuwenyu/RT-DETR#672)."""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from detpipe.core.errors import StageError
from detpipe.export.exporter import raw_taps, torch_export_supported
from detpipe.models import build_model, family_of, family_of_model, model_kwargs, optimizer_recipe, uses_masks
from detpipe.models.transformers_family import CONFIGS, PAPER_PARAMS_M, postprocess

DOCS = Path(__file__).resolve().parents[2] / "docs" / "train.md"


def _docs_counts() -> dict[str, int]:
    """``| `name` | ... | 20,175,xxx | ...`` rows of docs/train.md's "Model families" table -> exact counts."""
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| [^|]+ \| ([\d,]+) \|", DOCS.read_text(), flags=re.M)
    return {name: int(count.replace(",", "")) for name, count in rows}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_configs_have_the_papers_sizes(name):
    """Built on the meta device (no memory, no init) for COCO's 80 classes: the parameter count is the one
    docs/train.md gives, and within 6 % of the paper's table (the papers round to millions)."""
    with torch.device("meta"):
        model = build_model(name, 81, size=640)
    count = sum(p.numel() for p in model.parameters())
    assert _docs_counts()[name] == count, f"docs/train.md: {name} has {count:,} parameters"
    if name in PAPER_PARAMS_M:
        assert abs(count / 1e6 - PAPER_PARAMS_M[name]) <= 0.06 * PAPER_PARAMS_M[name], (name, count)


def test_families_answer_for_the_stages():
    """What the stages used to find by name prefix, each family declares: masks, raw taps, torch.export, sizing."""
    tv = build_model("ssdlite320_mobilenet_v3_large", 3)
    hf = build_model("rtdetr_v2_tiny", 3, size=128)
    hf._detpipe_name = "rtdetr_v2_tiny"
    assert family_of_model(tv).name == "torchvision" and family_of_model(hf).name == "transformers"
    assert raw_taps(tv) == ["head"] and raw_taps(hf) == ["hf.model.enc_score_head", "hf.model.enc_bbox_head"]
    assert torch_export_supported(tv) and not torch_export_supported(hf)
    assert not uses_masks(tv) and not uses_masks(hf)
    fixed, keep = {"resize": "fixed", "size": 320}, {"resize": "keep_ratio", "size": 320, "min_size": 320,
                                                       "max_size": 533}
    assert model_kwargs("dfine_n", fixed) == {"size": 320}
    with pytest.raises(StageError, match="augment.resize: fixed"):
        model_kwargs("dfine_n", keep)
    with pytest.raises(StageError, match="multiple of 32"):
        model_kwargs("rtdetr_v2_r18vd", {"resize": "fixed", "size": 300})
    assert family_of("ssd300_vgg16").default_augment("ssd300_vgg16") == "ssd"
    assert family_of("fcos_resnet50_fpn").default_augment("fcos_resnet50_fpn") == "flip"
    assert family_of("dfine_s").default_augment("dfine_s") == "detr"
    with pytest.raises(StageError, match="unknown model 'nope'.*rtdetr_v2_r18vd"):
        build_model("nope", 3)


def test_postprocess_matches_transformers_own():
    """`postprocess` against transformers' ``RTDetrImageProcessor.post_process_object_detection`` (focal-loss
    scores, top-Q over query x class, threshold 0) on random logits: same scores, labels + 1, XYXY pixel boxes (ours
    clipped to the image, as torchvision's detectors clip theirs)."""
    from transformers import RTDetrImageProcessor
    torch.manual_seed(0)
    logits, boxes = torch.randn(2, 30, 5), torch.rand(2, 30, 4) * 0.5 + 0.25
    sizes = [(320, 320), (240, 400)]
    ours = postprocess(logits, boxes, sizes, detections=30)
    ref = RTDetrImageProcessor().post_process_object_detection(
        types.SimpleNamespace(logits=logits, pred_boxes=boxes), threshold=0.0, target_sizes=sizes)
    for o, r, (h, w) in zip(ours, ref, sizes):
        torch.testing.assert_close(o["scores"], r["scores"])
        assert torch.equal(o["labels"], r["labels"] + 1)
        clipped = torch.min(r["boxes"].clamp(min=0), torch.tensor([w, h, w, h], dtype=torch.float32))  # ours clip
        torch.testing.assert_close(o["boxes"], clipped, atol=1e-4, rtol=0)


def _batch():
    """Two 128 px images: one with two objects (XYXY pixels, labels 1..K), one with none."""
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 128, 128, generator=g) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[8.0, 10.0, 60.0, 90.0], [70.0, 20.0, 120.0, 64.0]]),
                "labels": torch.tensor([1, 2])},
               {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}]
    return images, targets


@pytest.mark.parametrize("name", ["rtdetr_v2_tiny", "dfine_tiny"])
def test_wrapper_has_torchvision_interface(name):
    """Train mode: a dict of finite scalar losses whose backward reaches every trainable parameter, even for a
    batch without boxes; eval mode: per image ``boxes`` (D, 4) XYXY inside the image, ``scores``, ``labels`` 1..K."""
    torch.manual_seed(0)
    model = build_model(name, 3, size=128).train()
    images, targets = _batch()
    for batch in ((images, targets), (images[1:], targets[1:])):   # with boxes; only an empty image
        model.zero_grad(set_to_none=True)
        losses = model(*batch)
        assert all(v.ndim == 0 and torch.isfinite(v) for v in losses.values()), losses
        sum(losses.values()).backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, missing[:5]
    model.eval()
    with torch.no_grad():
        dets = model(images)
    assert len(dets) == 2
    for d in dets:
        assert d["boxes"].shape == (100, 4) and d["scores"].shape == (100,)
        assert d["labels"].dtype == torch.int64 and 1 <= int(d["labels"].min()) and int(d["labels"].max()) <= 2
        assert float(d["boxes"].min()) >= 0 and float(d["boxes"].max()) <= 128
        assert bool((d["boxes"][:, 2:] >= d["boxes"][:, :2]).all())


def test_optimizer_recipe_per_family():
    """auto: SGD (one group, the default run's optimizer) for torchvision; AdamW for transformers with the backbone
    at 0.1 x lr and no weight decay on 1-D parameters; the LR schedule keeps the backbone's factor; AdamW at
    SGD's lr is a one-line params error."""
    from detpipe import params as params_mod
    from detpipe.engine.hooks import LRScheduleHook
    from detpipe.engine.trainer import make_optimizer

    tv = params_mod.Train()
    assert optimizer_recipe(tv)[:2] == ("sgd", 1.0)
    opt = make_optimizer(build_model(tv.model, 3), tv, 0.05)
    assert isinstance(opt, torch.optim.SGD) and len(opt.param_groups) == 1
    assert opt.param_groups[0]["weight_decay"] == tv.weight_decay

    cfg = params_mod.Train(model="dfine_tiny", lr=1e-4, weight_decay=1e-4)
    model = build_model("dfine_tiny", 3, size=128)
    opt = make_optimizer(model, cfg, 1e-4)
    assert isinstance(opt, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        backbone = {names[id(p)].startswith("hf.model.backbone.") for p in g["params"]}
        assert len(backbone) == 1 and g["lr_mult"] == (0.1 if backbone.pop() else 1.0)
        assert g["weight_decay"] == (1e-4 if g["decay"] else 0.0)
        assert all((p.ndim > 1) == g["decay"] for p in g["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == sum(1 for p in model.parameters() if p.requires_grad)
    hook = LRScheduleHook(opt, 1e-4, warmup_iters=0, schedule="cosine")
    hook.trainer = types.SimpleNamespace(start_iter=0, max_iter=10, iter=0, storage=types.SimpleNamespace(
        put_scalar=lambda *a: None))
    hook.before_train()
    assert sorted({round(g["lr"] / 1e-4, 9) for g in opt.param_groups}) == [0.1, 1.0]
    with pytest.raises(StageError, match="train.lr=0.05 with AdamW"):
        optimizer_recipe(params_mod.Train(model="dfine_n"))


def _ddp_worker(rank: int, world: int, init_file: str, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model("rtdetr_v2_tiny", 3, size=128).train())
    images, targets = _batch()
    mine = (images[:1], targets[:1]) if rank == 0 else (images[1:], targets[1:])   # rank 1: no box at all
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        sum(model(*mine).values()).backward()
        opt.step()
    first = next(model.module.parameters()).detach().clone()
    dist.all_reduce(gathered := first.clone())
    Path(out, f"rank{rank}").write_text(str(bool(torch.allclose(gathered, first * world))))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_rank_without_boxes_does_not_hang(tmp_path):
    """Two gloo processes, DDP as the trainer wraps the model (find_unused_parameters off); rank 1's batch has no
    box, so the transformers loss skips the denoising branch there: the steps still finish within the timeout on
    both ranks, and the replicas stay equal (the gradients were averaged)."""
    ctx = mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "init"), 2, str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")
    try:
        for _ in range(240):               # up to 240 s (each step is ~1 s on one thread)
            if ctx.join(timeout=1):
                break
        else:
            pytest.fail("DDP with an empty-target rank did not finish in 240 s (hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["True", "True"]


@pytest.mark.parametrize("name", ["rtdetr_v2_tiny", "dfine_tiny"])
def test_onnx_export_passes_the_parity_gate_on_the_family_taps(tmp_path, name):
    """The export stage's functions on the family's model: the ONNX file's raw outputs (the encoder's class logits
    and boxes over every anchor) equal eager's within the stage's default rtol; a changed weight in the eager
    model fails the same gate (so it is no tautology)."""
    from detpipe.export.exporter import DetectionExport, export_onnx
    from detpipe.export.parity import parity, split_outputs
    torch.manual_seed(0)
    model = build_model(name, 4, size=128).eval()
    model._detpipe_name = name
    with torch.no_grad():   # as after training: transformers' init zeroes weights here (the encoder's output
        for head in ("enc_output", "enc_score_head", "enc_bbox_head"):   # projection, the heads' last layers), which
            for p in getattr(model.hf.model, head).parameters():         # makes these outputs constant
                p.normal_(0, 0.1)
    images = [torch.rand(3, 128, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    wrapper = DetectionExport(model, False).eval()
    names = wrapper.output_names(images[0])[3:]
    assert names == ["hf.model.enc_score_head", "hf.model.enc_bbox_head"], names
    with torch.inference_mode():
        eager = [split_outputs(wrapper(im), False) for im in images]
    run = export_onnx(wrapper, images[0], tmp_path / "model.onnx", 17)
    outs = [split_outputs(run(im), False) for im in images]
    assert parity(eager, outs, names, 1e-3, 0.05, 0.99)["raw"]["ok"]
    with torch.no_grad():
        model.hf.model.enc_score_head.weight.mul_(1.5)
        changed = [split_outputs(wrapper(im), False) for im in images]
    assert not parity(changed, outs, names, 1e-3, 0.05, 0.99)["raw"]["ok"]
