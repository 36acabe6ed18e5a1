"""Unit behaviour of the trainer's pieces: LR schedule, model kwargs, launch args, RNG state round trip."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from detpipe.errors import StageError
from detpipe.hooks import lr_factor, rng_state, set_rng_state
from detpipe.params import Train
from stages.train import launch_args, model_kwargs


def test_lr_warmup_then_cosine():
    f = [lr_factor(i, 100, 10) for i in range(100)]
    assert f[0] == pytest.approx(0.001) and f[10] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:10], f[1:11]))          # warmup rises
    assert all(a >= b for a, b in zip(f[10:], f[11:]))          # cosine falls
    assert f[55] == pytest.approx(0.5, abs=1e-9)                # half-way through the cosine part
    assert f[99] < 0.001


def test_lr_multistep():
    f = [lr_factor(i, 100, 0, "multistep", (0.5, 0.8), 0.1) for i in range(100)]
    assert f[49] == 1.0 and f[50] == pytest.approx(0.1) and f[80] == pytest.approx(0.01)


def test_model_kwargs_match_cache():
    fixed = {"resize": "fixed", "size": 320, "min_size": 800, "max_size": 1333}
    assert model_kwargs("ssdlite320_mobilenet_v3_large", fixed) == {}
    with pytest.raises(StageError, match="augment.size: 300"):
        model_kwargs("ssd300_vgg16", fixed)
    assert model_kwargs("fasterrcnn_resnet50_fpn", fixed) == {"min_size": 320, "max_size": 320}
    keep = {**fixed, "resize": "keep_ratio", "min_size": 512, "max_size": 853}
    assert model_kwargs("retinanet_resnet50_fpn", keep) == {"min_size": 512, "max_size": 853}


def test_launch_args_from_params():
    multi = launch_args(Train(nnodes="1:2", nproc_per_node=2, rdzv_endpoint="10.0.0.5:29400", max_restarts=5),
                        run_id="4711")
    assert multi == ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     "10.0.0.5:29400", "--rdzv-id", "4711", "--rdzv-conf", "join_timeout=600,last_call_timeout=30",
                     "--max-restarts", "5", "-m", "stages.train"]
    # a loopback endpoint: the agent's stores and the workers' bootstrap address stay on 127.0.0.1
    assert launch_args(Train(nnodes=2), "127.0.0.1:5000", "x")[-4:] == ["--local-addr", "127.0.0.1", "-m",
                                                                         "stages.train"]
    for bad in ("0", "2:1", "a", "1:2:3"):
        with pytest.raises(ValueError):
            Train(nnodes=bad)


def test_rng_state_roundtrip_through_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_amp_off_survives_yaml_rewrites(tmp_path):
    """`dvc exp run -S` rewrites params.yaml with `amp: off` unquoted, which YAML 1.1 reads as False."""
    import shutil
    from detpipe.params import load

    p = tmp_path / "params.yaml"
    shutil.copy("params.yaml", p)
    p.write_text(p.read_text().replace('amp: "off"', "amp: off"))
    assert load("train", p).amp == "off"
