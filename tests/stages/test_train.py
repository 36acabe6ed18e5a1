"""Train stage on real COCO128 images: outputs, resume semantics, exact resume after kill -9, bad input."""
from __future__ import annotations

import csv
import datetime
import hashlib
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from support.pipeline import (LEARNS_DETR, assert_same_training_state, checkpoint_iterations, checkpoints,
                              kill9_training_after, stage_cli, stage_in_background, write_params)
from support.procs import run, stage_env

from detpipe.core.errors import StageError
from detpipe.models import build_from_config, load_weights
from detpipe.warm_start import materialise_weights


def test_train_outputs(trained_workdir):
    work = trained_workdir
    params = yaml.safe_load((work / "params.yaml").read_text())["train"]
    meta = json.loads((work / "data/arrow/meta.json").read_text())
    n_train = meta["splits"]["train"]["images"]
    max_iter = params["epochs"] * (n_train // params["batch_size"])
    model = torch.load(work / "models/model.pt", weights_only=True)
    assert model["iters"] == max_iter
    assert model["config"]["name"] == params["model"]
    assert model["config"]["num_classes"] == meta["num_classes"] == 81
    # keep_last checkpoints, the newest at the final iteration
    ckpts = checkpoints(work)
    assert [p.name for p in ckpts][-1] == f"ckpt-{max_iter:07d}.pt"
    assert len(ckpts) <= params["keep_last"]
    last = torch.load(ckpts[-1], weights_only=True)
    for k, v in model["model"].items():
        assert torch.equal(v, last["model"][k]), k
    # DVCLive curves: one row per iteration, finite losses
    metrics = json.loads((work / "dvclive/metrics.json").read_text())
    assert metrics["step"] == max_iter
    rows = list(csv.DictReader(open(work / "dvclive/plots/metrics/train/loss.tsv"), delimiter="\t"))
    assert [int(r["step"]) for r in rows] == list(range(1, max_iter + 1))
    assert all(float(r["loss"]) == float(r["loss"]) and float(r["loss"]) > 0 for r in rows)


def _copy(src: Path, dst: Path, overrides: dict | None = None) -> Path:
    shutil.copytree(src / "data", dst / "data")
    write_params(dst, overrides)
    return dst


_PROGRESS = re.compile(r"^(\S+ \S+) detpipe\.core\.progress INFO train: iteration (\d+)/(\d+), epoch \d+/\d+, loss [\d.e+-]+, "
                       r"lr [\d.e+-]+, [\d.]+ images/s, ETA \d+:\d\d:\d\d$", re.M)


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _sigterm_when(work: Path, stderr_path: Path, ready) -> tuple[int, str]:
    """Run the train stage in ``work`` (stderr to ``stderr_path``, a file: nobody reads a pipe meanwhile), send
    SIGTERM once ``ready(stderr so far)`` holds; returns ``(exit status, stderr)``."""
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=work, env=stage_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 300
        while not ready(stderr_path.read_text()):
            assert proc.poll() is None and time.time() < deadline, "training ended before it could be interrupted"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return proc.returncode, stderr_path.read_text()


@pytest.mark.slow
def test_kill9_and_sigterm_resume_is_bit_identical(cached_workdir, tmp_path):
    """kill -9 mid-training, run again, SIGTERM that run mid-training, run again: final weights and optimizer
    state equal an uninterrupted run's. The SIGTERM gives one `error:` line naming the iteration and the kept
    checkpoint, exit status 143, a checkpoint that loads; without a TTY the log has a progress line at least every
    train.log_every_s seconds (plus one step)."""
    overrides = {"train": {"epochs": 5, "checkpoint_every": 1, "keep_last": 10, "log_every_s": 1}}
    straight = _copy(cached_workdir, tmp_path / "straight", overrides)
    killed = _copy(cached_workdir, tmp_path / "killed", overrides)
    with stage_in_background("train", straight):      # the uninterrupted run, on the other core
        kill9_training_after(killed)
        interrupted_at = len(checkpoints(killed))   # its workers are gone too: no checkpoint comes after this
        # resume, then SIGTERM once two progress lines were logged and a checkpoint past the resumed one exists
        status, stderr = _sigterm_when(killed, tmp_path / "sigterm.log",
                                       lambda text: len(_PROGRESS.findall(text)) >= 2
                                       and checkpoint_iterations(killed)[-1] > interrupted_at)
    final_iter = checkpoint_iterations(straight)[-1]
    assert interrupted_at < final_iter, "the kill came too late to test anything"
    assert "resuming from" in stderr
    assert status == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    m = re.fullmatch(r"error: interrupted by SIGTERM at iteration (\d+); checkpoint (ckpt-(\d{7})\.pt) kept",
                     errors[0])
    assert m, errors[0]
    newest = checkpoints(killed)[-1]
    assert newest.name == m.group(2) and int(m.group(1)) >= int(m.group(3)) > interrupted_at
    assert torch.load(newest, weights_only=True)["iter"] == int(m.group(3)) < final_iter
    assert not list((killed / "checkpoints").glob(".ckpt-*"))  # no half-written file left
    # progress lines from the start of training on, never more than log_every_s + the slowest step apart
    start = _stamp(re.search(r"^(\S+ \S+) detpipe\.engine\.trainer INFO rank 0/1 .* iterations \d+\.\.", stderr, re.M)[1])
    lines = _PROGRESS.findall(stderr)
    assert all(total == str(final_iter) for _, _, total in lines)
    step_times = [float(r["step_time"]) for r in csv.DictReader(
        open(killed / "dvclive/plots/metrics/train/step_time.tsv"), delimiter="\t")]
    stamps = [start] + [_stamp(t) for t, _, _ in lines]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert max(gaps) <= 1 + max(step_times) + 1.0, (gaps, step_times)  # 1 s slack for a loaded machine

    resumed = stage_cli("train", killed)
    assert f"resuming from checkpoints/{m.group(2)}" in resumed.stderr

    assert assert_same_training_state(checkpoints(straight)[-1], checkpoints(killed)[-1]) == final_iter
    # the resumed run's curves have one row per iteration, no gap and no duplicate
    rows = list(csv.DictReader(open(killed / "dvclive/plots/metrics/train/loss.tsv"), delimiter="\t"))
    assert [int(r["step"]) for r in rows] == list(range(1, final_iter + 1))


@pytest.mark.slow
def test_kill9_resume_of_rtdetr_is_bit_identical(learns_detr_prepared, tmp_path):
    """The transformers family (rtdetr_v2_tiny on the learns test's 4 images at 128 px, AdamW, the family's
    default `detr` augmentation with flips and its multi-scale sizes 96/128/160 px per step but in the last epoch,
    denoising queries drawn each step): a run killed with kill -9 after
    its checkpoint at iteration 3 and resumed ends with the same weights and AdamW state (step, exp_avg,
    exp_avg_sq) as an uninterrupted run."""
    overrides = {"augment": LEARNS_DETR["augment"],
                 "train": {**LEARNS_DETR["train"], "epochs": 6, "checkpoint_every": 1, "keep_last": 10,
                           "log_every": 1, "augment": "auto", "hflip": 0.5}}
    straight = _copy(learns_detr_prepared, tmp_path / "straight", overrides)
    killed = _copy(learns_detr_prepared, tmp_path / "killed", overrides)
    with stage_in_background("train", straight):
        kill9_training_after(killed, iteration=3)
    interrupted_at = checkpoint_iterations(killed)[-1]
    resumed = stage_cli("train", killed)
    assert f"resuming from checkpoints/ckpt-{interrupted_at:07d}.pt" in resumed.stderr
    final_iter = checkpoint_iterations(straight)[-1]
    assert interrupted_at < final_iter == 6
    assert torch.load(straight / "models/model.pt", weights_only=True)["config"]["name"] == "rtdetr_v2_tiny"
    state = torch.load(checkpoints(straight)[-1], weights_only=True)["optimizer"]["state"]
    assert {"exp_avg", "exp_avg_sq"} <= set(next(iter(state.values())))
    assert assert_same_training_state(checkpoints(straight)[-1], checkpoints(killed)[-1]) == final_iter
    # the run trained at several sizes (6 epochs of one step each; the last one at the cache's 128 px)
    from detpipe import params as params_mod
    from detpipe.data import train_transforms as tt
    cfg = params_mod.Train(**overrides["train"])
    sizes = [tt.step_size(tt.resolve(cfg), cfg.seed, it, it, 128) for it in range(final_iter)]
    assert len(set(sizes[:-1])) > 1 and None not in sizes[:-1] and sizes[-1] is None, sizes


@pytest.mark.slow
def test_kill9_resume_with_mosaic_and_mixup_is_bit_identical(cached_workdir, tmp_path):
    """The yolo preset with mosaic and mixup on (close_mosaic: the last of 3 epochs): a run killed with kill -9
    mid-epoch 1 and resumed ends with the same weights and optimizer state as an uninterrupted run, across the
    epoch where mosaic closes; plots/train_batch.png is the loader's augmented first step (mosaic tiles and all)."""
    from detpipe import params as params_mod
    from detpipe.data.dataset import CachedDetectionDataset
    from detpipe.data.loader import micro_batches
    from detpipe.data.sampler import ResumableDistributedSampler
    from detpipe.data.train_transforms import TrainTransforms, resolve
    from detpipe.vis.batch_plot import draw_batch
    from detpipe.vis.drawing import encode_png

    overrides = {"train": {"epochs": 3, "checkpoint_every": 1, "keep_last": 10, "augment": "yolo", "mixup": 0.5,
                           "close_mosaic": 1}}
    straight = _copy(cached_workdir, tmp_path / "straight", overrides)
    killed = _copy(cached_workdir, tmp_path / "killed", overrides)
    with stage_in_background("train", straight):
        kill9_training_after(killed, iteration=3)
    interrupted_at = len(checkpoints(killed))
    resumed = stage_cli("train", killed)
    assert "resuming from" in resumed.stderr
    final_iter = checkpoint_iterations(straight)[-1]
    assert interrupted_at < final_iter
    assert assert_same_training_state(checkpoints(straight)[-1], checkpoints(killed)[-1]) == final_iter
    # the drawn batch is the augmented one the loader yields
    cfg = params_mod.load("train", straight / "params.yaml")
    ds = CachedDetectionDataset(straight / "data/cache", "train", hflip=cfg.hflip, seed=cfg.seed)
    ds.transforms = TrainTransforms(resolve(cfg), cfg.seed, len(ds))
    sampler = ResumableDistributedSampler(len(ds), 1, 0, seed=cfg.seed, shards=ds.sample_shards())
    data = micro_batches(ds, sampler, (0, 0, 0), cfg.batch_size, cfg.accumulate)
    try:
        micro = next(data)
    finally:
        data.close()
    names = json.loads((straight / "data/arrow/meta.json").read_text())["label_names"]
    assert (straight / "plots/train_batch.png").read_bytes() == encode_png(draw_batch(micro, names))
    # the boxes the augmentation cut away are counted per step: iteration 1's row is this step's sum
    rows = list(csv.DictReader(open(straight / "dvclive/plots/metrics/train/boxes_dropped.tsv"), delimiter="\t"))
    assert [int(r["step"]) for r in rows] == list(range(1, final_iter + 1))
    assert float(rows[0]["boxes_dropped"]) == sum(int(t["dropped"]) for _, ts in micro for t in ts) > 0
    image, target = micro[0][0][0], micro[0][1][0]
    u8 = image.mul(255).round().to(torch.uint8)
    cached = [ds.cached_sample(i, 0)["image"].as_subclass(torch.Tensor) for i in range(len(ds))]
    assert "dropped" in target and all(not torch.equal(u8, c) and not torch.equal(u8, c.flip(-1)) for c in cached)


def test_resume_rules(trained_workdir, tmp_path):
    work = _copy(trained_workdir, tmp_path / "w")
    shutil.copytree(trained_workdir / "checkpoints", work / "checkpoints")
    # same params: resumes at the end, nothing left to do (no extra epoch, the same model)
    before = torch.load(trained_workdir / "models/model.pt", weights_only=True)
    ckpts = [p.name for p in checkpoints(work)]
    same = stage_cli("train", work)
    assert "resuming from" in same.stderr
    after = torch.load(work / "models/model.pt", weights_only=True)
    assert [p.name for p in checkpoints(work)] == ckpts and after["iters"] == before["iters"]
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
    # another training (seed: not a schedule key) + must: a clear one-line error, exit 2
    write_params(work, {"train": {"seed": 1, "resume": "must"}})
    must = stage_cli("train", work, check=False)
    assert must.returncode == 2
    assert "train.resume is 'must'" in must.stderr and "Traceback" not in must.stderr
    # another training + auto: starts fresh, says why, and removes the foreign checkpoints
    write_params(work, {"train": {"seed": 1, "epochs": 1}})
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    fresh = stage_cli("train", work, env={"TMPDIR": str(tmp)})
    assert "starting fresh" in fresh.stderr and "other training params" in fresh.stderr
    assert list(tmp.iterdir()) == []       # torchelastic's per-run folder (workers' error files) went with the run
    assert [p.name for p in checkpoints(work)] == ["ckpt-0000002.pt"]
    # a finished run, another lr and no epoch added (a `dvc exp run -S train.lr=...`): another training
    write_params(work, {"train": {"seed": 1, "epochs": 1, "lr": 0.02}})
    other_lr = stage_cli("train", work)
    assert "starting fresh" in other_lr.stderr, other_lr.stderr[-3000:]
    assert "finished its schedule and the new one (lr 0.01 -> 0.02) adds no epoch" in other_lr.stderr
    # resume: restart starts fresh on any schedule change, more epochs included
    write_params(work, {"train": {"seed": 1, "epochs": 2, "lr": 0.02, "resume": "restart"}})
    restart = stage_cli("train", work)
    assert "another schedule (epochs 1 -> 2) and train.resume is 'restart'" in restart.stderr, restart.stderr[-3000:]
    assert torch.load(work / "models/model.pt", weights_only=True)["iters"] == 4


def _samples(folder: Path) -> dict[int, list[int]]:
    """iteration -> image ids trained on, from the `DETPIPE_SAMPLE_LOG` files in ``folder`` (one rank)."""
    rows = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]
    return {r["iter"]: sorted(r["image_ids"]) for r in rows}


