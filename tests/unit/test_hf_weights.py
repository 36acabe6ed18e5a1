"""``train.weights`` for the transformers family (`detpipe.models.hf_weights`): a Hugging Face model folder written
by transformers' own ``save_pretrained`` (80 classes) loads into a model of another class count (class heads
re-initialised and logged, every other tensor equal to what transformers' own ``from_pretrained`` reads), pinned by
the download stage's folder-manifest digest; a single ``.safetensors`` file; another architecture, a torchvision
model and a hub id offline are refused with one line."""
from __future__ import annotations

import logging

import pytest
import torch

from detpipe.data.download import print_sha256
from detpipe.core.errors import StageError
from detpipe.models import build_model, hf_weights, load_weights
from detpipe.models.transformers_family import hf_config

HEADS = ("class_embed", "enc_score_head", "denoising_class_embed")


@pytest.fixture(scope="module")
def coco_folder(tmp_path_factory):
    """An RT-DETRv2 tiny model for COCO's 80 classes saved by transformers' ``save_pretrained``, and the tensors
    transformers' ``from_pretrained`` reads back from it (the reference)."""
    from transformers import RTDetrV2ForObjectDetection
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("hf") / "rtdetr_coco"
    RTDetrV2ForObjectDetection(hf_config("rtdetr_v2_tiny", 80)).save_pretrained(folder)
    ref = RTDetrV2ForObjectDetection.from_pretrained(folder).state_dict()
    return folder, ref


def _digest(folder, capsys) -> str:
    print_sha256(str(folder), None)   # what `python -m stages.download --print-sha256 <folder>` prints
    return capsys.readouterr().out.split()[-1]


def test_folder_loads_into_another_class_count(coco_folder, capsys, caplog):
    folder, ref = coco_folder
    torch.manual_seed(2)
    model = build_model("rtdetr_v2_tiny", 4, size=320)   # 3 classes + background
    before = {k: v.clone() for k, v in model.hf.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="detpipe.models"):
        out = load_weights(model, str(folder), _digest(folder, capsys))
    own = model.hf.state_dict()
    heads = {k for k in own if any(h in k for h in HEADS) and own[k].shape != ref[k].shape}
    assert heads and {"hf." + k for k in heads} == set(out["skipped"])
    assert own["model.enc_score_head.weight"].shape[0] == 3 and ref["model.enc_score_head.weight"].shape[0] == 80
    same = [k for k in own if k not in heads]
    assert len(same) > 400
    for k in same:
        assert torch.equal(own[k], ref[k]), k
    changed = [k for k in same if not torch.equal(before[k], own[k])]
    assert len(changed) > 100   # the saved tensors replaced the random init (norms, biases: same init)
    assert "re-initialised" in caplog.text and "another number of classes" in caplog.text


def test_folder_sha256_pin_mismatch_is_one_line(coco_folder):
    folder, _ = coco_folder
    model = build_model("rtdetr_v2_tiny", 4, size=320)
    with pytest.raises(StageError) as e:
        load_weights(model, str(folder), "0" * 64)
    msg = str(e.value)
    assert "\n" not in msg and "train.weights" in msg and "folder manifest sha256" in msg and "0" * 64 in msg


def test_safetensors_file_of_the_same_class_count_loads_every_tensor(coco_folder):
    folder, ref = coco_folder
    model = build_model("rtdetr_v2_tiny", 81, size=320)
    out = load_weights(model, str(folder / "model.safetensors"))
    assert out["skipped"] == []
    own = model.hf.state_dict()
    assert set(own) == set(ref)
    for k in own:
        assert torch.equal(own[k], ref[k]), k


def test_another_architecture_is_refused(coco_folder):
    folder, _ = coco_folder
    with pytest.raises(StageError, match=r"is a rt_detr_v2 model, train.model dfine_tiny is d_fine") as e:
        load_weights(build_model("dfine_tiny", 4, size=320), str(folder))
    assert "\n" not in str(e.value)
    with torch.device("meta"):   # same model_type, other sizes: r18vd is no tiny
        r18 = build_model("rtdetr_v2_r18vd", 4, size=320)
    with pytest.raises(StageError, match=r"another architecture than train.model rtdetr_v2_r18vd: \d+ tensors") as e:
        load_weights(r18, str(folder))
    assert "\n" not in str(e.value)


def test_torchvision_model_and_offline_hub_id_are_one_line(coco_folder, monkeypatch):
    folder, _ = coco_folder
    with torch.device("meta"):
        ssd = build_model("ssdlite320_mobilenet_v3_large", 4)
    ssd._detpipe_name = "ssdlite320_mobilenet_v3_large"
    with pytest.raises(StageError, match="is not of the transformers family") as e:
        load_weights(ssd, str(folder))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(hf_weights, "_USER_OFFLINE", True)   # HF_HUB_OFFLINE=1 as the user set it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with torch.device("meta"):
        model = build_model("rtdetr_v2_tiny", 4, size=320)
    with pytest.raises(StageError, match=r"'PekingU/rtdetr_v2_r18vd' is a Hugging Face hub id, and HF_HUB_OFFLINE "
                                         r"is set: no download \(offline\)") as e:
        load_weights(model, "PekingU/rtdetr_v2_r18vd")
    assert "\n" not in str(e.value)
    assert hf_weights.is_hub_id("ustc-community/dfine-small-coco") and not hf_weights.is_hub_id(str(folder))


def test_launcher_refuses_a_hub_id_offline_before_any_worker(tmp_path, monkeypatch):
    """`check_inputs` (the launcher, before torchrun) gives the same one line for a hub id offline; online it lets
    the id through to the workers (no 'file not found' for ``owner/name``)."""
    import json

    from detpipe.launch.jobs import check_inputs
    from detpipe.params import Train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/arrow").mkdir(parents=True)
    (tmp_path / "data/arrow/meta.json").write_text(json.dumps({"num_classes": 3}))
    (tmp_path / "data/cache").mkdir(parents=True)
    (tmp_path / "data/cache/meta.json").write_text(json.dumps(
        {"resize": "fixed", "size": 320, "masks": False, "splits": {"train": {"rows": 4, "rows_without_masks": 2}}}))
    cfg = Train(model="rtdetr_v2_tiny", lr=1e-4, weights="PekingU/rtdetr_v2_r18vd")
    monkeypatch.setattr(hf_weights, "_USER_OFFLINE", True)
    with pytest.raises(StageError, match=r"'PekingU/rtdetr_v2_r18vd' is a Hugging Face hub id, and HF_HUB_OFFLINE"):
        check_inputs(cfg)
    monkeypatch.setattr(hf_weights, "_USER_OFFLINE", False)
    check_inputs(cfg)
    with pytest.raises(StageError, match="file 'hf/missing.safetensors' not found"):
        check_inputs(Train(model="rtdetr_v2_tiny", lr=1e-4, weights="hf/missing.safetensors"))
