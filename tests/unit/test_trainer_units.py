"""Unit behaviour of the trainer's pieces: LR schedule, model kwargs, the launcher's input check, launch args, RNG state
round trip."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from detpipe.core.errors import StageError
from detpipe.engine.checkpoints import rng_state, set_rng_state
from detpipe.engine.hooks import lr_factor
from detpipe.params import Train
from detpipe.models import model_kwargs
from detpipe.launch.jobs import launch_args


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


def _sgd_trainer(lr: float, hooks, skip=(), stop=None, optimizer=None):
    """A `TrainerBase` over one SGD parameter with the hooks ``hooks(optimizer)``; its ``run_step`` records the lr it
    trains with in ``lrs``, skips the optimizer step (as a non-finite loss or fp16's GradScaler does) at iterations
    in ``skip`` and raises KeyboardInterrupt at ``stop`` (a kill)."""
    from detpipe.engine.train_loop import TrainerBase

    class T(TrainerBase):
        def run_step(self):
            if self.iter == stop:
                raise KeyboardInterrupt
            self.lrs.append(self.optimizer.param_groups[0]["lr"])
            if self.iter not in skip:
                self.param.grad = torch.ones_like(self.param)
                self.optimizer.step()

    t = T()
    t.param = torch.nn.Parameter(torch.zeros(2))
    t.optimizer = optimizer or torch.optim.SGD([t.param], lr=lr, momentum=0.9)
    t.lrs = []
    t.register_hooks(hooks(t.optimizer))
    return t


@pytest.mark.parametrize("schedule", [dict(warmup_iters=5), dict(warmup_iters=3, schedule="multistep",
                                                                 milestones=(0.5, 0.8), gamma=0.1)])
def test_lr_schedule_hook_is_base_lr_times_lr_factor_fresh_and_resumed(schedule, recwarn):
    """The lr of every iteration is exactly ``base_lr * lr_factor(it, ...)`` (the float product), fresh, resumed
    from an optimizer state saved mid-run, and resumed with another base lr (another world size with
    train.base_batch_size); a skipped first optimizer step warns nothing."""
    from detpipe.engine.hooks import LRScheduleHook

    base, n, k = 0.02, 20, 7
    hooks = lambda lr: lambda opt: [LRScheduleHook(opt, lr, **schedule)]  # noqa: E731
    want = lambda lr, its: [lr * lr_factor(i, n, **schedule) for i in its]  # noqa: E731
    fresh = _sgd_trainer(base, hooks(base), skip=(0,))
    fresh.train(0, n)
    assert fresh.lrs == want(base, range(n))
    killed = _sgd_trainer(base, hooks(base), stop=k)
    with pytest.raises(KeyboardInterrupt):
        killed.train(0, n)
    for lr in (base, 2 * base):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr, momentum=0.9)
        opt.load_state_dict(killed.optimizer.state_dict())
        resumed = _sgd_trainer(lr, hooks(lr), skip=(k,), optimizer=opt)
        resumed.train(k, n)
        assert killed.lrs + resumed.lrs == want(base, range(k)) + want(lr, range(k, n))
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]


def test_eval_hook_needs_its_ema_hook_before_it(tmp_path):
    from detpipe.engine.hooks import EMAHook, EvalHook

    def hooks(ema_first):
        def make(opt):
            ema = EMAHook(torch.nn.Linear(2, 2), 0.9)
            ev = EvalHook(1, lambda model: {"AP": 0.0}, tmp_path / "best.pt", {}, ema)
            return [ema, ev] if ema_first else [ev, ema]
        return make

    _sgd_trainer(0.1, hooks(ema_first=True)).train(0, 0)
    with pytest.raises(ValueError, match="EMAHook must be registered before it"):
        _sgd_trainer(0.1, hooks(ema_first=False)).train(0, 0)


def test_model_kwargs_match_cache():
    fixed = {"resize": "fixed", "size": 320, "min_size": 800, "max_size": 1333}
    assert model_kwargs("ssdlite320_mobilenet_v3_large", fixed) == {}
    with pytest.raises(StageError, match="augment.size: 300"):
        model_kwargs("ssd300_vgg16", fixed)
    assert model_kwargs("fasterrcnn_resnet50_fpn", fixed) == {"min_size": 320, "max_size": 320}
    keep = {**fixed, "resize": "keep_ratio", "min_size": 512, "max_size": 853}
    assert model_kwargs("retinanet_resnet50_fpn", keep) == {"min_size": 512, "max_size": 853}



def test_launcher_checks_inputs_on_a_meta_model(tmp_path, monkeypatch):
    """`check_inputs` refuses what every worker would refuse (missing meta.json, unknown model, an SSD on a cache of
    another size, a mask model on a cache without masks, a missing weights file) with one line, building the model
    on the meta device only: no weights, no draw from torch's RNG; the worker's build has the same structure."""
    import json

    from detpipe.launch.jobs import check_inputs
    from detpipe.models import build_detector

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/arrow").mkdir(parents=True)
    (tmp_path / "data/arrow/meta.json").write_text(json.dumps({"num_classes": 3}))
    with pytest.raises(StageError, match=r"data/cache/meta.json: not found \(run the augment stage first\)"):
        check_inputs(Train())
    (tmp_path / "data/cache").mkdir(parents=True)
    (tmp_path / "data/cache/meta.json").write_text(json.dumps(
        {"resize": "fixed", "size": 320, "masks": False, "splits": {"train": {"rows": 4, "rows_without_masks": 2}}}))
    rng = torch.get_rng_state()
    check_inputs(Train())
    assert torch.equal(torch.get_rng_state(), rng)
    meta_model, config, _ = build_detector(Train(), device="meta")
    assert {p.device.type for p in meta_model.parameters()} == {"meta"}
    model, same_config, _ = build_detector(Train())
    assert same_config == config and not torch.equal(torch.get_rng_state(), rng)
    assert [(k, v.shape) for k, v in meta_model.state_dict().items()] == \
        [(k, v.shape) for k, v in model.state_dict().items()]
    for cfg, line in [(Train(model="no_such_net"), "unknown model 'no_such_net'"),
                      (Train(model="ssd300_vgg16"), "augment.size: 300"),
                      (Train(model="maskrcnn_resnet50_fpn"), "needs instance masks"),
                      (Train(weights="missing.pt"), "key 'train.weights': file 'missing.pt' not found")]:
        with pytest.raises(StageError, match=line):
            check_inputs(cfg)

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


def test_event_storage_rows_and_state():
    from detpipe.engine.train_loop import EventStorage

    s = EventStorage(keep_every=3)
    for it in range(7):
        s.put_scalar("loss", 10 - it)
        if it == 4:
            s.put_scalar("val/AP", 0.5, keep=True)  # kept whatever keep_every says
        s.step(last=it == 6)
    assert [r["step"] for r in s.history] == [3, 5, 6, 7]
    assert s.history[1] == {"step": 5, "loss": 6.0, "val/AP": 0.5}
    assert s.latest() == {"loss": (4.0, 6), "val/AP": (0.5, 4)} and s.iter == 7
    t = EventStorage(keep_every=3)
    t.load_state_dict(s.state_dict())
    assert t.history == s.history and t.latest() == s.latest()



def _recording_trainer(fail_at: int | None):
    import gc
    import weakref

    from detpipe.engine.train_loop import HookBase, TrainerBase

    calls = []

    class Trainer(TrainerBase):
        def run_step(self):
            if self.iter == fail_at:
                raise RuntimeError("step failed")
            self.storage.put_scalar("loss", float(self.iter))

    class Reader(HookBase):  # registered first: reads what Writer puts, one iteration later
        def before_step(self):
            calls.append(("before_step", self.trainer.iter, self.trainer.storage.value("from_writer", -1.0)))

        def after_train(self):
            calls.append(("after_train", self.trainer.iter))

    class Writer(HookBase):
        def after_step(self):
            self.trainer.storage.put_scalar("from_writer", self.trainer.iter * 10)

    t = Trainer()
    t.register_hooks([Reader(), Writer()])
    ref = weakref.ref(t)
    return t, calls, ref, gc


def test_after_train_runs_when_a_step_raises_and_hooks_hold_weak_references():
    t, calls, ref, gc = _recording_trainer(fail_at=2)
    with pytest.raises(RuntimeError, match="step failed"):
        t.train(0, 5)
    assert calls[-1] == ("after_train", 2)  # in `finally`
    # values travel through the storage: the reader sees the writer's value of the previous iteration
    assert calls[:3] == [("before_step", 0, -1.0), ("before_step", 1, 0.0), ("before_step", 2, 10.0)]
    hooks = t.hooks
    del t
    gc.collect()
    assert ref() is None  # hooks do not keep the trainer alive (weakref.proxy)
    with pytest.raises(ReferenceError):
        hooks[0].trainer.iter


def test_progress_lines_without_a_tty(caplog):
    import logging
    import re
    import time

    from detpipe.core.progress import Progress

    p = Progress(4, "train", every_s=1.0, initial=1, tty=False)
    with caplog.at_level(logging.INFO, logger="detpipe.core.progress"):
        p.update(1, images=8, epoch="1/2", loss=1.23456, lr=0.01)  # too soon after the start: no line
        time.sleep(1.1)
        p.update(1, images=8, epoch="2/2", loss=0.5, lr=0.005)
        p.update(1, images=8, epoch="2/2", loss=0.25, lr=0.001)  # the last one always logs
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert re.fullmatch(r"train: iteration 3/4, epoch 2/2, loss 0\.5, lr 0\.005, [\d.]+ images/s, ETA 0:00:0\d",
                        lines[0]), lines[0]
    assert lines[1].startswith("train: iteration 4/4, epoch 2/2, loss 0.25, lr 0.001, ") and "ETA" not in lines[1]


def test_train_keys_have_one_role_each_and_the_fingerprint_follows_it():
    """Every train key has exactly one role (`detpipe.params.train_keys`); changing a launch, run or schedule key keeps
    the checkpoint fingerprint, changing a result key changes it (`detpipe.engine.checkpoints.fingerprint`); the
    launch params take the launch keys (`detpipe.launch.stage.LaunchParams.of_train`)."""
    from detpipe.engine.checkpoints import fingerprint, schedule_params
    from detpipe.launch.stage import LaunchParams
    from detpipe.params import train_keys

    roles = {r: train_keys(r) for r in ("result", "schedule", "run", "launch")}
    assert sum(len(k) for k in roles.values()) == len(Train.model_fields)
    assert set().union(*roles.values()) == set(Train.model_fields)
    base = fingerprint(Train(), b"c", b"a")
    for changed in ({"nnodes": "2"}, {"k8s_gpus": 1}, {"keep_last": 5}, {"epochs": 3}, {"lr": 0.01}):
        assert fingerprint(Train(**changed), b"c", b"a") == base, changed
    for changed in ({"seed": 1}, {"model": "fasterrcnn_mobilenet_v3_large_320_fpn"}, {"batch_size": 2}):
        assert fingerprint(Train(**changed), b"c", b"a") != base, changed
    assert set(schedule_params(Train())) == roles["schedule"]
    launch = LaunchParams.of_train(Train(nnodes="1:2", max_restarts=7, threads=3, socket_ifname="eth1"))
    assert (launch.nnodes, launch.max_restarts, launch.threads, launch.socket_ifname) == ("1:2", 7, 3, "eth1")