@pytest.mark.slow
def test_a_longer_schedule_continues_the_training(request, cached_workdir, tmp_path):
    """A run of 1 epoch (4 iterations of 2 images, checkpoints every iteration, EMA), cut back to its checkpoint
    at iteration 2 (mid-epoch), continued with 3 epochs, another lr and EMA decay (schedule keys only):
    - the continuation logs what it kept and re-planned, and trains exactly iterations 2..11;
    - what its first step starts from is the checkpoint's: weights, SGD momentum buffers, EMA, RNG states (tensors);
    - epoch 0 goes on with the very samples the first run had at iterations 2 and 3, and every later epoch has
      each sample at most once;
    - its lr rows (DVCLive) are the first run's plan before iteration 2 and the new plan (0.02 x `lr_factor` over
      12 iterations) from there on;
    - a continuation killed at iteration 5 and run again ends bit-identical to the uninterrupted one;
    - the same checkpoints with train.epochs=1 (fewer than the killed one had started): a one-line error."""
    from detpipe import params as params_mod
    from detpipe.engine.checkpoints import find_resume_state
    from detpipe.engine.hooks import lr_factor
    from detpipe.engine.trainer import build_trainer, schedule_params

    base = {"epochs": 1, "batch_size": 2, "checkpoint_every": 1, "keep_last": 20, "ema": True}
    for folder in ("s_first", "s_a"):
        (tmp_path / folder).mkdir()
    first = _copy(cached_workdir, tmp_path / "first", {"train": base})
    run([sys.executable, "-m", "stages.train"], first, env={"DETPIPE_SAMPLE_LOG": str(tmp_path / "s_first")})
    assert checkpoint_iterations(first) == [1, 2, 3, 4]
    more = {"train": {**base, "epochs": 3, "lr": 0.02, "ema_decay": 0.99}}
    works = []
    for name in ("a", "b"):
        work = _copy(cached_workdir, tmp_path / name, more)
        shutil.copytree(first / "checkpoints", work / "checkpoints")
        shutil.copytree(first / "dvclive", work / "dvclive")
        for p in checkpoints(work)[2:]:
            p.unlink()
        works.append(work)
    a, b = works

    # the state the continuation starts from, in this process (its threads and RNG states restored after)
    threads, rngs = torch.get_num_threads(), (random.getstate(), np.random.get_state(), torch.get_rng_state())
    request.addfinalizer(lambda: (torch.set_num_threads(threads), random.setstate(rngs[0]),
                                  np.random.set_state(rngs[1]), torch.set_rng_state(rngs[2])))
    cfg = params_mod.load("train", a / "params.yaml")
    ckpt = torch.load(checkpoints(a)[-1], weights_only=True)
    trainer = build_trainer(cfg, a / "data/cache", a / "data/arrow/meta.json", a / "checkpoints", str(tmp_path / "dl"))
    state = find_resume_state(cfg.resume, trainer.fingerprint, a / "checkpoints", schedule_params(cfg))
    assert state["iter"] == 2
    trainer.load_checkpoint_state(state)
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in trainer.module.state_dict().items())
    moments = trainer.optimizer.state_dict()["state"]
    assert len(moments) > 0 and all(torch.equal(moments[k]["momentum_buffer"], ckpt["optimizer"]["state"][k]["momentum_buffer"])
                                    for k in moments)
    assert all(g["weight_decay"] == cfg.weight_decay for g in trainer.optimizer.param_groups)
    saved_ema = ckpt["hooks"]["EMAHook"]["ema"]
    assert all(torch.equal(v, saved_ema[k]) for k, v in trainer.ema.ema.state_dict().items())
    assert torch.equal(torch.get_rng_state(), ckpt["rng"][0]["torch"])
    del trainer

    with stage_in_background("train", a, env={"DETPIPE_SAMPLE_LOG": str(tmp_path / "s_a")}) as proc:
        kill9_training_after(b, iteration=5)
        shutil.copytree(b, tmp_path / "c", ignore=shutil.ignore_patterns("dvclive"))
    log = proc.output
    assert ("continuing the training of checkpoint iteration 2 with another schedule (ema_decay 0.9998 -> 0.99, "
            "epochs 1 -> 3, lr 0.01 -> 0.02)") in log, log[-3000:]
    assert "iterations 2..12 follow the lr schedule planned for 12 iterations" in log
    s_first, s_a = _samples(tmp_path / "s_first"), _samples(tmp_path / "s_a")
    assert sorted(s_a) == list(range(2, 12))                      # exactly the added iterations
    assert [s_a[2], s_a[3]] == [s_first[2], s_first[3]]           # epoch 0 goes on where it was cut
    for epoch in (1, 2):
        ids = [i for it in range(4 * epoch, 4 * epoch + 4) for i in s_a[it]]
        assert len(ids) == 8 == len(set(ids)), (epoch, ids)
    rows = list(csv.DictReader(open(a / "dvclive/plots/metrics/train/lr.tsv"), delimiter="\t"))
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    expected = [0.01 * lr_factor(it, 4, 1) if it < 2 else 0.02 * lr_factor(it, 12, 1) for it in range(12)]
    assert [float(r["lr"]) for r in rows] == pytest.approx(expected, rel=1e-9, abs=0)
    assert torch.load(a / "models/model.pt", weights_only=True)["iters"] == 12

    resumed = stage_cli("train", b)
    assert "resuming from checkpoints/ckpt-00000" in resumed.stderr
    assert assert_same_training_state(checkpoints(a)[-1], checkpoints(b)[-1]) == 12

    write_params(tmp_path / "c", {"train": {**base, "epochs": 1, "lr": 0.02, "ema_decay": 0.99}})
    fewer = stage_cli("train", tmp_path / "c", check=False)
    errors = [line for line in fewer.stderr.splitlines() if line.startswith("error:")]
    assert fewer.returncode == 2 and len(errors) == 1 and "Traceback" not in fewer.stderr, fewer.stderr[-3000:]
    assert "train.epochs=1 is fewer epochs than" in errors[0] and "in epoch 2 of its 3" in errors[0], errors[0]


@pytest.mark.slow
def test_patience_stops_every_rank_at_one_iteration_and_a_resume_keeps_counting(cached_workdir, tmp_path):
    """train.patience 2 with an improvement no model makes (min_delta 1.0 AP), evaluating every iteration, 2 ranks
    (4 iterations planned): the first evaluation sets the reference, so both ranks stop after iteration 3, the last
    line and DVCLive's metrics say so, and models/model.pt holds best.pt's weights (train.final: best). Resumed from
    its checkpoint at iteration 2 (one stale evaluation counted) it stops at 3 again (with a reset count it would
    run to 4); resumed after the stop it trains nothing more."""
    stop = {"epochs": 2, "batch_size": 2, "nproc_per_node": 2, "eval_every": 1, "patience": 2, "min_delta": 1.0,
            "final": "best", "checkpoint_every": 1, "keep_last": 20}
    work = _copy(cached_workdir, tmp_path / "w", {"train": stop})
    first = stage_cli("train", work).stderr
    reason = "stopped early at iteration 3: val AP did not improve by more than 1.0 for 2 evaluations"
    assert reason in first, first[-3000:]
    digests = set(re.findall(r"rank \d final weights digest (\w+)", first))
    assert len(re.findall(r"rank \d final weights digest", first)) == 2 and len(digests) == 1, first[-3000:]
    assert checkpoint_iterations(work) == [1, 2, 3]
    assert torch.load(checkpoints(work)[-1], weights_only=True)["trainer"]["stopped"]
    assert json.loads((work / "dvclive/metrics.json").read_text())["train"]["stopped_early_at"] == 3
    model = torch.load(work / "models/model.pt", weights_only=True)
    best = torch.load(work / "checkpoints/best.pt", weights_only=True)
    assert model["iters"] == 3 and all(torch.equal(v, best["model"][k]) for k, v in model["model"].items())
    # train.weights checkpoint:best (issue 35.3) takes this real best.pt, checked against its pin, and loads its tensors
    pin = hashlib.sha256((work / "checkpoints/best.pt").read_bytes()).hexdigest()
    start = materialise_weights("checkpoint:best", pin, tmp_path / "warm_start.pt", work / "checkpoints")
    assert start.read_bytes() == (work / "checkpoints/best.pt").read_bytes()
    net = build_from_config(best["config"])
    load_weights(net, str(start))
    assert all(torch.equal(v, best["model"][k]) for k, v in net.state_dict().items())
    with pytest.raises(StageError, match="train.weights_sha256 says"):
        materialise_weights("checkpoint:best", "0" * 64, tmp_path / "other.pt", work / "checkpoints")

    again = _copy(cached_workdir, tmp_path / "again", {"train": stop})
    shutil.copytree(work / "checkpoints", again / "checkpoints", ignore=shutil.ignore_patterns("ckpt-0000003.pt"))
    resumed = stage_cli("train", again).stderr
    assert "resuming from checkpoints/ckpt-0000002.pt" in resumed and reason in resumed, resumed[-3000:]

    after = stage_cli("train", work).stderr
    assert "resuming from checkpoints/ckpt-0000003.pt" in after and reason in after, after[-3000:]
    assert checkpoint_iterations(work) == [1, 2, 3]
    assert all(torch.equal(v, model["model"][k]) for k, v in
               torch.load(work / "models/model.pt", weights_only=True)["model"].items())


def test_unknown_model_is_one_line_error(cached_workdir, tmp_path):
    work = _copy(cached_workdir, tmp_path / "w", {"train": {"model": "no_such_net"}})
    proc = stage_cli("train", work, check=False)
    assert proc.returncode == 2
    err = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "unknown model 'no_such_net'" in err[0] and "train.model" in err[0]
    assert "Traceback" not in proc.stderr
    assert not (work / "models/model.pt").exists() and not (work / "checkpoints").exists()


def test_local_weights_path(trained_workdir, tmp_path):
    """train.weights: a local state_dict file initialises the model (checked by its sha256)."""
    from detpipe.core.files import sha256_file
    from detpipe.models import build_from_config, load_weights

    ckpt = torch.load(trained_workdir / "models/model.pt", weights_only=True)
    path = tmp_path / "w.pt"
    torch.save(ckpt["model"], path)
    model = build_from_config(ckpt["config"])
    out = load_weights(model, str(path), sha256_file(path))
    assert out["loaded"] == len(ckpt["model"]) and out["skipped"] == []
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["model"][k])
    from detpipe.core.errors import StageError
    with pytest.raises(StageError, match="sha256"):
        load_weights(model, str(path), "0" * 64)

